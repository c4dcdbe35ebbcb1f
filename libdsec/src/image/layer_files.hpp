// An image's layers as files and mounts on the building machine: what a build on top of a parent reads to find what
// its new layer must hold (tree_diff.hpp). Not the node's way of reading layers (the agent fetches chunks lazily);
// here every chunk of every layer is read, verified and written out whole.
//
// Each layer becomes two files (chunk_index.hpp): "meta", the EROFS metadata image, and "data", its data device,
// mounted with mount(2) type "erofs", source "meta" (a file-backed mount) and the option "device=<data>",
// read-only, nodev, nosuid. The layers are stacked with a read-only overlayfs (lowerdir=top:...:bottom) into one
// merged view; an image of one layer is its own view.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/manifest.hpp"

namespace dsec::image {

struct LayerFiles {
  std::filesystem::path meta;  // the EROFS image (the whole layer when it has no separate data device)
  std::filesystem::path data;  // its data device; empty for a one-part layer
};

// Reads the layer's chunk index and every chunk from `store` (each chunk checked against its digest by
// decode_chunk: DATA_LOSS when one does not match), and writes the layer's parts as `dir`/meta and `dir`/data
// (`dir` is created). INVALID_ARGUMENT when the index does not belong to the layer. `progress` gets bytes written
// of the layer's size.
LayerFiles write_layer_files(BlobStore& store, const LayerDescriptor& layer, const std::filesystem::path& dir,
                             const ProgressFn& progress = {});

// An image's layers written under a scratch directory and mounted as one read-only tree; unmounted and removed when
// the object goes. Needs root (mounting); PERMISSION_DENIED otherwise, and FAILED_PRECONDITION naming what the
// kernel lacks when it cannot mount EROFS from files or overlayfs.
class MountedImage {
 public:
  // `scratch` must not exist; it is created and holds the layer files and mount points.
  MountedImage(BlobStore& store, const Manifest& manifest, const std::filesystem::path& scratch,
               const ProgressFn& progress = {});
  MountedImage(const MountedImage&) = delete;
  MountedImage& operator=(const MountedImage&) = delete;
  ~MountedImage();

  // The merged view of all layers.
  const std::filesystem::path& root() const noexcept { return root_; }
  // Bytes of the layers written (their uncompressed size).
  std::uint64_t layer_bytes() const noexcept { return layer_bytes_; }
  // Unmounts everything and removes the scratch directory; idempotent. The destructor does the same and logs
  // nothing: call this to see errors.
  void release();

 private:
  void mount_layer(const LayerDescriptor& layer, const LayerFiles& files, const std::filesystem::path& at);

  std::filesystem::path scratch_;
  std::filesystem::path root_;
  std::vector<std::filesystem::path> mounts_;  // in mount order
  std::uint64_t layer_bytes_ = 0;
};

}  // namespace dsec::image
