// Building images: a directory copied faithfully, busybox from the host's static binary, tarball round trips, and
// builds that fail leaving nothing under the name.
#include <archive.h>
#include <archive_entry.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/time.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <string>

#include <gtest/gtest.h>

#include "dsec/error.hpp"
#include "image/debootstrap.hpp"
#include "image/fs_tree.hpp"
#include "image/process.hpp"
#include "image/store.hpp"
#include "image_test_util.hpp"

namespace dsec::image {
namespace {

namespace fs = std::filesystem;
using testing::entries_with_prefix;
using testing::lstat_of;
using testing::read_text;
using testing::running_as_root;
using testing::TempDir;
using testing::write_text;

// A tree with what an image copy must keep: modes (setuid, sticky, private), symlinks (relative, absolute,
// dangling), a hard link pair, a fifo, foreign ownership, times and an xattr; and what it must drop: a device node.
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
    fs::create_symlink("../bin/tool", root / "data/rel-link");
    fs::create_symlink("/etc/secret", root / "data/abs-link");
    fs::create_symlink("nowhere", root / "data/dangling");
    ::mkfifo((root / "data/fifo").c_str(), 0640);
    struct timeval times[2] = {{1000000000, 0}, {1234567890, 0}};
    ::utimes((root / "etc/secret").c_str(), times);
    if (running_as_root()) {
      write_text(root / "home/user/file", "mine", 0640);
      ::chown((root / "home/user/file").c_str(), 1234, 5678);
      ::chown((root / "home/user").c_str(), 1234, 5678);
      ::mknod((root / "dev-null").c_str(), S_IFCHR | 0666, makedev(1, 3));
    }
    has_xattr = ::setxattr((root / "bin/tool").c_str(), "user.dsec", "yes", 3, 0) == 0;
  }
  fs::path root;
  bool has_xattr = false;
};

void expect_same_tree(const fs::path& src, const fs::path& dst, bool root) {
  for (const char* p : {"bin/tool", "etc/secret", "usr/bin/suid", "tmp", "private", "data/a", "data/fifo"}) {
    struct stat a = lstat_of(src / p), b = lstat_of(dst / p);
    EXPECT_EQ(a.st_mode, b.st_mode) << p;
    EXPECT_EQ(a.st_size, b.st_size) << p;
  }
  EXPECT_EQ(lstat_of(dst / "usr/bin/suid").st_mode & 07777, 04755u);
  EXPECT_EQ(lstat_of(dst / "tmp").st_mode & 07777, 01777u);
  EXPECT_EQ(lstat_of(dst / "private").st_mode & 07777, 0700u);
  EXPECT_TRUE(S_ISFIFO(lstat_of(dst / "data/fifo").st_mode));
  EXPECT_EQ(read_text(dst / "etc/secret"), "s3cret\n");
  EXPECT_EQ(lstat_of(dst / "etc/secret").st_mtime, 1234567890);
  EXPECT_EQ(read_text(dst / "data/a"), std::string(100000, 'a'));

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

TEST(ImageBuild, DirectoryRoundTripKeepsModesLinksAndOwners) {
  TempDir tmp;
  SourceTree src(tmp / "src");
  ImageStore store(tmp / "images");
  ImageRecord r = store.build_from_directory("roundtrip:v1", src.root);

  EXPECT_EQ(r.name, "roundtrip:v1");
  EXPECT_EQ(r.dir, tmp / "images/roundtrip%3Av1");
  ASSERT_EQ(r.layers.size(), 1u);
  expect_same_tree(src.root, r.layers[0], running_as_root());
  if (src.has_xattr) {
    char value[8] = {};
    EXPECT_EQ(::getxattr((r.layers[0] / "bin/tool").c_str(), "user.dsec", value, sizeof value), 3);
    EXPECT_EQ(std::string(value, 3), "yes");
  }
  // Content bytes with the hard-linked 100000 counted once, plus symlink targets.
  std::uint64_t expected = 20 + 7 + 1 + 100000 + std::string("../bin/tool").size() + std::string("/etc/secret").size() +
                           std::string("nowhere").size() + (running_as_root() ? 4 : 0);
  EXPECT_EQ(r.size_bytes, expected);
  if (running_as_root()) {
    ASSERT_FALSE(r.notes.empty());
    EXPECT_NE(r.notes[0].find("skipped character device /dev-null"), std::string::npos) << r.notes[0];
  }

  // What list/find read back from the manifest is what the build returned.
  auto found = store.find("roundtrip:v1");
  ASSERT_TRUE(found);
  EXPECT_EQ(found->size_bytes, r.size_bytes);
  EXPECT_EQ(found->notes, r.notes);
  EXPECT_NE(found->source.find(src.root.string()), std::string::npos);
  EXPECT_GT(found->created_at, 1.6e9);
  EXPECT_TRUE(entries_with_prefix(tmp / "images", ".").empty());
}

TEST(ImageBuild, RebuildReplacesTheImageWholly) {
  TempDir tmp;
  write_text(tmp / "one/only-in-one", "1");
  write_text(tmp / "two/only-in-two", "2");
  ImageStore store(tmp / "images");
  store.build_from_directory("app", tmp / "one");
  ImageRecord r = store.build_from_directory("app", tmp / "two");
  EXPECT_TRUE(fs::exists(r.layers[0] / "only-in-two"));
  EXPECT_FALSE(fs::exists(r.layers[0] / "only-in-one"));
  EXPECT_EQ(store.list().size(), 1u);
  EXPECT_TRUE(entries_with_prefix(tmp / "images", ".").empty()) << "the replaced image was left behind";
}

TEST(ImageBuild, DirectoryErrors) {
  TempDir tmp;
  ImageStore store(tmp / "images");
  try {
    store.build_from_directory("x", tmp / "missing");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos);
  }
  write_text(tmp / "file", "x");
  EXPECT_THROW(store.build_from_directory("x", tmp / "file"), Error);
  EXPECT_THROW(store.build_from_directory("bad name", tmp.path()), Error);
  // The store itself (or a tree that contains it) cannot be its own source.
  fs::create_directories(tmp / "images");
  EXPECT_THROW(store.build_from_directory("x", tmp.path()), Error);
  EXPECT_TRUE(store.list().empty());
  EXPECT_TRUE(entries_with_prefix(tmp / "images", ".").empty());
}

// A build that fails half way (the store's filesystem fills up) leaves neither a half image nor its temporary
// directory, and the image that was there before is untouched.
TEST(ImageBuild, FailedBuildLeavesNoImage) {
  if (!running_as_root()) GTEST_SKIP() << "needs root to mount a small tmpfs";
  TempDir tmp;
  fs::create_directories(tmp / "home");
  if (::mount("tmpfs", (tmp / "home").c_str(), "tmpfs", 0, "size=256k") != 0)
    GTEST_SKIP() << "cannot mount tmpfs here: " << std::strerror(errno);
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{tmp / "home"};

  write_text(tmp / "small/marker", "old");
  write_text(tmp / "big/a", "a");
  write_text(tmp / "big/huge", std::string(2 << 20, 'x'));
  ImageStore store(tmp / "home/images");
  store.build_from_directory("app", tmp / "small");

  try {
    store.build_from_directory("app", tmp / "big");
    FAIL() << "a build larger than its filesystem succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kResourceExhausted) << e.what();
  }
  auto r = store.resolve("app");
  EXPECT_EQ(read_text(r.layers[0] / "marker"), "old");
  EXPECT_FALSE(fs::exists(r.layers[0] / "huge"));
  EXPECT_TRUE(entries_with_prefix(tmp / "home/images", ".").empty());

  try {
    store.build_from_directory("fresh", tmp / "big");
    FAIL();
  } catch (const Error&) {
  }
  EXPECT_FALSE(store.find("fresh"));
  EXPECT_TRUE(entries_with_prefix(tmp / "home/images", ".").empty());
}

TEST(ImageBuild, FailedDebootstrapLeavesNoImage) {
  if (!running_as_root()) GTEST_SKIP() << "debootstrap needs root";
  if (find_executable("debootstrap").empty()) GTEST_SKIP() << "debootstrap is not installed";
  TempDir tmp;
  ImageStore store(tmp / "images");
  try {
    store.build_debootstrap("deb", "bookworm", {"hello"}, "file://" + (tmp / "no-mirror").string());
    FAIL() << "debootstrap from a missing mirror succeeded";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("debootstrap bookworm"), std::string::npos) << msg;
  }
  EXPECT_FALSE(store.find("deb"));
  EXPECT_TRUE(entries_with_prefix(tmp / "images", ".").empty());
  EXPECT_FALSE(fs::exists(store.cache_dir() / debootstrap_cache_name("bookworm", host_debian_arch(), {"hello"})));
}

TEST(ImageBuild, DebootstrapRejectsBadArgumentsBeforeDoingAnything) {
  TempDir tmp;
  ImageStore store(tmp / "images");
  EXPECT_THROW(store.build_debootstrap("deb", "Bookworm;rm", {}), Error);
  EXPECT_THROW(store.build_debootstrap("deb", "bookworm", {"python3,evil"}), Error);
  EXPECT_THROW(store.build_debootstrap("deb", "bookworm", {}, "ftp://example"), Error);
  EXPECT_FALSE(fs::exists(tmp / "images"));
}

TEST(ImageBuild, BusyboxImageHasAppletsAccountsAndMountPoints) {
  if (!fs::exists("/bin/busybox")) GTEST_SKIP() << "busybox-static is not installed";
  TempDir tmp;
  ImageStore store(tmp / "images");
  ImageRecord r;
  try {
    r = store.build_busybox("busybox");
  } catch (const Error& e) {
    if (e.code() == Code::kFailedPrecondition) GTEST_SKIP() << e.what();
    throw;
  }
  const fs::path root = r.layers[0];
  EXPECT_EQ(r.name, "busybox:latest");
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
  EXPECT_GT(r.size_bytes, 500000u);

  if (running_as_root()) {
    // The image is a working root: its shell runs, finds its applets through PATH and reads its own passwd.
    ProcessResult p = run_process({"chroot", root.string(), "/bin/sh", "-c",
                                   "test \"$(id -un)\" = root && ls /bin | grep -qx wget && exit 42"});
    EXPECT_EQ(p.exit_code, 42) << p.status_text() << ": " << p.tail();
  }
}

TEST(ImageBuild, BusyboxRejectsADynamicBinary) {
  TempDir tmp;
  ImageStore store(tmp / "images");
  try {
    store.build_busybox("bb", "/bin/ls");
    FAIL() << "a dynamically linked busybox was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("dynamically linked"), std::string::npos) << e.what();
  }
  try {
    store.build_busybox("bb", tmp / "nope");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("busybox-static"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(store.find("bb"));
}

TEST(ImageTree, PackAndUnpackRoundTrip) {
  TempDir tmp;
  SourceTree src(tmp / "src");
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
    archive* a = archive_write_new();
    archive_write_set_format_pax_restricted(a);
    ASSERT_EQ(archive_write_open_filename(a, tar.c_str()), ARCHIVE_OK);
    archive_entry* e = archive_entry_new();
    archive_entry_set_pathname(e, evil);
    archive_entry_set_filetype(e, AE_IFREG);
    archive_entry_set_perm(e, 0644);
    archive_entry_set_size(e, 4);
    archive_write_header(a, e);
    archive_write_data(a, "evil", 4);
    archive_entry_free(e);
    archive_write_close(a);
    archive_write_free(a);

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
