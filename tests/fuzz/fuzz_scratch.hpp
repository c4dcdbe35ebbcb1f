// Scratch trees for the fuzz targets that write files (tar_import, sandbox_path), and a check that nothing outside
// the tree a decoder was given has changed.
#pragma once

#include <sched.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <system_error>

#include "fuzz_util.hpp"

namespace fuzz {

namespace fs = std::filesystem;

// Where a target keeps its trees. As root: a tmpfs of its own at /run/dsec-fuzz/<name>, mounted in a mount namespace
// of the fuzzer's own, so the path is the same on every run (seed inputs can name it in absolute symlinks), the size
// is bounded, and it goes with the process however the process ends. Otherwise a directory under $TMPDIR, removed at
// exit. `mounts` says whether the namespace is there (targets mount more in it).
inline fs::path scratch_dir(const char* name, bool& mounts) {
  mounts = false;
  fs::path fixed = fs::path("/run/dsec-fuzz") / name;
  if (::geteuid() == 0 && ::unshare(CLONE_NEWNS) == 0 &&
      ::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) == 0) {
    std::error_code ec;
    fs::create_directories(fixed, ec);
    if (!ec && ::mount("dsec-fuzz", fixed.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, "size=256m,mode=0755") == 0) {
      mounts = true;
      std::fprintf(stderr, "dsec fuzz: scratch tree %s (a tmpfs in a mount namespace of this process)\n",
                   fixed.c_str());
      return fixed;
    }
  }
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/dsec-fuzz-" + name + "-XXXXXX";
  if (!::mkdtemp(pattern.data())) fail("mkdtemp");
  static fs::path made;
  made = pattern;
  std::fprintf(stderr, "dsec fuzz: scratch tree %s (not root: no private mounts)\n", pattern.c_str());
  std::atexit([] {
    std::error_code ec;
    fs::remove_all(made, ec);
  });
  return made;
}

// What a tree holds, entry by entry: type, mode, owner, link count, size, times, and content or link target.
using TreeState = std::map<std::string, std::string>;

inline TreeState tree_state(const fs::path& dir) {
  TreeState out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, fs::directory_options::none, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    const fs::path& p = it->path();
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0) continue;
    std::string what = std::to_string(st.st_mode) + " " + std::to_string(st.st_uid) + ":" + std::to_string(st.st_gid) +
                       " n" + std::to_string(st.st_nlink) + " s" + std::to_string(st.st_size) + " m" +
                       std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec);
    if (S_ISREG(st.st_mode)) {
      std::ifstream in(p, std::ios::binary);
      what += " " + std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    } else if (S_ISLNK(st.st_mode)) {
      what += " -> " + fs::read_symlink(p, ec).string();
    }
    out[fs::relative(p, dir).string()] = what;
  }
  return out;
}

inline void expect_unchanged(const TreeState& before, const fs::path& dir, const char* what) {
  TreeState now = tree_state(dir);
  if (now == before) return;
  std::string diff;
  for (const auto& [k, v] : now)
    if (!before.count(k) || before.at(k) != v) diff += "\n  now    " + k + ": " + v;
  for (const auto& [k, v] : before)
    if (!now.count(k) || now.at(k) != v) diff += "\n  before " + k + ": " + v;
  fail(std::string(what) + ": something outside the tree changed:" + diff);
}

inline void write_text(const fs::path& p, const std::string& text, mode_t mode = 0644) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << text;
  ::chmod(p.c_str(), mode);
}

}  // namespace fuzz
