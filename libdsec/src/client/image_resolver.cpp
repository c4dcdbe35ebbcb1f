#include "client/image_resolver.hpp"

#include "image/store/catalog.hpp"
#include "image/store/manifest.hpp"

namespace dsec::detail {

ImageResolver::ImageResolver(const std::vector<std::string>& store_urls, std::chrono::milliseconds tag_ttl,
                             const image::StoreOptions& options)
    : tag_ttl_(tag_ttl) {
  for (const auto& url : store_urls) stores_.push_back(image::open_store(url, options));
}

std::shared_ptr<const ResolvedImageRef> ImageResolver::resolve(const std::string& image) {
  image::ImageReference ref = image::parse_reference(image);
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

}  // namespace dsec::detail
