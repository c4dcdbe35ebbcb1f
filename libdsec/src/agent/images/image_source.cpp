#include "agent/images/image_source.hpp"

#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "agent/images/layers/blob_cache.hpp"
#include "agent/images/layers/layer_mounts.hpp"
#include "common/log.hpp"
#include "image/store/catalog.hpp"
#include "image/store/digest.hpp"
#include "image/store/manifest.hpp"

namespace dsec::agent {
namespace {

using layers::BlobCache;
using layers::LayerMounts;
using layers::MountedLayer;
using layers::Stores;

Stores open_stores(const ImageSourceOptions& options) {
  if (options.stores.empty()) throw Error(Code::kInvalidArgument, "images: no image store is configured");
  Stores out;
  for (const auto& url : options.stores) out.push_back(image::open_store(url, options.store_options));
  return out;
}

class LayeredImageSource final : public ImageSource {
 public:
  LayeredImageSource(const ImageSourceOptions& options, LayerMetrics& metrics)
      : mode_(layers::parse_layer_mode(options.layer_mode)),
        stores_(open_stores(options)),
        cache_(layers::BlobCacheOptions{options.cache_dir, options.cache_bytes}, metrics),
        mounts_(layers::LayerMountsOptions{options.mount_dir, mode_, stores_, {}}, cache_, metrics) {
    for (const auto& url : options.stores)
      remote_ = remote_ || url.starts_with("http://") || url.starts_with("https://");
    if (options.registry) {
      // Imports go to the first store (where `dsec image build` and snapshots go too).
      std::vector<image::BlobStore*> all;
      for (const auto& s : stores_) all.push_back(s.get());
      imports_ = std::make_unique<RegistryImports>(*options.registry, *stores_.front(), std::move(all));
    }
  }

  ~LayeredImageSource() override {
    imports_.reset();  // imports are cancelled and joined before the stores go
    mounts_.shutdown();
  }

  ResolvedImage resolve(const std::string& reference, std::string_view manifest_json, ManifestOrigin origin) override {
    image::ImageReference ref = image::parse_reference(reference);
    auto [tagged, digest, manifest] = manifest_of(ref, manifest_json, origin);

    std::vector<MountedLayer> held;
    std::vector<std::filesystem::path> dirs;
    std::vector<layers::LayerImage> images;
    const std::string pinned = tagged + "@" + digest;
    for (std::size_t i = 0; i < manifest->layers.size(); ++i) {
      const image::LayerDescriptor& layer = manifest->layers[i];
      try {
        held.push_back(mounts_.acquire(layer, stores_));
      } catch (const Error& e) {
        throw Error(e.code(),
                    fmt::format("image {}: layer {} of {} ({}, {}): {}", pinned, i + 1, manifest->layers.size(),
                                image::to_string(layer.role), layer.digest, e.what()));
      }
      dirs.push_back(held.back().dir);
      images.push_back(held.back().image);
    }
    // The hold keeps the layers mounted and the manifest known (a snapshot of the sandbox builds on it).
    auto hold = std::make_shared<HeldImage>(HeldImage{std::move(held), manifest});
    if (std::any_of(images.begin(), images.end(), [](const auto& i) { return i.file.empty(); })) images.clear();
    ResolvedImage out{pinned, std::move(dirs), std::move(images), std::move(hold), {}};
    if (manifest->config) out.config = *manifest->config;
    return out;
  }

  std::shared_ptr<const image::Manifest> manifest(const std::string& pinned_reference) override {
    image::ImageReference ref = image::parse_reference(pinned_reference);
    if (ref.digest.empty())
      throw Error(Code::kInvalidArgument,
                  fmt::format("'{}' is not a pinned image reference (name:tag@sha256:...)", pinned_reference));
    return manifest_of(ref, {}, ManifestOrigin::kAgent).manifest;
  }

  std::vector<image::BlobStore*> stores() override {
    std::vector<image::BlobStore*> out;
    for (const auto& s : stores_) out.push_back(s.get());
    return out;
  }

  std::vector<std::string> names() const override {
    // GET /v1/node may be asked often (placement): the listing of an HTTP store serves for a few seconds.
    constexpr auto kFresh = std::chrono::seconds(5);
    std::lock_guard lock(names_mutex_);
    auto now = std::chrono::steady_clock::now();
    if (remote_ && names_at_ && now - *names_at_ < kFresh) return names_;
    std::set<std::string> names;
    for (const auto& store : stores_) {
      try {
        for (auto& ref : store->list_refs())
          if (!image::is_oci_layer_ref(ref)) names.insert(std::move(ref));
      } catch (const std::exception&) {
        // Listing is best effort: a plain HTTP store may not offer it.
      }
    }
    names_.assign(names.begin(), names.end());
    names_at_ = now;
    return names_;
  }

  void prune() override { mounts_.prune(); }

  void shutdown() override { mounts_.shutdown(); }

  LayerStatus layer_status() const override {
    LayerStatus status;
    status.mode = mounts_.mode_description();
    status.cached_layers = cache_.layers();
    auto users = mounts_.users();
    std::map<std::string, std::set<std::string>> images;  // layer digest -> the known images that hold it
    {
      std::lock_guard lock(manifests_mutex_);
      for (const auto& [digest, m] : manifests_)
        for (const auto& layer : m->layers) images[layer.digest].insert(m->reference());
    }
    for (auto& layer : status.cached_layers) {
      if (auto it = users.find(layer.digest); it != users.end()) layer.users = it->second;
      if (auto it = images.find(layer.digest); it != images.end())
        layer.images.assign(it->second.begin(), it->second.end());
    }
    return status;
  }

 private:
  static constexpr std::size_t kManifestCacheSize = 1024;
  using ManifestPtr = std::shared_ptr<const image::Manifest>;
  struct HeldImage {
    std::vector<MountedLayer> layers;
    ManifestPtr manifest;
  };

  struct FoundManifest {
    std::string tagged;  // the image's name:tag (a registry image pinned by the registry's digest: its import tag)
    std::string digest;
    ManifestPtr manifest;
  };

  // The manifest's digest and contents: from the cache of manifests by digest, the client's copy (checked against
  // the pin and, for a caller's, found in a store), the stores, or a registry (imported into the store first). A
  // caller's pinned digest must be its name's image.
  FoundManifest manifest_of(const image::ImageReference& ref, std::string_view json, ManifestOrigin origin) {
    const bool caller = origin == ManifestOrigin::kCaller;
    if (!json.empty()) {
      if (ref.digest.empty())
        throw Error(Code::kInvalidArgument,
                    fmt::format("image_manifest: comes only with a pinned image reference (name:tag@sha256:...), "
                                "not '{}'",
                                ref.to_string()));
      std::string got = image::sha256_digest(json);
      if (got != ref.digest)
        throw Error(Code::kInvalidArgument,
                    fmt::format("image_manifest: its sha256 is {}, but the image reference pins {}", got, ref.digest));
    }
    if (!ref.digest.empty())
      if (ManifestPtr m = cached(ref.digest)) {
        if (caller) check_named(ref, *m);
        return {ref.tagged(), ref.digest, m};
      }
    if (!json.empty()) {
      ManifestPtr m;
      try {
        m = std::make_shared<const image::Manifest>(image::manifest_from_json(json));
      } catch (const Error& e) {
        throw Error(Code::kInvalidArgument, fmt::format("image_manifest: {}", e.what()));
      }
      if (caller) {
        check_stored(ref);
        check_named(ref, *m);
      }
      remember(ref.digest, m);
      return {ref.tagged(), ref.digest, m};
    }
    std::vector<image::BlobStore*> stores;
    for (const auto& s : stores_) stores.push_back(s.get());
    image::ResolvedManifest resolved =
        imports_ && imports_->handles(ref) ? imports_->resolve(ref) : image::fetch_manifest(stores, ref);
    auto m = std::make_shared<const image::Manifest>(std::move(resolved.manifest));
    if (caller && !ref.digest.empty()) check_named(resolved.reference, *m);
    remember(resolved.digest, m);
    return {resolved.reference.tagged(), resolved.digest, m};
  }

  static Error not_in_stores(const image::ImageReference& ref) {
    return Error(Code::kNotFound, fmt::format("image {} is not in any of the node's stores", ref.to_string()));
  }

  // Whether `holds` is true of one of the stores. When none says so and one could not answer, that store's
  // UNAVAILABLE: the answer is not known.
  template <typename Holds>
  bool any_store(const Holds& holds) {
    std::optional<Error> unavailable;
    for (const auto& store : stores_) {
      try {
        if (holds(*store)) return true;
      } catch (const Error& e) {
        if (e.code() != Code::kUnavailable) throw;
        if (!unavailable) unavailable = e;
      }
    }
    if (unavailable) throw *unavailable;
    return false;
  }

  // A caller's copy of a manifest counts once a store holds those bytes: stores hold what dsec wrote (images,
  // snapshots), never a manifest a caller made up to name layers of images it may not use.
  void check_stored(const image::ImageReference& ref) {
    if (!any_store([&](image::BlobStore& s) { return s.has_blob(ref.digest); })) throw not_in_stores(ref);
  }

  // A pinned digest is the image of the name it is pinned to: the manifest names itself so, or a store's tag of
  // that name points to it (an image tagged again). Not another image's digest under a name the caller may use.
  void check_named(const image::ImageReference& ref, const image::Manifest& m) {
    const std::string tagged = ref.tagged();
    if (m.reference() == tagged) return;
    const std::string pinned = tagged + "@" + ref.digest;
    {
      std::lock_guard lock(manifests_mutex_);
      if (tags_seen_.count(pinned)) return;
    }
    if (!any_store([&](image::BlobStore& s) { return s.read_ref(tagged) == ref.digest; })) throw not_in_stores(ref);
    std::lock_guard lock(manifests_mutex_);
    if (tags_seen_.size() >= kManifestCacheSize) tags_seen_.clear();
    tags_seen_.insert(pinned);
  }

  ManifestPtr cached(const std::string& digest) const {
    std::lock_guard lock(manifests_mutex_);
    auto it = manifests_.find(digest);
    return it == manifests_.end() ? nullptr : it->second;
  }

  void remember(const std::string& digest, ManifestPtr m) {
    std::lock_guard lock(manifests_mutex_);
    if (!manifests_.emplace(digest, std::move(m)).second) return;
    manifest_order_.push_back(digest);
    // The oldest go first, except those a sandbox still holds (its HeldImage shares the pointer): they go to the
    // back, so that a snapshot of a long-lived sandbox finds its image's manifest without a store.
    for (std::size_t looked = 0; manifest_order_.size() > kManifestCacheSize && looked < manifest_order_.size();
         ++looked) {
      std::string oldest = std::move(manifest_order_.front());
      manifest_order_.pop_front();
      auto it = manifests_.find(oldest);
      if (it != manifests_.end() && it->second.use_count() > 1) {
        manifest_order_.push_back(std::move(oldest));
        continue;
      }
      manifests_.erase(oldest);
    }
  }

  layers::LayerMode mode_;
  Stores stores_;
  BlobCache cache_;
  LayerMounts mounts_;
  std::unique_ptr<RegistryImports> imports_;  // registry images on first use; none without registry settings
  bool remote_ = false;                       // some store is an HTTP store
  mutable std::mutex names_mutex_;
  mutable std::vector<std::string> names_;
  mutable std::optional<std::chrono::steady_clock::time_point> names_at_;
  mutable std::mutex manifests_mutex_;
  std::map<std::string, ManifestPtr> manifests_;
  std::deque<std::string> manifest_order_;
  std::set<std::string> tags_seen_;  // "name:tag@digest" a store's tag was found to point to
};

}  // namespace

std::unique_ptr<ImageSource> make_layered_image_source(const ImageSourceOptions& options, LayerMetrics& metrics) {
  return std::make_unique<LayeredImageSource>(options, metrics);
}

}  // namespace dsec::agent
