// Image layers as directories a sandbox's overlay can stack: each layer mounted once per node, however many sandboxes
// use it, and unmounted when none does.
//
// Lazy mode (the default where the kernel can): mount(2) of type "erofs" whose source is the layer's file in the
// lazy layer file system (lazy_layer_fs), read-only, nodev, nosuid; the kernel reads the layer through FUSE and the
// blob cache fetches what it reads. Extract mode (a kernel without EROFS or without file-backed EROFS mounts, no
// FUSE, or not root): the whole layer is fetched and its files extracted with `fsck.erofs --extract` into the
// cache, where it stays for later sandboxes. "auto" chooses lazy when /proc/filesystems lists erofs and /dev/fuse
// exists, and falls back to extract (saying why in mode_description()) when the first FUSE or EROFS mount fails.
//
// Mounts live under <run dir>/.layers: "blobs" (the FUSE mount) and one directory per layer named by its digest's
// hex. Mounts a killed agent left there are detached at start; shutdown() leaves none.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "agent/layers/blob_cache.hpp"
#include "agent/layers/lazy_layer_fs.hpp"
#include "agent/metrics.hpp"
#include "dsec/error.hpp"
#include "image/store/manifest.hpp"

namespace dsec::agent::layers {

enum class LayerMode { kAuto, kLazy, kExtract };
// "auto", "lazy" or "extract"; INVALID_ARGUMENT otherwise.
LayerMode parse_layer_mode(std::string_view text);
std::string_view to_string(LayerMode mode);

struct LayerMountsOptions {
  std::filesystem::path mount_dir;  // <run dir>/.layers
  LayerMode mode = LayerMode::kAuto;
};

struct MountedLayer {
  std::filesystem::path dir;          // the layer's files
  std::shared_ptr<const void> hold;   // keeps the layer mounted while held
};

class LayerMounts {
 public:
  // Detaches what an earlier agent left under mount_dir, decides the mode and, in lazy mode, mounts the layer file
  // system. FAILED_PRECONDITION when mode is lazy and the node cannot do it.
  LayerMounts(LayerMountsOptions options, BlobCache& cache, LayerMetrics& metrics);
  LayerMounts(const LayerMounts&) = delete;
  LayerMounts& operator=(const LayerMounts&) = delete;
  ~LayerMounts();

  // The layer's directory, mounted (or extracted) on first use; concurrent callers for one layer wait for one
  // mount. Errors are the blob cache's (NOT_FOUND, DATA_LOSS, UNAVAILABLE, RESOURCE_EXHAUSTED...), and
  // INVALID_ARGUMENT for a layer that is not a valid EROFS image.
  MountedLayer acquire(const image::LayerDescriptor& layer, const Stores& stores);
  // Unmounts the layers no sandbox holds, then lets the cache evict beyond its limit. Returns layers unmounted.
  std::size_t prune();
  // Unmounts every layer (lazily when one is still busy) and the layer file system. Idempotent.
  void shutdown();

  bool lazy() const noexcept { return lazy_.load(); }
  // "erofs-lazy", or "extract (<why>)".
  std::string mode_description() const;
  // Layer digest -> sandboxes holding it now.
  std::map<std::string, std::uint32_t> users() const;

 private:
  struct Slot;
  void prepare(Slot& slot, const image::LayerDescriptor& layer, const Stores& stores);
  bool mount_lazy(Slot& slot);
  void extract(Slot& slot);
  void release_slot(Slot& slot, bool force);
  void fall_back_to_extract(const std::string& reason);

  LayerMountsOptions options_;
  BlobCache& cache_;
  LayerMetrics& metrics_;
  std::unique_ptr<LazyLayerFs> fs_;
  std::atomic<bool> lazy_{false};

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::shared_ptr<Slot>, std::less<>> slots_;  // by hex
  std::string description_;
  bool shut_down_ = false;
};

}  // namespace dsec::agent::layers
