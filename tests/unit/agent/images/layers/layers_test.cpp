// The node's layer cache, lazy layer file system, layer mounts and image source, on real layers: trees made into
// EROFS images by the image builder (mkfs.erofs), cut into chunks and stored in a directory store. Stores that are
// slow, damaged or gone are the real directory store behind a wrapper. Mount tests need root, /dev/fuse and EROFS
// and skip themselves with the reason otherwise.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "agent/images/image_source.hpp"
#include "agent/images/layers/blob_cache.hpp"
#include "agent/images/layers/layer_keeper.hpp"
#include "agent/images/layers/layer_mounts.hpp"
#include "agent/images/layers/lazy_layer_fs.hpp"
#include "agent/metrics.hpp"
#include "dsec/error.hpp"
#include "error_test_util.hpp"
#include "image/build.hpp"
#include "image/fs_tree.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/digest.hpp"
#include "image/store/manifest.hpp"

namespace dsec::agent::layers {
namespace {
namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base && *base ? base : "/tmp") + "/dsec-layers-test-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = fs::canonical(templ);
  }
  ~TempDir() {
    try {
      image::remove_tree(path_);
    } catch (...) {
    }
  }
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& rel) const { return path_ / rel; }

 private:
  fs::path path_;
};

void write_file(const fs::path& p, const std::string& bytes, mode_t mode = 0644) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
  ::chmod(p.c_str(), mode);
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string random_bytes(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string out(n, '\0');
  for (auto& c : out) c = static_cast<char>(rng());
  return out;
}

bool is_mounted(const fs::path& point) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string a, b, c, d, mount_point;
    fields >> a >> b >> c >> d >> mount_point;
    if (mount_point == point.string()) return true;
  }
  return false;
}

bool mounted_below(const fs::path& dir) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string a, b, c, d, mount_point;
    fields >> a >> b >> c >> d >> mount_point;
    if (mount_point.rfind(dir.string(), 0) == 0) return true;
  }
  return false;
}

// Why layers cannot be mounted lazily here, or "".
std::string lazy_skip_reason() {
  if (::geteuid() != 0) return "needs root (FUSE and EROFS mounts)";
  if (::access("/dev/fuse", F_OK) != 0) return "no /dev/fuse";
  std::ifstream in("/proc/filesystems");
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (all.find("erofs") == std::string::npos) return "the kernel has no EROFS";
  return "";
}

// A directory store behind knobs: reads can be slowed down, counted per chunk, damaged, or fail as if the store
// were gone.
class TestStore final : public image::BlobStore {
 public:
  explicit TestStore(const fs::path& root) : inner_(image::open_directory_store(root)), url_(root.string()) {}

  std::atomic<int> delay_ms{0};
  std::atomic<bool> gone{false};
  std::atomic<std::int64_t> damage_offset{-1};  // a range read starting here gets one byte flipped
  std::atomic<bool> damage_all{false};          // every range read gets one byte flipped
  std::string hold_file;  // while this file exists, range reads wait (and say so by creating "<hold_file>.seen")

  int range_reads(std::uint64_t offset) {
    std::lock_guard lock(mutex_);
    return reads_[offset];
  }
  void reset_counts() {
    std::lock_guard lock(mutex_);
    reads_.clear();
  }
  int total_range_reads() {
    std::lock_guard lock(mutex_);
    int n = 0;
    for (auto& [o, c] : reads_) n += c;
    return n;
  }

  const std::string& url() const override { return url_; }
  bool has_blob(const std::string& digest) override { return inner_->has_blob(digest); }
  std::string read_blob(const std::string& digest, std::uint64_t max_size) override {
    check();
    return inner_->read_blob(digest, max_size);
  }
  std::string read_range(const std::string& digest, std::uint64_t offset, std::uint64_t length) override {
    {
      std::lock_guard lock(mutex_);
      ++reads_[offset];
    }
    if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms.load()));
    if (!hold_file.empty() && ::access(hold_file.c_str(), F_OK) == 0) {
      write_file(hold_file + ".seen", "");
      while (::access(hold_file.c_str(), F_OK) == 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    check();
    std::string bytes = inner_->read_range(digest, offset, length);
    if ((damage_all || damage_offset.load() == static_cast<std::int64_t>(offset)) && !bytes.empty())
      bytes[bytes.size() / 2] ^= 0x5a;
    return bytes;
  }
  void put_blob_file(const std::string& d, const fs::path& f) override { inner_->put_blob_file(d, f); }
  void put_blob(const std::string& d, std::string_view b) override { inner_->put_blob(d, b); }
  void remove_blob(const std::string& d) override { inner_->remove_blob(d); }
  std::vector<image::BlobInfo> list_blobs() override { return inner_->list_blobs(); }
  std::optional<std::string> read_ref(const std::string& t) override { return inner_->read_ref(t); }
  void write_ref(const std::string& t, const std::string& d) override { inner_->write_ref(t, d); }
  bool remove_ref(const std::string& t) override { return inner_->remove_ref(t); }
  std::vector<std::string> list_refs() override { return inner_->list_refs(); }

 private:
  void check() {
    if (gone) throw Error(Code::kUnavailable, fmt::format("store {} cannot be reached (test)", url_));
  }
  std::unique_ptr<image::BlobStore> inner_;
  std::string url_;
  std::mutex mutex_;
  std::map<std::uint64_t, int> reads_;
};

// A layer built from a tree: its descriptor, the tree, and its bytes as the store holds them.
struct TestLayer {
  image::LayerDescriptor descriptor;
  image::ChunkIndex index;
  std::string manifest_digest;
  std::string manifest_json;
  fs::path tree;
  std::string bytes;  // the whole layer, decoded chunk by chunk straight from the store
};

class LayersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    store_ = std::make_shared<TestStore>(tmp_ / "store");
    stores_ = {store_};
  }

  // An image "t/<name>:1" of one layer made from files (path -> bytes); chunks of `chunk_size`.
  TestLayer make_layer(const std::string& name, const std::map<std::string, std::string>& files,
                       std::uint32_t chunk_size = 16384) {
    TestLayer layer;
    layer.tree = tmp_ / ("tree-" + name);
    for (const auto& [path, bytes] : files) write_file(layer.tree / path, bytes);
    image::BuildOptions options;
    options.reference = "t/" + name + ":1";
    options.source = image::LayerSource::parse(layer.tree.string());
    options.work_dir = tmp_ / ("work-" + name);
    fs::create_directories(options.work_dir);
    options.chunk_size = chunk_size;
    image::BuildResult built = image::build_image(*store_, options);
    layer.descriptor = built.layer;
    layer.manifest_digest = built.image.digest;
    layer.manifest_json = built.image.json;
    layer.index = image::chunk_index_from_json(store_->read_blob(layer.descriptor.index, 64u << 20));
    std::string out;
    for (std::size_t i = 0; i < layer.index.chunk_count(); ++i) {
      const auto& c = layer.index.chunks[i];
      image::decode_chunk(layer.index, i, store_->read_range(layer.index.data, c.offset, c.length), out);
      layer.bytes += out;
    }
    store_->reset_counts();
    return layer;
  }

  std::map<std::string, std::string> sample_files(std::uint64_t seed = 1) {
    return {{"etc/hostname", "layers-test\n"},
            {"big.bin", random_bytes(300 * 1024, seed)},
            {"dir/nested/note.txt", "nested note " + std::to_string(seed) + "\n"},
            {"zeros.bin", std::string(100 * 1024, '\0')}};
  }

  BlobCache make_cache(std::uint64_t max_bytes = 1ull << 30) {
    return BlobCache(BlobCacheOptions{tmp_ / "cache", max_bytes}, metrics_);
  }

  // Chunks fetched so far (metric).
  std::uint64_t fetches() const { return metrics_.chunk_fetches.load(); }

  TempDir tmp_;
  LayerMetrics metrics_;
  std::shared_ptr<TestStore> store_;
  Stores stores_;
};

TEST_F(LayersTest, AcquirePrefetchesMetadataAndReadsFetchTheRestOnce) {
  TestLayer layer = make_layer("a", sample_files());
  ASSERT_GT(layer.index.chunk_count(), 10u);
  ASSERT_GT(layer.index.meta_size, 0u);
  BlobCache cache = make_cache();
  LayerUse use = cache.acquire(layer.descriptor, stores_);
  CacheEntry& entry = use.entry();
  std::set<std::size_t> prefetched{0};
  for (auto i : layer.index.prefetch) prefetched.insert(i);
  EXPECT_EQ(fetches(), prefetched.size());
  for (std::size_t i = 0; i < layer.index.chunk_count(); ++i)
    EXPECT_EQ(cache.fetch_count(entry, i), prefetched.count(i) ? 1u : 0u) << "chunk " << i;
  EXPECT_LT(entry.present_bytes(), layer.bytes.size());

  // Odd-sized reads that straddle chunk boundaries give back the layer's bytes exactly.
  std::string got;
  std::vector<char> buf(10007);
  for (std::uint64_t off = 0; off < layer.bytes.size();) {
    std::size_t n = cache.read(entry, off, buf.size(), buf.data());
    ASSERT_GT(n, 0u);
    got.append(buf.data(), n);
    off += n;
  }
  EXPECT_EQ(got, layer.bytes);
  EXPECT_EQ(cache.read(entry, layer.bytes.size(), 100, buf.data()), 0u);
  for (std::size_t i = 0; i < layer.index.chunk_count(); ++i) EXPECT_EQ(cache.fetch_count(entry, i), 1u);
  EXPECT_EQ(fetches(), layer.index.chunk_count());
  EXPECT_EQ(metrics_.chunk_refetches.load(), 0u);
  EXPECT_EQ(entry.present_bytes(), layer.bytes.size());
  auto listed = cache.layers();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].digest, layer.descriptor.digest);
  EXPECT_EQ(listed[0].cached_bytes, layer.bytes.size());
}

TEST_F(LayersTest, ManyReadersOfOneColdChunkShareOneFetch) {
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();
  LayerUse use = cache.acquire(layer.descriptor, stores_);
  const std::size_t chunk = layer.index.chunk_count() - 2;  // file data, not prefetched
  ASSERT_EQ(cache.fetch_count(use.entry(), chunk), 0u);
  store_->delay_ms = 200;
  const std::uint64_t offset = chunk * layer.index.chunk_size + 100;
  std::vector<std::thread> readers;
  std::atomic<int> right{0};
  for (int t = 0; t < 32; ++t)
    readers.emplace_back([&] {
      std::string buf(5000, '\0');
      std::size_t n = cache.read(use.entry(), offset, buf.size(), buf.data());
      if (buf.substr(0, n) == layer.bytes.substr(offset, 5000)) ++right;
    });
  for (auto& t : readers) t.join();
  EXPECT_EQ(right.load(), 32);
  EXPECT_EQ(store_->range_reads(layer.index.chunks[chunk].offset), 1);
  EXPECT_EQ(cache.fetch_count(use.entry(), chunk), 1u);
  EXPECT_EQ(metrics_.chunk_refetches.load(), 0u);
}

TEST_F(LayersTest, DamagedChunkIsAnErrorNeverWrongBytes) {
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();
  LayerUse use = cache.acquire(layer.descriptor, stores_);
  const std::size_t chunk = layer.index.chunk_count() - 3;
  store_->damage_offset = static_cast<std::int64_t>(layer.index.chunks[chunk].offset);
  std::vector<char> buf(layer.index.chunk_size, 'X');
  try {
    cache.read(use.entry(), chunk * layer.index.chunk_size, buf.size(), buf.data());
    FAIL() << "a damaged chunk was served";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kDataLoss) << e.what();
    EXPECT_NE(std::string(e.what()).find(layer.descriptor.digest), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("chunk " + std::to_string(chunk)), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::string(buf.data(), buf.size()), std::string(buf.size(), 'X'));  // nothing copied out
  EXPECT_EQ(metrics_.chunk_errors.load(), 1u);
  EXPECT_EQ(cache.fetch_count(use.entry(), chunk), 0u);
  // Its neighbours are fine, and once the store serves good bytes the chunk is fetched (the failure is not kept).
  EXPECT_NO_THROW(cache.read(use.entry(), (chunk + 1) * layer.index.chunk_size, 10, buf.data()));
  store_->damage_offset = -1;
  std::size_t n = cache.read(use.entry(), chunk * layer.index.chunk_size, buf.size(), buf.data());
  EXPECT_EQ(std::string(buf.data(), n), layer.bytes.substr(chunk * layer.index.chunk_size, n));
}

TEST_F(LayersTest, ConcurrentReadersOfAFailingChunkGetOneAttemptEach) {
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();
  LayerUse use = cache.acquire(layer.descriptor, stores_);
  const std::size_t chunk = layer.index.chunk_count() - 2;
  store_->delay_ms = 1000;
  store_->gone = true;
  auto started = std::chrono::steady_clock::now();
  std::atomic<int> unavailable{0};
  std::vector<std::thread> readers;
  for (int t = 0; t < 16; ++t)
    readers.emplace_back([&] {
      char buf[100];
      try {
        cache.read(use.entry(), chunk * layer.index.chunk_size, sizeof buf, buf);
      } catch (const Error& e) {
        if (e.code() == Code::kUnavailable) ++unavailable;
      }
    });
  for (auto& t : readers) t.join();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  EXPECT_EQ(unavailable.load(), 16);
  // Readers waiting on a fetch share its failure instead of trying one after another (16 x 1 s).
  EXPECT_LT(seconds, 6.0);
  EXPECT_LE(store_->range_reads(layer.index.chunks[chunk].offset), 4);
}

TEST_F(LayersTest, MissingBlobsAreNotFoundAndLeaveTheCacheConsistent) {
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();

  image::LayerDescriptor no_index = layer.descriptor;
  no_index.index = image::sha256_digest("no such index");
  try {
    cache.acquire(no_index, stores_);
    FAIL() << "a missing index was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound) << e.what();
    EXPECT_NE(std::string(e.what()).find(no_index.index), std::string::npos) << e.what();
  }
  EXPECT_TRUE(cache.layers().empty());

  store_->remove_blob(layer.descriptor.data);
  try {
    cache.acquire(layer.descriptor, stores_);
    FAIL() << "a layer whose data blob is missing was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound) << e.what();
    EXPECT_NE(std::string(e.what()).find("chunk 0"), std::string::npos) << e.what();
  }
  // The index is cached (it was whole and checked); no chunk is marked present; nothing half-made is left.
  auto listed = cache.layers();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].cached_bytes, 0u);
  for (const auto& item : fs::directory_iterator(tmp_ / "cache"))
    EXPECT_FALSE(item.path().filename().string().starts_with(".")) << item.path();
  BlobCache reopened = make_cache();
  EXPECT_EQ(reopened.layers().size(), 1u);
}

TEST_F(LayersTest, ManifestAndIndexMustAgree) {
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();
  image::LayerDescriptor wrong = layer.descriptor;
  wrong.size += 4096;
  try {
    cache.acquire(wrong, stores_);
    FAIL() << "a manifest that disagrees with its index was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.what();
  }
  EXPECT_TRUE(cache.layers().empty());
}

TEST_F(LayersTest, AStoreThatGoesAwayGivesPromptErrorsAndComesBack) {
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();
  LayerUse use = cache.acquire(layer.descriptor, stores_);
  const std::size_t chunk = layer.index.chunk_count() - 2;
  fs::rename(tmp_ / "store", tmp_ / "store-away");
  auto started = std::chrono::steady_clock::now();
  char buf[64];
  try {
    cache.read(use.entry(), chunk * layer.index.chunk_size, sizeof buf, buf);
    FAIL() << "a read from a store that is gone succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound) << e.what();
    EXPECT_NE(std::string(e.what()).find((tmp_ / "store").string()), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(), 3.0);
  // What was fetched before is still served.
  EXPECT_EQ(cache.read(use.entry(), 0, sizeof buf, buf), sizeof buf);
  fs::rename(tmp_ / "store-away", tmp_ / "store");
  std::size_t n = cache.read(use.entry(), chunk * layer.index.chunk_size, sizeof buf, buf);
  EXPECT_EQ(std::string(buf, n), layer.bytes.substr(chunk * layer.index.chunk_size, n));
}

TEST_F(LayersTest, ARestartedCacheKeepsItsChunksAndChecksThemBeforeUse) {
  TestLayer layer = make_layer("a", sample_files());
  {
    BlobCache cache = make_cache();
    LayerUse use = cache.acquire(layer.descriptor, stores_);
    std::string all(layer.bytes.size(), '\0');
    ASSERT_EQ(cache.read(use.entry(), 0, all.size(), all.data()), all.size());
  }
  // Damage one cached chunk on disk, as a crash or a bad disk might.
  const std::size_t chunk = layer.index.chunk_count() - 3;
  fs::path file = tmp_ / "cache" / image::digest_hex(layer.descriptor.digest) / "layer";
  {
    int fd = ::open(file.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, "garbage", 7, static_cast<off_t>(chunk * layer.index.chunk_size + 10)), 7);
    ::close(fd);
  }
  LayerMetrics fresh;
  BlobCache cache(BlobCacheOptions{tmp_ / "cache", 1ull << 30}, fresh);
  ASSERT_EQ(cache.layers().size(), 1u);
  EXPECT_EQ(cache.layers()[0].cached_bytes, layer.bytes.size());
  LayerUse use = cache.acquire(layer.descriptor, stores_);
  EXPECT_EQ(fresh.chunk_fetches.load(), 0u);  // the prefetch found its chunks on disk, and good
  std::string all(layer.bytes.size(), '\0');
  ASSERT_EQ(cache.read(use.entry(), 0, all.size(), all.data()), all.size());
  EXPECT_EQ(all, layer.bytes);
  EXPECT_EQ(fresh.chunk_fetches.load(), 1u);  // only the damaged chunk
}

TEST_F(LayersTest, EvictsTheLeastRecentlyUsedUnusedLayersBeyondTheLimit) {
  TestLayer a = make_layer("a", sample_files(1));
  TestLayer b = make_layer("b", sample_files(2));
  TestLayer c = make_layer("c", sample_files(3));
  // Room for a bit more than two whole layers.
  BlobCache cache = make_cache(a.bytes.size() + b.bytes.size() + a.bytes.size() / 2);
  auto read_all = [&](LayerUse& use, const TestLayer& l) {
    std::string all(l.bytes.size(), '\0');
    cache.read(use.entry(), 0, all.size(), all.data());
  };
  {
    LayerUse ua = cache.acquire(a.descriptor, stores_);
    read_all(ua, a);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  LayerUse ub = cache.acquire(b.descriptor, stores_);
  read_all(ub, b);
  ub.reset();
  LayerUse uc = cache.acquire(c.descriptor, stores_);
  read_all(uc, c);
  EXPECT_EQ(cache.enforce_limit(), 1u);
  std::set<std::string> left;
  for (const auto& l : cache.layers()) left.insert(l.digest);
  EXPECT_EQ(left, (std::set<std::string>{b.descriptor.digest, c.descriptor.digest}));
  EXPECT_FALSE(fs::exists(tmp_ / "cache" / image::digest_hex(a.descriptor.digest)));
  EXPECT_EQ(metrics_.evictions.load(), 1u);

  // A layer in use is never evicted, even when the cache is over its limit with it alone.
  BlobCache tiny(BlobCacheOptions{tmp_ / "cache", 1}, metrics_);
  LayerUse held = tiny.acquire(c.descriptor, stores_);
  tiny.enforce_limit();
  ASSERT_EQ(tiny.layers().size(), 1u);
  EXPECT_EQ(tiny.layers()[0].digest, c.descriptor.digest);
}

TEST_F(LayersTest, AFullCacheDiskEvictsUnusedLayersThenFailsClearly) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount a small tmpfs as the cache's disk";
  TestLayer a = make_layer("a", {{"a.bin", random_bytes(900 * 1024, 11)}});
  TestLayer b = make_layer("b", {{"b.bin", random_bytes(900 * 1024, 12)}});
  TestLayer big = make_layer("big", {{"big.bin", random_bytes(3 * 1024 * 1024, 13)}});
  fs::path disk = tmp_ / "cache";
  fs::create_directories(disk);
  ASSERT_EQ(::mount("dsec-test", disk.c_str(), "tmpfs", 0, "size=1600k"), 0) << std::strerror(errno);
  struct Unmount {
    fs::path p;
    ~Unmount() { ::umount2(p.c_str(), MNT_DETACH); }
  } unmount{disk};
  {
    BlobCache cache = make_cache();
    auto read_all = [&](LayerUse& use, const TestLayer& l) {
      std::string all(l.bytes.size(), '\0');
      cache.read(use.entry(), 0, all.size(), all.data());
      EXPECT_EQ(all, l.bytes);
    };
    {
      LayerUse ua = cache.acquire(a.descriptor, stores_);
      read_all(ua, a);
    }
    // b does not fit beside a: the full disk makes room from a (unused), and the write is tried again.
    {
      LayerUse ub = cache.acquire(b.descriptor, stores_);
      read_all(ub, b);
    }
    EXPECT_EQ(metrics_.evictions.load(), 1u);
    EXPECT_EQ(cache.layers().size(), 1u);

    // A layer larger than the disk: a clear RESOURCE_EXHAUSTED, and only whole chunks marked present.
    LayerUse ubig = cache.acquire(big.descriptor, stores_);
    std::string all(big.bytes.size(), '\0');
    try {
      cache.read(ubig.entry(), 0, all.size(), all.data());
      FAIL() << "a layer larger than the cache's disk was read";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kResourceExhausted) << e.what();
      EXPECT_NE(std::string(e.what()).find("is full"), std::string::npos) << e.what();
    }
  }
  // The cache reads back consistent: every chunk marked present checks out.
  LayerMetrics fresh;
  BlobCache reopened(BlobCacheOptions{disk, 1ull << 30}, fresh);
  auto entry = reopened.find(image::digest_hex(big.descriptor.digest));
  ASSERT_TRUE(entry);
  ASSERT_GT(entry->present_bytes(), 0u);
  image::remove_tree(disk / image::digest_hex(b.descriptor.digest));  // room to check the big one's chunks
  LayerMetrics again;
  BlobCache checked(BlobCacheOptions{disk, 1ull << 30}, again);
  LayerUse use = checked.acquire(big.descriptor, stores_);
  const std::uint64_t present_before = use.entry().present_bytes();
  std::string head(present_before, '\0');
  ASSERT_EQ(checked.read(use.entry(), 0, head.size(), head.data()), head.size());
  EXPECT_EQ(head, big.bytes.substr(0, head.size()));
}

TEST_F(LayersTest, LazyMountsServeTheTreeAndUnmountWhenUnused) {
  if (std::string why = lazy_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();
  fs::path mounts_dir = tmp_ / "run" / ".layers";
  LayerMounts mounts(LayerMountsOptions{mounts_dir, LayerMode::kLazy, {}, {}}, cache, metrics_);
  EXPECT_EQ(mounts.mode_description(), "erofs-lazy");
  {
    MountedLayer first = mounts.acquire(layer.descriptor, stores_);
    MountedLayer second = mounts.acquire(layer.descriptor, stores_);
    EXPECT_EQ(first.dir, second.dir);
    EXPECT_TRUE(is_mounted(first.dir));
    EXPECT_EQ(mounts.users()[layer.descriptor.digest], 2u);
    const std::uint64_t after_mount = fetches();
    EXPECT_EQ(read_file(first.dir / "etc/hostname"), "layers-test\n");
    EXPECT_EQ(read_file(first.dir / "dir/nested/note.txt"), "nested note 1\n");
    std::set<std::string> names;
    for (const auto& item : fs::directory_iterator(first.dir)) names.insert(item.path().filename().string());
    EXPECT_EQ(names, (std::set<std::string>{"etc", "big.bin", "dir", "zeros.bin"}));
    // Small files and listings come from the prefetched metadata and at most a chunk or two of data.
    EXPECT_LE(fetches(), after_mount + 2);
    EXPECT_EQ(read_file(first.dir / "big.bin"), sample_files().at("big.bin"));
    EXPECT_EQ(mounts.prune(), 0u);  // still held
  }
  EXPECT_EQ(mounts.prune(), 1u);
  EXPECT_FALSE(is_mounted(mounts_dir / image::digest_hex(layer.descriptor.digest)));
  EXPECT_EQ(metrics_.chunk_refetches.load(), 0u);
  mounts.shutdown();
  EXPECT_FALSE(mounted_below(mounts_dir));
  EXPECT_FALSE(fs::exists(mounts_dir));
}

TEST_F(LayersTest, ADamagedChunkReadsAsEioInsideTheMount) {
  if (std::string why = lazy_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();
  LayerMounts mounts(LayerMountsOptions{tmp_ / "run" / ".layers", LayerMode::kLazy, {}, {}}, cache, metrics_);
  MountedLayer mounted = mounts.acquire(layer.descriptor, stores_);
  // The metadata is in; every chunk fetched from now on comes damaged.
  store_->damage_all = true;
  int fd = ::open((mounted.dir / "big.bin").c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);  // opening needs only metadata
  std::string got;
  char buf[65536];
  int err = 0;
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      err = errno;
      break;
    }
    if (n == 0) break;
    got.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  EXPECT_EQ(err, EIO);
  EXPECT_TRUE(got.empty()) << got.size() << " bytes read from damaged chunks";
  EXPECT_GE(metrics_.read_errors.load(), 1u);
  EXPECT_GE(metrics_.chunk_errors.load(), 1u);
  // Once the store serves good bytes again, the same file reads right: the failure was not cached.
  store_->damage_all = false;
  EXPECT_EQ(read_file(mounted.dir / "big.bin"), sample_files().at("big.bin"));
}

TEST_F(LayersTest, ConcurrentAcquiresOfAColdLayerMountOnceAndFetchEachChunkOnce) {
  if (std::string why = lazy_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();
  LayerMounts mounts(LayerMountsOptions{tmp_ / "run" / ".layers", LayerMode::kLazy, {}, {}}, cache, metrics_);
  store_->delay_ms = 20;
  std::vector<std::thread> threads;
  std::mutex mutex;
  std::vector<MountedLayer> held;
  std::atomic<int> right{0};
  for (int t = 0; t < 32; ++t)
    threads.emplace_back([&] {
      MountedLayer m = mounts.acquire(layer.descriptor, stores_);
      if (read_file(m.dir / "big.bin") == sample_files().at("big.bin")) ++right;
      std::lock_guard lock(mutex);
      held.push_back(std::move(m));
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(right.load(), 32);
  EXPECT_EQ(mounts.users()[layer.descriptor.digest], 32u);
  for (const auto& c : layer.index.chunks) EXPECT_LE(store_->range_reads(c.offset), 1) << "offset " << c.offset;
  EXPECT_EQ(metrics_.chunk_refetches.load(), 0u);
  EXPECT_EQ(fetches(), static_cast<std::uint64_t>(store_->total_range_reads()));
  held.clear();
  EXPECT_EQ(mounts.prune(), 1u);
}

TEST_F(LayersTest, ExtractModeUnpacksTheWholeLayerOnceAndKeepsIt) {
  if (::geteuid() != 0) GTEST_SKIP() << "fsck.erofs --preserve needs root";
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();
  LayerMounts mounts(LayerMountsOptions{tmp_ / "run" / ".layers", LayerMode::kExtract, {}, {}}, cache, metrics_);
  EXPECT_EQ(mounts.mode_description(), "extract (chosen by --layer-mode extract)");
  fs::path dir;
  {
    MountedLayer m = mounts.acquire(layer.descriptor, stores_);
    dir = m.dir;
    EXPECT_FALSE(is_mounted(m.dir));
    EXPECT_EQ(read_file(m.dir / "big.bin"), sample_files().at("big.bin"));
    EXPECT_EQ(read_file(m.dir / "dir/nested/note.txt"), "nested note 1\n");
  }
  EXPECT_EQ(fetches(), layer.index.chunk_count());
  EXPECT_EQ(mounts.prune(), 1u);
  EXPECT_TRUE(fs::exists(dir / "big.bin"));  // the tree is the cache in this mode
  auto listed = cache.layers();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_GE(listed[0].cached_bytes, 400u * 1024);
  MountedLayer again = mounts.acquire(layer.descriptor, stores_);
  EXPECT_EQ(again.dir, dir);
  EXPECT_EQ(fetches(), layer.index.chunk_count());
}

TEST_F(LayersTest, AStaleMountOfAKilledAgentIsDetachedAtStart) {
  if (std::string why = lazy_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  fs::path mounts_dir = tmp_ / "run" / ".layers";
  fs::create_directories(mounts_dir / "blobs");
  fs::create_directories(mounts_dir / "0123");
  ASSERT_EQ(::mount("dsec-stale", (mounts_dir / "blobs").c_str(), "tmpfs", 0, nullptr), 0);
  ASSERT_EQ(::mount("dsec-stale", (mounts_dir / "0123").c_str(), "tmpfs", 0, nullptr), 0);
  BlobCache cache = make_cache();
  {
    LayerMounts mounts(LayerMountsOptions{mounts_dir, LayerMode::kLazy, {}, {}}, cache, metrics_);
    EXPECT_FALSE(is_mounted(mounts_dir / "0123"));
    EXPECT_FALSE(fs::exists(mounts_dir / "0123"));
    EXPECT_TRUE(is_mounted(mounts_dir / "blobs"));  // its own FUSE mount now
  }
  EXPECT_FALSE(mounted_below(mounts_dir));
}

TEST_F(LayersTest, ImageSourceResolvesNamesPinsAndClientManifests) {
  TestLayer layer = make_layer("img", sample_files());
  ImageSourceOptions options;
  options.stores = {(tmp_ / "store").string()};
  options.cache_dir = tmp_ / "cache";
  options.mount_dir = tmp_ / "run" / ".layers";
  options.layer_mode = lazy_skip_reason().empty() ? "lazy" : "extract";
  if (options.layer_mode == "extract" && ::geteuid() != 0) GTEST_SKIP() << "neither mode can run unprivileged here";
  auto source = make_layered_image_source(options, metrics_);
  EXPECT_EQ(source->names(), std::vector<std::string>{"t/img:1"});

  ResolvedImage by_name = source->resolve("t/img:1");
  EXPECT_EQ(by_name.name, "t/img:1@" + layer.manifest_digest);
  ASSERT_EQ(by_name.layers.size(), 1u);
  EXPECT_EQ(read_file(by_name.layers[0] / "etc/hostname"), "layers-test\n");

  ResolvedImage pinned = source->resolve("t/img:1@" + layer.manifest_digest, layer.manifest_json);
  EXPECT_EQ(pinned.layers, by_name.layers);
  LayerStatus status = source->layer_status();
  ASSERT_EQ(status.cached_layers.size(), 1u);
  EXPECT_EQ(status.cached_layers[0].users, 2u);
  EXPECT_EQ(status.mode, options.layer_mode == "lazy" ? "erofs-lazy" : "extract (chosen by --layer-mode extract)");

  EXPECT_CODE(source->resolve("t/nothing:1"), Code::kNotFound);
  EXPECT_CODE(source->resolve("t/img:1", layer.manifest_json), Code::kInvalidArgument);  // a manifest needs a pin
  EXPECT_CODE(source->resolve("t/img:1@" + image::sha256_digest("other"), layer.manifest_json), Code::kInvalidArgument);
  EXPECT_CODE(source->resolve("t/img:1@" + image::sha256_digest("x"), "x"), Code::kInvalidArgument);  // not a manifest
  EXPECT_CODE(source->resolve("Bad Name"), Code::kInvalidArgument);

  // What a caller names is what it gets: a pinned digest under another name is no image, unless a store's tag of
  // that name points to it (an image tagged again).
  EXPECT_CODE(source->resolve("t/other:1@" + layer.manifest_digest), Code::kNotFound);
  EXPECT_CODE(source->resolve("t/other:1@" + layer.manifest_digest, layer.manifest_json), Code::kNotFound);
  store_->write_ref("t/again:2", layer.manifest_digest);
  EXPECT_EQ(source->resolve("t/again:2@" + layer.manifest_digest).layers, by_name.layers);
  // The layer cache says which images hold each layer.
  EXPECT_EQ(source->layer_status().cached_layers.at(0).images, std::vector<std::string>{"t/img:1"});

  // A manifest naming a layer whose blobs are not in the store: from a caller, refused as an image no store holds
  // (a caller's made-up manifest must not name layers); from the agent's own record, NOT_FOUND naming the image
  // and the blob.
  image::Manifest broken = image::manifest_from_json(layer.manifest_json);
  broken.tag = "broken";
  broken.layers[0].digest = image::sha256_digest("a layer nobody stored");
  broken.layers[0].index = image::sha256_digest("its index");
  std::string broken_json = image::manifest_to_json(broken);
  std::string broken_digest = image::sha256_digest(broken_json);
  try {
    source->resolve("t/img:broken@" + broken_digest, broken_json);
    FAIL() << "a caller's manifest no store holds resolved";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound) << e.what();
    EXPECT_NE(std::string(e.what()).find("is not in any of the node's stores"), std::string::npos) << e.what();
  }
  try {
    source->resolve("t/img:broken@" + broken_digest, broken_json, ManifestOrigin::kAgent);
    FAIL() << "an image with missing blobs resolved";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound) << e.what();
    EXPECT_NE(std::string(e.what()).find(broken.layers[0].index), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("t/img:broken"), std::string::npos) << e.what();
  }

  by_name.hold.reset();
  pinned.hold.reset();
  source->prune();
  EXPECT_EQ(source->layer_status().cached_layers.at(0).users, 0u);
  source->shutdown();
  EXPECT_FALSE(mounted_below(options.mount_dir));
}

// --------------------------------------------------------------------------------------------------------------
// Restart: the layer file system outlives its killed server (the layer keeper holds the FUSE connection) and the
// next server takes it over, with the layer mounts on it.

// A process that is `pid` started at `start_time` and has not ended (a zombie has).
bool running(pid_t pid, std::uint64_t start_time) {
  std::string line = read_file(fmt::format("/proc/{}/stat", pid));
  auto close = line.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream fields(line.substr(close + 1));
  std::vector<std::string> f;
  for (std::string w; fields >> w;) f.push_back(w);
  return f.size() >= 20 && f[0] != "Z" && f[0] != "X" && std::stoull(f[19]) == start_time;
}

bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

pid_t spawn(const std::vector<std::string>& args, const std::vector<std::string>& extra_env, const fs::path& log) {
  std::vector<char*> argv, envp;
  std::vector<std::string> a = args, e = extra_env;
  for (auto& x : a) argv.push_back(x.data());
  argv.push_back(nullptr);
  for (char** p = environ; *p; ++p) e.emplace_back(*p);
  for (auto& x : e) envp.push_back(x.data());
  envp.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  ::posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  ::posix_spawn_file_actions_adddup2(&actions, 1, 2);
  pid_t pid = 0;
  int rc = ::posix_spawnp(&pid, argv[0], &actions, nullptr, argv.data(), envp.data());
  ::posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error(fmt::format("spawn {}: {}", args[0], std::strerror(rc)));
  return pid;
}

// The layer server of LayersTest.AKilledServersLayerMountsKeepServingAfterARestart: this test binary once more,
// running LayerServerProcess.ServesUntilTerminated on the test's directory.
class LayerServerChild {
 public:
  LayerServerChild(const fs::path& dir, int run) : dir_(dir), run_(std::to_string(run)) {
    log_ = dir_ / ("server-" + run_ + ".log");
    pid_ =
        spawn({fs::read_symlink("/proc/self/exe").string(), "--gtest_filter=LayerServerProcess.ServesUntilTerminated"},
              {"DSEC_LAYER_SERVER_DIR=" + dir_.string(), "DSEC_LAYER_SERVER_RUN=" + run_}, log_);
  }
  ~LayerServerChild() { kill9(); }

  // The lines of its ready file: the layer's directory, 1 when it took over an earlier server, layers adopted.
  std::vector<std::string> wait_ready(std::chrono::seconds limit) {
    std::vector<std::string> lines;
    wait_until(
        [&] {
          lines.clear();
          std::istringstream in(read_file(dir_ / ("ready." + run_)));
          for (std::string l; std::getline(in, l);) lines.push_back(l);
          return lines.size() >= 3 || ::waitpid(pid_, nullptr, WNOHANG) != 0;
        },
        limit);
    return lines;
  }
  void kill9() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = 0;
  }
  // SIGTERM (a clean shutdown); its exit status, -1 when it had to be killed.
  int terminate() {
    ::kill(pid_, SIGTERM);
    int status = 0;
    bool ended = wait_until([&] { return ::waitpid(pid_, &status, WNOHANG) == pid_; }, std::chrono::seconds(30));
    if (!ended) {
      kill9();
      return -1;
    }
    pid_ = 0;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }
  std::string log() const { return read_file(log_); }

 private:
  fs::path dir_, log_;
  std::string run_;
  pid_t pid_ = 0;
};

// Not a test of its own: the layer server process that AKilledServersLayerMountsKeepServingAfterARestart starts
// (and kills), with the test's directory in DSEC_LAYER_SERVER_DIR.
TEST(LayerServerProcess, ServesUntilTerminated) {
  const char* dir_env = std::getenv("DSEC_LAYER_SERVER_DIR");
  const char* run_env = std::getenv("DSEC_LAYER_SERVER_RUN");
  if (dir_env == nullptr || run_env == nullptr)
    GTEST_SKIP() << "the layer server process of LayersTest.AKilledServersLayerMountsKeepServingAfterARestart; it "
                    "runs only when that test starts it";
  const fs::path dir = dir_env;
  const std::string run = run_env;
  // SIGTERM is taken by sigwait below: blocked before any thread starts, so that no thread takes it.
  sigset_t term;
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &term, nullptr);
  LayerMetrics metrics;
  auto store = std::make_shared<TestStore>(dir / "store");
  store->hold_file = (dir / "hold").string();
  Stores stores{store};
  BlobCache cache(BlobCacheOptions{dir / "cache", 1ull << 30}, metrics);
  LayerMounts mounts(LayerMountsOptions{dir / "run" / ".layers", LayerMode::kLazy, stores, {}}, cache, metrics);
  image::ResolvedManifest resolved = image::fetch_manifest(*store, image::parse_reference("t/a:1"));
  MountedLayer layer = mounts.acquire(resolved.manifest.layers.at(0), stores);
  write_file(dir / ("ready." + run),
             fmt::format("{}\n{}\n{}\n", layer.dir.string(), mounts.resumed() ? 1 : 0, mounts.adopted().size()));
  int sig = 0;
  sigwait(&term, &sig);
  layer.hold.reset();
  mounts.shutdown();
}

// Chunks the cache marks present for a layer.
int present_chunks(const fs::path& cache_dir, const std::string& hex) {
  std::string present = read_file(cache_dir / hex / "present");
  return static_cast<int>(std::count(present.begin(), present.end(), '\1'));
}

TEST_F(LayersTest, AKilledServersLayerMountsKeepServingAfterARestart) {
  if (std::string why = lazy_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  ASSERT_TRUE(fs::exists(default_keeper_binary())) << default_keeper_binary() << " is not built";
  const std::string big = random_bytes(3u << 20, 7);
  TestLayer layer = make_layer("a", {{"big.bin", big}, {"etc/hostname", "restart\n"}});
  const std::string hex = image::digest_hex(layer.descriptor.digest);
  const fs::path run = tmp_ / "run", mount_dir = run / ".layers";

  int fd = -1;
  std::future<std::string> held;
  std::optional<LayerServerChild> first, second;
  // Whatever happens, nothing stays: servers killed, the keeper ended (which ends the connection, so a read still
  // waiting on it returns), mounts detached.
  struct Cleanup {
    std::optional<LayerServerChild>& first;
    std::optional<LayerServerChild>& second;
    fs::path run;
    int& fd;
    ~Cleanup() {
      first.reset();
      second.reset();
      std::string why;
      if (auto keeper = LayerKeeper::find(run / ".layers" / "keeper", why)) keeper->stop();
      std::vector<std::string> points;
      std::ifstream in("/proc/self/mountinfo");
      for (std::string line; std::getline(in, line);) {
        std::istringstream f(line);
        std::string a, b, c, d, point;
        f >> a >> b >> c >> d >> point;
        if (point.rfind(run.string(), 0) == 0) points.push_back(point);
      }
      for (auto it = points.rbegin(); it != points.rend(); ++it) ::umount2(it->c_str(), MNT_DETACH);
      if (fd >= 0) ::close(fd);
    }
  } cleanup{first, second, run, fd};

  first.emplace(tmp_.path(), 1);
  std::vector<std::string> ready = first->wait_ready(std::chrono::seconds(60));
  ASSERT_EQ(ready.size(), 3u) << first->log();
  const fs::path dir = ready[0];
  EXPECT_EQ(ready[1], "0");
  std::optional<KeeperRecord> keeper = read_keeper_record(mount_dir / "keeper");
  ASSERT_TRUE(keeper);
  EXPECT_TRUE(running(keeper->pid, keeper->start_time));

  fd = ::open((dir / "big.bin").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  std::string head(64u << 10, '\0');
  ASSERT_EQ(::pread(fd, head.data(), head.size(), 0), static_cast<ssize_t>(head.size()));
  EXPECT_EQ(head, big.substr(0, head.size()));

  // A read of data nobody fetched yet, held in the server's store read; then the server is killed.
  const off_t held_at = 2 << 20;
  write_file(tmp_ / "hold", "");
  held = std::async(std::launch::async, [fd, held_at] {
    std::string b(64u << 10, '\0');
    ssize_t n = ::pread(fd, b.data(), b.size(), held_at);
    b.resize(n < 0 ? 0 : static_cast<std::size_t>(n));
    return b;
  });
  ASSERT_TRUE(wait_until([&] { return fs::exists(tmp_ / "hold.seen"); }, std::chrono::seconds(30))) << first->log();
  first->kill9();
  EXPECT_TRUE(running(keeper->pid, keeper->start_time)) << "the keeper ended with the server";
  EXPECT_TRUE(is_mounted(dir));
  EXPECT_EQ(held.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "the held read ended with its server";
  const int present_before = present_chunks(tmp_ / "cache", hex);
  fs::remove(tmp_ / "hold");

  // The next server takes the connection and the layer mount over, and answers the read the first one took.
  second.emplace(tmp_.path(), 2);
  ready = second->wait_ready(std::chrono::seconds(60));
  ASSERT_EQ(ready.size(), 3u) << second->log();
  EXPECT_EQ(ready[0], dir.string()) << "acquire() of the adopted layer gives its directory";
  EXPECT_EQ(ready[1], "1") << second->log();
  EXPECT_EQ(ready[2], "1");
  ASSERT_EQ(held.wait_for(std::chrono::seconds(30)), std::future_status::ready) << second->log();
  EXPECT_EQ(held.get(), big.substr(held_at, 64u << 10));

  // The rest of the file, none of it fetched before: the new server fetches it.
  std::string rest;
  char buf[1 << 16];
  for (off_t off = static_cast<off_t>(head.size());;) {
    ssize_t n = ::pread(fd, buf, sizeof buf, off);
    ASSERT_GE(n, 0) << std::strerror(errno);
    if (n == 0) break;
    rest.append(buf, static_cast<std::size_t>(n));
    off += n;
  }
  EXPECT_TRUE(rest == big.substr(head.size())) << "the rest of the file differs (" << rest.size() << " bytes)";
  EXPECT_GE(present_chunks(tmp_ / "cache", hex), present_before + 100);
  EXPECT_EQ(read_file(dir / "etc/hostname"), "restart\n");
  ::close(fd);
  fd = -1;
  std::optional<KeeperRecord> now = read_keeper_record(mount_dir / "keeper");
  ASSERT_TRUE(now);
  EXPECT_EQ(now->pid, keeper->pid) << "the first server's keeper holds the connection for the second";

  // A clean shutdown leaves no mount, no keeper and no record.
  EXPECT_EQ(second->terminate(), 0) << second->log();
  EXPECT_FALSE(mounted_below(run));
  EXPECT_TRUE(wait_until([&] { return !running(keeper->pid, keeper->start_time); }, std::chrono::seconds(5)));
  EXPECT_FALSE(fs::exists(mount_dir));
}

TEST_F(LayersTest, CleanShutdownLeavesNoMountKeeperOrRecordAndAnEndedKeeperIsReplaced) {
  if (std::string why = lazy_skip_reason(); !why.empty()) GTEST_SKIP() << why;
  ASSERT_TRUE(fs::exists(default_keeper_binary())) << default_keeper_binary() << " is not built";
  TestLayer layer = make_layer("a", sample_files());
  BlobCache cache = make_cache();
  fs::path mounts_dir = tmp_ / "run" / ".layers";
  LayerMounts mounts(LayerMountsOptions{mounts_dir, LayerMode::kLazy, {}, {}}, cache, metrics_);
  const pid_t keeper = mounts.keeper_pid();
  ASSERT_GT(keeper, 0);
  const std::uint64_t started = process_start_time(keeper);
  EXPECT_TRUE(running(keeper, started));
  std::optional<KeeperRecord> record = read_keeper_record(mounts_dir / "keeper");
  ASSERT_TRUE(record);
  EXPECT_EQ(record->pid, keeper);
  EXPECT_EQ(record->start_time, started);
  EXPECT_EQ(record->boot_id, current_boot_id());
  struct stat blobs {};
  ASSERT_EQ(::stat((mounts_dir / "blobs").c_str(), &blobs), 0);
  EXPECT_EQ(record->connection, minor(blobs.st_dev));
  // The keeper holds the FUSE device and nothing else; it sits at / in a session of its own.
  std::set<std::string> fds;
  for (const auto& item : fs::directory_iterator(fmt::format("/proc/{}/fd", keeper)))
    fds.insert(item.path().filename().string());
  EXPECT_EQ(fds, (std::set<std::string>{"0", "1", "2", "3"}));
  EXPECT_EQ(fs::read_symlink(fmt::format("/proc/{}/fd/3", keeper)), "/dev/fuse");
  EXPECT_EQ(fs::read_symlink(fmt::format("/proc/{}/fd/0", keeper)), "/dev/null");
  EXPECT_EQ(fs::read_symlink(fmt::format("/proc/{}/cwd", keeper)), "/");
  EXPECT_EQ(::getsid(keeper), keeper);

  // Node ids are a function of the digest: the same in every run of the agent.
  MountedLayer m = mounts.acquire(layer.descriptor, stores_);
  const std::string hex = image::digest_hex(layer.descriptor.digest);
  struct stat meta {
  }, data{};
  ASSERT_EQ(::stat((mounts_dir / "blobs" / hex).c_str(), &meta), 0);
  ASSERT_EQ(::stat((mounts_dir / "blobs" / (hex + ".data")).c_str(), &data), 0);
  EXPECT_EQ(meta.st_ino, layer_inode(hex, false));
  EXPECT_EQ(data.st_ino, layer_inode(hex, true));
  EXPECT_NE(layer_inode(hex, false), layer_inode(hex, true));
  EXPECT_GT(layer_inode(std::string(64, '0'), false), 1u);
  EXPECT_EQ(read_file(m.dir / "big.bin"), sample_files().at("big.bin"));

  // A keeper that ends while the file system is mounted is replaced at the next prune.
  ASSERT_EQ(::kill(keeper, SIGKILL), 0);
  ASSERT_TRUE(wait_until([&] { return !running(keeper, started); }, std::chrono::seconds(5)));
  mounts.prune();
  const pid_t replacement = mounts.keeper_pid();
  ASSERT_GT(replacement, 0);
  EXPECT_NE(replacement, keeper);
  const std::uint64_t replacement_started = process_start_time(replacement);
  EXPECT_TRUE(running(replacement, replacement_started));
  ASSERT_TRUE(read_keeper_record(mounts_dir / "keeper"));
  EXPECT_EQ(read_keeper_record(mounts_dir / "keeper")->pid, replacement);

  m.hold.reset();
  mounts.shutdown();
  EXPECT_FALSE(mounted_below(mounts_dir));
  EXPECT_FALSE(fs::exists(mounts_dir));
  EXPECT_FALSE(running(replacement, replacement_started));
  EXPECT_EQ(mounts.keeper_pid(), 0);
}

void write_record(const fs::path& path, pid_t pid, std::uint64_t start_time, const std::string& boot_id,
                  unsigned connection) {
  write_file(path,
             fmt::format("pid {}\nstart_time {}\nboot_id {}\nconnection {}\n", pid, start_time, boot_id, connection));
}

TEST_F(LayersTest, AKeeperRecordIsTrustedOnlyForTheProcessItNames) {
  // Another process, started here: a pid the record may name after its keeper is gone.
  pid_t other = spawn({"sleep", "60"}, {}, tmp_ / "sleep.log");
  struct Reap {
    pid_t pid;
    ~Reap() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{other};
  ASSERT_TRUE(
      wait_until([&] { return read_file(fmt::format("/proc/{}/comm", other)) == "sleep\n"; }, std::chrono::seconds(5)));
  const std::uint64_t started = process_start_time(other);
  ASSERT_GT(started, 0u);
  const fs::path record = tmp_ / "keeper";
  std::string why;

  EXPECT_EQ(LayerKeeper::find(record, why), nullptr);
  EXPECT_EQ(why, "") << "no record: nothing to say";

  write_file(record, "pid twelve\n");
  EXPECT_EQ(LayerKeeper::find(record, why), nullptr);
  EXPECT_NE(why.find("cannot be read"), std::string::npos) << why;

  write_record(record, other, started + 1, current_boot_id(), 7);  // the pid, reused by another process
  EXPECT_EQ(LayerKeeper::find(record, why), nullptr);
  EXPECT_NE(why.find("another process"), std::string::npos) << why;

  write_record(record, other, started, current_boot_id(), 7);  // the right start time, but not the keeper
  EXPECT_EQ(LayerKeeper::find(record, why), nullptr);
  EXPECT_NE(why.find("runs 'sleep'"), std::string::npos) << why;

  write_record(record, other, started, "00000000-0000-0000-0000-000000000000", 7);
  EXPECT_EQ(LayerKeeper::find(record, why), nullptr);
  EXPECT_NE(why.find("earlier boot"), std::string::npos) << why;
  EXPECT_TRUE(running(other, started)) << "a process the record names but that is not the keeper was signalled";

  // Layer mounts under such a record are not taken over: detached, and the other process left alone.
  if (std::string skip = lazy_skip_reason(); !skip.empty()) GTEST_SKIP() << skip;
  fs::path mounts_dir = tmp_ / "run" / ".layers";
  fs::create_directories(mounts_dir / "blobs");
  fs::create_directories(mounts_dir / "0123");
  ASSERT_EQ(::mount("dsec-stale", (mounts_dir / "blobs").c_str(), "tmpfs", 0, nullptr), 0);
  ASSERT_EQ(::mount("dsec-stale", (mounts_dir / "0123").c_str(), "tmpfs", 0, nullptr), 0);
  struct stat blobs {};
  ASSERT_EQ(::stat((mounts_dir / "blobs").c_str(), &blobs), 0);
  write_record(mounts_dir / "keeper", other, started + 1, current_boot_id(), minor(blobs.st_dev));
  BlobCache cache = make_cache();
  {
    LayerMounts mounts(LayerMountsOptions{mounts_dir, LayerMode::kLazy, {}, {}}, cache, metrics_);
    EXPECT_FALSE(mounts.resumed());
    EXPECT_TRUE(mounts.adopted().empty());
    EXPECT_FALSE(is_mounted(mounts_dir / "0123"));
    EXPECT_TRUE(is_mounted(mounts_dir / "blobs"));  // its own FUSE mount now
    EXPECT_NE(mounts.keeper_pid(), other);
    ASSERT_TRUE(read_keeper_record(mounts_dir / "keeper"));
    EXPECT_EQ(read_keeper_record(mounts_dir / "keeper")->pid, mounts.keeper_pid());
  }
  EXPECT_TRUE(running(other, started));
  EXPECT_FALSE(mounted_below(mounts_dir));
}

TEST_F(LayersTest, ExtractedLayersOfAnEarlierAgentAreKeptUntilTheFirstPrune) {
  if (::geteuid() != 0) GTEST_SKIP() << "fsck.erofs --preserve needs root";
  TestLayer layer = make_layer("a", sample_files());
  const fs::path mounts_dir = tmp_ / "run" / ".layers";
  fs::path dir;
  {
    BlobCache cache = make_cache();
    LayerMounts mounts(LayerMountsOptions{mounts_dir, LayerMode::kExtract, {}, {}}, cache, metrics_);
    MountedLayer m = mounts.acquire(layer.descriptor, stores_);
    dir = m.dir;
    EXPECT_TRUE(mounts.adopted().empty());
  }
  // The next agent, with a cache limit that every unused layer is over.
  BlobCache cache = make_cache(1);
  LayerMounts mounts(LayerMountsOptions{mounts_dir, LayerMode::kExtract, stores_, {}}, cache, metrics_);
  EXPECT_EQ(mounts.adopted(), std::vector<std::string>{layer.descriptor.digest});
  EXPECT_EQ(cache.enforce_limit(), 0u) << "an adopted layer was evicted before its sandboxes were taken over";
  const std::uint64_t before = fetches();
  {
    MountedLayer again = mounts.acquire(layer.descriptor, stores_);
    EXPECT_EQ(again.dir, dir);
    EXPECT_EQ(read_file(again.dir / "big.bin"), sample_files().at("big.bin"));
    EXPECT_EQ(mounts.prune(), 0u);  // held again
  }
  EXPECT_EQ(fetches(), before);
  EXPECT_EQ(mounts.prune(), 1u);
  EXPECT_TRUE(cache.layers().empty()) << "unused and over the limit once released";
}

TEST(LayerModeTest, ParsesTheThreeModes) {
  EXPECT_EQ(parse_layer_mode("auto"), LayerMode::kAuto);
  EXPECT_EQ(parse_layer_mode("lazy"), LayerMode::kLazy);
  EXPECT_EQ(parse_layer_mode("extract"), LayerMode::kExtract);
  EXPECT_THROW(parse_layer_mode("fast"), Error);
}

}  // namespace
}  // namespace dsec::agent::layers
