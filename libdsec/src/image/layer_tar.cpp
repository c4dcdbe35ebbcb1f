#include "image/layer_tar.hpp"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <random>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "image/archive_internal.hpp"
#include "image/debootstrap.hpp"
#include "image/fs_tree.hpp"
#include "image/store/digest.hpp"

namespace dsec::image {
namespace {

using nlohmann::json;

constexpr std::string_view kWhiteoutPrefix = ".wh.";
constexpr std::string_view kOpaqueMarker = ".wh..wh..opq";
constexpr std::uint64_t kFreeSpaceMargin = 64ull << 20;

fs::path scratch_name(const fs::path& dir, std::string_view prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return dir / fmt::format("{}{:012x}", prefix, rng() & 0xffffffffffffull);
}

// True when `rel` names something inside `root` reached without passing through a symlink (so deleting or marking
// it cannot touch anything outside the tree).
bool reachable_without_symlinks(const fs::path& root, const fs::path& rel) {
  UniqueFd dir(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!dir) throw_errno_fmt(errno, "open {}", root.string());
  // Directories that do not exist (yet) hold no symlink: what exists of the path must be reachable without one. A
  // whiteout in a layer on a parent image usually names a directory only the parent has.
  for (fs::path parent = rel.parent_path(); !parent.empty(); parent = parent.parent_path()) {
    open_how how{};
    how.flags = O_PATH | O_DIRECTORY | O_CLOEXEC;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
    int fd = static_cast<int>(::syscall(SYS_openat2, dir.get(), parent.c_str(), &how, sizeof how));
    if (fd >= 0) {
      ::close(fd);
      return true;
    }
    if (errno != ENOENT) return false;
  }
  return true;
}

void remove_children(const fs::path& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) remove_tree(entry.path());
}

void make_whiteout(const fs::path& path) {
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  if (::mknod(path.c_str(), S_IFCHR | 0000, makedev(0, 0)) != 0 && errno != EEXIST)
    throw_errno_fmt(errno, "make whiteout {}", path.string());
}

void mark_opaque(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (::lsetxattr(dir.c_str(), "trusted.overlay.opaque", "y", 1, 0) != 0)
    throw_errno_fmt(errno, "mark {} opaque", dir.string());
}

ReadArchive open_tar(const fs::path& tar) {
  ReadArchive ar(archive_read_new());
  if (!ar) throw Error(Code::kResourceExhausted, "archive_read_new failed");
  archive_read_support_filter_all(ar.get());
  archive_read_support_format_tar(ar.get());
  archive_read_support_format_gnutar(ar.get());
  if (archive_read_open_filename(ar.get(), tar.c_str(), 1 << 20) != ARCHIVE_OK)
    throw_archive_read(ar.get(), fmt::format("open {}", tar.string()));
  return ar;
}

// The next header, or nullptr at the end. A damaged stream is DATA_LOSS.
archive_entry* next_entry(archive* ar, const fs::path& tar, Warnings& warnings) {
  archive_entry* e = nullptr;
  int r = archive_read_next_header(ar, &e);
  if (r == ARCHIVE_EOF) return nullptr;
  if (r == ARCHIVE_WARN) warnings.add(ar, tar.string());
  if (r < ARCHIVE_WARN) {
    const char* msg = archive_error_string(ar);
    throw Error(Code::kDataLoss, fmt::format("{}: not a readable tar stream ({})", tar.string(), msg ? msg : "?"));
  }
  return e;
}

std::uint64_t free_bytes(const fs::path& dir) {
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) != 0) return UINT64_MAX;
  return static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
}

// Standard input to a file, at most `max_bytes` of it (a tar is about as large as what it unpacks to, and no larger
// than the free space minus a margin).
fs::path spool_stdin(const fs::path& dir, std::uint64_t max_bytes) {
  fs::path path = scratch_name(dir, ".stdin-");
  UniqueFd out(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!out) throw_errno_fmt(errno, "create {}", path.string());
  char buf[1 << 16];
  std::uint64_t total = 0;
  const std::uint64_t free_now = free_bytes(dir);
  const std::uint64_t room = free_now > kFreeSpaceMargin ? free_now - kFreeSpaceMargin : 0;
  for (;;) {
    ssize_t n = ::read(STDIN_FILENO, buf, sizeof buf);
    if (n > 0 && (total += static_cast<std::uint64_t>(n)) > std::min(max_bytes, room)) {
      ::unlink(path.c_str());
      throw Error(Code::kResourceExhausted,
                  fmt::format("the tar on standard input is larger than {} bytes ({})", std::min(max_bytes, room),
                              max_bytes <= room ? "the build's limit" : "the free space"));
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, "read standard input");
    }
    if (n == 0) break;
    for (ssize_t done = 0; done < n;) {
      ssize_t w = ::write(out.get(), buf + done, static_cast<std::size_t>(n - done));
      if (w < 0) {
        int err = errno;
        ::unlink(path.c_str());
        if (err == ENOSPC) throw Error(Code::kResourceExhausted, "spooling standard input: the disk is full");
        throw_errno(err, "spool standard input");
      }
      done += w;
    }
  }
  return path;
}

}  // namespace

namespace {

// A layer's whiteouts: directories it makes opaque and paths it deletes.
struct LayerWhiteouts {
  std::vector<fs::path> opaque_dirs;
  std::vector<fs::path> deleted;
};

// Pass 1 over the tar: its whiteouts, which apply before the layer's own entries (which they must not hide).
LayerWhiteouts read_whiteouts(const fs::path& tar, Warnings& warnings) {
  LayerWhiteouts w;
  ReadArchive ar = open_tar(tar);
  while (archive_entry* e = next_entry(ar.get(), tar, warnings)) {
    fs::path rel = safe_relative(archive_entry_pathname(e));
    std::string base = rel.filename().string();
    if (base == kOpaqueMarker) {
      w.opaque_dirs.push_back(rel.parent_path());
    } else if (base.starts_with(kWhiteoutPrefix)) {
      std::string name = base.substr(kWhiteoutPrefix.size());
      if (name.empty() || name == "." || name == "..")
        throw Error(Code::kInvalidArgument, fmt::format("{}: malformed whiteout {}", tar.string(), rel.string()));
      w.deleted.push_back(rel.parent_path() / name);
    }
    if (archive_read_data_skip(ar.get()) < ARCHIVE_WARN) throw_archive_read(ar.get(), tar.string());
  }
  return w;
}

void apply_whiteouts(const LayerWhiteouts& w, const fs::path& root, WhiteoutMode mode,
                     std::vector<std::string>& notes) {
  for (const fs::path& rel : w.opaque_dirs) {
    if (!reachable_without_symlinks(root, rel / "x")) continue;
    fs::path dir = join(root, rel);
    struct stat st {};
    if (::lstat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) remove_children(dir);
  }
  for (const fs::path& rel : w.deleted) {
    if (!reachable_without_symlinks(root, rel)) {
      notes.push_back(fmt::format("whiteout {} lies under a symlink; ignored", rel.string()));
      continue;
    }
    remove_tree(root / rel);
    if (mode == WhiteoutMode::kOverlay) make_whiteout(root / rel);
  }
}

// Counts a regular file's bytes against the build's budget and the disk's free space (RESOURCE_EXHAUSTED past
// either).
void count_file_bytes(const fs::path& tar, const fs::path& rel, archive_entry* e, const fs::path& root,
                      TarLimits& limits) {
  const la_int64_t size = archive_entry_size_is_set(e) ? archive_entry_size(e) : 0;
  if (size < 0) throw Error(Code::kDataLoss, fmt::format("{}: {} has a negative size", tar.string(), rel.string()));
  if (archive_entry_filetype(e) != AE_IFREG || archive_entry_hardlink(e) != nullptr) return;
  const auto bytes = static_cast<std::uint64_t>(size);
  if (bytes > limits.max_bytes - std::min(limits.max_bytes, limits.used_bytes))
    throw Error(Code::kResourceExhausted, fmt::format("{}: {} is {} bytes, over the build's limit of {} bytes",
                                                      tar.string(), rel.string(), bytes, limits.max_bytes));
  if (bytes + kFreeSpaceMargin > free_bytes(root))
    throw Error(Code::kResourceExhausted, fmt::format("{}: no space left for {} ({} bytes) under {}", tar.string(),
                                                      rel.string(), bytes, root.string()));
  limits.used_bytes += bytes;
}

// Writes one entry under `root` (its path and any hard link's target made relative to the root first).
void extract_entry(ReadArchive& ar, WriteArchive& wd, archive_entry* e, const fs::path& tar, const fs::path& root,
                   const fs::path& rel, Warnings& warnings) {
  archive_entry_set_pathname(e, join(root, rel).c_str());
  if (const char* hl = archive_entry_hardlink(e)) {
    fs::path target = safe_relative(hl);
    if (target.empty())
      throw Error(Code::kInvalidArgument, fmt::format("{}: hard link to the tree's root", tar.string()));
    archive_entry_set_hardlink(e, join(root, target).c_str());
  }
  try {
    write_entry_to_disk(ar.get(), wd.get(), e, archive_entry_hardlink(e) == nullptr, warnings);
  } catch (const Error& err) {
    if (std::string_view(err.what()).find("No space") != std::string_view::npos ||
        err.code() == Code::kResourceExhausted)
      throw Error(Code::kResourceExhausted, fmt::format("{}: {}", tar.string(), err.what()));
    // libarchive refuses what a hostile tar asks for (extracting through a symlink, a hard link through one)
    // without an errno: the tar is at fault, not dsec.
    throw Error(err.code() == Code::kInternal ? Code::kInvalidArgument : err.code(),
                fmt::format("{}: {}", tar.string(), err.what()));
  }
}

}  // namespace

void apply_layer_tar(const fs::path& tar_arg, const fs::path& root, WhiteoutMode mode, TarLimits& limits,
                     std::vector<std::string>& notes) {
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) throw Error(code_for_errno(ec.value()), fmt::format("create {}: {}", root.string(), ec.message()));
  fs::path tar = tar_arg;
  struct Spool {
    fs::path p;
    ~Spool() {
      if (!p.empty()) ::unlink(p.c_str());
    }
  } spool;
  if (tar == "-") tar = spool.p = spool_stdin(root.parent_path(), limits.max_bytes + (64ull << 20));
  if (!fs::is_regular_file(tar))
    throw Error(Code::kNotFound, fmt::format("tar {} does not exist or is not a file", tar.string()));
  Warnings warnings(notes);

  const LayerWhiteouts whiteouts = read_whiteouts(tar, warnings);
  apply_whiteouts(whiteouts, root, mode, notes);

  // Pass 2: the layer's own entries.
  ReadArchive ar = open_tar(tar);
  WriteArchive wd = open_disk_writer();
  std::size_t skipped_special = 0;
  while (archive_entry* e = next_entry(ar.get(), tar, warnings)) {
    fs::path rel = safe_relative(archive_entry_pathname(e));
    std::string base = rel.filename().string();
    if (base.starts_with(kWhiteoutPrefix)) continue;
    if (++limits.used_entries > limits.max_entries)
      throw Error(Code::kResourceExhausted, fmt::format("{}: more than {} entries", tar.string(), limits.max_entries));
    const mode_t type = archive_entry_filetype(e);
    if (type == AE_IFCHR || type == AE_IFBLK || type == AE_IFSOCK || type == AE_IFIFO) {
      if (skipped_special++ < 5)
        notes.push_back(
            fmt::format("skipped {} (device nodes, sockets and FIFOs are not kept in layers)", rel.string()));
      continue;
    }
    if (rel.empty()) {
      // The tree's root itself: keep the root we made (its owner and mode come from the build).
      continue;
    }
    count_file_bytes(tar, rel, e, root, limits);
    extract_entry(ar, wd, e, tar, root, rel, warnings);
  }
  if (skipped_special > 5) notes.push_back(fmt::format("... {} special files skipped in all", skipped_special));
  if (archive_write_close(wd.get()) != ARCHIVE_OK) throw_archive(wd.get(), fmt::format("finish {}", root.string()));
  if (mode == WhiteoutMode::kOverlay)
    for (const fs::path& rel : whiteouts.opaque_dirs)
      if (reachable_without_symlinks(root, rel / "x")) mark_opaque(join(root, rel));
}

namespace {

std::string read_small_file(const fs::path& path, std::size_t max = 16u << 20) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(Code::kNotFound, fmt::format("{} is missing", path.string()));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.size() > max) throw Error(Code::kInvalidArgument, fmt::format("{} is too large", path.string()));
  return text;
}

json parse_json_file(const fs::path& path) {
  try {
    return json::parse(read_small_file(path));
  } catch (const json::exception& e) {
    throw Error(Code::kInvalidArgument, fmt::format("{}: not JSON ({})", path.string(), e.what()));
  }
}

// The layout's JSON is the image author's: a member of the wrong type is INVALID_ARGUMENT naming it, never
// nlohmann's type_error.
[[noreturn]] void bad_layout(const fs::path& layout, std::string_view what) {
  throw Error(Code::kInvalidArgument, fmt::format("{}: {}", layout.string(), what));
}

// A string member of an object of the layout ("" when it is missing); `what` names the object in errors.
std::string string_member(const fs::path& layout, const json& j, const char* key, std::string_view what) {
  if (!j.is_object()) bad_layout(layout, fmt::format("{} is not a JSON object", what));
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  if (!it->is_string()) bad_layout(layout, fmt::format("{}: {} is not a string", what, key));
  return it->get<std::string>();
}

fs::path oci_blob(const fs::path& layout, const std::string& digest) {
  return layout / "blobs" / "sha256" / digest_hex(digest, "OCI descriptor digest");
}

// The verified blob a descriptor names.
fs::path checked_blob(const fs::path& layout, const json& descriptor) {
  std::string digest = string_member(layout, descriptor, "digest", "a descriptor");
  if (digest.empty()) bad_layout(layout, "a descriptor without a digest");
  fs::path blob = oci_blob(layout, digest);
  if (!fs::is_regular_file(blob))
    throw Error(Code::kNotFound, fmt::format("{}: blob {} is missing", layout.string(), digest));
  if (descriptor.contains("size") && descriptor["size"].is_number_unsigned() &&
      descriptor["size"].get<std::uint64_t>() != fs::file_size(blob))
    throw Error(Code::kDataLoss, fmt::format("{}: blob {} has the wrong size", layout.string(), digest));
  std::string actual = sha256_file(blob);
  if (actual != digest)
    throw Error(Code::kDataLoss,
                fmt::format("{}: blob {} is damaged (its bytes hash to {})", layout.string(), digest, actual));
  return blob;
}

std::string host_oci_arch() {
  std::string arch = host_debian_arch();
  if (arch == "armhf") return "arm";
  if (arch == "i386") return "386";
  if (arch == "ppc64el") return "ppc64le";
  return arch;
}

bool is_index_type(const std::string& media) {
  return media == "application/vnd.oci.image.index.v1+json" ||
         media == "application/vnd.docker.distribution.manifest.list.v2+json";
}

// Image manifests reachable from an index, with nested indexes opened.
void collect_manifests(const fs::path& layout, const json& index, std::vector<json>& out, int depth) {
  if (depth > 4) throw Error(Code::kInvalidArgument, fmt::format("{}: indexes nested too deep", layout.string()));
  if (!index.is_object() || !index.contains("manifests") || !index["manifests"].is_array())
    throw Error(Code::kInvalidArgument, fmt::format("{}: index without a manifests list", layout.string()));
  for (const json& d : index["manifests"]) {
    std::string media = string_member(layout, d, "mediaType", "an entry of an index's manifests");
    if (is_index_type(media)) {
      json nested = parse_json_file(checked_blob(layout, d));
      collect_manifests(layout, nested, out, depth + 1);
    } else {
      out.push_back(d);
    }
  }
}

std::string apply_oci_layout(const fs::path& layout, const fs::path& root, WhiteoutMode mode, TarLimits& limits,
                             std::vector<std::string>& notes, const std::string& described) {
  std::vector<fs::path> layer_files;
  std::string what;
  if (fs::exists(layout / "index.json")) {
    std::vector<json> manifests;
    collect_manifests(layout, parse_json_file(layout / "index.json"), manifests, 0);
    if (manifests.empty())
      throw Error(Code::kInvalidArgument, fmt::format("{}: the index lists no image", layout.string()));
    const json* chosen = nullptr;
    const std::string arch = host_oci_arch();
    for (const json& d : manifests) {
      if (!d.contains("platform")) continue;
      const json& p = d["platform"];
      if (string_member(layout, p, "os", "a platform") == "linux" &&
          string_member(layout, p, "architecture", "a platform") == arch) {
        chosen = &d;
        break;
      }
    }
    if (!chosen) {
      chosen = &manifests.front();
      if (manifests.size() > 1)
        notes.push_back(
            fmt::format("no image for linux/{} in the index; took the first of {}", arch, manifests.size()));
    }
    fs::path manifest_blob = checked_blob(layout, *chosen);
    json manifest = parse_json_file(manifest_blob);
    if (!manifest.is_object() || !manifest.contains("layers") || !manifest["layers"].is_array())
      throw Error(Code::kInvalidArgument, fmt::format("{}: image manifest without layers", layout.string()));
    for (const json& l : manifest["layers"]) {
      std::string media = string_member(layout, l, "mediaType", "a layer of the image manifest");
      if (media.find("nondistributable") != std::string::npos || l.contains("urls"))
        throw Error(Code::kFailedPrecondition,
                    fmt::format("{}: layer {} is a foreign layer not in the layout", layout.string(),
                                string_member(layout, l, "digest", "a layer of the image manifest")));
      layer_files.push_back(checked_blob(layout, l));
    }
    what = fmt::format("{} {} ({} layers)", described, (*chosen)["digest"].get<std::string>(), layer_files.size());
  } else if (fs::exists(layout / "manifest.json")) {
    // The older `docker save` format: [{"Config": "...", "RepoTags": [...], "Layers": ["<id>/layer.tar", ...]}].
    json manifest = parse_json_file(layout / "manifest.json");
    if (!manifest.is_array() || manifest.empty() || !manifest[0].contains("Layers") ||
        !manifest[0]["Layers"].is_array())
      throw Error(Code::kInvalidArgument, fmt::format("{}/manifest.json: no image in it", layout.string()));
    if (manifest.size() > 1)
      notes.push_back(fmt::format("{} holds {} images; took the first", described, manifest.size()));
    for (const json& l : manifest[0]["Layers"]) {
      if (!l.is_string()) bad_layout(layout, "manifest.json: a layer that is not a file name");
      fs::path rel = safe_relative(l.get<std::string>().c_str());
      fs::path file = layout / rel;
      if (!fs::is_regular_file(file))
        throw Error(Code::kNotFound, fmt::format("{}: layer {} is missing", layout.string(), rel.string()));
      layer_files.push_back(file);
    }
    what = fmt::format("{} ({} layers)", described, layer_files.size());
  } else {
    throw Error(
        Code::kInvalidArgument,
        fmt::format("{} is not an OCI image layout (no index.json) nor a docker save archive (no manifest.json)",
                    layout.string()));
  }
  for (std::size_t i = 0; i < layer_files.size(); ++i) apply_layer_tar(layer_files[i], root, mode, limits, notes);
  return what;
}

}  // namespace

std::string apply_oci_image(const fs::path& layout, const fs::path& root, WhiteoutMode mode, TarLimits& limits,
                            std::vector<std::string>& notes) {
  std::string described = fmt::format("oci:{}", layout.string());
  if (fs::is_directory(layout)) return apply_oci_layout(layout, root, mode, limits, notes, described);
  if (!fs::is_regular_file(layout))
    throw Error(Code::kNotFound, fmt::format("OCI image {} does not exist", layout.string()));
  // A tar of a layout (docker save): unpacked beside the tree first, then read as a directory.
  fs::path unpacked = scratch_name(root.parent_path(), ".oci-");
  struct Remove {
    fs::path p;
    ~Remove() { remove_tree(p); }
  } remove_unpacked{unpacked};
  TarLimits outer;
  outer.max_bytes = limits.max_bytes;
  apply_layer_tar(layout, unpacked, WhiteoutMode::kApply, outer, notes);
  return apply_oci_layout(unpacked, root, mode, limits, notes, described);
}

bool looks_like_oci_image(const fs::path& path) {
  if (fs::is_directory(path)) return fs::exists(path / "oci-layout") || fs::exists(path / "index.json");
  if (!fs::is_regular_file(path)) return false;
  try {
    ReadArchive ar = open_tar(path);
    std::vector<std::string> ignored;
    Warnings warnings(ignored);
    for (int i = 0; i < 100000; ++i) {
      archive_entry* e = next_entry(ar.get(), path, warnings);
      if (!e) break;
      std::string name = fs::path(archive_entry_pathname(e)).lexically_normal().string();
      if (name == "oci-layout" || name == "index.json" || name == "manifest.json") return true;
      archive_read_data_skip(ar.get());
    }
  } catch (const Error&) {
  }
  return false;
}

}  // namespace dsec::image
