#include "agent/images/layers/blob_cache.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/syscall.hpp"
#include "image/fs_tree.hpp"
#include "image/store/digest.hpp"

namespace dsec::agent::layers {
namespace fs = std::filesystem;

namespace {

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

bool is_hex64(std::string_view s) {
  return s.size() == 64 &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool disk_full(int err) { return err == ENOSPC || err == EDQUOT; }

// pwrite of all of `bytes`; returns 0 or the errno of the failure.
int pwrite_all(int fd, std::string_view bytes, std::uint64_t offset) {
  while (!bytes.empty()) {
    ssize_t n = ::pwrite(fd, bytes.data(), bytes.size(), static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    bytes.remove_prefix(static_cast<std::size_t>(n));
    offset += static_cast<std::uint64_t>(n);
  }
  return 0;
}

// pread of exactly `size` bytes; returns 0, the errno of the failure, or -1 when the file ended first.
int pread_all(int fd, char* out, std::size_t size, std::uint64_t offset) {
  while (size > 0) {
    ssize_t n = ::pread(fd, out, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return -1;
    out += n;
    size -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
  return 0;
}

std::string read_small_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(Code::kNotFound, fmt::format("{} is missing", path.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The chunk index of `layer`, from the first store that has it (read_blob checks its digest).
std::string read_chunk_index(const image::LayerDescriptor& layer, const Stores& stores) {
  std::optional<Error> failure;
  for (const auto& store : stores) {
    try {
      return store->read_blob(layer.index, 64u << 20);
    } catch (const Error& e) {
      if (e.code() != Code::kNotFound || !failure)
        failure = Error(e.code(), fmt::format("layer {}: chunk index {}: {}", layer.digest, layer.index, e.what()));
    }
  }
  if (stores.empty()) throw Error(Code::kFailedPrecondition, "layer cache: no image store is configured");
  throw *failure;
}

}  // namespace

LayerUse& LayerUse::operator=(LayerUse&& o) noexcept {
  if (this != &o) {
    reset();
    cache_ = std::exchange(o.cache_, nullptr);
    entry_ = std::move(o.entry_);
  }
  return *this;
}

void LayerUse::reset() {
  if (cache_ && entry_) cache_->release(*entry_);
  cache_ = nullptr;
  entry_.reset();
}

BlobCache::BlobCache(BlobCacheOptions options, LayerMetrics& metrics)
    : options_(std::move(options)), metrics_(metrics) {
  if (options_.dir.empty()) throw Error(Code::kInvalidArgument, "layer cache: no directory given");
  std::error_code ec;
  fs::create_directories(options_.dir, ec);
  if (ec)
    throw Error(code_for_errno(ec.value()), fmt::format("layer cache {}: {}", options_.dir.string(), ec.message()));
  std::vector<fs::path> leftovers;
  for (const auto& item : fs::directory_iterator(options_.dir, ec)) {
    std::string name = item.path().filename().string();
    if (name.starts_with(".trash-") || name.starts_with(".new-")) {
      leftovers.push_back(item.path());
      continue;
    }
    if (!is_hex64(name) || !item.is_directory()) continue;
    try {
      auto entry = load_entry(name);
      entries_.emplace(name, std::move(entry));
    } catch (const std::exception& e) {
      log_warn("layer cache: removing the unusable entry {}: {}", item.path().string(), e.what());
      leftovers.push_back(item.path());
    }
  }
  if (ec)
    throw Error(code_for_errno(ec.value()), fmt::format("layer cache {}: {}", options_.dir.string(), ec.message()));
  remove_dirs(leftovers);
}

BlobCache::~BlobCache() = default;

std::shared_ptr<CacheEntry> BlobCache::load_entry(const std::string& hex) const {
  auto entry = std::make_shared<CacheEntry>();
  entry->hex_ = hex;
  entry->digest_ = "sha256:" + hex;
  entry->dir_ = options_.dir / hex;
  std::string text = read_small_file(entry->dir_ / "index.json");
  entry->index_ = image::chunk_index_from_json(text);
  entry->index_digest_ = image::sha256_digest(text);
  entry->index_bytes_ = text.size();
  if (entry->index_.layer != entry->digest_)
    throw Error(Code::kDataLoss, fmt::format("its index is of layer {}", entry->index_.layer));
  const std::size_t chunks = entry->index_.chunk_count();

  entry->layer_fd_.reset(::open(entry->layer_file().c_str(), O_RDWR | O_CLOEXEC));
  if (!entry->layer_fd_) throw_errno_fmt(errno, "open {}", entry->layer_file().string());
  struct stat st {};
  if (::fstat(entry->layer_fd_.get(), &st) != 0) throw_errno_fmt(errno, "stat {}", entry->layer_file().string());
  if (static_cast<std::uint64_t>(st.st_size) != entry->index_.size)
    throw Error(Code::kDataLoss,
                fmt::format("layer file has {} bytes, the index says {}", st.st_size, entry->index_.size));
  fs::path present_path = entry->dir_ / "present";
  entry->present_fd_.reset(::open(present_path.c_str(), O_RDWR | O_CLOEXEC));
  if (!entry->present_fd_) throw_errno_fmt(errno, "open {}", present_path.string());
  std::string present(chunks, '\0');
  int err = pread_all(entry->present_fd_.get(), present.data(), present.size(), 0);
  if (err != 0) throw Error(Code::kDataLoss, fmt::format("{} is shorter than the chunk count", present_path.string()));
  if (::fstat(entry->present_fd_.get(), &st) == 0) entry->last_used_ = static_cast<double>(st.st_mtime);

  entry->state_.assign(chunks, CacheEntry::ChunkState::kAbsent);
  entry->attempts_.assign(chunks, 0);
  entry->fetched_.assign(chunks, 0);
  std::uint64_t bytes = 0;
  for (std::size_t i = 0; i < chunks; ++i)
    if (present[i] == 1) {
      entry->state_[i] = CacheEntry::ChunkState::kUnchecked;
      bytes += entry->index_.chunk_length(i);
    }
  entry->present_bytes_ = bytes;
  std::error_code ec;
  if (fs::is_directory(entry->tree_dir(), ec)) entry->extra_bytes_ = image::tree_size(entry->tree_dir());
  return entry;
}

LayerUse BlobCache::acquire(const image::LayerDescriptor& layer, const Stores& stores, bool prefetch) {
  const std::string hex = image::digest_hex(layer.digest, "layer digest");
  image::digest_hex(layer.index, "layer index digest");
  image::digest_hex(layer.data, "layer data digest");

  std::shared_ptr<std::mutex> opener;
  {
    std::lock_guard lock(mutex_);
    auto& m = opening_[hex];
    if (!m) m = std::make_shared<std::mutex>();
    opener = m;
  }
  LayerUse use;
  {
    std::lock_guard open_lock(*opener);
    std::shared_ptr<CacheEntry> entry;
    std::vector<fs::path> stale;
    {
      std::lock_guard lock(mutex_);
      if (auto it = entries_.find(hex); it != entries_.end()) {
        entry = it->second;
        if (entry->index_digest_ != layer.index) {
          // The same layer cut into chunks differently (rebuilt with another chunk size): start over, unless it is
          // in use, where the cached index serves as well (chunk digests are of the layer's own bytes).
          if (entry->users_ == 0) {
            stale.push_back(take_out(entry));
            entry.reset();
          } else {
            log_warn("layer {}: in use with chunk index {}, not {}", layer.digest, entry->index_digest_, layer.index);
          }
        }
      }
      if (entry) {
        ++entry->users_;
        entry->last_used_ = unix_now();
        use = LayerUse(this, entry);
      }
    }
    remove_dirs(stale);
    if (!entry) {
      entry = std::make_shared<CacheEntry>();
      entry->hex_ = hex;
      entry->digest_ = layer.digest;
      entry->dir_ = options_.dir / hex;
      open_new_entry(*entry, layer, stores);
      std::lock_guard lock(mutex_);
      entry->users_ = 1;
      entry->last_used_ = unix_now();
      entries_.insert_or_assign(hex, entry);
      use = LayerUse(this, entry);
    }
  }
  {
    std::lock_guard lock(mutex_);
    if (auto it = opening_.find(hex); it != opening_.end() && it->second.use_count() == 2) opening_.erase(it);
  }
  opener.reset();

  CacheEntry& entry = use.entry();
  const image::ChunkIndex& index = entry.index();
  if (index.layer != layer.digest || index.size != layer.size || index.data != layer.data)
    throw Error(Code::kInvalidArgument,
                fmt::format("layer {}: the manifest and the chunk index {} disagree (index: layer {}, {} bytes, data "
                            "{}; manifest: {} bytes, data {})",
                            layer.digest, layer.index, index.layer, index.size, index.data, layer.size, layer.data));
  {
    std::lock_guard lock(entry.mutex_);
    entry.stores_ = stores;
  }
  // The superblock is in the first chunk; the index names the chunks holding the rest of the metadata.
  if (prefetch) {
    std::set<std::size_t> wanted{0};
    for (auto i : index.prefetch) wanted.insert(i);
    ensure_chunks(entry, {wanted.begin(), wanted.end()});
  }
  enforce_limit();
  return use;
}

void BlobCache::open_new_entry(CacheEntry& entry, const image::LayerDescriptor& layer, const Stores& stores) {
  const std::string text = read_chunk_index(layer, stores);
  image::ChunkIndex index;
  try {
    index = image::chunk_index_from_json(text);
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("layer {}: {}", layer.digest, e.what()));
  }
  if (index.layer != layer.digest || index.size != layer.size || index.data != layer.data)
    throw Error(Code::kInvalidArgument,
                fmt::format("layer {}: the manifest and its chunk index {} disagree (index: layer {}, {} bytes, data "
                            "{}; manifest: {} bytes, data {})",
                            layer.digest, layer.index, index.layer, index.size, index.data, layer.size, layer.data));
  if (index.size == 0 || index.chunk_count() == 0)
    throw Error(Code::kInvalidArgument, fmt::format("layer {}: empty", layer.digest));

  const std::size_t chunks = index.chunk_count();
  // Built under a temporary name and renamed into place whole: an entry directory always has its index.
  fs::path building;
  {
    std::lock_guard lock(mutex_);
    building = options_.dir / fmt::format(".new-{}-{}", entry.hex_, ++trash_seq_);
  }
  auto attempt = [&] {
    image::remove_tree(building);
    if (::mkdir(building.c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}", building.string());
    UniqueFd layer_fd(::open((building / "layer").c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!layer_fd) throw_errno_fmt(errno, "create {}", (building / "layer").string());
    if (::ftruncate(layer_fd.get(), static_cast<off_t>(index.size)) != 0)
      throw_errno_fmt(errno, "size {} to {} bytes", (building / "layer").string(), index.size);
    UniqueFd present_fd(::open((building / "present").c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!present_fd) throw_errno_fmt(errno, "create {}", (building / "present").string());
    if (int err = pwrite_all(present_fd.get(), std::string(chunks, '\0'), 0))
      throw_errno_fmt(err, "write {}", (building / "present").string());
    {
      UniqueFd index_fd(::open((building / "index.json").c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
      if (!index_fd) throw_errno_fmt(errno, "create {}", (building / "index.json").string());
      if (int err = pwrite_all(index_fd.get(), text, 0))
        throw_errno_fmt(err, "write {}", (building / "index.json").string());
    }
    image::remove_tree(entry.dir_);
    if (::rename(building.c_str(), entry.dir_.c_str()) != 0)
      throw_errno_fmt(errno, "rename {} to {}", building.string(), entry.dir_.string());
    entry.layer_fd_ = std::move(layer_fd);
    entry.present_fd_ = std::move(present_fd);
  };
  try {
    try {
      attempt();
    } catch (const Error& e) {
      if (e.code() != Code::kResourceExhausted) throw;
      // The disk is full: make room from the layers no sandbox uses, and try once more.
      evict_all_unused(nullptr);
      attempt();
    }
  } catch (const Error& e) {
    try {
      image::remove_tree(building);
    } catch (...) {
    }
    if (e.code() == Code::kResourceExhausted)
      throw Error(Code::kResourceExhausted, fmt::format("layer cache {} is full: cannot add layer {} ({} bytes): {}",
                                                        options_.dir.string(), layer.digest, layer.size, e.what()));
    throw;
  }
  entry.index_ = std::move(index);
  entry.index_digest_ = layer.index;
  entry.index_bytes_ = text.size();
  entry.state_.assign(chunks, CacheEntry::ChunkState::kAbsent);
  entry.attempts_.assign(chunks, 0);
  entry.fetched_.assign(chunks, 0);
}

LayerUse BlobCache::hold(std::string_view hex) {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(hex);
  if (it == entries_.end())
    throw Error(Code::kNotFound, fmt::format("layer sha256:{} is not in the cache {}", hex, options_.dir.string()));
  ++it->second->users_;
  it->second->last_used_ = unix_now();
  return LayerUse(this, it->second);
}

void BlobCache::set_default_stores(Stores stores) {
  std::lock_guard lock(mutex_);
  default_stores_ = std::move(stores);
}

std::shared_ptr<CacheEntry> BlobCache::find(std::string_view hex) const {
  std::lock_guard lock(mutex_);
  auto it = entries_.find(hex);
  return it == entries_.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<CacheEntry>> BlobCache::entries() const {
  std::lock_guard lock(mutex_);
  std::vector<std::shared_ptr<CacheEntry>> out;
  for (const auto& [hex, entry] : entries_) out.push_back(entry);
  return out;
}

std::size_t BlobCache::read(CacheEntry& entry, std::uint64_t offset, std::size_t length, char* out) {
  const std::uint64_t size = entry.size();
  if (offset >= size || length == 0) return 0;
  length = static_cast<std::size_t>(std::min<std::uint64_t>(length, size - offset));
  const image::ChunkIndex& index = entry.index();
  const std::size_t first = index.chunk_of(offset), last = index.chunk_of(offset + length - 1);
  for (std::size_t i = first; i <= last; ++i) ensure_chunk(entry, i);
  int err = pread_all(entry.layer_fd_.get(), out, length, offset);
  if (err > 0) throw_errno_fmt(err, "read layer {} at {}", entry.digest(), offset);
  if (err < 0) throw Error(Code::kDataLoss, fmt::format("layer {}: cache file shorter than the layer", entry.digest()));
  return length;
}

void BlobCache::ensure_chunk(CacheEntry& entry, std::size_t i) {
  using State = CacheEntry::ChunkState;
  std::unique_lock lock(entry.mutex_);
  if (i >= entry.state_.size()) throw Error(Code::kOutOfRange, fmt::format("layer {}: no chunk {}", entry.digest(), i));
  for (;;) {
    State state = entry.state_[i];
    if (state == State::kPresent) {
      metrics_.cache_hits.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    if (state == State::kFetching) {
      // Another reader is fetching it: wait for that fetch, and share its outcome (a failure too, so that many
      // readers of a chunk a store cannot give are answered after one attempt, not one after another).
      const std::uint32_t seen = entry.attempts_[i];
      entry.changed_.wait(lock, [&] { return entry.state_[i] != State::kFetching; });
      if (entry.state_[i] == State::kPresent) return;
      if (entry.attempts_[i] != seen)
        if (auto it = entry.errors_.find(i); it != entry.errors_.end()) throw it->second;
      continue;
    }
    const bool unchecked = state == State::kUnchecked;
    entry.state_[i] = State::kFetching;
    Stores stores = entry.stores_;
    lock.unlock();
    if (stores.empty()) {
      std::lock_guard cache_lock(mutex_);
      stores = default_stores_;
    }
    std::optional<Error> failure;
    bool fetched = false;
    try {
      if (!(unchecked && check_local_chunk(entry, i))) {
        fetch_chunk(entry, i, stores);
        fetched = true;
      }
    } catch (const Error& e) {
      failure = e;
    } catch (const std::exception& e) {
      failure = Error(Code::kInternal, fmt::format("layer {} chunk {}: {}", entry.digest(), i, e.what()));
    }
    lock.lock();
    ++entry.attempts_[i];
    if (failure) {
      entry.state_[i] = State::kAbsent;
      entry.errors_.insert_or_assign(i, *failure);
      entry.changed_.notify_all();
      throw *failure;
    }
    entry.state_[i] = State::kPresent;
    entry.errors_.erase(i);
    if (fetched && ++entry.fetched_[i] > 1) metrics_.chunk_refetches.fetch_add(1, std::memory_order_relaxed);
    entry.changed_.notify_all();
    return;
  }
}

bool BlobCache::check_local_chunk(CacheEntry& entry, std::size_t i) {
  const image::ChunkIndex& index = entry.index();
  const std::uint32_t length = index.chunk_length(i);
  std::string bytes(length, '\0');
  const std::uint64_t offset = static_cast<std::uint64_t>(i) * index.chunk_size;
  bool good = pread_all(entry.layer_fd_.get(), bytes.data(), length, offset) == 0 &&
              std::string_view(image::sha256_digest(bytes)).substr(7) == index.chunks[i].sha256_hex;
  if (good) return true;
  log_warn("layer cache: chunk {} of layer {} was damaged on disk; fetching it again", i, entry.digest());
  // Not present any more until fetched again.
  static const char kZero = 0;
  (void)pwrite_all(entry.present_fd_.get(), std::string_view(&kZero, 1), i);
  entry.present_bytes_.fetch_sub(length, std::memory_order_relaxed);
  return false;
}

void BlobCache::fetch_chunk(CacheEntry& entry, std::size_t i, const Stores& stores) {
  const image::ChunkIndex& index = entry.index();
  const image::ChunkEntry& chunk = index.chunks[i];
  std::optional<Error> failure;
  std::string stored, plain;
  bool got = false;
  for (const auto& store : stores) {
    try {
      stored = store->read_range(index.data, chunk.offset, chunk.length);
      metrics_.fetched_bytes.fetch_add(stored.size(), std::memory_order_relaxed);
      image::decode_chunk(index, i, stored, plain);
      got = true;
      break;
    } catch (const Error& e) {
      // A store without the blob, or with a damaged copy: another store may do better.
      if (!failure || failure->code() == Code::kNotFound) {
        std::string what = e.what();
        failure = Error(e.code(), what.find(entry.digest()) != std::string::npos
                                      ? fmt::format("{} (from store {})", what, store->url())
                                      : fmt::format("layer {} chunk {} of {} from store {}: {}", entry.digest(), i,
                                                    index.chunk_count(), store->url(), what));
      }
    }
  }
  if (!got) {
    metrics_.chunk_errors.fetch_add(1, std::memory_order_relaxed);
    if (!failure)
      failure = Error(Code::kFailedPrecondition,
                      fmt::format("layer {} chunk {}: no image store is known for it", entry.digest(), i));
    throw *failure;
  }
  metrics_.chunk_fetches.fetch_add(1, std::memory_order_relaxed);
  try {
    write_chunk(entry, i, plain);
  } catch (...) {
    metrics_.chunk_errors.fetch_add(1, std::memory_order_relaxed);
    throw;
  }
}

void BlobCache::write_chunk(CacheEntry& entry, std::size_t i, std::string_view bytes) {
  const std::uint64_t offset = static_cast<std::uint64_t>(i) * entry.index().chunk_size;
  int err = pwrite_all(entry.layer_fd_.get(), bytes, offset);
  if (disk_full(err)) {
    std::size_t evicted = evict_all_unused(&entry);
    log_warn("layer cache {}: disk full writing chunk {} of layer {}; evicted {} unused layers and trying again",
             options_.dir.string(), i, entry.digest(), evicted);
    err = pwrite_all(entry.layer_fd_.get(), bytes, offset);
  }
  if (err != 0) {
    if (disk_full(err))
      throw Error(Code::kResourceExhausted,
                  fmt::format("layer cache {} is full: cannot store chunk {} of layer {} ({} bytes): {}",
                              options_.dir.string(), i, entry.digest(), bytes.size(), std::strerror(err)));
    throw_errno_fmt(err, "write chunk {} of layer {} to {}", i, entry.digest(), entry.layer_file().string());
  }
  // The chunk's bytes are written before its mark, so a mark never names bytes that are not there.
  static const char kOne = 1;
  err = pwrite_all(entry.present_fd_.get(), std::string_view(&kOne, 1), i);
  if (err != 0) throw_errno_fmt(err, "mark chunk {} present in {}", i, entry.dir().string());
  entry.present_bytes_.fetch_add(bytes.size(), std::memory_order_relaxed);
}

void BlobCache::ensure_chunks(CacheEntry& entry, const std::vector<std::size_t>& chunks) {
  // A few fetches at a time: a store far away answers many small requests faster side by side than in a row.
  constexpr std::size_t kParallel = 4;
  if (chunks.size() <= 1) {
    for (std::size_t i : chunks) ensure_chunk(entry, i);
    return;
  }
  std::atomic<std::size_t> next{0};
  std::mutex failure_mutex;
  std::optional<Error> failure;
  auto work = [&] {
    for (std::size_t k; (k = next.fetch_add(1)) < chunks.size();) {
      {
        std::lock_guard lock(failure_mutex);
        if (failure) return;
      }
      try {
        ensure_chunk(entry, chunks[k]);
      } catch (const Error& e) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = e;
      } catch (const std::exception& e) {
        std::lock_guard lock(failure_mutex);
        if (!failure) failure = Error(Code::kInternal, e.what());
      }
    }
  };
  std::vector<std::thread> helpers;
  for (std::size_t t = 1; t < std::min(kParallel, chunks.size()); ++t) helpers.emplace_back(work);
  work();
  for (auto& h : helpers) h.join();
  if (failure) throw *failure;
}

void BlobCache::ensure_all(CacheEntry& entry) {
  std::vector<std::size_t> all(entry.index().chunk_count());
  for (std::size_t i = 0; i < all.size(); ++i) all[i] = i;
  ensure_chunks(entry, all);
}

void BlobCache::drop_chunks(CacheEntry& entry, std::uint64_t tree_bytes) {
  std::lock_guard lock(entry.mutex_);
  const std::size_t chunks = entry.index().chunk_count();
  if (::ftruncate(entry.layer_fd_.get(), 0) != 0 ||
      ::ftruncate(entry.layer_fd_.get(), static_cast<off_t>(entry.index().size)) != 0)
    throw_errno_fmt(errno, "free {}", entry.layer_file().string());
  if (int err = pwrite_all(entry.present_fd_.get(), std::string(chunks, '\0'), 0))
    throw_errno_fmt(err, "write {}/present", entry.dir().string());
  entry.state_.assign(chunks, CacheEntry::ChunkState::kAbsent);
  entry.fetched_.assign(chunks, 0);  // dropped on purpose: fetching them again is no refetch
  entry.present_bytes_ = 0;
  entry.extra_bytes_ = tree_bytes;
}

void BlobCache::release(CacheEntry& entry) {
  std::lock_guard lock(mutex_);
  if (entry.users_ > 0) --entry.users_;
  entry.last_used_ = unix_now();
  // The mark file's time is the layer's last use for the next run of the agent.
  if (entry.present_fd_) ::futimens(entry.present_fd_.get(), nullptr);
}

fs::path BlobCache::take_out(const std::shared_ptr<CacheEntry>& victim) {
  entries_.erase(victim->hex_);
  victim->evicted_ = true;
  fs::path aside = options_.dir / fmt::format(".trash-{}-{}", victim->hex_, ++trash_seq_);
  if (::rename(victim->dir_.c_str(), aside.c_str()) != 0) return victim->dir_;
  return aside;
}

void BlobCache::remove_dirs(const std::vector<fs::path>& dirs) {
  for (const auto& dir : dirs) {
    try {
      image::remove_tree(dir);
    } catch (const std::exception& e) {
      log_warn("layer cache: removing {}: {}", dir.string(), e.what());
    }
  }
}

std::size_t BlobCache::enforce_limit() {
  std::vector<fs::path> dirs;
  {
    std::lock_guard lock(mutex_);
    std::uint64_t total = 0;
    for (const auto& [hex, e] : entries_) total += e->present_bytes() + e->extra_bytes() + e->index_bytes_;
    while (total > options_.max_bytes) {
      std::shared_ptr<CacheEntry> victim;
      for (const auto& [hex, e] : entries_)
        if (e->users_ == 0 && (!victim || e->last_used_ < victim->last_used_)) victim = e;
      if (!victim) break;
      total -= victim->present_bytes() + victim->extra_bytes() + victim->index_bytes_;
      dirs.push_back(take_out(victim));
      metrics_.evictions.fetch_add(1, std::memory_order_relaxed);
    }
  }
  remove_dirs(dirs);
  return dirs.size();
}

std::size_t BlobCache::evict_all_unused(const CacheEntry* keep) {
  std::vector<fs::path> dirs;
  {
    std::lock_guard lock(mutex_);
    std::vector<std::shared_ptr<CacheEntry>> victims;
    for (const auto& [hex, e] : entries_)
      if (e->users_ == 0 && e.get() != keep) victims.push_back(e);
    for (const auto& v : victims) {
      dirs.push_back(take_out(v));
      metrics_.evictions.fetch_add(1, std::memory_order_relaxed);
    }
  }
  remove_dirs(dirs);
  return dirs.size();
}

std::uint64_t BlobCache::total_bytes() const {
  std::lock_guard lock(mutex_);
  std::uint64_t total = 0;
  for (const auto& [hex, e] : entries_) total += e->present_bytes() + e->extra_bytes() + e->index_bytes_;
  return total;
}

std::vector<CachedLayer> BlobCache::layers() const {
  std::lock_guard lock(mutex_);
  std::vector<CachedLayer> out;
  for (const auto& [hex, e] : entries_)
    out.push_back(CachedLayer{e->digest_, e->size(), e->present_bytes() + e->extra_bytes(), 0, {}});
  return out;
}

std::uint32_t BlobCache::fetch_count(const CacheEntry& entry, std::size_t i) const {
  std::lock_guard lock(entry.mutex_);
  return i < entry.fetched_.size() ? entry.fetched_[i] : 0;
}

}  // namespace dsec::agent::layers
