// Client-side image resolution: "swe/task-17:latest" -> the manifest it names, so the agent is sent the exact layer
// list (a pinned reference plus the manifest) and never has to look a tag up itself. Tags are cached for a short
// time (a retagged image is seen within the TTL); manifests are cached by digest for good (they are immutable).
#pragma once

#include <chrono>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "dsec/sandbox_info.hpp"
#include "image/store/blob_store.hpp"

namespace dsec::detail {

struct ResolvedImageRef {
  std::string reference;                   // "swe/task-17:latest@sha256:..."
  std::string digest;                      // the manifest's
  std::string manifest_json;               // as stored (its sha256 is `digest`)
  std::vector<std::string> layer_digests;  // lowest first
  std::uint64_t size = 0;                  // bytes of all layers
};

class ImageResolver {
 public:
  ImageResolver(const std::vector<std::string>& store_urls, std::chrono::milliseconds tag_ttl,
                const image::StoreOptions& options = {});
  bool enabled() const noexcept { return !stores_.empty(); }

  // NOT_FOUND naming the stores when no store has the image; INVALID_ARGUMENT for a malformed name; UNAVAILABLE when
  // a store cannot be reached and none had it. Null for an OCI registry's image ("host/repo:tag"): the agent resolves
  // those (imports on first use, re-checks tags).
  std::shared_ptr<const ResolvedImageRef> resolve(const std::string& image);

  // The tagged images of every store, store by store, as `dsec image ls` lists them; an image whose manifest
  // cannot be read is left out. UNAVAILABLE when a store cannot be reached, UNIMPLEMENTED when one cannot list.
  std::vector<ImageInfo> list();
  // Removes the tag `image` ("name[:tag]") from every store that has it, as `dsec image rm` does (the blobs stay
  // for `dsec image gc`), and forgets it here. NOT_FOUND naming the stores when none had it.
  void remove(const std::string& image);

 private:
  struct TagEntry {
    std::shared_ptr<const ResolvedImageRef> value;
    std::chrono::steady_clock::time_point fetched;
  };
  static constexpr std::size_t kMaxEntries = 4096;

  std::vector<std::unique_ptr<image::BlobStore>> stores_;
  std::chrono::milliseconds tag_ttl_;
  std::mutex mu_;
  std::unordered_map<std::string, TagEntry> tags_;                                    // "name:tag"
  std::unordered_map<std::string, std::shared_ptr<const ResolvedImageRef>> digests_;  // manifest digest
  std::mutex fetch_mu_;  // one lookup at a time: a pulse of creates of one cold tag reads it once
};

}  // namespace dsec::detail
