// Image manifests and references.
//
// An image is a manifest: its name and tag and an ordered list of layers, lowest first. Each layer is an immutable
// EROFS filesystem image with a role, named by the sha256 of its bytes, and stored as zstd-compressed chunks
// (chunk_index.hpp). A manifest is itself a blob, named by its digest; a tag ("swe/task-17:latest") is a ref in a
// store that names a manifest digest. Layers are shared: the same base layer under a thousand task images is stored,
// fetched and cached once.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::image {

enum class LayerRole { kBase, kToolchain, kTask, kSnapshot };
std::string_view to_string(LayerRole role);
// INVALID_ARGUMENT for anything but base, toolchain, task, snapshot.
LayerRole parse_layer_role(std::string_view text);

struct LayerDescriptor {
  LayerRole role = LayerRole::kBase;
  std::string digest;             // sha256 of the uncompressed EROFS image: the layer's identity
  std::uint64_t size = 0;         // bytes of the EROFS image
  std::string index;              // digest of the chunk index blob (chunk_index.hpp)
  std::string data;               // digest of the chunk data blob (the compressed chunks, one after another)
  std::uint64_t stored_size = 0;  // bytes of the chunk data blob
  std::uint64_t files_size = 0;   // bytes of file content in the layer (what `du` of its tree would say)
};

struct Manifest {
  static constexpr int kSchemaVersion = 1;
  std::string name;                     // normalised repository, "swe/task-17"
  std::string tag;                      // "latest"
  std::vector<LayerDescriptor> layers;  // lowest first
  double created_at = 0;                // unix seconds
  std::string source;                   // what it was built from ("debootstrap:bookworm +python3", "oci:./img", ...)
  std::string parent;                   // "name:tag@sha256:..." of the image it was built on, or empty
  std::vector<std::string> notes;       // what the build left out or changed (skipped device nodes, ...)

  std::string reference() const { return name + ":" + tag; }
  std::uint64_t size() const;         // sum of layer sizes
  std::uint64_t stored_size() const;  // sum of layer stored sizes
};

// Canonical JSON (sorted keys, no whitespace), so the digest of a manifest is stable.
std::string manifest_to_json(const Manifest& m);
// INVALID_ARGUMENT naming the field for anything malformed (wrong schema version, bad digest, unknown role, no
// layers...).
Manifest manifest_from_json(std::string_view text);

// What a user writes to name an image: "busybox", "busybox:1", "swe/task-17:latest", or with a pinned manifest
// "swe/task-17@sha256:..." / "swe/task-17:latest@sha256:...".
struct ImageReference {
  std::string name;    // normalised repository
  std::string tag;     // "latest" when not given
  std::string digest;  // manifest digest when pinned, else empty

  std::string tagged() const { return name + ":" + tag; }
  std::string to_string() const { return digest.empty() ? tagged() : tagged() + "@" + digest; }
};
// Repositories keep letters, digits, '-', '_', '.', '/' (each '/'-part starts with a letter or digit, at most 255
// characters in all); tags letters, digits, '-', '_', '.' (starting with a letter, digit or '_', at most 128).
// INVALID_ARGUMENT saying what is wrong otherwise.
ImageReference parse_reference(std::string_view text);
// "swe/task-17:latest" -> "swe%2Ftask-17%3Alatest": one path component, safe in a URL and in mount options.
std::string escape_reference(std::string_view tagged);
std::string unescape_reference(std::string_view escaped);

}  // namespace dsec::image
