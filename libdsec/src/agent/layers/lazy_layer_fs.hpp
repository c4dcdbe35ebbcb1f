// The file system that lets the kernel's EROFS driver read a layer before the node has it: a FUSE mount (libfuse3,
// low-level API) of one flat, read-only directory with a file per cached layer, named by the layer digest's hex and
// as large as the layer. A read of such a file is served from the blob cache, which fetches the chunks it lacks;
// layer_mounts mounts EROFS with the file as its source.
//
// A read that cannot be served (a store that is gone, a chunk that fails its digest) is answered with EIO, never
// with other bytes, and logged as an error and counted (dsec_layer_read_errors_total). The file system runs on its
// own threads; they only ever wait for the stores and the cache's disk, never for anything that reads through this
// file system. Destruction unmounts it.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "agent/layers/blob_cache.hpp"
#include "agent/metrics.hpp"

struct fuse_session;

namespace dsec::agent::layers {

class LazyLayerFs {
 public:
  // Mounts at `mount_point` (created when missing; it must not be a mount point already) and starts serving.
  // FAILED_PRECONDITION (with the reason) when FUSE cannot be set up or mounted.
  LazyLayerFs(BlobCache& cache, std::filesystem::path mount_point, LayerMetrics& metrics);
  LazyLayerFs(const LazyLayerFs&) = delete;
  LazyLayerFs& operator=(const LazyLayerFs&) = delete;
  ~LazyLayerFs();

  // The file of a layer (it exists while the cache has the layer).
  std::filesystem::path file_of(const std::string& hex) const { return mount_point_ / hex; }
  const std::filesystem::path& mount_point() const noexcept { return mount_point_; }
  // Unmounts and stops the threads; idempotent. Mounts that still read through it get errors afterwards.
  void stop();

  // FUSE request handlers (called by libfuse through C callbacks).
  struct Handlers;

 private:
  struct Inode {
    std::string hex;
    std::uint64_t size = 0;
  };
  std::uint64_t inode_of(const std::string& hex, std::uint64_t size);
  bool inode(std::uint64_t ino, Inode& out) const;
  void log_read_error(const std::string& what);

  BlobCache& cache_;
  std::filesystem::path mount_point_;
  LayerMetrics& metrics_;
  fuse_session* session_ = nullptr;
  std::thread loop_;
  std::mutex loop_mutex_;
  std::condition_variable loop_done_;
  bool loop_ended_ = false;
  dev_t device_ = 0;

  mutable std::mutex inodes_mutex_;
  std::map<std::string, std::uint64_t, std::less<>> inode_by_hex_;
  std::vector<Inode> inodes_;  // inode n (from 2) is inodes_[n - 2]; numbers are never reused

  std::mutex log_mutex_;
  double log_window_start_ = 0;
  int logged_in_window_ = 0;
};

}  // namespace dsec::agent::layers
