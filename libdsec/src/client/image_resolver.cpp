#include "client/image_resolver.hpp"

#include <fmt/format.h>

#include "dsec/error.hpp"
#include "image/store/catalog.hpp"
#include "image/store/manifest.hpp"

namespace dsec::detail {
namespace {

ImageInfo image_info(const image::ResolvedManifest& m, const std::string& store) {
  ImageInfo out;
  out.name = m.manifest.name;
  out.tag = m.manifest.tag;
  out.reference = m.reference.tagged();
  out.digest = m.digest;
  for (const auto& l : m.manifest.layers)
    out.layers.push_back(ImageLayerInfo{std::string(image::to_string(l.role)), l.digest, l.size, l.stored_size});
  out.size = m.manifest.size();
  out.stored_size = m.manifest.stored_size();
  out.created_at = m.manifest.created_at;
  out.source = m.manifest.source;
  out.parent = m.manifest.parent;
  out.store = store;
  return out;
}

}  // namespace

ImageResolver::ImageResolver(const std::vector<std::string>& store_urls, std::chrono::milliseconds tag_ttl,
                             const image::StoreOptions& options)
    : tag_ttl_(tag_ttl) {
  for (const auto& url : store_urls) stores_.push_back(image::open_store(url, options));
}

std::shared_ptr<const ResolvedImageRef> ImageResolver::resolve(const std::string& image) {
  image::ImageReference ref = image::parse_reference(image);
  // An OCI registry's image is the agents' to resolve: they import it on first use and ask the registry again when
  // its tag's time is up (docs/images.md).
  if (!ref.registry().empty()) return nullptr;
  const std::string tagged = ref.tagged();
  auto lookup = [&]() -> std::shared_ptr<const ResolvedImageRef> {
    std::lock_guard lock(mu_);
    if (!ref.digest.empty()) {
      auto it = digests_.find(ref.digest);
      if (it != digests_.end() && it->second->reference.starts_with(tagged + "@")) return it->second;
      return nullptr;
    }
    auto it = tags_.find(tagged);
    if (it != tags_.end() && std::chrono::steady_clock::now() - it->second.fetched < tag_ttl_) return it->second.value;
    return nullptr;
  };
  if (auto hit = lookup()) return hit;
  std::lock_guard fetching(fetch_mu_);
  if (auto hit = lookup()) return hit;

  std::vector<image::BlobStore*> stores;
  for (auto& s : stores_) stores.push_back(s.get());
  image::ResolvedManifest m = image::fetch_manifest(stores, ref);
  auto value = std::make_shared<ResolvedImageRef>();
  value->reference = m.reference.to_string();
  value->digest = m.digest;
  value->manifest_json = std::move(m.json);
  for (const auto& l : m.manifest.layers) value->layer_digests.push_back(l.digest);
  value->size = m.manifest.size();

  std::lock_guard lock(mu_);
  if (tags_.size() >= kMaxEntries) tags_.clear();
  if (digests_.size() >= kMaxEntries) digests_.clear();
  digests_[value->digest] = value;
  if (ref.digest.empty()) tags_[tagged] = TagEntry{value, std::chrono::steady_clock::now()};
  return value;
}

std::vector<ImageInfo> ImageResolver::list() {
  std::vector<ImageInfo> out;
  for (auto& store : stores_) {
    for (const auto& tagged : store->list_refs()) {
      if (image::is_oci_layer_ref(tagged)) continue;  // a converted registry layer, not an image
      try {
        out.push_back(image_info(image::fetch_manifest(*store, image::parse_reference(tagged)), store->url()));
      } catch (const Error& e) {
        if (e.code() == Code::kUnavailable) throw;
      }
    }
  }
  return out;
}

void ImageResolver::remove(const std::string& image) {
  const std::string tagged = image::parse_reference(image).tagged();
  bool removed = false;
  std::string urls;
  for (auto& store : stores_) {
    if (store->remove_ref(tagged)) removed = true;
    urls += (urls.empty() ? "" : ", ") + store->url();
  }
  {
    std::lock_guard lock(mu_);
    tags_.erase(tagged);
  }
  if (!removed) throw Error(Code::kNotFound, fmt::format("image {} is not in store {}", tagged, urls));
}

}  // namespace dsec::detail
