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
//
// Restart: the FUSE connection can outlive the agent (layer_keeper holds it open) and be served again by the next
// agent's LazyLayerFs (the resuming constructor). Everything the kernel keeps from the earlier server therefore
// means the same to the next one: node ids are a function of the layer digest and the part (layer_inode), file
// handles carry nothing (every request names its node id), and the files are the blob cache's layers, which the
// cache re-opens from disk at start.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "agent/images/layers/blob_cache.hpp"
#include "agent/metrics.hpp"
#include "common/unique_fd.hpp"

struct fuse_session;

namespace dsec::agent::layers {

// The node id of a layer's file: 1 << 63 | the first 60 bits of the digest << 1 | 1 for the data device. Never 0 or
// FUSE_ROOT_ID, the same in every run of the agent.
std::uint64_t layer_inode(std::string_view hex, bool data_part);
// Aborts FUSE connection `connection` through fusectl (mounted for the moment when it is not): whatever waits on
// it gets an error, its server's reads end with ENODEV. False when it could not be done (logged).
bool abort_fuse_connection(unsigned connection);

class LazyLayerFs {
 public:
  // Mounts at `mount_point` (created when missing; it must not be a mount point already) and starts serving.
  // FAILED_PRECONDITION (with the reason) when FUSE cannot be set up or mounted.
  LazyLayerFs(BlobCache& cache, std::filesystem::path mount_point, LayerMetrics& metrics);
  // Serves the connection an earlier agent mounted at `mount_point`, through `device` (a descriptor of its
  // /dev/fuse file, taken from the layer keeper). The kernel made its INIT with the earlier server: libfuse is
  // handed an INIT like it, whose answer the kernel refuses (no request has its id) and libfuse ignores. Requests
  // the earlier server had taken but not answered are then put back in the queue (FUSE_NOTIFY_RESEND, Linux 6.9+;
  // resent() says whether the kernel did). FAILED_PRECONDITION when libfuse refuses the descriptor.
  LazyLayerFs(BlobCache& cache, std::filesystem::path mount_point, LayerMetrics& metrics, UniqueFd device);
  LazyLayerFs(const LazyLayerFs&) = delete;
  LazyLayerFs& operator=(const LazyLayerFs&) = delete;
  ~LazyLayerFs();

  // The file of a layer, and of its data device (they exist while the cache has the layer).
  std::filesystem::path file_of(const std::string& hex) const { return mount_point_ / hex; }
  std::filesystem::path data_file_of(const std::string& hex) const { return mount_point_ / (hex + ".data"); }
  const std::filesystem::path& mount_point() const noexcept { return mount_point_; }
  // The /dev/fuse descriptor the file system is served through (for the layer keeper's duplicate), -1 once stopped.
  int device_fd() const noexcept;
  // The FUSE connection's number (fusectl; the mount's device minor).
  unsigned connection() const noexcept { return connection_; }
  // This server took over an earlier one's connection; and the kernel accepted FUSE_NOTIFY_RESEND for it.
  bool resumed() const noexcept { return resumed_; }
  bool resent() const noexcept { return resent_; }
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
    bool data = false;  // the data device of a layer in two parts
  };
  // The files of a layer: for a layer in two parts, "<hex>" (its metadata part) and "<hex>.data" (its data device);
  // for a plain EROFS image, "<hex>" (all of it).
  static std::vector<Inode> files_of(const CacheEntry& entry);
  std::uint64_t inode_of(const Inode& file);
  // The file of a node id; a node id from an earlier run is found among the cache's layers.
  bool inode(std::uint64_t ino, Inode& out);
  void log_read_error(const std::string& what);
  void start_loop();

  BlobCache& cache_;
  std::filesystem::path mount_point_;
  LayerMetrics& metrics_;
  fuse_session* session_ = nullptr;
  std::thread loop_;
  std::mutex loop_mutex_;
  std::condition_variable loop_done_;
  bool loop_ended_ = false;
  unsigned connection_ = 0;  // the FUSE connection's number (fusectl)
  bool resumed_ = false;
  bool resent_ = false;
  std::atomic<bool> initialized_{false};  // libfuse took an INIT

  std::mutex inodes_mutex_;
  std::map<std::uint64_t, Inode> inodes_;  // by layer_inode()

  std::mutex log_mutex_;
  double log_window_start_ = 0;
  int logged_in_window_ = 0;
};

}  // namespace dsec::agent::layers
