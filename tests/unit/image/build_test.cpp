// Building images: a directory, a tar, an OCI layout (directory, docker save tar, legacy manifest.json), busybox and
// debootstrap trees become EROFS layers in a store. Each built layer is read back from the store chunk by chunk,
// mounted the way a node mounts it, and its files checked; layers built on a parent are stacked with overlayfs to
// check that whiteouts hide the parent's files. Hostile tars and full disks fail with the right code and leave no
// tag and no scratch files. Also the tree helpers the builders share (pack/unpack, remove_tree) and run_process.
#include <archive.h>
#include <archive_entry.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/time.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <memory>
#include <set>
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "dsec/error.hpp"
#include "image/build.hpp"
#include "image/debootstrap.hpp"
#include "image/fs_tree.hpp"
#include "image/image_test_util.hpp"
#include "image/layer_tar.hpp"
#include "image/process.hpp"
#include "image/rootfs_builders.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/digest.hpp"

namespace dsec::image {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::entries_with_prefix;
using testing::lstat_of;
using testing::MountedLayer;
using testing::OverlayView;
using testing::random_bytes;
using testing::read_text;
using testing::running_as_root;
using testing::tar_attrs;
using testing::TarWriter;
using testing::TempDir;
using testing::tree_paths;
using testing::write_text;
using testing::xattr_of;

#define SKIP_UNLESS_MOUNTS()                                                               \
  do {                                                                                     \
    if (std::string why = testing::mount_skip_reason(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

template <typename Fn>
Error expect_error(Fn&& fn, Code code, std::vector<std::string> parts = {}) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code_name(), code_name(code)) << e.what();
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected dsec::Error " << code_name(code) << ", got: " << e.what();
    return Error(Code::kUnknown, e.what());
  }
  ADD_FAILURE() << "expected dsec::Error " << code_name(code) << ", nothing was thrown";
  return Error(Code::kOk, "");
}

bool any_note_has(const std::vector<std::string>& notes, std::string_view part) {
  for (const auto& n : notes)
    if (n.find(part) != std::string::npos) return true;
  return false;
}

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) out += s + "\n";
  return out;
}

std::string joined(const std::set<std::string>& v) { return joined(std::vector<std::string>(v.begin(), v.end())); }

// A directory store under a test's temporary directory, with builds that scratch in <store>/.tmp as the CLI does,
// and layers mounted for checking (unmounted when the fixture goes away).
class StoreFixture {
 public:
  explicit StoreFixture(const fs::path& root) : root_(root), store_(open_directory_store(root)) {}

  BlobStore& store() { return *store_; }
  const fs::path& root() const { return root_; }

  BuildOptions options(const std::string& reference, const std::string& source) const {
    BuildOptions o;
    o.reference = reference;
    o.source = LayerSource::parse(source);
    o.work_dir = root_ / ".tmp";
    o.chunk_size = 64 << 10;  // small chunks: more of them, so chunk boundaries are exercised
    return o;
  }
  BuildResult build(const std::string& reference, const std::string& source,
                    const std::function<void(BuildOptions&)>& tweak = {}) {
    BuildOptions o = options(reference, source);
    if (tweak) tweak(o);
    return build_image(*store_, o);
  }

  // The layer mounted at a fresh directory; stays mounted until the fixture goes.
  fs::path mount(const LayerDescriptor& layer, const fs::path& scratch) {
    mounts_.push_back(
        std::make_unique<MountedLayer>(*store_, layer, scratch / fmt::format("layer-{}", mounts_.size())));
    return mounts_.back()->root();
  }
  // The image's layers mounted and stacked (top first), and the merged view.
  fs::path mount_image(const ResolvedManifest& image, const fs::path& scratch) {
    std::vector<fs::path> lowers;
    for (auto it = image.manifest.layers.rbegin(); it != image.manifest.layers.rend(); ++it)
      lowers.push_back(mount(*it, scratch));
    if (lowers.size() == 1) return lowers[0];
    overlays_.push_back(std::make_unique<OverlayView>(lowers, scratch / fmt::format("merged-{}", overlays_.size())));
    return overlays_.back()->root();
  }

  // Nothing of a build is left: no scratch directories, no temporary files.
  void expect_no_scratch() const {
    EXPECT_TRUE(entries_with_prefix(root_ / ".tmp", "").empty())
        << "left in " << (root_ / ".tmp") << ": " << joined(entries_with_prefix(root_ / ".tmp", ""));
  }
  std::set<std::string> blobs() {
    std::set<std::string> out;
    for (const auto& b : store_->list_blobs()) out.insert(b.digest);
    return out;
  }

  ~StoreFixture() {
    overlays_.clear();
    mounts_.clear();
  }

 private:
  fs::path root_;
  std::unique_ptr<BlobStore> store_;
  std::vector<std::unique_ptr<MountedLayer>> mounts_;
  std::vector<std::unique_ptr<OverlayView>> overlays_;
};

// A tree with what an image must keep: modes (setuid, sticky, private), symlinks (relative, absolute, dangling), a
// hard link pair, a fifo, foreign ownership, times, xattrs, an overlayfs whiteout and an opaque directory; and what
// it must drop: a device node (root only).
struct SourceTree {
  explicit SourceTree(const fs::path& root) : root(root) {
    write_text(root / "bin/tool", "#!/bin/sh\necho tool\n", 0755);
    write_text(root / "etc/secret", "s3cret\n", 0600);
    write_text(root / "usr/bin/suid", "x", 0755);
    ::chmod((root / "usr/bin/suid").c_str(), 04755);
    fs::create_directories(root / "tmp");
    ::chmod((root / "tmp").c_str(), 01777);
    fs::create_directories(root / "private");
    ::chmod((root / "private").c_str(), 0700);
    write_text(root / "data/a", std::string(100000, 'a'));
    fs::create_hard_link(root / "data/a", root / "data/a-link");
    write_text(root / "data/random", random_bytes(300000, 5));
    fs::create_symlink("../bin/tool", root / "data/rel-link");
    fs::create_symlink("/etc/secret", root / "data/abs-link");
    fs::create_symlink("nowhere", root / "data/dangling");
    ::mkfifo((root / "data/fifo").c_str(), 0640);
    struct timespec times[2] = {{1000000000, 0}, {1234567890, 123456789}};
    ::utimensat(AT_FDCWD, (root / "etc/secret").c_str(), times, AT_SYMLINK_NOFOLLOW);
    if (running_as_root()) {
      write_text(root / "home/user/file", "mine", 0640);
      ::chown((root / "home/user/file").c_str(), 1234, 5678);
      ::chown((root / "home/user").c_str(), 1234, 5678);
      ::lchown((root / "data/rel-link").c_str(), 4321, 8765);
      ::mknod((root / "dev-null").c_str(), S_IFCHR | 0666, makedev(1, 3));
      // overlayfs markers, as a sandbox's upper directory has them
      ::mknod((root / "gone").c_str(), S_IFCHR | 0000, makedev(0, 0));
      write_text(root / "opaque/kept", "k");
      ::lsetxattr((root / "opaque").c_str(), "trusted.overlay.opaque", "y", 1, 0);
      ::lsetxattr((root / "bin/tool").c_str(), "trusted.dsec", "t", 1, 0);
    }
    has_xattr = ::lsetxattr((root / "bin/tool").c_str(), "user.dsec", "yes", 3, 0) == 0;
  }
  fs::path root;
  bool has_xattr = false;
};

void expect_same_tree(const fs::path& src, const fs::path& dst, bool root) {
  for (const char* p :
       {"bin/tool", "etc/secret", "usr/bin/suid", "tmp", "private", "data/a", "data/fifo", "data/random"}) {
    struct stat a = lstat_of(src / p), b = lstat_of(dst / p);
    EXPECT_EQ(a.st_mode, b.st_mode) << p;
    if (!S_ISDIR(a.st_mode)) {
      EXPECT_EQ(a.st_size, b.st_size) << p;
    }
  }
  EXPECT_EQ(lstat_of(dst / "usr/bin/suid").st_mode & 07777, 04755u);
  EXPECT_EQ(lstat_of(dst / "tmp").st_mode & 07777, 01777u);
  EXPECT_EQ(lstat_of(dst / "private").st_mode & 07777, 0700u);
  EXPECT_TRUE(S_ISFIFO(lstat_of(dst / "data/fifo").st_mode));
  EXPECT_EQ(read_text(dst / "etc/secret"), "s3cret\n");
  EXPECT_EQ(lstat_of(dst / "etc/secret").st_mtime, 1234567890);
  EXPECT_EQ(read_text(dst / "data/a"), std::string(100000, 'a'));
  EXPECT_EQ(read_text(dst / "data/random"), read_text(src / "data/random"));
  EXPECT_EQ(read_text(dst / "bin/tool"), "#!/bin/sh\necho tool\n");

  struct stat a = lstat_of(dst / "data/a"), link = lstat_of(dst / "data/a-link");
  EXPECT_EQ(a.st_ino, link.st_ino) << "hard link became a copy";
  EXPECT_EQ(a.st_nlink, 2u);

  EXPECT_EQ(fs::read_symlink(dst / "data/rel-link"), "../bin/tool");
  EXPECT_EQ(fs::read_symlink(dst / "data/abs-link"), "/etc/secret");
  EXPECT_EQ(fs::read_symlink(dst / "data/dangling"), "nowhere");

  if (root) {
    struct stat f = lstat_of(dst / "home/user/file");
    EXPECT_EQ(f.st_uid, 1234u);
    EXPECT_EQ(f.st_gid, 5678u);
    EXPECT_EQ(lstat_of(dst / "home/user").st_uid, 1234u);
    EXPECT_FALSE(fs::exists(fs::symlink_status(dst / "dev-null"))) << "device node was copied";
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Sources

TEST(ImageLayerSource, ParsesEveryKind) {
  TempDir tmp;
  fs::create_directories(tmp / "dir");
  write_text(tmp / "file.tar", "");
  write_text(tmp / "oci/oci-layout", "{\"imageLayoutVersion\":\"1.0.0\"}");
  using K = LayerSource::Kind;
  struct Case {
    std::string text;
    K kind;
    std::string path;
  };
  for (const Case& c : std::vector<Case>{
           {(tmp / "dir").string(), K::kDirectory, (tmp / "dir").string()},
           {"dir:/any/where", K::kDirectory, "/any/where"},
           {(tmp / "file.tar").string(), K::kTar, (tmp / "file.tar").string()},
           {"tar:/x.tar.gz", K::kTar, "/x.tar.gz"},
           {"tar:-", K::kTar, "-"},
           {"-", K::kTar, "-"},
           {"oci:./img", K::kOci, "./img"},
           {(tmp / "oci").string(), K::kOci, (tmp / "oci").string()},
           {"busybox-static", K::kBusybox, ""},
           {"debootstrap:bookworm", K::kDebootstrap, "bookworm"},
       }) {
    SCOPED_TRACE(c.text);
    LayerSource s = LayerSource::parse(c.text);
    EXPECT_EQ(static_cast<int>(s.kind), static_cast<int>(c.kind));
    EXPECT_EQ(s.path, c.path);
  }
  expect_error([] { LayerSource::parse(""); }, Code::kInvalidArgument);
  expect_error([] { LayerSource::parse("tar:"); }, Code::kInvalidArgument);
  expect_error([] { LayerSource::parse("oci:"); }, Code::kInvalidArgument);
  expect_error([] { LayerSource::parse("debootstrap:"); }, Code::kInvalidArgument, {"suite"});
  expect_error([&] { LayerSource::parse((tmp / "no-such-thing").string()); }, Code::kNotFound, {"no-such-thing"});
}

TEST(ImageBuild, RefusesBadRequestsBeforeDoingAnything) {
  TempDir tmp;
  StoreFixture s(tmp / "store");
  fs::create_directories(tmp / "src");
  write_text(tmp / "file", "x");
  expect_error([&] { s.build("Bad Name", (tmp / "src").string()); }, Code::kInvalidArgument, {"invalid image name"});
  expect_error([&] { s.build("app@" + sha256_digest("x"), (tmp / "src").string()); }, Code::kInvalidArgument,
               {"tag, not a digest"});
  expect_error([&] { s.build("app", (tmp / "src").string(), [](BuildOptions& o) { o.work_dir.clear(); }); },
               Code::kInvalidArgument, {"work directory"});
  expect_error([&] { s.build("app", "dir:" + (tmp / "missing").string()); }, Code::kNotFound, {"missing"});
  expect_error([&] { s.build("app", "dir:" + (tmp / "file").string()); }, Code::kInvalidArgument, {"not a directory"});
  expect_error([&] { s.build("app", "tar:" + (tmp / "missing.tar").string()); }, Code::kNotFound, {"missing.tar"});
  expect_error([&] { s.build("app", "oci:" + (tmp / "missing-oci").string()); }, Code::kNotFound, {"missing-oci"});
  expect_error([&] { s.build("app", (tmp / "src").string(), [](BuildOptions& o) { o.parent = "ghost:v1"; }); },
               Code::kNotFound, {"ghost:v1"});
  expect_error([&] { s.build("app", "debootstrap:bookworm"); }, Code::kInvalidArgument, {"cache"});
  EXPECT_TRUE(s.store().list_refs().empty());
  EXPECT_TRUE(s.store().list_blobs().empty());
  s.expect_no_scratch();
}

TEST(ImageBuild, FromADirectoryEverythingSurvives) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  SourceTree src(tmp / "src");
  StoreFixture s(tmp / "store");
  std::vector<std::string> logged;
  BuildResult r = s.build("roundtrip:v1", (tmp / "src").string(),
                          [&](BuildOptions& o) { o.log = [&](std::string_view l) { logged.emplace_back(l); }; });

  EXPECT_EQ(r.image.reference.tagged(), "roundtrip:v1");
  EXPECT_EQ(s.store().read_ref("roundtrip:v1"), r.image.digest);
  const Manifest& m = r.image.manifest;
  ASSERT_EQ(m.layers.size(), 1u);
  EXPECT_EQ(m.layers[0].role, LayerRole::kBase);
  EXPECT_EQ(m.layers[0].digest, r.layer.digest);
  EXPECT_TRUE(m.parent.empty());
  EXPECT_NE(m.source.find((tmp / "src").string()), std::string::npos) << m.source;
  EXPECT_GT(m.created_at, 1.6e9);
  EXPECT_FALSE(r.layer_existed);
  // Content bytes with the hard-linked 100000 counted once, plus symlink targets.
  const std::uint64_t expected = 20 + 7 + 1 + 100000 + 300000 + std::string("../bin/tool").size() +
                                 std::string("/etc/secret").size() + std::string("nowhere").size() + 4 + 1;
  EXPECT_EQ(m.layers[0].files_size, expected);
  EXPECT_TRUE(any_note_has(m.notes, "left out 1 device")) << joined(m.notes);
  EXPECT_TRUE(any_note_has(m.notes, "/dev-null")) << joined(m.notes);
  EXPECT_TRUE(any_note_has(logged, "left out 1 device")) << joined(logged);
  s.expect_no_scratch();

  const fs::path root = s.mount(m.layers[0], tmp / "mnt");
  expect_same_tree(src.root, root, true);
  // Exactly the source's files, less the device node.
  std::set<std::string> want = tree_paths(src.root);
  want.erase("dev-null");
  EXPECT_EQ(tree_paths(root), want) << joined(tree_paths(root));
  EXPECT_EQ(lstat_of(root / "etc/secret").st_mtim.tv_nsec, 123456789) << "mtime nanoseconds lost";
  EXPECT_EQ(lstat_of(root / "data/rel-link").st_uid, 4321u);
  EXPECT_EQ(xattr_of(root / "bin/tool", "trusted.dsec"), "t");
  if (src.has_xattr) {
    EXPECT_EQ(xattr_of(root / "bin/tool", "user.dsec"), "yes");
  }
  // The overlayfs markers are kept as they are: a whiteout (char 0/0) and an opaque directory.
  struct stat gone = lstat_of(root / "gone");
  EXPECT_TRUE(S_ISCHR(gone.st_mode));
  EXPECT_EQ(gone.st_rdev, makedev(0, 0));
  EXPECT_EQ(xattr_of(root / "opaque", "trusted.overlay.opaque"), "y");
  EXPECT_EQ(read_text(root / "opaque/kept"), "k");

  // The layer's metadata is a whole number of chunks, all marked for prefetch; the data device follows.
  const ChunkIndex index = chunk_index_from_json(s.store().read_blob(m.layers[0].index));
  EXPECT_GT(index.meta_size, 0u);
  EXPECT_EQ(index.meta_size % index.chunk_size, 0u);
  EXPECT_EQ(index.prefetch.size(), index.meta_size / index.chunk_size);
  // (mkfs.erofs stores identical 4 KiB blocks once: data/a's 100000 'a's take a block or two.)
  EXPECT_GE(index.size - index.meta_size, 300000u) << "file data is not in the data part";
}

TEST(ImageBuild, FromATar) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  {
    TarWriter t(tmp / "layer.tar.gz", TarWriter::Compression::kGzip);
    t.dir("etc", tar_attrs(0755));
    t.file("etc/hostname", "box\n");
    t.file("etc/shadow", "root:*:1::::::\n", tar_attrs(0640, 0, 42, 1500000000));
    t.dir("home/u", tar_attrs(0750, 1000, 1000));
    t.file("home/u/notes", "hello", tar_attrs(0600, 1000, 1000, 1400000000, {{"user.origin", "tar"}}));
    t.file("usr/bin/prog", random_bytes(200000, 8), tar_attrs(0755));
    t.hardlink("usr/bin/prog-again", "usr/bin/prog");
    t.symlink("bin", "usr/bin");
    t.file("./dot/slash", "normalised");
    // A whiteout next to a file of the same name: the whiteout hides lower layers only, never its own layer.
    t.file("etc/.wh.motd", "");
    t.file("etc/motd", "welcome");
    t.char_device("dev/console", 5, 1);
  }
  StoreFixture s(tmp / "store");
  BuildResult r = s.build("fromtar", "tar:" + (tmp / "layer.tar.gz").string());
  const Manifest& m = r.image.manifest;
  EXPECT_NE(m.source.find("layer.tar.gz"), std::string::npos) << m.source;
  EXPECT_TRUE(any_note_has(m.notes, "dev/console")) << joined(m.notes);
  s.expect_no_scratch();

  const fs::path root = s.mount(m.layers[0], tmp / "mnt");
  EXPECT_EQ(tree_paths(root),
            (std::set<std::string>{"bin", "dot", "dot/slash", "etc", "etc/hostname", "etc/motd", "etc/shadow", "home",
                                   "home/u", "home/u/notes", "usr", "usr/bin", "usr/bin/prog", "usr/bin/prog-again"}))
      << joined(tree_paths(root));
  struct stat shadow = lstat_of(root / "etc/shadow");
  EXPECT_EQ(shadow.st_mode & 07777, 0640u);
  EXPECT_EQ(shadow.st_gid, 42u);
  EXPECT_EQ(shadow.st_mtime, 1500000000);
  struct stat notes = lstat_of(root / "home/u/notes");
  EXPECT_EQ(notes.st_uid, 1000u);
  EXPECT_EQ(notes.st_mode & 07777, 0600u);
  EXPECT_EQ(notes.st_mtime, 1400000000);
  EXPECT_EQ(xattr_of(root / "home/u/notes", "user.origin"), "tar");
  EXPECT_EQ(lstat_of(root / "home/u").st_mode & 07777, 0750u);
  EXPECT_EQ(read_text(root / "usr/bin/prog"), random_bytes(200000, 8));
  EXPECT_EQ(lstat_of(root / "usr/bin/prog").st_ino, lstat_of(root / "usr/bin/prog-again").st_ino);
  EXPECT_EQ(fs::read_symlink(root / "bin"), "usr/bin");
  EXPECT_EQ(read_text(root / "etc/motd"), "welcome");
  EXPECT_EQ(read_text(root / "dot/slash"), "normalised");
  EXPECT_FALSE(fs::exists(fs::symlink_status(root / "dev/console"))) << "a device node from a tar was kept";
}

// ---------------------------------------------------------------------------------------------------------------
// OCI images

std::string host_arch_for_oci() {
  std::string a = host_debian_arch();
  if (a == "armhf") return "arm";
  if (a == "i386") return "386";
  if (a == "ppc64el") return "ppc64le";
  return a;
}

fs::path put_oci_blob(const fs::path& layout, const fs::path& file) {
  std::string digest = sha256_file(file);
  fs::path dest = layout / "blobs/sha256" / digest_hex(digest);
  fs::create_directories(dest.parent_path());
  fs::copy_file(file, dest, fs::copy_options::overwrite_existing);
  return dest;
}

json descriptor(const std::string& media, const fs::path& blob) {
  return {{"mediaType", media}, {"digest", "sha256:" + blob.filename().string()}, {"size", fs::file_size(blob)}};
}

// Two layers: the second deletes a file of the first (.wh.NAME) and makes a directory opaque (.wh..wh..opq) while
// adding a new file to it.
void write_oci_layers(const fs::path& dir, TarWriter::Compression compression) {
  {
    TarWriter t(dir / "layer1.tar", compression);
    t.dir("etc");
    t.file("etc/keep", "kept\n");
    t.file("etc/gone", "deleted by layer 2\n");
    t.dir("data");
    t.file("data/old1", "old");
    t.file("data/old2", "old");
    t.dir("data/sub");
    t.file("data/sub/x", "x");
    t.file("bin/tool", "v1", tar_attrs(0755));
  }
  {
    TarWriter t(dir / "layer2.tar", compression);
    t.file("etc/.wh.gone", "");
    t.file("data/.wh..wh..opq", "");
    t.file("data/new", "added in layer 2");
    t.file("bin/tool", "v2", tar_attrs(0700));
    t.file("etc/.wh.never-existed", "");
  }
}

const std::set<std::string> kOciExpected = {"bin", "bin/tool", "data", "data/new", "etc", "etc/keep"};

// An OCI image layout: oci-layout, index.json, a manifest blob, a config blob and two gzip layer blobs.
fs::path write_oci_layout(const fs::path& dir) {
  fs::create_directories(dir / "work");
  write_oci_layers(dir / "work", TarWriter::Compression::kGzip);
  const fs::path layout = dir / "layout";
  fs::create_directories(layout);
  write_text(layout / "oci-layout", R"({"imageLayoutVersion":"1.0.0"})");
  fs::path l1 = put_oci_blob(layout, dir / "work/layer1.tar");
  fs::path l2 = put_oci_blob(layout, dir / "work/layer2.tar");
  write_text(dir / "work/config.json", R"({"architecture":"amd64","os":"linux","rootfs":{"type":"layers"}})");
  fs::path config = put_oci_blob(layout, dir / "work/config.json");
  json manifest = {{"schemaVersion", 2},
                   {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
                   {"config", descriptor("application/vnd.oci.image.config.v1+json", config)},
                   {"layers", json::array({descriptor("application/vnd.oci.image.layer.v1.tar+gzip", l1),
                                           descriptor("application/vnd.oci.image.layer.v1.tar+gzip", l2)})}};
  write_text(dir / "work/manifest.json", manifest.dump());
  fs::path mblob = put_oci_blob(layout, dir / "work/manifest.json");
  json md = descriptor("application/vnd.oci.image.manifest.v1+json", mblob);
  md["platform"] = {{"architecture", host_arch_for_oci()}, {"os", "linux"}};
  // Another platform's image listed first: the host's must be chosen.
  json other = md;
  other["platform"] = {{"architecture", "s390x"}, {"os", "linux"}};
  other["digest"] = sha256_digest("not here");
  json index = {{"schemaVersion", 2}, {"manifests", json::array({other, md})}};
  write_text(layout / "index.json", index.dump());
  fs::remove_all(dir / "work");
  return layout;
}

// A tar of a directory's contents, names relative ("oci-layout", "blobs/sha256/...") as docker save writes them.
void tar_directory(const fs::path& dir, const fs::path& tar) {
  TarWriter t(tar);
  std::vector<fs::path> entries;
  for (auto it = fs::recursive_directory_iterator(dir); it != fs::recursive_directory_iterator(); ++it)
    entries.push_back(it->path());
  std::sort(entries.begin(), entries.end());
  for (const auto& p : entries) {
    std::string rel = p.lexically_relative(dir).string();
    if (fs::is_directory(p)) {
      t.dir(rel);
    } else {
      t.file(rel, read_text(p));
    }
  }
}

TEST(ImageBuild, FromAnOciLayoutAppliesWhiteouts) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  const fs::path layout = write_oci_layout(tmp / "oci");
  StoreFixture s(tmp / "store");
  // The layout is recognised without the oci: prefix too.
  EXPECT_EQ(static_cast<int>(LayerSource::parse(layout.string()).kind), static_cast<int>(LayerSource::Kind::kOci));
  BuildResult r = s.build("app:oci", layout.string());
  const Manifest& m = r.image.manifest;
  ASSERT_EQ(m.layers.size(), 1u) << "an OCI image becomes one dsec layer";
  EXPECT_NE(m.source.find("2 layers"), std::string::npos) << m.source;
  s.expect_no_scratch();

  const fs::path root = s.mount(m.layers[0], tmp / "mnt");
  EXPECT_EQ(tree_paths(root), kOciExpected) << joined(tree_paths(root));
  EXPECT_EQ(read_text(root / "etc/keep"), "kept\n");
  EXPECT_EQ(read_text(root / "data/new"), "added in layer 2");
  EXPECT_EQ(read_text(root / "bin/tool"), "v2");
  EXPECT_EQ(lstat_of(root / "bin/tool").st_mode & 07777, 0700u);
  // Applied, not carried: no overlayfs markers in a layer that is a whole image.
  EXPECT_FALSE(xattr_of(root / "data", "trusted.overlay.opaque"));
}

TEST(ImageBuild, FromADockerSaveTar) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  const fs::path layout = write_oci_layout(tmp / "oci");
  tar_directory(layout, tmp / "image.tar");
  StoreFixture s(tmp / "store");
  for (const std::string& source : {"oci:" + (tmp / "image.tar").string(), (tmp / "image.tar").string()}) {
    SCOPED_TRACE(source);
    BuildResult r = s.build("saved", source);
    EXPECT_NE(r.image.manifest.source.find("2 layers"), std::string::npos) << r.image.manifest.source;
    const fs::path root = s.mount(r.image.manifest.layers[0], tmp / "mnt");
    EXPECT_EQ(tree_paths(root), kOciExpected) << joined(tree_paths(root));
    EXPECT_EQ(read_text(root / "bin/tool"), "v2");
    s.expect_no_scratch();
  }
}

TEST(ImageBuild, FromTheLegacyDockerSaveFormat) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  fs::create_directories(tmp / "saved/aaa");
  fs::create_directories(tmp / "saved/bbb");
  fs::create_directories(tmp / "layers");
  write_oci_layers(tmp / "layers", TarWriter::Compression::kNone);
  fs::copy_file(tmp / "layers/layer1.tar", tmp / "saved/aaa/layer.tar");
  fs::copy_file(tmp / "layers/layer2.tar", tmp / "saved/bbb/layer.tar");
  write_text(tmp / "saved/manifest.json",
             R"([{"Config":"cfg.json","RepoTags":["app:1"],"Layers":["aaa/layer.tar","bbb/layer.tar"]}])");
  write_text(tmp / "saved/cfg.json", "{}");
  tar_directory(tmp / "saved", tmp / "legacy.tar");
  StoreFixture s(tmp / "store");
  BuildResult r = s.build("legacy", (tmp / "legacy.tar").string());
  const fs::path root = s.mount(r.image.manifest.layers[0], tmp / "mnt");
  EXPECT_EQ(tree_paths(root), kOciExpected) << joined(tree_paths(root));
  s.expect_no_scratch();

  // A layer path that climbs out of the archive is refused.
  write_text(tmp / "saved/manifest.json", R"([{"Layers":["../../etc/passwd"]}])");
  tar_directory(tmp / "saved", tmp / "evil.tar");
  expect_error([&] { s.build("evil", "oci:" + (tmp / "evil.tar").string()); }, Code::kInvalidArgument);
  EXPECT_FALSE(s.store().read_ref("evil"));
  s.expect_no_scratch();
}

// An index that points at another index (as multi-platform images do), and a layer the layout does not hold.
TEST(ImageBuild, NestedOciIndexesAndForeignLayers) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  const fs::path layout = write_oci_layout(tmp / "oci");
  const json top = json::parse(read_text(layout / "index.json"));
  write_text(tmp / "nested.json", json({{"schemaVersion", 2}, {"manifests", top["manifests"]}}).dump());
  fs::path nested = put_oci_blob(layout, tmp / "nested.json");
  write_text(layout / "index.json",
             json({{"schemaVersion", 2},
                   {"manifests", json::array({descriptor("application/vnd.oci.image.index.v1+json", nested)})}})
                 .dump());
  StoreFixture s(tmp / "store");
  BuildResult r = s.build("nested", "oci:" + layout.string());
  const fs::path root = s.mount(r.image.manifest.layers[0], tmp / "mnt");
  EXPECT_EQ(tree_paths(root), kOciExpected) << joined(tree_paths(root));

  // A layer with "urls" lives elsewhere (a foreign layer): refused, not fetched.
  const std::string md = top["manifests"][1]["digest"].get<std::string>();
  json manifest = json::parse(read_text(layout / "blobs/sha256" / digest_hex(md)));
  manifest["layers"][0]["urls"] = json::array({"https://example.invalid/layer"});
  manifest["layers"][0]["mediaType"] = "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip";
  write_text(tmp / "foreign.json", manifest.dump());
  fs::path foreign = put_oci_blob(layout, tmp / "foreign.json");
  write_text(layout / "index.json",
             json({{"schemaVersion", 2},
                   {"manifests", json::array({descriptor("application/vnd.oci.image.manifest.v1+json", foreign)})}})
                 .dump());
  expect_error([&] { s.build("foreign", "oci:" + layout.string()); }, Code::kFailedPrecondition, {"foreign layer"});
  EXPECT_FALSE(s.store().read_ref("foreign"));
  s.expect_no_scratch();
}

TEST(ImageBuild, DamagedOciBlobsAreRefused) {
  TempDir tmp;
  const fs::path layout = write_oci_layout(tmp / "oci");
  StoreFixture s(tmp / "store");
  // A layer blob whose bytes no longer match its digest.
  json index = json::parse(read_text(layout / "index.json"));
  json manifest =
      json::parse(read_text(layout / "blobs/sha256" / digest_hex(index["manifests"][1]["digest"].get<std::string>())));
  fs::path layer = layout / "blobs/sha256" / digest_hex(manifest["layers"][1]["digest"].get<std::string>());
  std::string bytes = read_text(layer);
  bytes[bytes.size() / 2] ^= 1;
  write_text(layer, bytes);
  expect_error([&] { s.build("bad", "oci:" + layout.string()); }, Code::kDataLoss, {"damaged"});
  // A missing layer blob.
  fs::remove(layer);
  expect_error([&] { s.build("bad", "oci:" + layout.string()); }, Code::kNotFound, {"missing"});
  // Not a layout at all.
  fs::create_directories(tmp / "empty");
  expect_error([&] { s.build("bad", "oci:" + (tmp / "empty").string()); }, Code::kInvalidArgument, {"index.json"});
  EXPECT_TRUE(s.store().list_refs().empty());
  EXPECT_TRUE(s.store().list_blobs().empty());
  s.expect_no_scratch();
}

// ---------------------------------------------------------------------------------------------------------------
// Layers on a parent

TEST(ImageBuild, OnAParentWhiteoutsHideTheParentsFiles) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  write_text(tmp / "base/etc/passwd", "root:x:0:0::/root:/bin/sh\n");
  write_text(tmp / "base/etc/hosts", "127.0.0.1 localhost\n");
  write_text(tmp / "base/opt/dir/a", "a");
  write_text(tmp / "base/opt/dir/b", "b");
  write_text(tmp / "base/opt/other", "o");
  StoreFixture s(tmp / "store");
  BuildResult base = s.build("base:v1", (tmp / "base").string());
  {
    TarWriter t(tmp / "task.tar");
    t.file("etc/.wh.passwd", "");
    t.file("opt/dir/.wh..wh..opq", "");
    t.file("opt/dir/c", "c");
    t.file("task/README", "solve it");
  }
  BuildResult task =
      s.build("swe/task-1", "tar:" + (tmp / "task.tar").string(), [](BuildOptions& o) { o.parent = "base:v1"; });
  const Manifest& m = task.image.manifest;
  ASSERT_EQ(m.layers.size(), 2u);
  EXPECT_EQ(m.layers[0].digest, base.layer.digest);
  EXPECT_EQ(m.layers[0].role, LayerRole::kBase);
  EXPECT_EQ(m.layers[1].role, LayerRole::kTask) << "a layer on a parent is a task layer unless told";
  EXPECT_EQ(m.parent, base.image.reference.to_string());
  EXPECT_NE(m.parent.find("@sha256:"), std::string::npos) << "the parent is pinned by digest";
  s.expect_no_scratch();

  // The new layer alone carries overlayfs's markers.
  const fs::path top = s.mount(m.layers[1], tmp / "top");
  struct stat wh = lstat_of(top / "etc/passwd");
  EXPECT_TRUE(S_ISCHR(wh.st_mode) && wh.st_rdev == makedev(0, 0)) << "no whiteout for etc/passwd";
  EXPECT_EQ(xattr_of(top / "opt/dir", "trusted.overlay.opaque"), "y");
  EXPECT_EQ(tree_paths(top),
            (std::set<std::string>{"etc", "etc/passwd", "opt", "opt/dir", "opt/dir/c", "task", "task/README"}))
      << joined(tree_paths(top));

  // Stacked: what a sandbox sees.
  const fs::path merged = s.mount_image(task.image, tmp / "image");
  EXPECT_EQ(tree_paths(merged), (std::set<std::string>{"etc", "etc/hosts", "opt", "opt/dir", "opt/dir/c", "opt/other",
                                                       "task", "task/README"}))
      << joined(tree_paths(merged));
  EXPECT_EQ(read_text(merged / "etc/hosts"), "127.0.0.1 localhost\n");
  EXPECT_EQ(read_text(merged / "opt/dir/c"), "c");

  // --role, and a second child on the same parent shares the parent's layer blobs.
  const auto blobs_before = s.blobs();
  BuildResult tool = s.build("py:dev", (tmp / "base").string(), [](BuildOptions& o) {
    o.parent = "base:v1";
    o.role = LayerRole::kToolchain;
  });
  EXPECT_EQ(tool.image.manifest.layers[1].role, LayerRole::kToolchain);
  EXPECT_EQ(s.blobs().size(), blobs_before.size() + 3) << "more than the new layer's two blobs and a manifest";
  // A pinned parent works the same.
  BuildResult pinned = s.build("swe/task-2", "tar:" + (tmp / "task.tar").string(),
                               [&](BuildOptions& o) { o.parent = "base:v1@" + base.image.digest; });
  EXPECT_EQ(pinned.image.manifest.layers[0].digest, base.layer.digest);
}

TEST(ImageBuild, AnOciImageOnAParent) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  write_text(tmp / "base/data/from-parent", "p");
  write_text(tmp / "base/etc/gone", "parent's copy");
  write_text(tmp / "base/etc/base-only", "b");
  StoreFixture s(tmp / "store");
  s.build("base", (tmp / "base").string());
  const fs::path layout = write_oci_layout(tmp / "oci");
  BuildResult r = s.build("app", "oci:" + layout.string(), [](BuildOptions& o) { o.parent = "base"; });
  const fs::path merged = s.mount_image(r.image, tmp / "image");
  // Layer 2's whiteout and opaque directory hide the parent's files as well as layer 1's.
  std::set<std::string> want = kOciExpected;
  want.insert("etc/base-only");
  EXPECT_EQ(tree_paths(merged), want) << joined(tree_paths(merged));
}

// ---------------------------------------------------------------------------------------------------------------
// Hostile and broken tars

class ImageHostileTar : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(tmp_ / "outside");
    write_text(tmp_ / "outside/secret", "host secret");
    fixture_ = std::make_unique<StoreFixture>(tmp_ / "store");
    fs::create_directories(tmp_ / "keep");
    write_text(tmp_ / "keep/file", "keep");
    fixture_->build("keep", (tmp_ / "keep").string());
    blobs_ = fixture_->blobs();
  }

  // The build fails with `code` and leaves no tag, no scratch file, no blob a tag needs, and nothing outside.
  Error expect_refused(const std::string& name, Code code, std::vector<std::string> parts = {},
                       std::uint64_t max_bytes = 64ull << 30) {
    Error e = expect_error(
        [&] { fixture_->build(name, "tar:" + tar().string(), [&](BuildOptions& o) { o.max_bytes = max_bytes; }); },
        code, std::move(parts));
    EXPECT_FALSE(fixture_->store().read_ref(name)) << name << " was tagged";
    EXPECT_EQ(fixture_->store().list_refs(), std::vector<std::string>{"keep:latest"});
    fixture_->expect_no_scratch();
    // Any blob the failed build stored is garbage: gc (dry run, no grace) would take all of them and nothing else.
    std::set<std::string> extra;
    for (const auto& b : fixture_->blobs())
      if (!blobs_.count(b)) extra.insert(b);
    GcResult gc = collect_garbage(fixture_->store(), std::chrono::seconds(0), true);
    EXPECT_EQ(std::set<std::string>(gc.removed.begin(), gc.removed.end()), extra);
    EXPECT_EQ(tree_paths(tmp_ / "outside"), std::set<std::string>{"secret"}) << "something was written outside";
    EXPECT_EQ(read_text(tmp_ / "outside/secret"), "host secret");
    return e;
  }
  fs::path tar() const { return tmp_ / "hostile.tar"; }
  fs::path outside() const { return tmp_ / "outside"; }

  TempDir tmp_;
  std::unique_ptr<StoreFixture> fixture_;
  std::set<std::string> blobs_;
};

TEST_F(ImageHostileTar, DotDotMembers) {
  for (const char* evil : {"../evil", "a/../../evil", "./../evil"}) {
    SCOPED_TRACE(evil);
    {
      TarWriter t(tar());
      t.file("fine", "ok");
      t.file(evil, "evil");
    }
    expect_refused("dotdot", Code::kInvalidArgument, {"leaves the tree"});
    EXPECT_FALSE(fs::exists(tmp_ / "store/.tmp/evil"));
    EXPECT_FALSE(fs::exists(tmp_ / "store/evil"));
  }
}

TEST_F(ImageHostileTar, AbsolutePaths) {
  const fs::path target = outside() / "abs-evil";
  {
    TarWriter t(tar());
    t.file(target.string(), "evil");
  }
  expect_refused("abs", Code::kInvalidArgument, {"absolute"});
  EXPECT_FALSE(fs::exists(target));
}

TEST_F(ImageHostileTar, WritingThroughASymlink) {
  {
    TarWriter t(tar());
    t.symlink("etc", outside().string());
    t.file("etc/passwd", "root::0:0::/:/bin/sh\n");
  }
  expect_refused("through-abs", Code::kInvalidArgument);
  {
    TarWriter t(tar());
    t.dir("a");
    t.symlink("a/up", "../../../../../../../../../../..");
    t.file("a/up" + outside().string() + "/planted", "evil");
  }
  expect_refused("through-rel", Code::kInvalidArgument);
  // Replacing the symlink's target file in place (same name as an outside file).
  {
    TarWriter t(tar());
    t.symlink("s", (outside() / "secret").string());
    t.file("s", "overwritten");
  }
  // Either refused, or the symlink replaced by a regular file: the outside file is untouched in both cases.
  try {
    BuildResult r = fixture_->build("replace", "tar:" + tar().string());
    EXPECT_EQ(read_text(outside() / "secret"), "host secret");
  } catch (const Error&) {
  }
  EXPECT_EQ(read_text(outside() / "secret"), "host secret");
}

TEST_F(ImageHostileTar, HardLinksOutOfTheTree) {
  {
    TarWriter t(tar());
    t.hardlink("h", "../outside/secret");
  }
  expect_refused("hl-dotdot", Code::kInvalidArgument);
  {
    TarWriter t(tar());
    t.hardlink("h", (outside() / "secret").string());
  }
  expect_refused("hl-abs", Code::kInvalidArgument);
  // Through a symlink that points outside: a link to the host's file must not end up in the image.
  {
    TarWriter t(tar());
    t.symlink("esc", outside().string());
    t.hardlink("h", "esc/secret");
  }
  expect_refused("hl-symlink", Code::kInvalidArgument);
  EXPECT_EQ(lstat_of(outside() / "secret").st_nlink, 1u) << "the host's file got a second name";
}

TEST_F(ImageHostileTar, DeviceNodesAreSkippedAndNoted) {
  SKIP_UNLESS_MOUNTS();
  {
    TarWriter t(tar());
    t.file("ok", "fine");
    t.char_device("dev/sda-ish", 8, 0);
    t.char_device("dev/mem", 1, 1);
  }
  BuildResult r = fixture_->build("devices", "tar:" + tar().string());
  EXPECT_TRUE(any_note_has(r.image.manifest.notes, "dev/sda-ish")) << joined(r.image.manifest.notes);
  EXPECT_TRUE(any_note_has(r.image.manifest.notes, "dev/mem")) << joined(r.image.manifest.notes);
  const fs::path root = fixture_->mount(r.image.manifest.layers[0], tmp_ / "mnt");
  EXPECT_EQ(tree_paths(root), (std::set<std::string>{"ok"})) << joined(tree_paths(root));
  fixture_->expect_no_scratch();
}

TEST_F(ImageHostileTar, MembersOverTheSizeLimit) {
  {
    TarWriter t(tar());
    t.file("small", "x");
    t.file("big", random_bytes(2 << 20, 1));
  }
  expect_refused("big", Code::kResourceExhausted, {"big", "limit"}, 1 << 20);
  // Many members that are each small but too much together.
  {
    TarWriter t(tar());
    for (int i = 0; i < 4; ++i) t.file(fmt::format("part{}", i), random_bytes(300000, 10 + i));
  }
  expect_refused("sum", Code::kResourceExhausted, {"limit"}, 1 << 20);
}

TEST_F(ImageHostileTar, TruncatedAndGarbageStreamsAreDataLoss) {
  {
    TarWriter t(tmp_ / "whole.tar");
    t.file("a", random_bytes(100000, 2));
    t.file("b", random_bytes(100000, 3));
  }
  std::string whole = read_text(tmp_ / "whole.tar");
  write_text(tar(), whole.substr(0, 150000));  // in the middle of b's data
  expect_refused("cut-data", Code::kDataLoss);
  write_text(tar(), whole.substr(0, 100000 + 512 + 100));  // in the middle of b's header
  expect_refused("cut-header", Code::kDataLoss);
  {
    TarWriter t(tmp_ / "whole.tar.gz", TarWriter::Compression::kGzip);
    t.file("a", random_bytes(100000, 2));
    t.file("b", random_bytes(100000, 3));
  }
  std::string gz = read_text(tmp_ / "whole.tar.gz");
  write_text(tar(), gz.substr(0, gz.size() * 2 / 3));
  expect_refused("cut-gzip", Code::kDataLoss);
  write_text(tar(), random_bytes(10000, 4));
  expect_refused("garbage", Code::kDataLoss);
}

// ---------------------------------------------------------------------------------------------------------------
// Rebuilding, and full disks

TEST(ImageBuild, BuildingTheSameTreeTwice) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  SourceTree src(tmp / "src");
  StoreFixture s(tmp / "store");
  BuildResult one = s.build("one", (tmp / "src").string());
  BuildResult two = s.build("two", (tmp / "src").string());
  // mkfs.erofs may write a fresh UUID and build time each run, so the layers need not be identical; when they are,
  // the second build must say so and store nothing new.
  EXPECT_EQ(two.layer_existed, two.layer.digest == one.layer.digest);
  const fs::path a = s.mount(one.layer, tmp / "a"), b = s.mount(two.layer, tmp / "b");
  EXPECT_EQ(tree_paths(a), tree_paths(b));
  expect_same_tree(src.root, a, true);
  expect_same_tree(src.root, b, true);
  // Rebuilding under the same tag moves the tag; the old image's blobs stay until gc.
  BuildResult again = s.build("one", (tmp / "src").string());
  EXPECT_EQ(s.store().read_ref("one"), again.image.digest);
  EXPECT_EQ(s.store().list_refs(), (std::vector<std::string>{"one:latest", "two:latest"}));
}

TEST(ImageBuild, AFullStoreDiskIsResourceExhausted) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  fs::create_directories(tmp / "small");
  if (::mount("tmpfs", (tmp / "small").c_str(), "tmpfs", 0, "size=8m") != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{tmp / "small"};

  write_text(tmp / "little/marker", "old");
  StoreFixture s(tmp / "small/store");
  BuildResult little = s.build("little", (tmp / "little").string());

  // Too big for the disk at different steps: the EROFS image itself, and the chunks beside the image.
  write_text(tmp / "huge/blob", random_bytes(12 << 20, 1));
  write_text(tmp / "mid/blob", random_bytes(5 << 20, 2));
  for (const char* name : {"huge", "mid"}) {
    SCOPED_TRACE(name);
    expect_error([&] { s.build(name, (tmp / name).string()); }, Code::kResourceExhausted);
    EXPECT_FALSE(s.store().read_ref(name));
    s.expect_no_scratch();
  }
  // A tar source that would unpack to more than the disk holds.
  {
    TarWriter t(tmp / "huge.tar");
    t.file("blob", random_bytes(12 << 20, 3));
  }
  expect_error([&] { s.build("huge-tar", "tar:" + (tmp / "huge.tar").string()); }, Code::kResourceExhausted);
  s.expect_no_scratch();

  // The store still works: the other image is listed, whole and readable.
  EXPECT_EQ(s.store().list_refs(), std::vector<std::string>{"little:latest"});
  ResolvedManifest image = fetch_manifest(s.store(), parse_reference("little"));
  EXPECT_EQ(image.digest, little.image.digest);
  const fs::path root = s.mount(image.manifest.layers[0], tmp / "mnt");
  EXPECT_EQ(read_text(root / "marker"), "old");
  // After gc (no grace) the disk has room again for a small build.
  collect_garbage(s.store(), std::chrono::seconds(0));
  write_text(tmp / "after/ok", "fits");
  EXPECT_NO_THROW(s.build("after", (tmp / "after").string()));
}

TEST(ImageBuild, AReadOnlyStoreIsPermissionDenied) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  fs::create_directories(tmp / "ro");
  if (::mount("tmpfs", (tmp / "ro").c_str(), "tmpfs", MS_RDONLY, "size=1m") != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here: " << std::strerror(errno);
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{tmp / "ro"};
  write_text(tmp / "src/file", "x");
  StoreFixture s(tmp / "ro/store");
  expect_error([&] { s.build("app", (tmp / "src").string()); }, Code::kPermissionDenied, {"Read-only"});
}

// ---------------------------------------------------------------------------------------------------------------
// busybox and debootstrap

TEST(ImageBuild, BusyboxImageHasAppletsAccountsAndMountPoints) {
  if (!fs::exists("/bin/busybox")) GTEST_SKIP() << "busybox-static is not installed";
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  StoreFixture s(tmp / "store");
  BuildResult r;
  try {
    r = s.build("busybox", "busybox-static");
  } catch (const Error& e) {
    if (e.code() == Code::kFailedPrecondition) GTEST_SKIP() << e.what();
    throw;
  }
  EXPECT_EQ(r.image.reference.tagged(), "busybox:latest");
  EXPECT_TRUE(any_note_has(r.image.manifest.notes, "applets")) << joined(r.image.manifest.notes);
  EXPECT_GT(r.layer.files_size, 500000u);
  const fs::path root = s.mount(r.layer, tmp / "mnt");
  EXPECT_TRUE(S_ISREG(lstat_of(root / "bin/busybox").st_mode));
  EXPECT_EQ(lstat_of(root / "bin/busybox").st_mode & 07777, 0755u);
  EXPECT_EQ(fs::read_symlink(root / "bin/sh"), "busybox");
  EXPECT_EQ(fs::read_symlink(root / "bin/ls"), "busybox");
  EXPECT_EQ(fs::read_symlink(root / "usr/bin"), "../bin");
  EXPECT_EQ(lstat_of(root / "tmp").st_mode & 07777, 01777u);
  EXPECT_EQ(lstat_of(root / "root").st_mode & 07777, 0700u);
  for (const char* d : {"proc", "dev", "sys"}) EXPECT_TRUE(fs::is_directory(root / d)) << d;
  for (const char* f : {"etc/hostname", "etc/resolv.conf"}) EXPECT_TRUE(fs::is_regular_file(root / f)) << f;
  EXPECT_EQ(read_text(root / "etc/passwd").rfind("root:x:0:0:root:/root:/bin/sh\n", 0), 0u);
  EXPECT_EQ(read_text(root / "etc/group").rfind("root:x:0:\n", 0), 0u);
  EXPECT_EQ(read_text(root / "bin/busybox"), read_text("/bin/busybox"));

  // The mounted image is a working root: its shell runs, finds its applets through PATH and reads its own passwd.
  ProcessResult p = run_process(
      {"chroot", root.string(), "/bin/sh", "-c", "test \"$(id -un)\" = root && ls /bin | grep -qx wget && exit 42"});
  EXPECT_EQ(p.exit_code, 42) << p.status_text() << ": " << p.tail();
}

TEST(ImageBuild, BusyboxRejectsADynamicBinary) {
  TempDir tmp;
  std::vector<std::string> notes;
  expect_error([&] { make_busybox_tree(tmp / "bb", "/bin/ls", notes); }, Code::kFailedPrecondition,
               {"dynamically linked"});
  expect_error([&] { make_busybox_tree(tmp / "bb2", tmp / "nope", notes); }, Code::kFailedPrecondition,
               {"busybox-static"});
  write_text(tmp / "script", "#!/bin/sh\n", 0755);
  expect_error([&] { make_busybox_tree(tmp / "bb3", tmp / "script", notes); }, Code::kFailedPrecondition, {"ELF"});
  EXPECT_FALSE(fs::exists(tmp / "bb"));
  StoreFixture s(tmp / "store");
  expect_error([&] { s.build("bb", "busybox-static", [](BuildOptions& o) { o.busybox = "/bin/ls"; }); },
               Code::kFailedPrecondition);
  EXPECT_FALSE(s.store().read_ref("bb"));
  s.expect_no_scratch();
}

TEST(ImageBuild, DebootstrapRejectsBadArgumentsBeforeDoingAnything) {
  TempDir tmp;
  std::vector<std::string> notes;
  auto tree = [&](const std::string& suite, std::vector<std::string> packages, const std::string& mirror) {
    make_debootstrap_tree(tmp / "tree", suite, packages, mirror, tmp / "cache", {}, notes);
  };
  expect_error([&] { tree("Bookworm;rm", {}, ""); }, Code::kInvalidArgument);
  expect_error([&] { tree("../bookworm", {}, ""); }, Code::kInvalidArgument);
  expect_error([&] { tree("bookworm", {"python3,evil"}, ""); }, Code::kInvalidArgument);
  expect_error([&] { tree("bookworm", {"--force"}, ""); }, Code::kInvalidArgument);
  expect_error([&] { tree("bookworm", {}, "ftp://example"); }, Code::kInvalidArgument);
  EXPECT_FALSE(fs::exists(tmp / "tree"));
  EXPECT_FALSE(fs::exists(tmp / "cache"));
}

TEST(ImageBuild, FailedDebootstrapLeavesNoImage) {
  if (!running_as_root()) GTEST_SKIP() << "debootstrap needs root";
  if (find_executable("debootstrap").empty()) GTEST_SKIP() << "debootstrap is not installed";
  TempDir tmp;
  StoreFixture s(tmp / "store");
  try {
    s.build("deb", "debootstrap:bookworm", [&](BuildOptions& o) {
      o.include_packages = {"hello"};
      o.mirror = "file://" + (tmp / "no-mirror").string();
      o.cache_dir = tmp / "cache";
    });
    FAIL() << "debootstrap from a missing mirror succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("debootstrap bookworm"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(s.store().read_ref("deb"));
  EXPECT_TRUE(s.store().list_blobs().empty());
  s.expect_no_scratch();
  EXPECT_FALSE(fs::exists(tmp / "cache" / debootstrap_cache_name("bookworm", host_debian_arch(), {"hello"})));
}

// ---------------------------------------------------------------------------------------------------------------
// Tree helpers and processes

TEST(ImageTree, PackAndUnpackRoundTrip) {
  TempDir tmp;
  SourceTree src(tmp / "src");
  if (running_as_root()) fs::remove(src.root / "dev-null");
  pack_tree(src.root, tmp / "cache/tree.tar.zst");
  ASSERT_TRUE(fs::is_regular_file(tmp / "cache/tree.tar.zst"));
  EXPECT_TRUE(entries_with_prefix(tmp / "cache", "tree.tar.zst.tmp").empty());
  std::vector<std::string> notes;
  unpack_tree(tmp / "cache/tree.tar.zst", tmp / "out", notes);
  expect_same_tree(src.root, tmp / "out", false);
}

TEST(ImageTree, UnpackRefusesEntriesOutsideTheTree) {
  TempDir tmp;
  for (const char* evil : {"../evil", "/abs-evil", "a/../../evil"}) {
    fs::path tar = tmp / "evil.tar";
    {
      TarWriter t(tar);
      t.file(evil, "evil");
    }
    std::vector<std::string> notes;
    fs::path out = tmp / "out";
    remove_tree(out);
    EXPECT_THROW(unpack_tree(tar, out, notes), Error) << evil;
    EXPECT_FALSE(fs::exists(tmp / "evil"));
    EXPECT_FALSE(fs::exists("/abs-evil"));
  }
}

TEST(ImageTree, RemoveTreeDoesNotFollowSymlinksOrCrossMounts) {
  TempDir tmp;
  write_text(tmp / "keep/precious", "keep");
  fs::create_directories(tmp / "doomed/sub");
  fs::create_symlink(tmp / "keep", tmp / "doomed/link-to-keep");
  bool mounted = false;
  if (running_as_root()) {
    fs::create_directories(tmp / "doomed/mnt");
    mounted = ::mount((tmp / "keep").c_str(), (tmp / "doomed/mnt").c_str(), nullptr, MS_BIND, nullptr) == 0;
  }
  remove_tree(tmp / "doomed");
  EXPECT_FALSE(fs::exists(tmp / "doomed"));
  EXPECT_EQ(read_text(tmp / "keep/precious"), "keep");
  if (mounted) {
    EXPECT_TRUE(fs::exists(tmp / "keep/precious")) << "remove_tree went through a bind mount";
  }
  EXPECT_NO_THROW(remove_tree(tmp / "doomed"));  // already gone
}

TEST(ImageProcess, RunsProgramsAndReportsTheirStatus) {
  ProcessResult ok = run_process({"sh", "-c", "echo out; echo err >&2; exit 3"});
  EXPECT_EQ(ok.exit_code, 3);
  EXPECT_EQ(ok.out, "out\n");
  EXPECT_EQ(ok.err, "err\n");
  EXPECT_EQ(ok.tail(), "err");
  EXPECT_FALSE(ok.ok());
  std::vector<std::string> lines;
  ProcessOptions opts;
  opts.on_line = [&](std::string_view l) { lines.emplace_back(l); };
  run_process({"sh", "-c", "printf 'a\\nb\\nc'"}, opts);
  EXPECT_EQ(lines, (std::vector<std::string>{"a", "b", "c"}));
  ProcessResult killed = run_process({"sh", "-c", "kill -9 $$"});
  EXPECT_EQ(killed.signal, 9);
  EXPECT_EQ(killed.exit_code, -1);
  try {
    run_process({"dsec-no-such-program"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace dsec::image
