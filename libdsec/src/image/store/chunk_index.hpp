// How a layer is stored: its EROFS image cut into fixed-size chunks (1 MiB by default), each compressed with zstd on
// its own, written one after another into a data blob; the chunk index says where each chunk lies in the data blob
// and what the sha256 of its uncompressed bytes is. A node can so fetch and verify any part of a layer with one
// Range request, and a reader of 4% of a layer fetches about 4% of it.
//
// A layer's bytes are two EROFS parts one after the other: the metadata image (superblock, inodes, directories,
// xattrs, chunk maps; zero-padded to whole chunks) and its data device (file contents, 4 KiB-aligned), as
// `mkfs.erofs --blobdev=DATA --chunksize=4096 META TREE` writes them. A node mounts the first part with
// "device=<the second>", and fetches all metadata chunks (the `prefetch` list) before the first lookup, so listing
// and opening files never waits for the store and file reads fetch only the chunks holding their data.
// meta_size == 0 means the whole layer is one plain EROFS image (no separate data device).
//
// The index is a JSON blob:
//   {"schema":1, "layer":"sha256:..", "size":N, "meta_size":K, "chunk_size":1048576, "data":"sha256:..", "data_size":M,
//    "chunks":[[offset, stored_length, "hex of sha256 of the uncompressed chunk"], ...],
//    "prefetch":[chunk numbers worth fetching before the first read (the EROFS metadata)]}
// Every chunk but the last is chunk_size bytes uncompressed; the last is the rest. A chunk whose compressed form would
// not be smaller is stored raw (stored_length == its uncompressed length).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::image {

struct ChunkEntry {
  std::uint64_t offset = 0;  // in the data blob
  std::uint32_t length = 0;  // stored bytes in the data blob
  std::string sha256_hex;    // of the uncompressed chunk
};

struct ChunkIndex {
  static constexpr int kSchemaVersion = 1;
  static constexpr std::uint32_t kDefaultChunkSize = 1u << 20;
  std::string layer;            // digest of the uncompressed layer
  std::uint64_t size = 0;       // uncompressed layer bytes
  std::uint64_t meta_size = 0;  // bytes of the EROFS metadata part (a multiple of chunk_size), 0: one plain image
  std::uint32_t chunk_size = kDefaultChunkSize;
  std::string data;  // digest of the data blob
  std::uint64_t data_size = 0;
  std::vector<ChunkEntry> chunks;
  std::vector<std::uint32_t> prefetch;

  std::size_t chunk_count() const noexcept { return chunks.size(); }
  // Uncompressed bytes of chunk i (chunk_size, or less for the last one).
  std::uint32_t chunk_length(std::size_t i) const;
  // The chunk holding byte `offset` of the layer.
  std::size_t chunk_of(std::uint64_t offset) const noexcept { return static_cast<std::size_t>(offset / chunk_size); }
};

std::string chunk_index_to_json(const ChunkIndex& index);
// INVALID_ARGUMENT naming the field for anything malformed or inconsistent (chunk count not matching the size,
// chunks outside the data blob, bad hex...).
ChunkIndex chunk_index_from_json(std::string_view text);

// Decompresses (or copies, for a raw chunk) chunk i from its stored bytes into `out` (resized to the chunk's length)
// and checks its sha256. DATA_LOSS naming the layer and the chunk when the bytes do not decompress to exactly the
// chunk's length or their digest differs.
void decode_chunk(const ChunkIndex& index, std::size_t i, std::string_view stored, std::string& out);

// The blobs a layer is stored as, written by write_chunked_layer.
struct ChunkedLayer {
  ChunkIndex index;
  std::string index_json;           // chunk_index_to_json(index)
  std::string index_digest;         // sha256 of index_json
  std::filesystem::path data_file;  // the data blob, as written
};

// Cuts the EROFS image `layer_file` into chunks, compresses them (zstd level `level`, on `threads` threads) into
// `data_file`, and returns the index. `prefetch` lists the chunks to mark for prefetching. `progress` (if set) is
// called with bytes done and total.
// `meta_size` is recorded in the index as it is.
ChunkedLayer write_chunked_layer(const std::filesystem::path& layer_file, const std::filesystem::path& data_file,
                                 std::uint64_t meta_size, const std::vector<std::uint32_t>& prefetch = {0},
                                 std::uint32_t chunk_size = ChunkIndex::kDefaultChunkSize, int level = 3,
                                 const std::function<void(std::uint64_t done, std::uint64_t total)>& progress = {});

}  // namespace dsec::image
