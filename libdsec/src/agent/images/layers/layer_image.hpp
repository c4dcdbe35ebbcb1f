// A layer of an image as the EROFS image files a virtual machine attaches (layer_mounts.hpp makes them).
#pragma once

#include <filesystem>

namespace dsec::agent::layers {

// A layer as an EROFS image a virtual machine attaches as disks: `file` holds the whole image or, for a layer in
// two parts (chunk_index.hpp), its metadata part, and `data_file` its data device. In lazy mode these are the
// files of the layer file system, so a VM's reads fetch only the chunks it touches, as a mount's do. Empty when
// the node keeps layers extracted (the image file is not kept whole then).
struct LayerImage {
  std::filesystem::path file;
  std::filesystem::path data_file;  // empty: the layer is one part
};

}  // namespace dsec::agent::layers
