// Building an image: a root filesystem tree from some source becomes one EROFS layer (mkfs.erofs), cut into
// zstd-compressed chunks, stored in a blob store with a manifest that lists the parent image's layers and the new
// one, and tagged.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "image/layer_tar.hpp"
#include "image/rootfs_builders.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/manifest.hpp"

namespace dsec::image {

// Where a layer's files come from, as the CLI writes it:
//   DIR | dir:DIR            a directory, taken as it is (overlayfs whiteouts and opaque markers in it are kept, so
//                            a sandbox's upper directory is a valid source)
//   tar:FILE | tar:-         a tar stream (compressed or not; '-' is standard input) with OCI whiteouts
//   oci:PATH                 an OCI image layout directory, or a tar of one (docker save)
//   FILE                     a tar, or a tar of an OCI layout (detected)
//   busybox-static           a tiny busybox system from the host's static busybox
//   debootstrap:SUITE        Debian SUITE, minbase, plus BuildOptions::include_packages
struct LayerSource {
  enum class Kind { kDirectory, kTar, kOci, kBusybox, kDebootstrap };
  Kind kind = Kind::kDirectory;
  std::string path;  // directory, file, "-", or the suite
  static LayerSource parse(const std::string& text);
};

struct BuildOptions {
  std::string reference;  // the tag to write: "swe/task-17:latest"
  LayerSource source;
  std::string parent;             // image to build on (its layers go below the new one), or empty
  std::optional<LayerRole> role;  // default: base without a parent, task with one
  // With a parent: the source is a whole root filesystem, and the new layer holds only what differs from the
  // parent's layers (tree_diff.hpp; whiteouts for what it removes). Tar and OCI sources are then applied as a whole
  // image (their whiteouts delete). Default: on for busybox-static and debootstrap sources with a parent, off
  // otherwise. Needs root (the parent's layers are mounted to compare); INVALID_ARGUMENT without a parent.
  std::optional<bool> diff;
  std::vector<std::string> include_packages;  // debootstrap
  std::string mirror;                         // debootstrap
  std::filesystem::path busybox = "/bin/busybox";
  std::filesystem::path cache_dir;        // debootstrap tarballs (required for debootstrap)
  std::filesystem::path work_dir;         // scratch space for the tree and the layer (required)
  std::uint64_t max_bytes = 64ull << 30;  // file content a tar/OCI source may unpack to
  std::uint32_t chunk_size = ChunkIndex::kDefaultChunkSize;
  LogSink log;          // builder output and notes, line by line
  ProgressFn progress;  // long steps: packing chunks, uploading
};

struct BuildResult {
  ResolvedManifest image;
  LayerDescriptor layer;       // the new layer
  bool layer_existed = false;  // the store had the layer already (same bytes built before)
  std::vector<std::string> notes;
  bool diff = false;  // the layer holds the difference from the parent
  double seconds_tree = 0, seconds_diff = 0, seconds_mkfs = 0, seconds_store = 0;
};

// Builds and tags an image in `store`. The parent is resolved in `store` too. Nothing is tagged unless every blob
// is stored; scratch files are removed on success and failure.
BuildResult build_image(BlobStore& store, const BuildOptions& options);

// A new directory "<prefix><12 hex digits>" under `parent` (created if missing), mode 0700, for a build's scratch
// files.
std::filesystem::path make_scratch_dir(const std::filesystem::path& parent, std::string_view prefix);

// Makes a layer from a finished tree: mkfs.erofs, prefetch list, chunks, blobs into the store. Returns the layer's
// descriptor (role as given). Used by build_image and by snapshots of sandboxes.
LayerDescriptor store_tree_as_layer(BlobStore& store, const std::filesystem::path& tree, LayerRole role,
                                    const std::filesystem::path& work_dir, std::vector<std::string>& notes,
                                    const ProgressFn& progress = {}, bool* existed = nullptr,
                                    std::uint32_t chunk_size = ChunkIndex::kDefaultChunkSize);

}  // namespace dsec::image
