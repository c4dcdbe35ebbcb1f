#include "image/store/catalog.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dsec/error.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/digest.hpp"

namespace dsec::image {
namespace {

constexpr std::uint64_t kMaxManifestBytes = 1u << 20;
constexpr std::uint64_t kMaxIndexBytes = 64u << 20;
constexpr std::uint64_t kCopyPiece = 8u << 20;

double now_unix() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

std::string short_digest(const std::string& digest) { return digest.substr(0, 19); }

// The manifest's blob, put in `store` once every layer blob it names is there (FAILED_PRECONDITION naming the first
// that is not): its digest, for commit_manifest and commit_manifest_new_tag to tag.
std::string put_manifest(BlobStore& store, const Manifest& m) {
  for (const auto& layer : m.layers)
    for (const std::string* blob : {&layer.index, &layer.data})
      if (!store.touch_blob(*blob))
        throw Error(Code::kFailedPrecondition,
                    fmt::format("image {}: layer {} needs blob {}, which store {} lacks", m.reference(),
                                short_digest(layer.digest), *blob, store.url()));
  std::string json = manifest_to_json(m);
  std::string digest = sha256_digest(json);
  store.put_blob(digest, json);
  return digest;
}

}  // namespace

ResolvedManifest fetch_manifest(BlobStore& store, const ImageReference& reference) {
  ResolvedManifest out;
  out.reference = reference;
  if (!reference.digest.empty()) {
    out.digest = reference.digest;
  } else {
    std::optional<std::string> digest = store.read_ref(reference.tagged());
    if (!digest)
      throw Error(Code::kNotFound, fmt::format("image {} is not in store {}", reference.tagged(), store.url()));
    out.digest = *digest;
  }
  try {
    out.json = store.read_blob(out.digest, kMaxManifestBytes);
  } catch (const Error& e) {
    if (e.code() == Code::kNotFound)
      throw Error(reference.digest.empty() ? Code::kDataLoss : Code::kNotFound,
                  fmt::format("image {}: manifest {} is not in store {}", reference.tagged(), out.digest, store.url()));
    throw;
  }
  try {
    out.manifest = manifest_from_json(out.json);
  } catch (const Error& e) {
    throw Error(Code::kDataLoss, fmt::format("image {} in store {}: {}", reference.tagged(), store.url(), e.what()));
  }
  out.reference.digest = out.digest;
  return out;
}

ResolvedManifest fetch_manifest(const std::vector<BlobStore*>& stores, const ImageReference& reference) {
  if (stores.empty())
    throw Error(Code::kFailedPrecondition,
                fmt::format("image {}: no image store is configured", reference.to_string()));
  std::optional<Error> unavailable;
  std::vector<std::string> urls;
  for (BlobStore* store : stores) {
    urls.push_back(store->url());
    try {
      return fetch_manifest(*store, reference);
    } catch (const Error& e) {
      if (e.code() == Code::kNotFound) continue;
      if (e.code() == Code::kUnavailable) {
        if (!unavailable) unavailable = e;
        continue;
      }
      throw;
    }
  }
  if (unavailable) throw *unavailable;
  throw Error(Code::kNotFound, fmt::format("image {} is not in {} {}", reference.to_string(),
                                           stores.size() == 1 ? "store" : "any of the stores", fmt::join(urls, ", ")));
}

bool is_oci_layer_ref(std::string_view tagged) {
  return tagged.starts_with("oci-layer/sha256:") || tagged.starts_with("oci-layers/sha256:");
}

std::string commit_manifest(BlobStore& store, const Manifest& m) {
  std::string digest = put_manifest(store, m);
  store.write_ref(m.reference(), digest);
  return digest;
}

std::vector<std::string> blobs_of(const ResolvedManifest& image) {
  std::vector<std::string> out{image.digest};
  for (const auto& layer : image.manifest.layers) {
    out.push_back(layer.index);
    out.push_back(layer.data);
  }
  return out;
}

namespace {

// Copies one layer's index and data blobs from `from` to `to`, skipping what `to` has. Adds the layer's stored size
// to `done` (reporting progress as it goes); returns the bytes copied.
std::uint64_t copy_layer(BlobStore& from, BlobStore& to, const LayerDescriptor& layer, const std::string& image,
                         const std::string& what, const ProgressFn& progress, std::uint64_t& done,
                         std::uint64_t total) {
  std::uint64_t copied = 0;
  if (!to.touch_blob(layer.index)) {
    std::string index_json = from.read_blob(layer.index, kMaxIndexBytes);
    ChunkIndex index = chunk_index_from_json(index_json);
    if (index.data != layer.data || index.layer != layer.digest)
      throw Error(Code::kDataLoss, fmt::format("image {}: the chunk index of layer {} does not match the manifest",
                                               image, short_digest(layer.digest)));
    to.put_blob(layer.index, index_json);
    copied += index_json.size();
  }
  if (to.touch_blob(layer.data)) {
    done += layer.stored_size;
    if (progress) progress(what + " (already there)", done, total);
    return copied;
  }
  // The data blob goes through a local temporary file, piece by piece, and is verified by put_blob_file. Its name
  // is this copy's own: threads of one process may copy the same layer at once (snapshots of one image).
  static std::atomic<std::uint64_t> serial{0};
  std::filesystem::path tmp =
      std::filesystem::temp_directory_path() /
      fmt::format("dsec-copy-{}-{}-{}", ::getpid(), serial.fetch_add(1), digest_hex(layer.data).substr(0, 16));
  struct Remove {
    std::filesystem::path p;
    ~Remove() {
      std::error_code ec;
      std::filesystem::remove(p, ec);
    }
  } remove_tmp{tmp};
  {
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) throw Error(Code::kInternal, fmt::format("create {}: {}", tmp.string(), std::strerror(errno)));
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> closer(f, &std::fclose);
    for (std::uint64_t off = 0; off < layer.stored_size; off += kCopyPiece) {
      std::uint64_t n = std::min(kCopyPiece, layer.stored_size - off);
      std::string piece = from.read_range(layer.data, off, n);
      if (std::fwrite(piece.data(), 1, piece.size(), f) != piece.size())
        throw Error(errno == ENOSPC ? Code::kResourceExhausted : Code::kInternal,
                    fmt::format("write {}: {}", tmp.string(), std::strerror(errno)));
      done += n;
      if (progress) progress(what, done, total);
    }
    if (std::fflush(f) != 0)
      throw Error(errno == ENOSPC ? Code::kResourceExhausted : Code::kInternal,
                  fmt::format("write {}: {}", tmp.string(), std::strerror(errno)));
  }
  to.put_blob_file(layer.data, tmp);
  return copied + layer.stored_size;
}

}  // namespace

std::uint64_t copy_image(BlobStore& from, BlobStore& to, const ImageReference& reference, const ProgressFn& progress) {
  ResolvedManifest image = fetch_manifest(from, reference);
  const Manifest& m = image.manifest;
  std::uint64_t total = 0, done = 0, copied = 0;
  for (const auto& layer : m.layers) total += layer.stored_size;
  for (std::size_t i = 0; i < m.layers.size(); ++i) {
    const LayerDescriptor& layer = m.layers[i];
    std::string what =
        fmt::format("layer {}/{} {} ({})", i + 1, m.layers.size(), short_digest(layer.digest), to_string(layer.role));
    copied += copy_layer(from, to, layer, reference.tagged(), what, progress, done, total);
  }
  to.put_blob(image.digest, image.json);
  to.write_ref(m.reference(), image.digest);
  return copied + image.json.size();
}

std::uint64_t copy_layer_blobs(const std::vector<BlobStore*>& from, BlobStore& to, const LayerDescriptor& layer) {
  if (to.touch_blob(layer.index) && to.touch_blob(layer.data)) return 0;
  std::vector<std::string> urls;
  for (BlobStore* store : from) {
    if (store == &to) continue;
    urls.push_back(store->url());
    bool has = false;
    try {
      has = store->has_blob(layer.index) && store->has_blob(layer.data);
    } catch (const Error& e) {
      if (e.code() != Code::kUnavailable) throw;
    }
    if (!has) continue;
    std::uint64_t done = 0;
    return copy_layer(*store, to, layer, fmt::format("of a {} layer", to_string(layer.role)),
                      short_digest(layer.digest), {}, done, layer.stored_size);
  }
  std::string others = urls.empty() ? std::string("no other store") : fmt::format("{}", fmt::join(urls, ", "));
  throw Error(Code::kNotFound,
              fmt::format("layer {}: its blobs are neither in store {} nor in {}", layer.digest, to.url(), others));
}

std::string commit_manifest_new_tag(BlobStore& store, const Manifest& m) {
  std::string digest = put_manifest(store, m);
  if (!store.create_ref(m.reference(), digest))
    throw Error(Code::kAlreadyExists,
                fmt::format("image {} exists in store {}; a tag is never moved by a snapshot: choose another name or "
                            "remove it first (dsec image rm)",
                            m.reference(), store.url()));
  return digest;
}

GcResult collect_garbage(BlobStore& store, std::chrono::seconds grace, bool dry_run) {
  GcResult result;
  // Listing blobs first: a blob written after this listing is not in it, so it cannot be removed.
  std::vector<BlobInfo> blobs = store.list_blobs();
  std::set<std::string> needed;
  for (const std::string& tagged : store.list_refs()) {
    try {
      ResolvedManifest image = fetch_manifest(store, parse_reference(tagged));
      for (auto& blob : blobs_of(image)) needed.insert(std::move(blob));
    } catch (const Error& e) {
      if (e.code() == Code::kUnavailable) throw;
      result.damaged_refs.push_back(fmt::format("{}: {}", tagged, e.what()));
      // Keep what the damaged ref's manifest digest names, if it names one.
      try {
        if (auto d = store.read_ref(tagged)) needed.insert(*d);
      } catch (const Error&) {
      }
    }
  }
  const double cutoff = now_unix() - static_cast<double>(grace.count());
  std::vector<const BlobInfo*> candidates;
  for (const BlobInfo& blob : blobs) {
    if (needed.count(blob.digest) || blob.modified == 0 || blob.modified > cutoff) {
      ++result.kept;
      continue;
    }
    candidates.push_back(&blob);
  }
  if (!candidates.empty() && !dry_run) {
    // A second look just before removing: a writer may have reused a candidate (touch_blob renews its time) or
    // tagged an image that needs it since the first listing.
    std::map<std::string, double> fresh;
    for (const BlobInfo& b : store.list_blobs()) fresh[b.digest] = b.modified;
    for (const std::string& tagged : store.list_refs()) {
      try {
        for (auto& blob : blobs_of(fetch_manifest(store, parse_reference(tagged)))) needed.insert(std::move(blob));
      } catch (const Error& e) {
        if (e.code() == Code::kUnavailable) throw;
      }
    }
    std::vector<const BlobInfo*> still;
    for (const BlobInfo* b : candidates) {
      auto it = fresh.find(b->digest);
      if (it == fresh.end()) continue;  // gone already
      if (needed.count(b->digest) || it->second == 0 || it->second > cutoff) {
        ++result.kept;
        continue;
      }
      still.push_back(b);
    }
    candidates.swap(still);
  }
  for (const BlobInfo* blob : candidates) {
    if (!dry_run) store.remove_blob(blob->digest);
    result.removed.push_back(blob->digest);
    result.removed_bytes += blob->size;
  }
  return result;
}

}  // namespace dsec::image
