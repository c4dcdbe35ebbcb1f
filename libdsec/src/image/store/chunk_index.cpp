#include "image/store/chunk_index.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <zstd.h>
#include <nlohmann/json.hpp>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "image/store/digest.hpp"

namespace dsec::image {
namespace {

using nlohmann::json;

[[noreturn]] void bad_field(std::string_view field, std::string_view why) {
  throw Error(Code::kInvalidArgument, fmt::format("chunk index: {}: {}", field, why));
}

// A non-negative integer that fits T. (nlohmann's get<T>() of a number that does not fit, 1e30 or -1.5 for a size,
// is undefined behaviour, and of a negative integer a wrapped one.)
template <typename T>
T count_field(const json& v, std::string_view field) {
  if (!v.is_number_unsigned() || v.get<std::uint64_t>() > std::numeric_limits<T>::max())
    bad_field(field, fmt::format("must be an integer from 0 to {}", std::numeric_limits<T>::max()));
  return static_cast<T>(v.get<std::uint64_t>());
}

bool is_hex64(std::string_view s) {
  if (s.size() != 64) return false;
  return std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

void read_exact_at(int fd, void* buf, std::size_t size, std::uint64_t offset, const std::filesystem::path& path) {
  auto* p = static_cast<char*>(buf);
  while (size > 0) {
    ssize_t n = ::pread(fd, p, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno_fmt(errno, "read {}", path.string());
    }
    if (n == 0) throw Error(Code::kDataLoss, fmt::format("{} ended early", path.string()));
    p += n;
    size -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
}

void write_all(int fd, std::string_view bytes, const std::filesystem::path& path) {
  while (!bytes.empty()) {
    ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno_fmt(errno, "write {}", path.string());
    }
    bytes.remove_prefix(static_cast<std::size_t>(n));
  }
}

}  // namespace

std::uint32_t ChunkIndex::chunk_length(std::size_t i) const {
  std::uint64_t start = static_cast<std::uint64_t>(i) * chunk_size;
  if (start >= size) return 0;
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(chunk_size, size - start));
}

std::string chunk_index_to_json(const ChunkIndex& index) {
  json chunks = json::array();
  for (const auto& c : index.chunks) chunks.push_back(json::array({c.offset, c.length, c.sha256_hex}));
  json j = {{"schema", ChunkIndex::kSchemaVersion}, {"layer", index.layer},           {"size", index.size},
            {"meta_size", index.meta_size},         {"chunk_size", index.chunk_size}, {"data", index.data},
            {"data_size", index.data_size},         {"chunks", std::move(chunks)},    {"prefetch", index.prefetch}};
  return j.dump();
}

ChunkIndex chunk_index_from_json(std::string_view text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(Code::kInvalidArgument, fmt::format("chunk index: not JSON: {}", e.what()));
  }
  if (!j.is_object()) bad_field("(top)", "must be an object");
  ChunkIndex index;
  try {
    const json& schema = j.at("schema");
    if (!schema.is_number_integer() || schema.get<std::int64_t>() != ChunkIndex::kSchemaVersion)
      bad_field("schema", "unsupported version");
    index.layer = j.at("layer").get<std::string>();
    index.size = count_field<std::uint64_t>(j.at("size"), "size");
    index.chunk_size = count_field<std::uint32_t>(j.at("chunk_size"), "chunk_size");
    if (auto m = j.find("meta_size"); m != j.end()) index.meta_size = count_field<std::uint64_t>(*m, "meta_size");
    index.data = j.at("data").get<std::string>();
    index.data_size = count_field<std::uint64_t>(j.at("data_size"), "data_size");
    if (!is_digest(index.layer)) bad_field("layer", "not a sha256 digest");
    if (!is_digest(index.data)) bad_field("data", "not a sha256 digest");
    if (index.chunk_size < 4096 || index.chunk_size > (64u << 20) || (index.chunk_size & (index.chunk_size - 1)))
      bad_field("chunk_size", "must be a power of two from 4 KiB to 64 MiB");
    if (index.meta_size % index.chunk_size != 0 || index.meta_size >= index.size)
      bad_field("meta_size", "must be a whole number of chunks, less than the layer's size");
    const json& chunks = j.at("chunks");
    if (!chunks.is_array()) bad_field("chunks", "must be a list");
    // Not (size + chunk_size - 1) / chunk_size: near 2^64 that wraps, and a huge layer would need no chunks at all.
    std::uint64_t expected = index.size / index.chunk_size + (index.size % index.chunk_size != 0 ? 1 : 0);
    if (chunks.size() != expected)
      bad_field("chunks", fmt::format("{} chunks for {} bytes in chunks of {} (expected {})", chunks.size(), index.size,
                                      index.chunk_size, expected));
    index.chunks.reserve(chunks.size());
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      const json& c = chunks[i];
      if (!c.is_array() || c.size() != 3) bad_field(fmt::format("chunks[{}]", i), "must be [offset, length, sha256]");
      std::string field = fmt::format("chunks[{}]", i);
      ChunkEntry e{count_field<std::uint64_t>(c[0], field), count_field<std::uint32_t>(c[1], field),
                   c[2].get<std::string>()};
      if (!is_hex64(e.sha256_hex)) bad_field(field, "bad sha256");
      if (e.length == 0 || e.offset > index.data_size || e.length > index.data_size - e.offset)
        bad_field(field, "lies outside the data blob");
      if (e.length > ZSTD_compressBound(index.chunk_size))
        bad_field(field, "stored length larger than any chunk can compress to");
      index.chunks.push_back(std::move(e));
    }
    if (auto p = j.find("prefetch"); p != j.end()) {
      if (!p->is_array()) bad_field("prefetch", "must be a list of chunk numbers");
      for (const json& n : *p) index.prefetch.push_back(count_field<std::uint32_t>(n, "prefetch"));
      for (auto n : index.prefetch)
        if (n >= index.chunks.size()) bad_field("prefetch", fmt::format("chunk {} does not exist", n));
    }
  } catch (const json::exception& e) {
    throw Error(Code::kInvalidArgument, fmt::format("chunk index: {}", e.what()));
  }
  return index;
}

void decode_chunk(const ChunkIndex& index, std::size_t i, std::string_view stored, std::string& out) {
  if (i >= index.chunks.size()) throw Error(Code::kOutOfRange, fmt::format("layer {}: no chunk {}", index.layer, i));
  const std::uint32_t length = index.chunk_length(i);
  out.resize(length);
  if (stored.size() == length) {
    // Stored raw: compression would not have made it smaller.
    out.assign(stored.data(), stored.size());
  } else {
    std::size_t n = ZSTD_decompress(out.data(), out.size(), stored.data(), stored.size());
    if (ZSTD_isError(n) || n != length)
      throw Error(Code::kDataLoss,
                  fmt::format("layer {} chunk {}: stored bytes do not decompress to {} bytes ({})", index.layer, i,
                              length, ZSTD_isError(n) ? ZSTD_getErrorName(n) : "wrong length"));
  }
  std::string digest = sha256_digest(out);
  if (std::string_view(digest).substr(7) != index.chunks[i].sha256_hex)
    throw Error(Code::kDataLoss, fmt::format("layer {} chunk {}: sha256 mismatch (got {}, index says sha256:{})",
                                             index.layer, i, digest, index.chunks[i].sha256_hex));
}

namespace {

// Compresses raw[0..n) into packed[0..n) on up to `threads` threads (this one too), and sets the digests of those
// chunks of `index` (from chunk `base` on). A chunk that compression would not make smaller is stored raw.
void compress_chunks(const std::vector<std::string>& raw, std::vector<std::string>& packed, std::size_t n,
                     unsigned threads, int level, ChunkIndex& index, std::size_t base) {
  std::atomic<std::size_t> next{0};
  std::mutex error_mutex;
  std::string error;
  auto work = [&] {
    ZSTD_CCtx* cctx = ZSTD_createCCtx();
    for (std::size_t k; (k = next.fetch_add(1)) < n;) {
      packed[k].resize(ZSTD_compressBound(raw[k].size()));
      std::size_t z = ZSTD_compressCCtx(cctx, packed[k].data(), packed[k].size(), raw[k].data(), raw[k].size(), level);
      if (ZSTD_isError(z)) {
        std::lock_guard lock(error_mutex);
        error = ZSTD_getErrorName(z);
        continue;
      }
      if (z >= raw[k].size()) packed[k] = raw[k];  // incompressible: stored raw
      else packed[k].resize(z);
      index.chunks[base + k].sha256_hex = sha256_digest(raw[k]).substr(7);
    }
    ZSTD_freeCCtx(cctx);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < std::min<std::size_t>(threads, n); ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  if (!error.empty()) throw Error(Code::kInternal, fmt::format("zstd: {}", error));
}

}  // namespace

ChunkedLayer write_chunked_layer(const std::filesystem::path& layer_file, const std::filesystem::path& data_file,
                                 std::uint64_t meta_size, const std::vector<std::uint32_t>& prefetch,
                                 std::uint32_t chunk_size, int level,
                                 const std::function<void(std::uint64_t, std::uint64_t)>& progress) {
  UniqueFd in(::open(layer_file.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) throw_errno_fmt(errno, "open {}", layer_file.string());
  struct stat st {};
  if (::fstat(in.get(), &st) != 0) throw_errno_fmt(errno, "stat {}", layer_file.string());
  const std::uint64_t size = static_cast<std::uint64_t>(st.st_size);
  if (size == 0) throw Error(Code::kInvalidArgument, fmt::format("{} is empty", layer_file.string()));
  UniqueFd out(::open(data_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!out) throw_errno_fmt(errno, "create {}", data_file.string());

  ChunkIndex index;
  index.size = size;
  index.meta_size = meta_size;
  index.chunk_size = chunk_size;
  const std::size_t count = static_cast<std::size_t>((size + chunk_size - 1) / chunk_size);
  index.chunks.resize(count);

  // Chunks are compressed in parallel in windows of a few per thread and written in order.
  const unsigned threads = std::max(1u, std::min(4u, std::thread::hardware_concurrency()));
  const std::size_t window = std::size_t{threads} * 4;
  std::vector<std::string> raw(window), packed(window);
  Sha256 layer_hash, data_hash;
  std::uint64_t data_offset = 0;
  for (std::size_t base = 0; base < count; base += window) {
    const std::size_t n = std::min(window, count - base);
    for (std::size_t k = 0; k < n; ++k) {
      raw[k].resize(index.chunk_length(base + k));
      read_exact_at(in.get(), raw[k].data(), raw[k].size(), static_cast<std::uint64_t>(base + k) * chunk_size,
                    layer_file);
      layer_hash.update(raw[k]);
    }
    compress_chunks(raw, packed, n, threads, level, index, base);
    for (std::size_t k = 0; k < n; ++k) {
      write_all(out.get(), packed[k], data_file);
      data_hash.update(packed[k]);
      index.chunks[base + k].offset = data_offset;
      index.chunks[base + k].length = static_cast<std::uint32_t>(packed[k].size());
      data_offset += packed[k].size();
    }
    if (progress) progress(std::min<std::uint64_t>(size, static_cast<std::uint64_t>(base + n) * chunk_size), size);
  }
  if (::fsync(out.get()) != 0) throw_errno_fmt(errno, "sync {}", data_file.string());
  index.layer = layer_hash.finish();
  index.data = data_hash.finish();
  index.data_size = data_offset;
  for (auto p : prefetch)
    if (p < count) index.prefetch.push_back(p);
  std::sort(index.prefetch.begin(), index.prefetch.end());
  index.prefetch.erase(std::unique(index.prefetch.begin(), index.prefetch.end()), index.prefetch.end());

  ChunkedLayer result;
  result.index_json = chunk_index_to_json(index);
  result.index_digest = sha256_digest(result.index_json);
  result.index = std::move(index);
  result.data_file = data_file;
  return result;
}

}  // namespace dsec::image
