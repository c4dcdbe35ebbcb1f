// The documents of an OCI image as a registry serves them: image indexes (and Docker manifest lists), image
// manifests (OCI and Docker schema 2) and image configurations. Parsing only: every field a registry sends is
// checked, since a registry may be hostile (a size that is negative or absurd, a digest that is not one, a layer of a
// type dsec cannot unpack), and what is wrong is named.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "image/store/manifest.hpp"

namespace dsec::image::registry {

// The media types a manifest request accepts, in the Accept header's form.
extern const char* const kManifestAccept;

struct Platform {
  std::string os;            // "linux"
  std::string architecture;  // "amd64"
  std::string variant;       // "v8", or empty
  std::string to_string() const;
};
// "linux/amd64", "linux/arm64/v8". INVALID_ARGUMENT for anything else.
Platform parse_platform(std::string_view text);

enum class LayerCompression { kNone, kGzip, kZstd };
std::string_view to_string(LayerCompression compression);

struct Descriptor {
  std::string media_type;
  std::string digest;  // sha256:<hex>; other algorithms are refused
  std::uint64_t size = 0;
  std::optional<Platform> platform;                        // index entries
  LayerCompression compression = LayerCompression::kNone;  // layers
};

// What a manifest request answered: an index (pick a platform's manifest from it) or an image manifest.
struct ManifestDocument {
  bool is_index = false;
  std::string media_type;
  std::vector<Descriptor> manifests;  // an index's entries
  Descriptor config;                  // an image manifest's config
  std::vector<Descriptor> layers;     // lowest first
};

// Parses a manifest body. `content_type` is the response's Content-Type (the document's own mediaType wins when it
// has one). INVALID_ARGUMENT naming the field for anything malformed or unsupported: Docker schema 1, a layer media
// type other than tar, tar+gzip, tar+zstd (OCI or Docker), non-distributable layers with no URL dsec fetches,
// more than 1000 layers or index entries.
ManifestDocument parse_manifest(std::string_view body, std::string_view content_type);

// The entry of an index for `wanted` (os and architecture equal; a variant only when both name one), or none.
std::optional<Descriptor> pick_platform(const ManifestDocument& index, const Platform& wanted);
// "linux/amd64, linux/arm64/v8": what an index offers, for an error message.
std::string platforms_of(const ManifestDocument& index);

struct ImageConfigDocument {
  Platform platform;
  ImageConfig config;
  std::vector<std::string> diff_ids;  // sha256 of each layer's uncompressed tar, lowest first
};
// Parses an image configuration blob: os, architecture, config (Env, Entrypoint, Cmd, WorkingDir, User, ExposedPorts,
// Labels, StopSignal) and rootfs.diff_ids. INVALID_ARGUMENT naming the field when malformed.
ImageConfigDocument parse_image_config(std::string_view body);

}  // namespace dsec::image::registry
