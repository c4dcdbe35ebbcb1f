// Where images live: a content-addressed blob store with a small set of tags (refs). Two kinds share one layout:
//
//   <root>/blobs/sha256/<hex>      manifests, chunk indexes and chunk data, each named by the sha256 of its bytes
//   <root>/refs/<escaped name:tag> a text file holding the manifest digest ("sha256:...\n")
//   <root>/.tmp/                   (directory stores) files being written, renamed into place when whole
//
// * a directory store ("/srv/dsec-store", "file:///srv/dsec-store"): also any shared filesystem mounted on every node
//   (NFS, CephFS, 3FS);
// * an HTTP(S) store ("http://host:8080/dsec", "https://..."): reads are GETs, chunk reads are Range requests, so an
//   object store or a plain nginx serves it; writes are PUT and DELETE (nginx's dav module, or an object store's API);
//   listing (for `dsec image ls` and gc) reads nginx's JSON autoindex where the server offers it.
//
// Errors: a missing blob or ref is NOT_FOUND; a store that cannot be reached, times out or answers 5xx is UNAVAILABLE
// (worth retrying); bytes that do not match their digest are DATA_LOSS; a full disk is RESOURCE_EXHAUSTED; a store
// that cannot do something (listing over plain HTTP) is UNIMPLEMENTED. Nothing half-written is ever visible under a
// blob's or ref's name. All methods are safe to call from several threads at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::image {

struct StoreOptions {
  // HTTP: connection setup limit, and the longest one request may take (a chunk, a manifest, a whole blob upload
  // gets max(request_timeout, size / 1 MiB/s)).
  std::chrono::milliseconds connect_timeout{3000};
  std::chrono::milliseconds request_timeout{15000};
  // HTTP: attempts per read on UNAVAILABLE (connection refused or reset, timeout, 5xx), with backoff between them.
  int attempts = 3;
  // HTTPS: a CA bundle to trust instead of the system's; verification is never turned off.
  std::string ca_file;
};

struct BlobInfo {
  std::string digest;
  std::uint64_t size = 0;
  double modified = 0;  // unix seconds; 0 when the store does not say
};

class BlobStore {
 public:
  virtual ~BlobStore() = default;
  // The store as the user named it, for messages.
  virtual const std::string& url() const = 0;

  virtual bool has_blob(const std::string& digest) = 0;
  // has_blob, and where the store keeps times (directory stores), marks the blob as just used, so a garbage
  // collection running now keeps it: a writer that finds a blob present and reuses it calls this, not has_blob.
  virtual bool touch_blob(const std::string& digest) { return has_blob(digest); }
  // A whole blob, checked against its digest. RESOURCE_EXHAUSTED when it is larger than max_size (manifests and
  // indexes are small; a hostile store must not make a reader allocate gigabytes).
  virtual std::string read_blob(const std::string& digest, std::uint64_t max_size = 64u << 20) = 0;
  // Exactly `length` bytes of a blob from `offset` (unverified: chunk readers check each chunk's own digest).
  // OUT_OF_RANGE when the blob is shorter.
  virtual std::string read_range(const std::string& digest, std::uint64_t offset, std::uint64_t length) = 0;
  // Stores a blob whose bytes are in `file` / `bytes`, checking them against `digest` first (DATA_LOSS if they
  // differ). Storing a blob that is there already is a no-op.
  virtual void put_blob_file(const std::string& digest, const std::filesystem::path& file) = 0;
  virtual void put_blob(const std::string& digest, std::string_view bytes) = 0;
  virtual void remove_blob(const std::string& digest) = 0;
  // Every blob in the store (for garbage collection), sorted by digest.
  virtual std::vector<BlobInfo> list_blobs() = 0;

  // Refs: "name:tag" (normalised) -> manifest digest.
  virtual std::optional<std::string> read_ref(const std::string& tagged) = 0;
  virtual void write_ref(const std::string& tagged, const std::string& manifest_digest) = 0;
  // Points a tag that does not exist yet at a manifest; false (and nothing written) when the tag exists. Directory
  // stores do this atomically. HTTP stores look first, then PUT with `If-None-Match: *`, which object stores honour
  // and a server answers 412 to when the tag appeared meanwhile; a plain nginx ignores the header, so there a tag
  // written by another writer between the look and the PUT is replaced. This default looks, then writes.
  virtual bool create_ref(const std::string& tagged, const std::string& manifest_digest) {
    if (read_ref(tagged)) return false;
    write_ref(tagged, manifest_digest);
    return true;
  }
  // False when there was no such ref.
  virtual bool remove_ref(const std::string& tagged) = 0;
  // Every "name:tag", sorted.
  virtual std::vector<std::string> list_refs() = 0;

  // An exclusive claim on `name` (work that must run once per store at a time: importing one registry image or
  // layer), held until the returned handle is dropped; other claimers of the name wait for it. Directory stores
  // hold flock(2) on <root>/.locks/<name> (every process of the node, and the nodes of a shared file system that
  // honours flock); other stores claim within this process only. `name` is a ref-like name ("name:tag").
  virtual std::shared_ptr<void> claim(const std::string& name);
};

// A store from its URL: "http://..." and "https://..." are HTTP stores, "file:///path" and plain paths directory
// stores (a directory store is created on first write). INVALID_ARGUMENT for any other scheme.
std::unique_ptr<BlobStore> open_store(std::string_view url, const StoreOptions& options = {});
std::unique_ptr<BlobStore> open_directory_store(const std::filesystem::path& root);
std::unique_ptr<BlobStore> open_http_store(std::string_view url, const StoreOptions& options);

}  // namespace dsec::image
