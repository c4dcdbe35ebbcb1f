// How the agent sees the node's images: resolve a name to its read-only layers before a backend is called, and list
// the names for GET /v1/node. The node's image::ImageStore is the real source; tests hand in their own.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace dsec::agent {

struct ResolvedImage {
  std::string name;                                 // normalised ("busybox:latest")
  std::vector<std::filesystem::path> layers;        // lowest first
  // Keeps the layers' files in place while held, even if the image is removed or rebuilt meanwhile: the registry
  // holds it for as long as the sandbox lives. Empty for sources whose files never go away.
  std::shared_ptr<const void> hold;
};

class ImageSource {
 public:
  virtual ~ImageSource() = default;
  // A missing image is dsec::Error(NOT_FOUND) naming it.
  virtual ResolvedImage resolve(const std::string& name) const = 0;
  virtual std::vector<std::string> names() const = 0;
  // Deletes the files of removed or replaced images that no sandbox holds any more. Called by the reaper.
  virtual void prune() {}
};

// The node's image store under `root` (<home>/images).
std::unique_ptr<ImageSource> make_image_store_source(const std::filesystem::path& root);

}  // namespace dsec::agent
