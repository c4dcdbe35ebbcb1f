// Fuzz target: tar streams dsec unpacks.
//  0, 1  An image layer (image/layer_tar.hpp apply_layer_tar, whiteouts applied, or kept as overlayfs markers).
//  2     An OCI image as `docker save` writes it (apply_oci_image: a tar of a layout, its index, manifests, layers).
//  3     A tar upload into a sandbox (agent/files/tar_stream.hpp extract_tar into a SandboxTree::Extraction, as
//        PUT /v1/sandboxes/{id}/files?format=tar does).
//  4     An OCI image layout as a directory (apply_oci_image), made here from parts separated by "\n--part--\n", so
//  that
//        the fuzzer can change its JSON without breaking a tar around it or the digests that name its blobs: part 0
//        is index.json, part i > 0 the blob whose digest "@i" stands for in the parts before it (a reference only
//        to a later part is filled in). A part 0 that starts with '[' is a `docker save` manifest.json instead, and
//        part i the file "p<i>" beside it.
// Input: byte 0 picks one of the above; the rest is the tar (plain or compressed), or the layout's parts.
//
// Each input unpacks into an empty directory that is removed afterwards; what it may write is bounded (1 MiB of
// file bytes, 256 entries; the sandbox's own disk limit plays that part for an upload). Properties: bad input is a
// dsec::Error (never INTERNAL, never another exception); nothing outside the directory changes (a tree beside it,
// which symlinks and hard links in the seeds aim at, is compared entry by entry); no scratch file is left behind.
#include <fcntl.h>

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "agent/files/tar_stream.hpp"
#include "common/sandbox_tree.hpp"
#include "dsec/error.hpp"
#include "fuzz_scratch.hpp"
#include "image/layer_tar.hpp"
#include "image/store/digest.hpp"

namespace {

namespace fs = std::filesystem;
using dsec::Code;
using dsec::Error;
namespace files = dsec::agent::files;

constexpr std::uint64_t kMaxBytes = 1u << 20;
constexpr std::uint64_t kMaxEntries = 256;

struct Scratch {
  fs::path dir;
  fs::path outside;  // what no input may touch
  fs::path work;     // the input's tar and the tree it unpacks into
  fs::path root;
  fs::path tar;
  fs::path layout;
  fuzz::TreeState outside_state;
};

Scratch& scratch() {
  static Scratch s = [] {
    Scratch s;
    bool mounts = false;
    s.dir = fuzz::scratch_dir("tar_import", mounts);
    s.outside = s.dir / "outside";
    s.work = s.dir / "work";
    s.root = s.work / "root";
    s.tar = s.work / "input.tar";
    s.layout = s.work / "layout";
    fs::create_directories(s.outside / "dir");
    fs::create_directories(s.work);
    fuzz::write_text(s.outside / "secret", "OUTSIDE-SECRET\n", 0600);
    fuzz::write_text(s.outside / "dir" / "file", "OUTSIDE-FILE\n");
    s.outside_state = fuzz::tree_state(s.outside);
    return s;
  }();
  return s;
}

// The sandbox's disk limit, for an upload: past it the sink fails as a full disk would.
class BoundedSink final : public files::TreeSink {
 public:
  explicit BoundedSink(files::TreeSink& inner) : inner_(inner) {}
  void entry(const files::TreeEntry& e) override {
    if (++entries_ > kMaxEntries) throw Error(Code::kResourceExhausted, "fuzz: too many entries");
    if (e.path.empty()) fuzz::fail("extract_tar: an entry without a path");
    inner_.entry(e);
  }
  void write_data(std::string_view bytes) override {
    if ((bytes_ += bytes.size()) > kMaxBytes) throw Error(Code::kResourceExhausted, "fuzz: disk full");
    inner_.write_data(bytes);
  }
  void finish() override { inner_.finish(); }

 private:
  files::TreeSink& inner_;
  std::uint64_t entries_ = 0, bytes_ = 0;
};

// Mode 4: the parts as a layout directory.
constexpr std::string_view kPartSeparator = "\n--part--\n";

void make_layout(const fs::path& dir, std::string_view input) {
  std::vector<std::string> parts;
  fuzz::Input in(reinterpret_cast<const std::uint8_t*>(input.data()), input.size());
  while (!in.empty() && parts.size() < 10) parts.emplace_back(in.until(kPartSeparator));
  if (parts.empty()) parts.emplace_back();
  const bool docker = !parts[0].empty() && parts[0][0] == '[';
  std::vector<std::string> digests(parts.size());
  for (std::size_t i = parts.size(); i-- > 0;) {
    for (std::size_t k = parts.size() - 1; k > i; --k) {  // "@12" before "@1"
      std::string ref = "@" + std::to_string(k);
      for (std::size_t at = parts[i].find(ref); at != std::string::npos; at = parts[i].find(ref, at + 1))
        parts[i].replace(at, ref.size(), docker ? "p" + std::to_string(k) : digests[k]);
    }
    digests[i] = dsec::image::sha256_digest(parts[i]);
  }
  fs::create_directories(dir / "blobs" / "sha256");
  std::ofstream(dir / (docker ? "manifest.json" : "index.json"), std::ios::binary) << parts[0];
  if (!docker) std::ofstream(dir / "oci-layout", std::ios::binary) << R"({"imageLayoutVersion":"1.0.0"})";
  for (std::size_t i = 1; i < parts.size(); ++i) {
    fs::path file = docker ? dir / ("p" + std::to_string(i)) : dir / "blobs" / "sha256" / digests[i].substr(7);
    std::ofstream(file, std::ios::binary) << parts[i];
  }
}

void unpack(int how, std::string_view tar) {
  Scratch& s = scratch();
  std::vector<std::string> notes;
  dsec::image::TarLimits limits;
  limits.max_bytes = kMaxBytes;
  limits.max_entries = kMaxEntries;
  if (how == 3) {
    fs::create_directories(s.root);
    dsec::UniqueFd root_fd(::open(s.root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!root_fd) fuzz::fail("open the tree's root");
    files::SandboxTree tree(std::move(root_fd));
    files::SandboxTree::Extraction extraction(tree, "/upload");
    BoundedSink sink(extraction);
    files::extract_tar(tar, sink);
    return;
  }
  if (how == 4) {
    make_layout(s.layout, tar);
    dsec::image::apply_oci_image(s.layout, s.root, dsec::image::WhiteoutMode::kApply, limits, notes);
    return;
  }
  {
    std::ofstream out(s.tar, std::ios::binary | std::ios::trunc);
    out.write(tar.data(), static_cast<std::streamsize>(tar.size()));
  }
  if (how == 2) {
    dsec::image::apply_oci_image(s.tar, s.root, dsec::image::WhiteoutMode::kOverlay, limits, notes);
  } else {
    auto mode = how == 0 ? dsec::image::WhiteoutMode::kApply : dsec::image::WhiteoutMode::kOverlay;
    dsec::image::apply_layer_tar(s.tar, s.root, mode, limits, notes);
  }
  if (limits.used_bytes > kMaxBytes || limits.used_entries > kMaxEntries + 1)
    fuzz::fail("apply_layer_tar: past its limits");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  Scratch& s = scratch();
  const int how = data[0] % 5;
  try {
    unpack(how, std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1));
  } catch (const Error& e) {
    if (e.code() == Code::kInternal) fuzz::fail(std::string("unpack: INTERNAL for bad input: ") + e.what());
  } catch (const std::exception& e) {
    fuzz::fail(std::string("unpack: threw something other than dsec::Error: ") + e.what());
  }
  fuzz::expect_unchanged(s.outside_state, s.outside, "unpack");
  std::error_code ec;
  fs::remove(s.tar, ec);
  fs::remove_all(s.layout, ec);
  fs::remove_all(s.root, ec);
  if (ec) fuzz::fail("remove the tree: " + ec.message());
  for (const auto& e : fs::directory_iterator(s.work)) fuzz::fail("unpack left " + e.path().string() + " behind");
  return 0;
}
