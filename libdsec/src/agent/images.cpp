#include "agent/images.hpp"

#include "image/store.hpp"

namespace dsec::agent {
namespace {

class ImageStoreSource final : public ImageSource {
 public:
  explicit ImageStoreSource(const std::filesystem::path& root) : store_(root) {}

  ResolvedImage resolve(const std::string& name) const override {
    image::ImageRecord record = store_.resolve(name);
    return ResolvedImage{record.name, record.layers};
  }

  std::vector<std::string> names() const override {
    std::vector<std::string> out;
    for (const auto& record : store_.list()) out.push_back(record.name);
    return out;
  }

 private:
  image::ImageStore store_;
};

}  // namespace

std::unique_ptr<ImageSource> make_image_store_source(const std::filesystem::path& root) {
  return std::make_unique<ImageStoreSource>(root);
}

}  // namespace dsec::agent
