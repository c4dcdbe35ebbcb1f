// The files API of a container sandbox: the agent reads and writes inside the sandbox's root through
// /proc/<init>/root, and resolves every path with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV):
// ".." and symlinks that the sandbox planted resolve inside its root, never on the host, and paths do not cross into
// the sandbox's /proc, /dev or /sys. Only regular files are read or written (a FIFO planted where a file is expected
// cannot block the agent).
#pragma once

#include <sys/types.h>

#include <string>
#include <string_view>

#include "common/unique_fd.hpp"

namespace dsec::agent::container {

class RootfsFiles {
 public:
  // `root` is an O_PATH descriptor of the sandbox's root directory.
  explicit RootfsFiles(UniqueFd root) : root_(std::move(root)) {}

  void write_file(std::string_view path, std::string_view data, unsigned mode);
  std::string read_file(std::string_view path, std::size_t max_bytes);
  bool is_directory(std::string_view path);
  // Extracts a tar stream (plain, or compressed in any way libarchive reads) into dir. Regular files, directories,
  // symlinks and hard links; devices and FIFOs are skipped; setuid/setgid bits are dropped.
  void put_archive(std::string_view dir, std::string_view tar_bytes);
  // A pax tar of dir, not following symlinks, not descending into other mounts.
  std::string get_archive(std::string_view dir, std::size_t max_bytes);

 private:
  UniqueFd root_;
};

// Splits an absolute path into normal components ("." dropped, ".." applied lexically; it cannot rise above "/").
// Throws INVALID_ARGUMENT for a relative path or one with NUL.
std::string normalize_sandbox_path(std::string_view path);

}  // namespace dsec::agent::container
