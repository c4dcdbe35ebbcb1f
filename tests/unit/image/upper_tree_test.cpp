// Snapshots' core: an overlayfs upper directory turned into a layer (copy_upper_tree, then store_tree_as_layer).
// A real overlay (a tmpfs upper over a lower tree, mounted like a sandbox's root) is changed in every way a sandbox
// can change it: files added, changed, chmod'ed and chown'ed (copied up), deleted (whiteouts), a directory replaced
// by a new one (opaque), a file replaced by a directory and back, symlinks, hard links, an empty file, a sparse and a
// big file, a FIFO, a socket, odd bytes in names, user xattrs. The copy keeps whiteouts and opaque directories and
// drops overlayfs's private xattrs; the layer made of it, mounted as EROFS and stacked over the lower tree, shows the
// same files as the live overlay did, entry by entry. The same holds for the layer extracted with fsck.erofs once
// restore_erofs_metadata has put back the xattrs and hard links that tool drops. Then the refusals: metacopy and
// redirect xattrs, the size and path limits, a full disk; and read_erofs_entries on its own (xattrs inline and
// shared, directories of many blocks, hard links).
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "image/build.hpp"
#include "image/erofs_meta.hpp"
#include "image/fs_tree.hpp"
#include "image/image_test_util.hpp"
#include "image/process.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/upper_tree.hpp"

namespace dsec::image {
namespace {

namespace fs = std::filesystem;
using testing::MountedLayer;
using testing::OverlayView;
using testing::read_text;
using testing::running_as_root;
using testing::TempDir;
using testing::write_text;

template <typename Fn>
Error expect_code(Fn&& fn, Code code) {
  try {
    fn();
    ADD_FAILURE() << "expected " << code_name(code);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    return e;
  }
  return Error(Code::kOk, "");
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

// Every entry of `want` is in `got` with the same type, mode, owner, size, mtime, xattrs, symlink target and
// content, and `got` has nothing more, except the relative paths in `absent`, which `got` must not have.
void expect_same_tree(const fs::path& want, const fs::path& got, const std::set<std::string>& absent,
                      const fs::path& rel = {}) {
  const fs::path w = rel.empty() ? want : want / rel;
  const fs::path g = rel.empty() ? got : got / rel;
  struct stat ws {
  }, gs{};
  ASSERT_EQ(::lstat(w.c_str(), &ws), 0) << w;
  ASSERT_EQ(::lstat(g.c_str(), &gs), 0) << "missing: /" << rel.string();
  const std::string where = "/" + rel.string();
  EXPECT_EQ(ws.st_mode, gs.st_mode) << where;
  EXPECT_EQ(ws.st_uid, gs.st_uid) << where;
  EXPECT_EQ(ws.st_gid, gs.st_gid) << where;
  EXPECT_EQ(ws.st_mtim.tv_sec, gs.st_mtim.tv_sec) << where;
  EXPECT_EQ(xattrs_of(w), xattrs_of(g)) << where;
  if (S_ISDIR(ws.st_mode) && S_ISDIR(gs.st_mode)) {
    auto wn = names_in(w), gn = names_in(g);
    std::vector<std::string> expected;
    for (const auto& n : wn)
      if (!absent.count((rel / n).string())) expected.push_back(n);
    EXPECT_EQ(expected, gn) << "entries of " << where;
    for (const auto& n : expected)
      if (std::binary_search(gn.begin(), gn.end(), n)) expect_same_tree(want, got, absent, rel / n);
  } else if (S_ISREG(ws.st_mode)) {
    EXPECT_EQ(ws.st_size, gs.st_size) << where;
    EXPECT_TRUE(read_text(w) == read_text(g)) << "content of " << where;
  } else if (S_ISLNK(ws.st_mode)) {
    EXPECT_EQ(fs::read_symlink(w), fs::read_symlink(g)) << where;
  }
}

const std::string kOddName = std::string("odd name\n\x01\xff\xfe.txt");

// A sandbox's root in miniature: a lower tree, and an overlay over it whose upper and work directories live on a
// tmpfs, mounted read-write with dsec's options. Unmounted when it goes away.
class LiveOverlay {
 public:
  explicit LiveOverlay(const fs::path& dir) : dir_(dir) {
    fs::create_directories(dir_ / "scratch");
    fs::create_directories(dir_ / "merged");
    if (::mount("tmpfs", (dir_ / "scratch").c_str(), "tmpfs", 0, "size=256m") != 0)
      throw std::runtime_error(std::string("mount tmpfs: ") + std::strerror(errno));
    scratch_mounted_ = true;
    fs::create_directories(dir_ / "scratch/upper");
    fs::create_directories(dir_ / "scratch/work");
    std::string options = "lowerdir=" + lower().string() + ",upperdir=" + upper().string() +
                          ",workdir=" + (dir_ / "scratch/work").string() + ",volatile,metacopy=off,redirect_dir=off";
    if (::mount("overlay", merged().c_str(), "overlay", 0, options.c_str()) != 0)
      throw std::runtime_error("mount overlay " + options + ": " + std::strerror(errno));
    overlay_mounted_ = true;
  }
  ~LiveOverlay() {
    if (overlay_mounted_) ::umount2(merged().c_str(), MNT_DETACH);
    if (scratch_mounted_) ::umount2((dir_ / "scratch").c_str(), MNT_DETACH);
  }
  LiveOverlay(const LiveOverlay&) = delete;
  LiveOverlay& operator=(const LiveOverlay&) = delete;

  fs::path lower() const { return dir_ / "lower"; }
  fs::path upper() const { return dir_ / "scratch/upper"; }
  fs::path merged() const { return dir_ / "merged"; }

 private:
  fs::path dir_;
  bool scratch_mounted_ = false;
  bool overlay_mounted_ = false;
};

void make_lower(const fs::path& root) {
  write_text(root / "etc/hostname", "base\n");
  write_text(root / "etc/gone.conf", "deleted by the sandbox\n");
  write_text(root / "etc/mode.conf", "chmod'ed by the sandbox\n", 0644);
  write_text(root / "var/cache/app/old-1", "replaced directory, old file 1");
  write_text(root / "var/cache/app/old-2", "replaced directory, old file 2");
  write_text(root / "usr/lib/sub/a", "deleted inside a directory");
  write_text(root / "usr/lib/sub/b", "kept inside a directory");
  write_text(root / "opt/file", "a file the sandbox turns into a directory");
  write_text(root / "opt/dir/inner", "a directory the sandbox turns into a file");
  fs::create_directories(root / "home/user");
}

// What a sandbox does to its root.
void change_everything(const fs::path& m) {
  fs::remove(m / "etc/gone.conf");
  fs::remove_all(m / "var/cache/app");
  write_text(m / "var/cache/app/fresh", "the new directory's only file");
  fs::remove(m / "usr/lib/sub/a");
  ASSERT_EQ(::chmod((m / "etc/mode.conf").c_str(), 0600), 0);
  write_text(m / "etc/hostname", "changed by the sandbox, and longer\n");
  fs::remove(m / "opt/file");
  write_text(m / "opt/file/now-inside", "inside the directory that replaced a file");
  fs::remove_all(m / "opt/dir");
  write_text(m / "opt/dir", "a file that replaced a directory");
  write_text(m / ("home/user/" + kOddName), "a name with a newline and bytes that are not UTF-8");
  fs::create_symlink("../../etc/hostname", m / "home/user/link");
  fs::create_symlink("/nonexistent/dangling", m / "home/user/dangling");
  write_text(m / "home/user/h1", "hard-linked twice");
  fs::create_hard_link(m / "home/user/h1", m / "home/user/h2");
  write_text(m / "home/user/empty", "");
  ASSERT_EQ(::mkfifo((m / "home/user/fifo").c_str(), 0640), 0);
  write_text(m / "home/user/owned", "owned by 1234:5678");
  ASSERT_EQ(::chown((m / "home/user/owned").c_str(), 1234, 5678), 0);
  write_text(m / "home/user/suid", "set-uid", 0755);
  ASSERT_EQ(::chmod((m / "home/user/suid").c_str(), 04755), 0);
  write_text(m / "home/user/x", "with a user xattr");
  ASSERT_EQ(::setxattr((m / "home/user/x").c_str(), "user.note", "kept", 4, 0), 0);
  fs::create_directories(m / "home/user/private");
  write_text(m / "home/user/private/secret", "in a 0700 directory", 0600);
  ASSERT_EQ(::chmod((m / "home/user/private").c_str(), 0700), 0);
  // Sparse: 16 MiB with two bytes of data; big: 3 MiB that do not compress.
  {
    fs::create_directories(m / "data");
    UniqueFd fd(::open((m / "data/sparse").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    ASSERT_TRUE(fd);
    ASSERT_EQ(::pwrite(fd.get(), "x", 1, 8 << 20), 1);
    ASSERT_EQ(::pwrite(fd.get(), "y", 1, (16 << 20) - 1), 1);
  }
  write_text(m / "data/big", testing::random_bytes(3 << 20, 7));
  // A socket: left out of the layer.
  int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(s, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::string sock = (m / "home/user/sock").string();
  ASSERT_LT(sock.size(), sizeof addr.sun_path);
  std::strcpy(addr.sun_path, sock.c_str());
  ASSERT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
  ::close(s);
}

#define SKIP_UNLESS_MOUNTS()                                                               \
  do {                                                                                     \
    if (std::string why = testing::mount_skip_reason(); !why.empty()) GTEST_SKIP() << why; \
  } while (0)

TEST(UpperTree, AnOverlayUpperBecomesALayerThatShowsTheSameFiles) {
  SKIP_UNLESS_MOUNTS();
  TempDir tmp;
  make_lower(tmp / "live/lower");
  LiveOverlay live(tmp / "live");
  change_everything(live.merged());
  if (HasFatalFailure()) return;

  // The upper as the kernel left it: whiteouts, an opaque directory, and overlayfs's bookkeeping xattrs.
  EXPECT_TRUE(is_whiteout(live.upper() / "etc/gone.conf"));
  EXPECT_TRUE(is_whiteout(live.upper() / "usr/lib/sub/a"));
  EXPECT_EQ(testing::xattr_of(live.upper() / "var/cache/app", "trusted.overlay.opaque"), "y");

  UniqueFd upper(::open(live.upper().c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(upper);
  std::vector<std::string> notes;
  UpperTreeStats stats = copy_upper_tree(upper.get(), tmp / "tree", {}, notes);
  const fs::path tree = tmp / "tree";

  EXPECT_EQ(stats.whiteouts, 2u);
  EXPECT_EQ(stats.opaque_directories, 2u) << "var/cache/app and opt/file";
  EXPECT_EQ(stats.hard_links, 1u);
  EXPECT_EQ(stats.fifos, 1u);
  EXPECT_EQ(stats.skipped, 1u) << "the socket";
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("/home/user/sock"), std::string::npos) << notes[0];
  EXPECT_NE(notes[0].find("socket"), std::string::npos) << notes[0];
  EXPECT_FALSE(fs::exists(fs::symlink_status(tree / "home/user/sock")));
  EXPECT_TRUE(is_whiteout(tree / "etc/gone.conf"));
  EXPECT_TRUE(is_whiteout(tree / "usr/lib/sub/a"));
  EXPECT_EQ(testing::xattr_of(tree / "var/cache/app", "trusted.overlay.opaque"), "y");
  EXPECT_EQ(testing::xattr_of(tree / "opt/file", "trusted.overlay.opaque"), "y");
  EXPECT_EQ(testing::xattr_of(tree / "home/user/x", "user.note"), "kept");
  // No overlay bookkeeping anywhere in the copy (the upper has trusted.overlay.origin on copied-up files).
  for (const auto& e : fs::recursive_directory_iterator(tree))
    for (const auto& [name, value] : xattrs_of(e.path()))
      if (name.starts_with("trusted.overlay.")) {
        EXPECT_EQ(name, "trusted.overlay.opaque") << e.path();
      }
  struct stat h1 = testing::lstat_of(tree / "home/user/h1"), h2 = testing::lstat_of(tree / "home/user/h2");
  EXPECT_EQ(h1.st_ino, h2.st_ino) << "hard links stay links";
  struct stat sparse = testing::lstat_of(tree / "data/sparse");
  EXPECT_EQ(sparse.st_size, 16 << 20);
  EXPECT_LT(sparse.st_blocks * 512, 1 << 20) << "holes stay holes";
  EXPECT_GE(stats.file_bytes, (16u << 20) + (3u << 20));
  EXPECT_LT(stats.data_bytes, (3u << 20) + (1u << 20)) << "only data is copied, not holes";
  EXPECT_EQ(testing::lstat_of(tree / "home/user/suid").st_mode & 07777, 04755u);
  EXPECT_EQ(testing::lstat_of(tree / "home/user/owned").st_uid, 1234u);
  EXPECT_EQ(testing::lstat_of(tree / "home/user/private").st_mode & 07777, 0700u);
  EXPECT_TRUE(fs::exists(tree / ("home/user/" + kOddName)));

  // The layer, read back through a store and mounted as EROFS over the same lower tree: the same files as live.
  auto store = open_directory_store(tmp / "store");
  std::vector<std::string> layer_notes;
  fs::create_directories(tmp / "work");
  LayerDescriptor layer = store_tree_as_layer(*store, tree, LayerRole::kSnapshot, tmp / "work", layer_notes);
  EXPECT_EQ(layer.role, LayerRole::kSnapshot);
  MountedLayer mounted(*store, layer, tmp / "mounted");
  struct stat m1 = testing::lstat_of(mounted.root() / "home/user/h1"),
              m2 = testing::lstat_of(mounted.root() / "home/user/h2");
  EXPECT_EQ(m1.st_ino, m2.st_ino) << "hard links in the layer";
  {
    OverlayView view({mounted.root(), live.lower()}, tmp / "view");
    expect_same_tree(live.merged(), view.root(), {"home/user/sock"});
    EXPECT_FALSE(fs::exists(view.root() / "etc/gone.conf"));
    EXPECT_EQ(names_in(view.root() / "var/cache/app"), std::vector<std::string>{"fresh"});
    EXPECT_EQ(names_in(view.root() / "usr/lib/sub"), std::vector<std::string>{"b"});
    EXPECT_EQ(names_in(view.root() / "opt/file"), std::vector<std::string>{"now-inside"});
    EXPECT_TRUE(fs::is_regular_file(view.root() / "opt/dir"));
  }

  // Extract mode: fsck.erofs writes the files; restore_erofs_metadata puts back the opaque markers, xattrs and links.
  const fs::path extracted = tmp / "extracted";
  ProcessResult r =
      run_process({"fsck.erofs", "--extract=" + extracted.string(), "--preserve",
                   "--device=" + (tmp / "mounted/data.img").string(), (tmp / "mounted/meta.img").string()});
  ASSERT_TRUE(r.ok()) << r.tail();
  ErofsRestoreStats restored = restore_erofs_metadata(tmp / "mounted/meta.img", 0, extracted);
  EXPECT_GE(restored.xattrs, 3u) << "two opaque markers and a user xattr";
  EXPECT_EQ(restored.hard_links, 1u);
  EXPECT_EQ(restored.modes, 1u) << "the set-uid bit fsck.erofs lost";
  EXPECT_EQ(testing::xattr_of(extracted / "var/cache/app", "trusted.overlay.opaque"), "y");
  EXPECT_EQ(testing::lstat_of(extracted / "home/user/h1").st_ino, testing::lstat_of(extracted / "home/user/h2").st_ino);
  {
    OverlayView view({extracted, live.lower()}, tmp / "view-extracted");
    expect_same_tree(live.merged(), view.root(), {"home/user/sock"});
  }
}

TEST(UpperTree, MetacopyAndRedirectUppersAreRefused) {
  if (!running_as_root()) GTEST_SKIP() << "trusted xattrs need root";
  TempDir tmp;
  for (const char* xattr : {"trusted.overlay.metacopy", "trusted.overlay.redirect"}) {
    fs::path upper = tmp / xattr;
    write_text(upper / "dir/file", "data in a lower layer");
    ASSERT_EQ(::lsetxattr((upper / "dir/file").c_str(), xattr, "/x", 2, 0), 0) << std::strerror(errno);
    UniqueFd fd(::open(upper.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    std::vector<std::string> notes;
    Error e = expect_code([&] { copy_upper_tree(fd.get(), tmp / (std::string(xattr) + ".out"), {}, notes); },
                          Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find(xattr), std::string::npos) << e.what();
  }
}

TEST(UpperTree, OverlayBookkeepingIsDroppedAndTheRootIsNeverOpaque) {
  if (!running_as_root()) GTEST_SKIP() << "trusted xattrs need root";
  TempDir tmp;
  fs::path upper = tmp / "upper";
  write_text(upper / "d/f", "x");
  for (const char* name : {"trusted.overlay.origin", "trusted.overlay.impure", "trusted.overlay.nlink"})
    ASSERT_EQ(::lsetxattr((upper / "d").c_str(), name, "v", 1, 0), 0);
  ASSERT_EQ(::lsetxattr(upper.c_str(), "trusted.overlay.opaque", "y", 1, 0), 0);
  ASSERT_EQ(::lsetxattr((upper / "d/f").c_str(), "trusted.other", "kept", 4, 0), 0);
  ASSERT_EQ(::lsetxattr((upper / "d").c_str(), "trusted.overlay.opaque", "x", 1, 0), 0);  // not "y": not opaque
  UniqueFd fd(::open(upper.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  std::vector<std::string> notes;
  UpperTreeStats stats = copy_upper_tree(fd.get(), tmp / "out", {}, notes);
  EXPECT_EQ(stats.opaque_directories, 0u);
  EXPECT_TRUE(xattrs_of(tmp / "out").empty());
  EXPECT_TRUE(xattrs_of(tmp / "out/d").empty());
  EXPECT_EQ(xattrs_of(tmp / "out/d/f"), (std::map<std::string, std::string>{{"trusted.other", "kept"}}));
}

TEST(UpperTree, LimitsAndAFullDiskAreResourceExhaustedAndNotRetryable) {
  TempDir tmp;
  fs::path upper = tmp / "upper";
  write_text(upper / "a", std::string(4096, 'a'));
  write_text(upper / "b", std::string(4096, 'b'));
  {
    UniqueFd fd(::open(upper.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    std::vector<std::string> notes;
    UpperTreeLimits limits;
    limits.max_file_bytes = 6000;
    Error e = expect_code([&] { copy_upper_tree(fd.get(), tmp / "out1", limits, notes); }, Code::kResourceExhausted);
    EXPECT_FALSE(e.retryable());
  }
  {
    std::string deep = "d";
    for (int i = 0; i < 30; ++i) deep += "/" + std::string(20, 'n');
    write_text(upper / deep / "f", "deep");
    UniqueFd fd(::open(upper.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    std::vector<std::string> notes;
    UpperTreeLimits limits;
    limits.max_path_bytes = 300;
    Error e = expect_code([&] { copy_upper_tree(fd.get(), tmp / "out2", limits, notes); }, Code::kResourceExhausted);
    EXPECT_FALSE(e.retryable());
    fs::remove_all(upper / "d");
  }
  if (!running_as_root()) GTEST_SKIP() << "the full-disk case mounts a tmpfs";
  fs::create_directories(tmp / "small");
  ASSERT_EQ(::mount("tmpfs", (tmp / "small").c_str(), "tmpfs", 0, "size=64k"), 0) << std::strerror(errno);
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{tmp / "small"};
  write_text(upper / "big", testing::random_bytes(1 << 20));
  UniqueFd fd(::open(upper.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  std::vector<std::string> notes;
  Error e = expect_code([&] { copy_upper_tree(fd.get(), tmp / "small/out", {}, notes); }, Code::kResourceExhausted);
  EXPECT_FALSE(e.retryable());
  EXPECT_NE(std::string(e.what()).find("disk is full"), std::string::npos) << e.what();
}

TEST(ErofsMeta, EntriesXattrsAndHardLinksAreReadFromTheImage) {
  if (!running_as_root()) GTEST_SKIP() << "trusted xattrs need root";
  TempDir tmp;
  fs::path tree = tmp / "tree";
  // Enough names for a directory of several blocks, one shared xattr on many inodes (mkfs.erofs shares it), and
  // inline ones of several sizes.
  for (int i = 0; i < 400; ++i) {
    fs::path p = tree / "many" / ("file-with-a-longish-name-" + std::to_string(i));
    write_text(p, std::to_string(i));
    ASSERT_EQ(::lsetxattr(p.c_str(), "user.common", "same everywhere", 15, 0), 0);
  }
  write_text(tree / "x/f", "f");
  std::string big(300, 'v');
  ASSERT_EQ(::lsetxattr((tree / "x/f").c_str(), "user.big", big.data(), big.size(), 0), 0);
  ASSERT_EQ(::lsetxattr((tree / "x").c_str(), "trusted.overlay.opaque", "y", 1, 0), 0);
  fs::create_symlink("f", tree / "x/link");
  ASSERT_EQ(::lsetxattr((tree / "x/link").c_str(), "trusted.t", "on a symlink", 12, 0), 0);
  fs::create_hard_link(tree / "x/f", tree / "x/g");
  ASSERT_EQ(::mknod((tree / "x/wh").c_str(), S_IFCHR | 0600, makedev(0, 0)), 0);
  ProcessResult r = run_process({"mkfs.erofs", "--quiet", "--blobdev=" + (tmp / "blob").string(), "--chunksize=4096",
                                 (tmp / "img").string(), tree.string()});
  ASSERT_TRUE(r.ok()) << r.tail();

  std::vector<ErofsEntry> entries = read_erofs_entries(tmp / "img");
  std::map<std::string, ErofsEntry> by_path;
  for (auto& e : entries) by_path[e.path] = e;
  EXPECT_EQ(entries.size(), by_path.size()) << "each path once";
  ASSERT_TRUE(by_path.count(""));
  EXPECT_TRUE(S_ISDIR(by_path[""].mode));
  EXPECT_EQ(entries.front().path, "") << "parents before children";
  for (int i = 0; i < 400; ++i) {
    std::string p = "many/file-with-a-longish-name-" + std::to_string(i);
    ASSERT_TRUE(by_path.count(p)) << p;
    EXPECT_EQ(by_path[p].xattrs, (std::vector<std::pair<std::string, std::string>>{{"user.common", "same everywhere"}}))
        << p;
  }
  EXPECT_EQ(by_path["x"].xattrs, (std::vector<std::pair<std::string, std::string>>{{"trusted.overlay.opaque", "y"}}));
  EXPECT_EQ(by_path["x/f"].xattrs, (std::vector<std::pair<std::string, std::string>>{{"user.big", big}}));
  EXPECT_EQ(by_path["x/link"].xattrs,
            (std::vector<std::pair<std::string, std::string>>{{"trusted.t", "on a symlink"}}));
  EXPECT_TRUE(S_ISLNK(by_path["x/link"].mode));
  EXPECT_TRUE(S_ISCHR(by_path["x/wh"].mode));
  EXPECT_EQ(by_path["x/f"].nid, by_path["x/g"].nid);
  EXPECT_EQ(by_path["x/f"].nlink, 2u);

  // Not EROFS at all: DATA_LOSS, not a crash.
  write_text(tmp / "junk", std::string(8192, 'j'));
  expect_code([&] { read_erofs_entries(tmp / "junk"); }, Code::kDataLoss);
}

TEST(DirectoryStore, LayersAreCopiedFromTheFirstStoreThatHasThemEvenByManyThreadsAtOnce) {
  TempDir tmp;
  write_text(tmp / "tree/data", testing::random_bytes(3 << 20, 11));
  auto empty = open_directory_store(tmp / "empty");
  auto source = open_directory_store(tmp / "source");
  auto target = open_directory_store(tmp / "target");
  std::vector<std::string> notes;
  fs::create_directories(tmp / "work");
  LayerDescriptor layer = store_tree_as_layer(*source, tmp / "tree", LayerRole::kBase, tmp / "work", notes);
  std::vector<BlobStore*> from{empty.get(), source.get()};
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&] {
      try {
        copy_layer_blobs(from, *target, layer);
      } catch (const std::exception&) {
        ++failures;
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_TRUE(target->has_blob(layer.index) && target->has_blob(layer.data));
  EXPECT_EQ(target->read_blob(layer.data, 64u << 20), source->read_blob(layer.data, 64u << 20));
  EXPECT_EQ(copy_layer_blobs(from, *target, layer), 0u) << "nothing to copy the second time";
  auto elsewhere = open_directory_store(tmp / "elsewhere");
  expect_code([&] { copy_layer_blobs({empty.get()}, *elsewhere, layer); }, Code::kNotFound);
}

TEST(DirectoryStore, CreateRefNeverMovesATag) {
  TempDir tmp;
  auto store = open_directory_store(tmp / "store");
  const std::string a = "sha256:" + std::string(64, 'a'), b = "sha256:" + std::string(64, 'b');
  EXPECT_TRUE(store->create_ref("snap/x:1", a));
  EXPECT_FALSE(store->create_ref("snap/x:1", b));
  EXPECT_EQ(store->read_ref("snap/x:1"), a);
  EXPECT_TRUE(testing::entries_with_prefix(tmp / "store/.tmp", "").empty()) << "no temporary file is left";
  // Many writers of one new tag: exactly one wins.
  std::atomic<int> won{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i)
    threads.emplace_back([&, i] {
      if (store->create_ref("snap/race:1", i % 2 ? a : b)) ++won;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(won.load(), 1);
}

}  // namespace
}  // namespace dsec::image
