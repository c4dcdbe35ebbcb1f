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
// Mounts live under <run dir>/.layers: "blobs" (the FUSE mount), one directory per layer named by its digest's hex,
// and "keeper", the record of the process that holds the FUSE connection open (layer_keeper.hpp).
//
// Restart. An agent killed outright (kill -9, a crash, the OOM killer) leaves its layer mounts, and the sandboxes
// on them keep running; the keeper keeps the FUSE connection alive, so their reads wait in the kernel instead of
// failing. The next agent on the same run dir takes over: when the keeper is still the process recorded and its
// connection is the one mounted at "blobs", it takes the connection back, serves it (requests the dead agent had
// taken are resent, Linux 6.9+), and adopts every EROFS layer mount still there, so that acquire() of such a layer
// returns the same directory the sandboxes' overlays use. Adopted layers are held by nobody until a sandbox
// acquires them: the agent acquires the layers of the sandboxes it takes over before its first prune(), which
// unmounts the adopted layers no sandbox holds. When the keeper is gone or does not match, everything the earlier
// agent left is detached (as without a keeper) and the reason logged. In extract mode the layers are directories in
// the cache: those extracted already are adopted the same way, so the cache keeps them until that first prune.
//
// shutdown() leaves nothing: no layer mount, no FUSE mount, no keeper, no record.
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
#include <vector>

#include "agent/images/layers/blob_cache.hpp"
#include "agent/images/layers/layer_image.hpp"
#include "agent/images/layers/layer_keeper.hpp"
#include "agent/images/layers/lazy_layer_fs.hpp"
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
  // Where the layers taken over from an earlier agent fetch the chunks they lack (the agent's stores); acquire()
  // names the stores of the layers it mounts itself.
  Stores stores;
  // dsec-layer-keeper; empty: the one beside the running program. Without it layers work, but a killed agent's
  // layer mounts stop working (logged once).
  std::filesystem::path keeper_binary;
};

struct MountedLayer {
  std::filesystem::path dir;         // the layer's files
  std::shared_ptr<const void> hold;  // keeps the layer mounted while held
  LayerImage image;
};

class LayerMounts {
 public:
  // Takes over what an earlier agent left under mount_dir (or detaches it, see above), decides the mode and, in lazy
  // mode, mounts the layer file system (or serves the earlier one). FAILED_PRECONDITION when mode is lazy and the
  // node cannot do it.
  LayerMounts(LayerMountsOptions options, BlobCache& cache, LayerMetrics& metrics);
  LayerMounts(const LayerMounts&) = delete;
  LayerMounts& operator=(const LayerMounts&) = delete;
  ~LayerMounts();

  // The layer's directory, mounted (or extracted) on first use; concurrent callers for one layer wait for one
  // mount. Errors are the blob cache's (NOT_FOUND, DATA_LOSS, UNAVAILABLE, RESOURCE_EXHAUSTED...), and
  // INVALID_ARGUMENT for a layer that is not a valid EROFS image.
  MountedLayer acquire(const image::LayerDescriptor& layer, const Stores& stores);
  // Unmounts the layers no sandbox holds, then lets the cache evict beyond its limit. Returns layers unmounted. Also
  // starts the keeper again if it ended while the layer file system is mounted.
  std::size_t prune();
  // Unmounts every layer (lazily when one is still busy) and the layer file system, and ends the keeper.
  // Idempotent.
  void shutdown();

  bool lazy() const noexcept { return lazy_.load(); }
  // "erofs-lazy", or "extract (<why>)".
  std::string mode_description() const;
  // Layer digest -> sandboxes holding it now.
  std::map<std::string, std::uint32_t> users() const;
  // Digests of the layers taken over from an earlier agent at start (mounts, or extracted trees).
  std::vector<std::string> adopted() const;
  // Whether the layer file system was taken over from an earlier agent's keeper.
  bool resumed() const noexcept { return resumed_; }
  // The keeper holding the layer file system's connection, 0 when there is none.
  pid_t keeper_pid() const;

 private:
  struct Slot;
  void prepare(Slot& slot, const image::LayerDescriptor& layer, const Stores& stores);
  bool mount_lazy(Slot& slot);
  void extract(Slot& slot);
  void release_slot(Slot& slot, bool force);
  void fall_back_to_extract(const std::string& reason);
  bool resume_lazy();
  // A layer mount the earlier agent left at `point` (of layer `hex`, in the cache), taken over as a ready slot.
  void adopt_layer_mount(const std::string& hex, const std::filesystem::path& point);
  void remove_leftovers();
  void adopt_extracted();
  void start_keeper();
  void check_keeper();
  std::filesystem::path keeper_record() const { return options_.mount_dir / "keeper"; }

  LayerMountsOptions options_;
  BlobCache& cache_;
  LayerMetrics& metrics_;
  std::unique_ptr<LazyLayerFs> fs_;
  std::unique_ptr<LayerKeeper> keeper_;  // guarded by mutex_ once constructed
  bool keeper_unavailable_ = false;
  bool resumed_ = false;
  std::atomic<bool> lazy_{false};

  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::string, std::shared_ptr<Slot>, std::less<>> slots_;  // by hex
  std::string description_;
  bool shut_down_ = false;
};

}  // namespace dsec::agent::layers
