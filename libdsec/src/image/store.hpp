// The node's local image store. For now an image is one read-only root directory; layered, content-addressed EROFS
// images streamed from remote stores replace this (issue: layered images), behind the same lookup.
//
// Layout under the store root (default /var/lib/dsec/images):
//   <escaped name>/manifest.json   {"name", "created_at", "size_bytes", "source", "layers": ["rootfs"]}
//   <escaped name>/rootfs/         the root filesystem, read-only to sandboxes (it is an overlay lower layer)
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace dsec::image {

struct ImageRecord {
  std::string name;                            // normalised: "busybox" and "busybox:latest" are one image
  std::filesystem::path dir;                   // the image's directory in the store
  std::vector<std::filesystem::path> layers;   // read-only root layers, lowest first
  std::uint64_t size_bytes = 0;
  double created_at = 0;
  std::string source;                          // what it was built from
};

// "busybox" -> "busybox:latest"; names keep letters, digits, '-', '_', '.', '/', and one ':' before the tag.
// Throws dsec::Error(INVALID_ARGUMENT) for anything else.
std::string normalize_name(const std::string& name);

class ImageStore {
 public:
  explicit ImageStore(std::filesystem::path root);

  const std::filesystem::path& root() const noexcept { return root_; }

  std::vector<ImageRecord> list() const;
  std::optional<ImageRecord> find(const std::string& name) const;
  // Like find, but a missing image is dsec::Error(NOT_FOUND) naming it and what the store has.
  ImageRecord resolve(const std::string& name) const;
  // Removes an image; NOT_FOUND if it does not exist.
  void remove(const std::string& name);

  // Builders. Each one builds into a temporary directory in the store and renames it into place, so a failed or
  // interrupted build never leaves a half image under the name. An existing image of that name is replaced.
  ImageRecord build_from_directory(const std::string& name, const std::filesystem::path& source_dir);
  // A tiny image from the host's busybox-static: /bin/busybox and a link per applet, /etc/passwd, /tmp.
  ImageRecord build_busybox(const std::string& name, const std::filesystem::path& busybox = "/bin/busybox");
  // debootstrap --variant=minbase SUITE with extra packages (e.g. python3) from the Debian mirror. The debootstrap
  // tree is cached as a tarball under <root>/../cache so a rebuild does not download again.
  ImageRecord build_debootstrap(const std::string& name, const std::string& suite,
                                const std::vector<std::string>& include_packages, const std::string& mirror = {});

 private:
  std::filesystem::path dir_for(const std::string& normalized_name) const;
  std::filesystem::path root_;
};

}  // namespace dsec::image
