// Layers that hold only what differs from their parent: make_diff_tree of two small trees (files added, changed,
// removed; a directory removed; a directory replacing a file and a file replacing a directory; metadata-only
// changes; hard links), checked by stacking the diff over the base with overlayfs and comparing the merged view with
// the wanted tree entry by entry. Then the same through the store: an image built with BuildOptions::diff on a
// parent, mounted back from its chunks (MountedImage), shows the wanted tree while its new layer holds only the
// changes. A damaged chunk is DATA_LOSS when layers are read back.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "dsec/error.hpp"
#include "image/build.hpp"
#include "image/fs_tree.hpp"
#include "image/image_test_util.hpp"
#include "image/layer_files.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/digest.hpp"
#include "image/tree_diff.hpp"

namespace dsec::image {
namespace {

namespace fs = std::filesystem;
using testing::read_text;
using testing::running_as_root;
using testing::TempDir;
using testing::write_text;

// Whiteouts, opaque directories and overlay mounts need root.
#define SKIP_UNLESS_ROOT()                                                              \
  do {                                                                                  \
    if (!running_as_root()) GTEST_SKIP() << "overlayfs whiteouts and mounts need root"; \
  } while (0)

template <typename Fn>
void expect_code(Fn&& fn, Code code) {
  try {
    fn();
    ADD_FAILURE() << "expected " << code_name(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
  }
}

void set_mtime(const fs::path& p, long sec, long nsec = 0) {
  const struct timespec times[2] = {{sec, nsec}, {sec, nsec}};
  ASSERT_EQ(::utimensat(AT_FDCWD, p.c_str(), times, AT_SYMLINK_NOFOLLOW), 0) << p;
}

std::map<std::string, std::string> xattrs_of(const fs::path& p) {
  std::map<std::string, std::string> out;
  char names[4096];
  ssize_t n = ::llistxattr(p.c_str(), names, sizeof names);
  for (ssize_t at = 0; n > 0 && at < n;) {
    std::string name = names + at;
    at += static_cast<ssize_t>(name.size()) + 1;
    char value[4096];
    ssize_t v = ::lgetxattr(p.c_str(), name.c_str(), value, sizeof value);
    if (v >= 0) out[name] = std::string(value, static_cast<std::size_t>(v));
  }
  return out;
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

bool is_whiteout(const fs::path& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0 && S_ISCHR(st.st_mode) && st.st_rdev == makedev(0, 0);
}

bool is_opaque(const fs::path& p) {
  char v[8];
  ssize_t n = ::lgetxattr(p.c_str(), "trusted.overlay.opaque", v, sizeof v);
  return n == 1 && v[0] == 'y';
}

// Every entry of `want` is in `got` with the same type, mode, owner, size, mtime, xattrs, symlink target and file
// content, and `got` has nothing more. Failures name the path.
void expect_same_tree(const fs::path& want, const fs::path& got, const fs::path& rel = {}) {
  const fs::path w = rel.empty() ? want : want / rel;
  const fs::path g = rel.empty() ? got : got / rel;
  struct stat ws {
  }, gs{};
  ASSERT_EQ(::lstat(w.c_str(), &ws), 0) << w;
  ASSERT_EQ(::lstat(g.c_str(), &gs), 0) << "missing in the merged view: /" << rel.string();
  const std::string where = "/" + rel.string();
  EXPECT_EQ(ws.st_mode, gs.st_mode) << where;
  EXPECT_EQ(ws.st_uid, gs.st_uid) << where;
  EXPECT_EQ(ws.st_gid, gs.st_gid) << where;
  EXPECT_EQ(ws.st_mtim.tv_sec, gs.st_mtim.tv_sec) << where;
  EXPECT_EQ(ws.st_mtim.tv_nsec, gs.st_mtim.tv_nsec) << where;
  EXPECT_EQ(xattrs_of(w), xattrs_of(g)) << where;
  if (S_ISDIR(ws.st_mode) && S_ISDIR(gs.st_mode)) {
    auto wn = names_in(w), gn = names_in(g);
    EXPECT_EQ(wn, gn) << "entries of " << where;
    for (const auto& n : wn)
      if (std::binary_search(gn.begin(), gn.end(), n)) expect_same_tree(want, got, rel / n);
  } else if (S_ISREG(ws.st_mode)) {
    EXPECT_EQ(ws.st_size, gs.st_size) << where;
    EXPECT_EQ(read_text(w), read_text(g)) << where;
  } else if (S_ISLNK(ws.st_mode)) {
    EXPECT_EQ(fs::read_symlink(w), fs::read_symlink(g)) << where;
  }
}

// A read-only overlay of `lowers` (top first).
class Overlay {
 public:
  Overlay(const std::vector<fs::path>& lowers, const fs::path& at) : at_(at) {
    fs::create_directories(at_);
    std::string options = "lowerdir=";
    for (std::size_t i = 0; i < lowers.size(); ++i) options += (i ? ":" : "") + lowers[i].string();
    if (::mount("overlay", at_.c_str(), "overlay", MS_RDONLY, options.c_str()) != 0)
      throw std::runtime_error("mount overlay " + options + ": " + std::strerror(errno));
  }
  ~Overlay() { ::umount2(at_.c_str(), MNT_DETACH); }
  Overlay(const Overlay&) = delete;
  Overlay& operator=(const Overlay&) = delete;

 private:
  fs::path at_;
};

// The base tree: a little root filesystem.
void make_base(const fs::path& root) {
  write_text(root / "etc/hostname", "base\n");
  write_text(root / "etc/keep.conf", "unchanged\n");
  write_text(root / "etc/mode.conf", "same bytes\n", 0644);
  write_text(root / "etc/xattr.conf", "same bytes\n");
  write_text(root / "usr/bin/tool", std::string(100000, 't'), 0755);
  write_text(root / "usr/lib/libold.so", "old library");
  write_text(root / "usr/lib/liblinked.so", "linked twice");
  fs::create_hard_link(root / "usr/lib/liblinked.so", root / "usr/lib/liblinked.so.1");
  write_text(root / "var/cache/app/a", "a");
  write_text(root / "var/cache/app/sub/b", "b");
  write_text(root / "opt/was-a-file", "file");
  write_text(root / "opt/was-a-dir/inner", "inner");
  fs::create_symlink("keep.conf", root / "etc/link-same");
  fs::create_symlink("keep.conf", root / "etc/link-retarget");
  ASSERT_EQ(::chown((root / "etc/keep.conf").c_str(), 1000, 1000), 0);
  ASSERT_EQ(::lsetxattr((root / "etc/xattr.conf").c_str(), "user.tag", "one", 3, 0), 0);
  // Fixed times everywhere, so that a copy compares equal.
  for (const auto& e : fs::recursive_directory_iterator(root)) set_mtime(e.path(), 1600000000, 123);
  set_mtime(root, 1600000000, 123);
}

// The wanted tree: a copy of base with every kind of change.
void make_full(const fs::path& base, const fs::path& full) {
  std::vector<std::string> notes;
  copy_tree(base, full, notes);
  write_text(full / "etc/hostname", "full, longer\n");                    // changed content and size
  write_text(full / "etc/new.conf", "added\n");                           // added file
  write_text(full / "usr/share/doc/pkg/README", "a new directory tree");  // added directories
  fs::remove(full / "usr/lib/libold.so");                                 // removed file
  fs::remove_all(full / "var/cache/app");                                 // removed directory
  fs::remove(full / "opt/was-a-file");                                    // a directory replaces a file
  write_text(full / "opt/was-a-file/now-inside", "inside");
  fs::remove_all(full / "opt/was-a-dir");  // a file replaces a directory
  write_text(full / "opt/was-a-dir", "now a file");
  ASSERT_EQ(::chmod((full / "etc/mode.conf").c_str(), 0600), 0);  // metadata only
  ASSERT_EQ(::lsetxattr((full / "etc/xattr.conf").c_str(), "user.tag", "two", 3, 0), 0);
  fs::remove(full / "etc/link-retarget");
  fs::create_symlink("hostname", full / "etc/link-retarget");
  set_mtime(full / "etc/link-retarget", 1600000000, 123);  // same time, other target
  // Both names of a hard-linked file change together.
  fs::remove(full / "usr/lib/liblinked.so");
  fs::remove(full / "usr/lib/liblinked.so.1");
  write_text(full / "usr/lib/liblinked.so", "linked twice, version 2");
  fs::create_hard_link(full / "usr/lib/liblinked.so", full / "usr/lib/liblinked.so.1");
  set_mtime(full / "usr/bin", 1700000000);  // a directory's own metadata
}

TEST(ImageDiff, OverlayOfTheDiffOverTheBaseIsTheFullTree) {
  SKIP_UNLESS_ROOT();
  TempDir tmp;
  make_base(tmp / "base");
  make_full(tmp / "base", tmp / "full");
  std::vector<std::string> notes;
  DiffStats stats = make_diff_tree(tmp / "base", tmp / "full", tmp / "out", notes);
  const fs::path out = tmp / "out";

  // What the layer holds: the changes, nothing unchanged.
  EXPECT_FALSE(fs::exists(fs::symlink_status(out / "etc/keep.conf")));
  EXPECT_FALSE(fs::exists(fs::symlink_status(out / "etc/link-same")));
  EXPECT_FALSE(fs::exists(fs::symlink_status(out / "usr/bin/tool")));
  EXPECT_EQ(read_text(out / "etc/hostname"), "full, longer\n");
  EXPECT_EQ(read_text(out / "etc/new.conf"), "added\n");
  EXPECT_EQ(read_text(out / "usr/share/doc/pkg/README"), "a new directory tree");
  EXPECT_EQ(read_text(out / "etc/mode.conf"), "same bytes\n");
  EXPECT_EQ(read_text(out / "etc/xattr.conf"), "same bytes\n");
  EXPECT_EQ(fs::read_symlink(out / "etc/link-retarget"), "hostname");
  EXPECT_TRUE(is_whiteout(out / "usr/lib/libold.so"));
  EXPECT_TRUE(is_whiteout(out / "var/cache/app"));  // one whiteout for the whole directory
  EXPECT_TRUE(fs::is_directory(fs::symlink_status(out / "opt/was-a-file")));
  EXPECT_TRUE(is_opaque(out / "opt/was-a-file"));
  EXPECT_EQ(read_text(out / "opt/was-a-file/now-inside"), "inside");
  EXPECT_EQ(read_text(out / "opt/was-a-dir"), "now a file");
  EXPECT_FALSE(is_opaque(out / "etc"));
  EXPECT_TRUE(fs::is_directory(out / "usr/bin"));  // its own metadata changed; its file did not
  EXPECT_TRUE(fs::is_empty(out / "usr/bin"));
  struct stat a {
  }, b{};
  ASSERT_EQ(::lstat((out / "usr/lib/liblinked.so").c_str(), &a), 0);
  ASSERT_EQ(::lstat((out / "usr/lib/liblinked.so.1").c_str(), &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino) << "hard links stay hard links";

  EXPECT_EQ(stats.whiteouts, 2u);
  EXPECT_EQ(stats.opaque_dirs, 1u);
  EXPECT_GE(stats.unchanged, 3u);  // keep.conf, link-same, tool
  EXPECT_LT(stats.bytes, 1000u) << "the unchanged 100 kB tool must not be in the layer";
  ASSERT_FALSE(notes.empty());
  EXPECT_NE(notes.back().find("2 removed"), std::string::npos) << notes.back();

  Overlay merged({out, tmp / "base"}, tmp / "merged");
  expect_same_tree(tmp / "full", tmp / "merged");
}

TEST(ImageDiff, CopiesAcrossFilesystemsKeepEverything) {
  SKIP_UNLESS_ROOT();
  TempDir tmp;
  make_base(tmp / "base");
  make_full(tmp / "base", tmp / "full");
  // The output on a tmpfs: files cannot be hard-linked from `full`, so they are copied.
  fs::create_directories(tmp / "other");
  if (::mount("tmpfs", (tmp / "other").c_str(), "tmpfs", 0, "size=64m") != 0)
    GTEST_SKIP() << "cannot mount a tmpfs: " << std::strerror(errno);
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{tmp / "other"};
  std::vector<std::string> notes;
  DiffStats stats = make_diff_tree(tmp / "base", tmp / "full", tmp / "other/out", notes);
  EXPECT_EQ(stats.linked, 0u);
  struct stat a {
  }, b{};
  ASSERT_EQ(::lstat((tmp / "other/out/usr/lib/liblinked.so").c_str(), &a), 0);
  ASSERT_EQ(::lstat((tmp / "other/out/usr/lib/liblinked.so.1").c_str(), &b), 0);
  EXPECT_EQ(a.st_ino, b.st_ino) << "hard links stay hard links when copied";
  Overlay merged({tmp / "other/out", tmp / "base"}, tmp / "merged");
  expect_same_tree(tmp / "full", tmp / "merged");
}

TEST(ImageDiff, CopiesInsteadOfLinkingWhenAskedTo) {
  SKIP_UNLESS_ROOT();
  TempDir tmp;
  make_base(tmp / "base");
  make_full(tmp / "base", tmp / "full");
  std::vector<std::string> notes;
  DiffStats linked = make_diff_tree(tmp / "base", tmp / "full", tmp / "linked", notes);
  EXPECT_GT(linked.linked, 0u);
  DiffOptions copy;
  copy.link_files = false;
  DiffStats copied = make_diff_tree(tmp / "base", tmp / "full", tmp / "copied", notes, copy);
  EXPECT_EQ(copied.linked, 0u);
  EXPECT_EQ(copied.bytes, linked.bytes);
  struct stat a {
  }, b{};
  ASSERT_EQ(::lstat((tmp / "full/etc/hostname").c_str(), &a), 0);
  ASSERT_EQ(::lstat((tmp / "copied/etc/hostname").c_str(), &b), 0);
  EXPECT_NE(a.st_ino, b.st_ino);
  Overlay merged({tmp / "copied", tmp / "base"}, tmp / "merged");
  expect_same_tree(tmp / "full", tmp / "merged");
}

TEST(ImageDiff, IdenticalTreesGiveAnEmptyLayer) {
  SKIP_UNLESS_ROOT();
  TempDir tmp;
  make_base(tmp / "base");
  std::vector<std::string> notes;
  copy_tree(tmp / "base", tmp / "full", notes);
  DiffStats stats = make_diff_tree(tmp / "base", tmp / "full", tmp / "out", notes);
  EXPECT_EQ(stats.written, 0u);
  EXPECT_EQ(stats.whiteouts, 0u);
  EXPECT_TRUE(fs::is_empty(tmp / "out"));
}

TEST(ImageDiff, BadArguments) {
  TempDir tmp;
  write_text(tmp / "file", "x");
  fs::create_directories(tmp / "dir");
  fs::create_directories(tmp / "exists");
  std::vector<std::string> notes;
  expect_code([&] { make_diff_tree(tmp / "file", tmp / "dir", tmp / "out", notes); }, Code::kInvalidArgument);
  expect_code([&] { make_diff_tree(tmp / "dir", tmp / "missing", tmp / "out", notes); }, Code::kNotFound);
  expect_code([&] { make_diff_tree(tmp / "dir", tmp / "dir", tmp / "exists", notes); }, Code::kAlreadyExists);
  EXPECT_FALSE(fs::exists(tmp / "out"));
}

// An image built on a parent from a whole tree, with diff on: the new layer holds the changes only, and the image
// read back from its chunks shows the whole tree.
TEST(ImageDiff, BuildOnAParentKeepsOnlyTheDifference) {
  SKIP_UNLESS_ROOT();
  TempDir tmp;
  make_base(tmp / "base");
  make_full(tmp / "base", tmp / "full");
  auto store = open_directory_store(tmp / "store");

  BuildOptions options;
  options.reference = "test/base:1";
  options.source = LayerSource::parse("dir:" + (tmp / "base").string());
  options.work_dir = tmp / "work";
  BuildResult base = build_image(*store, options);
  EXPECT_FALSE(base.diff);

  // The source directory is the user's: the build reads it and changes nothing, not even a change time.
  struct stat before {};
  ASSERT_EQ(::lstat((tmp / "full/etc/hostname").c_str(), &before), 0);
  options.reference = "test/full:1";
  options.source = LayerSource::parse("dir:" + (tmp / "full").string());
  options.parent = "test/base:1";
  options.role = LayerRole::kToolchain;
  options.diff = true;
  BuildResult full = build_image(*store, options);
  EXPECT_TRUE(full.diff);
  struct stat after {};
  ASSERT_EQ(::lstat((tmp / "full/etc/hostname").c_str(), &after), 0);
  EXPECT_EQ(before.st_ctim.tv_sec, after.st_ctim.tv_sec);
  EXPECT_EQ(before.st_ctim.tv_nsec, after.st_ctim.tv_nsec);
  EXPECT_EQ(after.st_nlink, 1u);
  ASSERT_EQ(full.image.manifest.layers.size(), 2u);
  EXPECT_EQ(full.image.manifest.layers[1].role, LayerRole::kToolchain);
  EXPECT_LT(full.layer.files_size, 1000u) << "the parent's 100 kB tool is not repeated in the new layer";
  EXPECT_GE(base.layer.files_size, 100000u);
  bool noted = false;
  for (const auto& n : full.image.manifest.notes) noted |= n.find("difference from its parent") != std::string::npos;
  EXPECT_TRUE(noted);
  EXPECT_TRUE(fs::is_empty(tmp / "work")) << "scratch files and mounts are gone";

  {
    MountedImage view(*store, full.image.manifest, tmp / "view");
    EXPECT_EQ(view.layer_bytes(), full.image.manifest.size());
    expect_same_tree(tmp / "full", view.root());
  }
  EXPECT_FALSE(fs::exists(tmp / "view")) << "the view's mounts and files are removed with it";

  // Without diff the same source becomes a layer holding the whole tree.
  options.reference = "test/whole:1";
  options.diff = false;
  BuildResult whole = build_image(*store, options);
  EXPECT_GE(whole.layer.files_size, 100000u);
}

TEST(ImageDiff, DiffWithoutAParentIsRefused) {
  TempDir tmp;
  fs::create_directories(tmp / "src");
  auto store = open_directory_store(tmp / "store");
  BuildOptions options;
  options.reference = "test/x:1";
  options.source = LayerSource::parse("dir:" + (tmp / "src").string());
  options.work_dir = tmp / "work";
  options.diff = true;
  expect_code([&] { build_image(*store, options); }, Code::kInvalidArgument);
}

TEST(ImageDiff, ADamagedChunkIsDataLossWhenLayersAreReadBack) {
  SKIP_UNLESS_ROOT();
  TempDir tmp;
  write_text(tmp / "src/big", std::string(3 << 20, 'x') + "tail");
  auto store = open_directory_store(tmp / "store");
  BuildOptions options;
  options.reference = "test/dmg:1";
  options.source = LayerSource::parse("dir:" + (tmp / "src").string());
  options.work_dir = tmp / "work";
  options.chunk_size = 1 << 20;
  BuildResult r = build_image(*store, options);

  // Read back whole first: the layer's parts add up to it.
  LayerFiles files = write_layer_files(*store, r.layer, tmp / "ok");
  EXPECT_EQ(fs::file_size(files.meta) + fs::file_size(files.data), r.layer.size);

  // Flip a byte in the last stored chunk.
  fs::path blob = tmp / "store/blobs/sha256" / digest_hex(r.layer.data);
  ASSERT_TRUE(fs::exists(blob));
  ::chmod(blob.c_str(), 0644);
  {
    std::fstream f(blob, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(fs::file_size(blob) - 2));
    char c = 0;
    f.read(&c, 1);
    f.seekp(static_cast<std::streamoff>(fs::file_size(blob) - 2));
    c = static_cast<char>(c ^ 0x5a);
    f.write(&c, 1);
  }
  expect_code([&] { write_layer_files(*store, r.layer, tmp / "bad"); }, Code::kDataLoss);
  expect_code([&] { MountedImage view(*store, r.image.manifest, tmp / "view"); }, Code::kDataLoss);
  EXPECT_FALSE(fs::exists(tmp / "view"));
}

}  // namespace
}  // namespace dsec::image
