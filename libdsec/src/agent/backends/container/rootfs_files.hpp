// The files API of a container sandbox: the agent reads and writes inside the sandbox's root through
// /proc/<init>/root, with the rules of files::SandboxTree (paths resolved inside the root, never across into its
// /proc, /dev or /sys, only regular files read or written), and tar streams made and read by files/tar_stream.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "common/sandbox_tree.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::container {

using files::normalize_sandbox_path;

class RootfsFiles {
 public:
  // `root` is an O_PATH descriptor of the sandbox's root directory; `userns_first` the first host id of its user
  // namespace's block, if it has one (the ids tar streams carry are the ones inside).
  explicit RootfsFiles(UniqueFd root, std::optional<std::uint32_t> userns_first = std::nullopt)
      : tree_(std::move(root)), userns_first_(userns_first) {}

  void write_file(std::string_view path, std::string_view data, unsigned mode) { tree_.write_file(path, data, mode); }
  std::string read_file(std::string_view path, std::size_t max_bytes) { return tree_.read_file(path, max_bytes); }
  bool is_directory(std::string_view path) { return tree_.is_directory(path); }
  // Extracts a tar stream (plain, or compressed in any way libarchive reads) into dir. Regular files, directories,
  // symlinks and hard links; devices and FIFOs are skipped; setuid/setgid bits are dropped.
  void put_archive(std::string_view dir, std::string_view tar_bytes);
  // A pax tar of dir, not following symlinks, not descending into other mounts.
  std::string get_archive(std::string_view dir, std::size_t max_bytes);

 private:
  files::SandboxTree tree_;
  std::optional<std::uint32_t> userns_first_;
};

}  // namespace dsec::agent::container
