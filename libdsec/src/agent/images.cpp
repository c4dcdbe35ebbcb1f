#include "agent/images.hpp"

#include "image/store.hpp"

namespace dsec::agent {
namespace {

class ImageStoreSource final : public ImageSource {
 public:
  explicit ImageStoreSource(const std::filesystem::path& root) : store_(root) {}

  ResolvedImage resolve(const std::string& name) const override {
    auto lease = std::make_shared<image::ImageLease>(store_.lease(name));
    const image::ImageRecord& record = lease->record();
    return ResolvedImage{record.name, record.layers, lease};
  }

  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    for (const auto& record : store_.list()) out.push_back(record.name);
    return out;
  }

  void prune() override { store_.prune_stale(); }

 private:
  image::ImageStore store_;
};

}  // namespace

std::unique_ptr<ImageSource> make_image_store_source(const std::filesystem::path& root) {
  return std::make_unique<ImageStoreSource>(root);
}

}  // namespace dsec::agent
