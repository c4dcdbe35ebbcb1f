// Shared helpers for the image store's unit tests: a private temporary directory per test, and small file makers.
#pragma once

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "image/fs_tree.hpp"

namespace dsec::image::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with everything below it when the test ends.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base && *base ? base : "/tmp") + "/dsec-image-test-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = std::filesystem::canonical(templ);
  }
  ~TempDir() {
    try {
      remove_tree(path_);
    } catch (...) {
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& rel) const { return path_ / rel; }

 private:
  std::filesystem::path path_;
};

inline void write_text(const std::filesystem::path& p, const std::string& text, mode_t mode = 0644) {
  std::filesystem::create_directories(p.parent_path());
  {
    std::ofstream out(p, std::ios::trunc | std::ios::binary);
    out << text;
  }
  ::chmod(p.c_str(), mode);
}

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline struct stat lstat_of(const std::filesystem::path& p) {
  struct stat st {};
  if (::lstat(p.c_str(), &st) != 0) ADD_FAILURE() << "lstat " << p << ": " << std::strerror(errno);
  return st;
}

inline bool running_as_root() { return ::geteuid() == 0; }

// The names in `dir` that start with `prefix` (to find leftover .tmp-* / .rm-* entries).
inline std::vector<std::string> entries_with_prefix(const std::filesystem::path& dir, const std::string& prefix) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    std::string n = e.path().filename().string();
    if (n.starts_with(prefix)) out.push_back(n);
  }
  return out;
}

}  // namespace dsec::image::testing
