// Fuzz target: the files API's path resolution inside a sandbox's root (common/sandbox_tree.hpp), with the
// paths and tree entries a caller (or a tar upload) chooses, in a small fixed tree that plants what a hostile sandbox
// would: symlinks up, out and absolute, a symlink loop, a FIFO, a mount of another file system, /proc.
//
// Input: up to 16 operations, each one byte (the operation and its options) then a path up to '\n'; an entry to
// extract also takes its link target up to the next '\n'.
//
// Properties, each an abort when broken:
//  - nothing outside the root changes, and no descriptor or byte handed out belongs to a file outside the root or
//    on another mount (the files outside hold "OUTSIDE", the mount's "MOUNTED");
//  - every descriptor the tree opens for reading or writing is a regular file;
//  - bad paths are dsec::Error (never INTERNAL, never another exception);
//  - normalize_sandbox_path gives an absolute path without ".", ".." or empty parts, and is idempotent.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "common/sandbox_tree.hpp"
#include "dsec/error.hpp"
#include "fuzz_scratch.hpp"

namespace {

namespace fs = std::filesystem;
using dsec::Code;
using dsec::Error;
namespace files = dsec::agent::files;

struct Scratch {
  fs::path dir;
  fs::path outside;
  fs::path root;
  dev_t root_dev = 0;
  fuzz::TreeState outside_state;
  fuzz::TreeState mounted_state;
  std::set<std::pair<dev_t, ino_t>> outside_inodes;
  bool mounts = false;
};

bool is_mount_point(const std::string& name) { return name == "mnt" || name == "proc"; }

// The root's fixture, made again before every input (what an input writes is gone by the next).
void make_fixture(const Scratch& s) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(s.root))
    if (!is_mount_point(e.path().filename().string())) fs::remove_all(e.path(), ec);
  fs::create_directories(s.root / "etc");
  fs::create_directories(s.root / "dir" / "sub");
  fs::create_directories(s.root / "mnt");
  fs::create_directories(s.root / "proc");
  fuzz::write_text(s.root / "etc" / "passwd", "root:x:0:0:inside\n");
  fuzz::write_text(s.root / "dir" / "file", "inside\n");
  fuzz::write_text(s.root / "dir" / "sub" / "deep", "inside deep\n", 0755);
  fs::create_symlink("..", s.root / "up");
  fs::create_symlink("../..", s.root / "dir" / "upup");
  fs::create_symlink("/", s.root / "abs");
  fs::create_symlink("../outside", s.root / "out");
  fs::create_symlink("../outside/secret", s.root / "secret");
  fs::create_symlink(s.outside, s.root / "outabs");
  fs::create_symlink(s.outside / "secret", s.root / "secretabs");
  fs::create_symlink("loop", s.root / "loop");
  fs::create_symlink("/etc/passwd", s.root / "passwd");
  fs::create_symlink("/proc/self/root", s.root / "hostroot");
  fs::create_symlink("/mnt/file", s.root / "mounted");
  fs::create_symlink("sub/../../up/outside", s.root / "dir" / "twisty");
  ::mkfifo((s.root / "fifo").c_str(), 0644);
}

Scratch& scratch() {
  static Scratch s = [] {
    Scratch s;
    s.dir = fuzz::scratch_dir("sandbox_path", s.mounts);
    s.outside = s.dir / "outside";
    s.root = s.dir / "root";
    fs::create_directories(s.outside / "dir");
    fs::create_directories(s.root / "mnt");
    fs::create_directories(s.root / "proc");
    fuzz::write_text(s.outside / "secret", "OUTSIDE secret\n", 0600);
    fuzz::write_text(s.outside / "dir" / "file", "OUTSIDE file\n");
    fuzz::write_text(s.outside / "passwd", "OUTSIDE passwd\n");
    fs::create_symlink("../root", s.outside / "back");
    if (s.mounts) {
      // The sandbox's own mounts: a file system the files API must not cross into, and a /proc.
      if (::mount("fuzz-mnt", (s.root / "mnt").c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "size=1m") == 0)
        fuzz::write_text(s.root / "mnt" / "file", "MOUNTED file\n");
      ::mount("proc", (s.root / "proc").c_str(), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr);
    }
    s.outside_state = fuzz::tree_state(s.outside);
    s.mounted_state = fuzz::tree_state(s.root / "mnt");
    for (const auto& e : fs::recursive_directory_iterator(s.outside)) {
      struct stat st {};
      if (::lstat(e.path().c_str(), &st) == 0) s.outside_inodes.emplace(st.st_dev, st.st_ino);
    }
    struct stat st {};
    ::stat(s.root.c_str(), &st);
    s.root_dev = st.st_dev;
    return s;
  }();
  return s;
}

void check_fd(const Scratch& s, int fd, const char* what) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fuzz::fail(std::string(what) + ": fstat");
  if (!S_ISREG(st.st_mode)) fuzz::fail(std::string(what) + ": handed out something that is not a regular file");
  if (st.st_dev != s.root_dev) fuzz::fail(std::string(what) + ": handed out a file on another mount");
  if (s.outside_inodes.count({st.st_dev, st.st_ino}))
    fuzz::fail(std::string(what) + ": handed out a file outside the root");
}

void check_bytes(std::string_view bytes, const char* what) {
  if (bytes.find("OUTSIDE") != std::string_view::npos) fuzz::fail(std::string(what) + ": read a file outside the root");
  if (bytes.find("MOUNTED") != std::string_view::npos) fuzz::fail(std::string(what) + ": read a file on another mount");
}

void check_normalized(std::string_view path) {
  std::string n;
  try {
    n = files::normalize_sandbox_path(path);
  } catch (const Error& e) {
    fuzz::expect_code(e, Code::kInvalidArgument, "normalize_sandbox_path");
    return;
  }
  if (n.empty() || n.front() != '/') fuzz::fail("normalize_sandbox_path: not absolute: " + n);
  if (n != "/" && n.back() == '/') fuzz::fail("normalize_sandbox_path: a trailing '/': " + n);
  for (std::string_view bad : {"//", "/./", "/../"})
    if (n != "/" && (n + "/").find(bad) != std::string::npos)
      fuzz::fail("normalize_sandbox_path: left a '.', '..' or '' in " + n);
  if (files::normalize_sandbox_path(n) != n) fuzz::fail("normalize_sandbox_path: not idempotent on " + n);
}

void run(const Scratch& s, fuzz::Input& in) {
  dsec::UniqueFd root_fd(::open(s.root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!root_fd) fuzz::fail("open the root");
  files::SandboxTree tree(std::move(root_fd));
  for (int op = 0; op < 16 && !in.empty(); ++op) {
    std::uint8_t b = in.byte();
    std::string path(in.until('\n'));
    check_normalized(path);
    try {
      switch (b % 8) {
        case 0: {
          dsec::UniqueFd fd = tree.open_for_reading(path);
          check_fd(s, fd.get(), "open_for_reading");
          break;
        }
        case 1:
          check_bytes(tree.read_file(path, 1u << 16), "read_file");
          break;
        case 2:
          (void)tree.mode_of(path);
          break;
        case 3:
          (void)tree.is_directory(path);
          break;
        case 4: {
          dsec::UniqueFd fd = tree.open_for_writing(path, 0644);
          check_fd(s, fd.get(), "open_for_writing");
          if (::write(fd.get(), "w", 1) != 1) fuzz::fail("write to an opened file");
          break;
        }
        case 5:
          tree.write_file(path, "written\n", (b >> 3) & 0777);
          break;
        case 6: {
          std::size_t entries = 0;
          tree.walk(
              path, 1u << 16,
              [&](const files::TreeEntry& e) {
                if (++entries > 4096) fuzz::fail("walk: more entries than the tree holds");
                if (e.path.empty() || e.path.front() == '/' || e.path == ".." || e.path.starts_with("../") ||
                    e.path.find("/../") != std::string::npos || e.path.ends_with("/.."))
                  fuzz::fail("walk: an entry path that is not relative: " + e.path);
              },
              [&](std::string_view data) { check_bytes(data, "walk"); });
          break;
        }
        case 7: {
          // One entry of an upload, below a directory the path names: what a tar member may ask for.
          files::TreeEntry e;
          e.kind = static_cast<files::EntryKind>(1 + (b >> 3) % 4);  // directory, regular, symlink, hard link
          e.path = std::string(in.until('\n'));
          e.mode = 0755;
          e.link = path;
          files::SandboxTree::Extraction x(tree, "/" + std::to_string(b >> 5));
          x.entry(e);
          if (e.kind == files::EntryKind::kRegular) x.write_data("extracted\n");
          x.finish();
          break;
        }
      }
    } catch (const Error& e) {
      if (e.code() == Code::kInternal) fuzz::fail(std::string("INTERNAL for a path: ") + e.what());
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Scratch& s = scratch();
  make_fixture(s);
  fuzz::Input in(data, size);
  try {
    run(s, in);
  } catch (const std::exception& e) {
    fuzz::fail(std::string("threw something other than dsec::Error: ") + e.what());
  }
  fuzz::expect_unchanged(s.outside_state, s.outside, "sandbox_path");
  if (s.mounts) fuzz::expect_unchanged(s.mounted_state, s.root / "mnt", "sandbox_path (the mount)");
  return 0;
}
