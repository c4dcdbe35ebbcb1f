// The file system that lets the kernel's EROFS driver read a layer before the node has it: a FUSE mount (libfuse3,
// low-level API) of one flat, read-only directory with files named by the layer digest's hex: for a layer in two
// parts (chunk_index.hpp: metadata, then the data device) "<hex>" holds the metadata part and "<hex>.data" the data
// device (the layer's bytes from meta_size on); a plain EROFS layer is "<hex>" alone, as large as the layer. A read
// is served from the blob cache, which fetches the chunks it lacks; layer_mounts mounts EROFS with "<hex>" as its
// source and "<hex>.data" as its device.
//
// A read that cannot be served (a store that is gone, a chunk that fails its digest) is answered with EIO, never
// with other bytes, and logged as an error and counted (dsec_layer_read_errors_total). The file system runs on its
// own threads; they only ever wait for the stores and the cache's disk, never for anything that reads through this
// file system. Destruction unmounts it.
#pragma once

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

  // The file of a layer, and of its data device (they exist while the cache has the layer).
  std::filesystem::path file_of(const std::string& hex) const { return mount_point_ / hex; }
  std::filesystem::path data_file_of(const std::string& hex) const { return mount_point_ / (hex + ".data"); }
  const std::filesystem::path& mount_point() const noexcept { return mount_point_; }
  // Unmounts and stops the threads; idempotent. Mounts that still read through it get errors afterwards.
  void stop();

  // FUSE request handlers (called by libfuse through C callbacks).
  struct Handlers;

 private:
  // A file: the bytes [base, base + size) of a layer.
  struct Inode {
    std::string name;
    std::string hex;
    std::uint64_t base = 0;
    std::uint64_t size = 0;
  };
  std::uint64_t inode_of(const Inode& file);
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
  unsigned connection_ = 0;  // the FUSE connection's number (fusectl)

  mutable std::mutex inodes_mutex_;
  std::map<std::string, std::uint64_t, std::less<>> inode_by_name_;
  std::vector<Inode> inodes_;  // inode n (from 2) is inodes_[n - 2]; numbers are never reused

  std::mutex log_mutex_;
  double log_window_start_ = 0;
  int logged_in_window_ = 0;
};

}  // namespace dsec::agent::layers
