// The node's layer cache: the uncompressed EROFS image of each layer a sandbox used, filled chunk by chunk as it is
// read, so a task that reads 5% of its image fetches about 5% of it.
//
// On disk, one directory per layer under the cache directory, named by the layer digest's hex:
//   <hex>/index.json   the layer's chunk index as the store had it (its sha256 is the manifest's index digest);
//                      written last, so a directory without it is a half-made entry and is removed at start
//   <hex>/layer        a sparse file of the layer's size: chunk i at offset i * chunk_size once fetched
//   <hex>/present      one byte per chunk: 1 when the chunk's bytes are in `layer`, written after them
//   <hex>/tree/        (extract mode) the layer's files, extracted by layer_mounts
//
// A chunk is fetched from the first store that has it, decompressed and checked against its digest in the index
// (image::decode_chunk) before a byte of it is written; bytes that do not check out are never served. Readers that
// want one missing chunk at once wait for a single fetch. A chunk found present when the agent starts is checked
// once, on its first read, before it is trusted. Layers no sandbox uses are evicted, least recently used first,
// when the cache grows past its byte limit, and all of them when the disk is full (then the write is tried once
// more).
//
// Thread-safe; the FUSE threads of lazy_layer_fs read through it while creates acquire layers.
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
#include <unordered_map>
#include <vector>

#include "agent/metrics.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox_info.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/manifest.hpp"

namespace dsec::agent::layers {

using Stores = std::vector<std::shared_ptr<image::BlobStore>>;

struct BlobCacheOptions {
  std::filesystem::path dir;              // created when missing
  std::uint64_t max_bytes = 20ull << 30;  // unused layers are evicted beyond this
};

class BlobCache;

// One layer in the cache. Its index and files are fixed once the cache hands it out; the chunk states change.
class CacheEntry {
 public:
  const std::string& digest() const noexcept { return digest_; }  // "sha256:<hex>"
  const std::string& hex() const noexcept { return hex_; }
  const std::filesystem::path& dir() const noexcept { return dir_; }
  std::filesystem::path layer_file() const { return dir_ / "layer"; }
  std::filesystem::path tree_dir() const { return dir_ / "tree"; }
  std::uint64_t size() const noexcept { return index_.size; }
  const image::ChunkIndex& index() const noexcept { return index_; }
  // Bytes of fetched chunks in `layer`.
  std::uint64_t present_bytes() const noexcept { return present_bytes_.load(std::memory_order_relaxed); }
  // Bytes of the extracted tree (extract mode), 0 otherwise.
  std::uint64_t extra_bytes() const noexcept { return extra_bytes_.load(std::memory_order_relaxed); }

 private:
  friend class BlobCache;
  enum class ChunkState : std::uint8_t { kAbsent, kFetching, kPresent, kUnchecked };

  std::string digest_, hex_;
  std::filesystem::path dir_;
  std::string index_digest_;
  std::uint64_t index_bytes_ = 0;
  image::ChunkIndex index_;
  UniqueFd layer_fd_, present_fd_;

  mutable std::mutex mutex_;  // guards the chunk vectors, stores_ and errors_
  std::condition_variable changed_;
  std::vector<ChunkState> state_;
  std::vector<std::uint32_t> attempts_;            // fetches of chunk i that ended (ok or not) in this run
  std::vector<std::uint16_t> fetched_;             // fetches of chunk i from a store in this run
  std::unordered_map<std::size_t, Error> errors_;  // why the last fetch of chunk i failed
  Stores stores_;
  std::atomic<std::uint64_t> present_bytes_{0};
  std::atomic<std::uint64_t> extra_bytes_{0};

  // Guarded by BlobCache::mutex_.
  std::uint32_t users_ = 0;
  double last_used_ = 0;  // unix seconds
  bool evicted_ = false;
};

// Holds a layer in the cache (a user: never evicted while held). Movable; releases on destruction.
class LayerUse {
 public:
  LayerUse() = default;
  LayerUse(BlobCache* cache, std::shared_ptr<CacheEntry> entry) : cache_(cache), entry_(std::move(entry)) {}
  LayerUse(LayerUse&& o) noexcept : cache_(std::exchange(o.cache_, nullptr)), entry_(std::move(o.entry_)) {}
  LayerUse& operator=(LayerUse&& o) noexcept;
  LayerUse(const LayerUse&) = delete;
  LayerUse& operator=(const LayerUse&) = delete;
  ~LayerUse() { reset(); }
  void reset();

  explicit operator bool() const noexcept { return entry_ != nullptr; }
  CacheEntry& entry() const noexcept { return *entry_; }
  const std::shared_ptr<CacheEntry>& shared() const noexcept { return entry_; }

 private:
  BlobCache* cache_ = nullptr;
  std::shared_ptr<CacheEntry> entry_;
};

class BlobCache {
 public:
  // Reads what an earlier run left in the directory: complete entries are kept (their chunks checked on first
  // read), half-made ones removed.
  BlobCache(BlobCacheOptions options, LayerMetrics& metrics);
  BlobCache(const BlobCache&) = delete;
  BlobCache& operator=(const BlobCache&) = delete;
  ~BlobCache();

  // The layer, ready to read: its index from the cache or else from the stores (checked against the descriptor:
  // the manifest's index digest, layer digest, size and data blob), and its first chunk (the EROFS superblock) plus
  // the index's prefetch chunks (the metadata) fetched. Errors: NOT_FOUND (a blob is in none of the stores),
  // DATA_LOSS (a blob or chunk does not match its digest), INVALID_ARGUMENT (index and manifest disagree),
  // UNAVAILABLE (a store cannot be reached), RESOURCE_EXHAUSTED (the cache's disk is full). Without `prefetch`,
  // no chunk is fetched yet (the extract fallback fetches them all, or finds the layer's files extracted already).
  LayerUse acquire(const image::LayerDescriptor& layer, const Stores& stores, bool prefetch = true);

  // A user of a layer the cache has already (a layer mount an earlier agent left, taken over at start), without its
  // descriptor: the index is the one on disk. NOT_FOUND when the cache has no such layer.
  LayerUse hold(std::string_view hex);
  // Where chunks come from for layers no acquire() has named stores for yet (layers found on disk at start that a
  // sandbox of an earlier agent still reads).
  void set_default_stores(Stores stores);

  // The entry of a layer by its digest's hex, or null when the cache has none.
  std::shared_ptr<CacheEntry> find(std::string_view hex) const;
  std::vector<std::shared_ptr<CacheEntry>> entries() const;

  // Copies layer bytes [offset, offset + length) into `out`, fetching the chunks that are missing; returns the bytes
  // copied (fewer at the end of the layer). Errors as for acquire, naming the layer and chunk.
  std::size_t read(CacheEntry& entry, std::uint64_t offset, std::size_t length, char* out);
  // Makes chunk i present: fetched and checked, or waited for when another thread is fetching it.
  void ensure_chunk(CacheEntry& entry, std::size_t i);
  // Makes the chunks present, a few at a time; the first error is thrown once all have been tried or skipped.
  void ensure_chunks(CacheEntry& entry, const std::vector<std::size_t>& chunks);
  // Makes every chunk present (the extract fallback needs the whole layer).
  void ensure_all(CacheEntry& entry);
  // Frees the layer file's chunks (after its tree was extracted) and records the tree's bytes.
  void drop_chunks(CacheEntry& entry, std::uint64_t tree_bytes);

  // Evicts layers no one uses, least recently used first, until the cache is within its limit; returns how many.
  std::size_t enforce_limit();
  // Bytes the cache holds (fetched chunks, indexes, extracted trees).
  std::uint64_t total_bytes() const;
  // Every layer in the cache, with its cached bytes (users are left 0: layer_mounts knows the sandboxes).
  std::vector<CachedLayer> layers() const;
  const BlobCacheOptions& options() const noexcept { return options_; }

  // How often chunk i of a layer was fetched from a store in this run (tests: a chunk wanted by many readers at once
  // is fetched once).
  std::uint32_t fetch_count(const CacheEntry& entry, std::size_t i) const;

 private:
  friend class LayerUse;
  void release(CacheEntry& entry);
  std::shared_ptr<CacheEntry> load_entry(const std::string& hex) const;
  void open_new_entry(CacheEntry& entry, const image::LayerDescriptor& layer, const Stores& stores);
  void fetch_chunk(CacheEntry& entry, std::size_t i, const Stores& stores);
  bool check_local_chunk(CacheEntry& entry, std::size_t i);
  void write_chunk(CacheEntry& entry, std::size_t i, std::string_view bytes);
  // Evicts every unused layer but `keep` (disk full); returns how many.
  std::size_t evict_all_unused(const CacheEntry* keep);
  // Caller holds mutex_: takes `victim` out of the table and moves its directory aside for removal.
  std::filesystem::path take_out(const std::shared_ptr<CacheEntry>& victim);
  void remove_dirs(const std::vector<std::filesystem::path>& dirs);

  BlobCacheOptions options_;
  LayerMetrics& metrics_;
  mutable std::mutex mutex_;
  std::map<std::string, std::shared_ptr<CacheEntry>, std::less<>> entries_;  // by hex
  std::map<std::string, std::shared_ptr<std::mutex>, std::less<>> opening_;  // one opener per layer at a time
  Stores default_stores_;
  std::uint64_t trash_seq_ = 0;
};

}  // namespace dsec::agent::layers
