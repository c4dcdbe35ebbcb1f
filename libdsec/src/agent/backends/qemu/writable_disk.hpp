// A VM's writable disk: a sparse file on the node's local disk, as large as the sandbox's disk limit, holding an
// empty ext4 file system that the guest mounts as the upper directory of its overlay (runtime writes go to local
// disk, never to guest memory). Writes past the limit fail inside the guest with ENOSPC.
//
// mkfs.ext4 runs once per size: the first disk of a size becomes a template in the cache directory, and every disk
// after it is a copy of the template's written blocks (well under a megabyte), holes left as holes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>

namespace dsec::agent::qemu {

class WritableDisks {
 public:
  explicit WritableDisks(std::filesystem::path cache_dir) : cache_dir_(std::move(cache_dir)) {}

  // Makes `path` (must not exist; mode 0600) as an empty ext4 disk of `bytes` (at least 16 MiB, rounded up to a
  // MiB). RESOURCE_EXHAUSTED when the node's disk is full.
  void make(const std::filesystem::path& path, std::uint64_t bytes);

 private:
  std::filesystem::path template_for(std::uint64_t bytes);

  std::filesystem::path cache_dir_;
  std::mutex mu_;
  std::map<std::uint64_t, std::filesystem::path> templates_;
};

// Copies `from` to a new file `to` (mode 0600), only the data extents: holes stay holes.
void copy_sparse(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace dsec::agent::qemu
