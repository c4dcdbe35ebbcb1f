// How the agent sees images: resolve a reference to its manifest and the manifest's layers to mounted read-only
// directories before a backend is called, and list the names for GET /v1/node. The real source reads manifests
// from the configured image stores (directory or HTTP) and mounts layers through the node's layer cache
// (agent/layers); tests hand in their own.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "agent/images/layers/layer_image.hpp"
#include "agent/images/registry_imports.hpp"
#include "agent/metrics.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox_info.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/manifest.hpp"

namespace dsec::agent {

struct ResolvedImage {
  std::string name;                           // the reference, pinned: "busybox:latest@sha256:..."
  std::vector<std::filesystem::path> layers;  // lowest first
  // The same layers as EROFS images for virtual machines (empty where the source has none, or in extract mode).
  std::vector<layers::LayerImage> layer_images;
  // Keeps the layers mounted while held: the registry holds it for as long as the sandbox lives. Empty for sources
  // whose layers never go away.
  std::shared_ptr<const void> hold;
  // How the image means to be run (registry images), applied to the sandbox's spec (image_config.hpp).
  std::optional<image::ImageConfig> config;
};

// How the node's layers are kept: GET /v1/node reports it.
struct LayerStatus {
  std::string mode;                        // "erofs-lazy", "extract (<why>)"
  std::vector<CachedLayer> cached_layers;  // each with the images ("name:tag") the source knows hold it
};

// Where a manifest handed to resolve() comes from: a caller's request, or the agent itself (a sandbox's record, a
// fork's parent), which checked it when the sandbox was made.
enum class ManifestOrigin { kCaller, kAgent };

class ImageSource {
 public:
  virtual ~ImageSource() = default;
  // `reference` is "name[:tag]" or pinned "name[:tag]@sha256:<manifest digest>". A client that resolved the name
  // already may send the manifest itself (`manifest_json`, with a pinned reference): the agent checks that its
  // sha256 is the pinned digest (INVALID_ARGUMENT otherwise). A missing image is NOT_FOUND naming it; a damaged one
  // DATA_LOSS; an unreachable store UNAVAILABLE.
  // What a caller names is what it gets: a pinned digest is used only as the image of that name (the manifest names
  // itself so, or a store's tag of that name points to it), and a caller's manifest only once a store holds it
  // (or the source has it from one already), so that no made-up manifest or other name reaches layers the named
  // image does not have. Both are NOT_FOUND, worded as for an image that does not exist. A manifest of
  // ManifestOrigin::kAgent is used as it is.
  virtual ResolvedImage resolve(const std::string& reference, std::string_view manifest_json = {},
                                ManifestOrigin origin = ManifestOrigin::kCaller) = 0;
  // The images the stores hold ("name:tag"), best effort.
  virtual std::vector<std::string> names() const = 0;
  // Unmounts layers no sandbox holds any more and keeps the cache within its limit. Called by the reaper.
  virtual void prune() {}
  // Unmounts everything (agent shutdown): no sandbox may hold a layer any more.
  virtual void shutdown() {}
  virtual LayerStatus layer_status() const { return {}; }
  // The manifest of a pinned reference ("name:tag@sha256:..."): the one resolve() used (kept while a sandbox holds
  // the image), else read from the stores. NOT_FOUND when neither has it. Snapshots build on it.
  virtual std::shared_ptr<const image::Manifest> manifest(const std::string& pinned_reference) {
    throw Error(Code::kUnimplemented, "this image source keeps no manifests");
  }
  // The stores it reads (for copying an image's layers elsewhere); empty when it has none.
  virtual std::vector<image::BlobStore*> stores() { return {}; }
};

struct ImageSourceOptions {
  std::vector<std::string> stores;  // store URLs, tried in order
  image::StoreOptions store_options;
  std::filesystem::path cache_dir;          // the layer cache
  std::uint64_t cache_bytes = 20ull << 30;  // its limit (layers in use are never evicted)
  std::string layer_mode = "auto";          // auto | lazy | extract
  std::filesystem::path mount_dir;          // where layers are mounted (<run dir>/.layers)
  // Registry images on first use (imported into the first store); none: names are store images only.
  std::optional<RegistryImportOptions> registry;
};

// The real image source: manifests from the stores, layers through the node's cache. Throws dsec::Error when a
// store URL or the layer mode is invalid, or the cache directory cannot be used.
std::unique_ptr<ImageSource> make_layered_image_source(const ImageSourceOptions& options, LayerMetrics& metrics);

}  // namespace dsec::agent
