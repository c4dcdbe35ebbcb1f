// Image manifests and references.
//
// An image is a manifest: its name and tag and an ordered list of layers, lowest first. Each layer is an immutable
// EROFS filesystem image with a role, named by the sha256 of its bytes, and stored as zstd-compressed chunks
// (chunk_index.hpp). A manifest is itself a blob, named by its digest; a tag ("swe/task-17:latest") is a ref in a
// store that names a manifest digest. Layers are shared: the same base layer under a thousand task images is stored,
// fetched and cached once.
#pragma once

#include <cstdint>
#include <map>
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

// How the image means to be run: the "config" of an OCI image's configuration, kept when an image comes from a
// registry (docs/images.md). Each field as OCI defines it; empty when the image does not say.
struct ImageConfig {
  std::vector<std::string> env;               // "KEY=value", in the image's order
  std::vector<std::string> entrypoint;        //
  std::vector<std::string> cmd;               // the entrypoint's arguments, or the command when there is no entrypoint
  std::string working_dir;                    // absolute
  std::string user;                           // "name", "uid", "uid:gid" or "name:group"
  std::vector<std::string> exposed_ports;     // "8080/tcp", sorted
  std::map<std::string, std::string> labels;  //
  std::string stop_signal;                    // "SIGTERM", "15"
  bool operator==(const ImageConfig&) const = default;
};

struct Manifest {
  // Version 1 has no config; a manifest with a config is written as version 2. Both are read.
  static constexpr int kSchemaVersion = 2;
  std::string name;                     // normalised repository, "swe/task-17"
  std::string tag;                      // "latest"
  std::vector<LayerDescriptor> layers;  // lowest first
  double created_at = 0;                // unix seconds
  std::string source;                   // what it was built from ("debootstrap:bookworm +python3", "oci:./img", ...)
  std::string parent;                   // "name:tag@sha256:..." of the image it was built on, or empty
  std::vector<std::string> notes;       // what the build left out or changed (skipped device nodes, ...)
  std::optional<ImageConfig> config;    // how the image means to be run (registry images), or none

  std::string reference() const { return name + ":" + tag; }
  std::uint64_t size() const;         // sum of layer sizes
  std::uint64_t stored_size() const;  // sum of layer stored sizes
};

// Canonical JSON (sorted keys, no whitespace), so the digest of a manifest is stable. Schema version 1 unless the
// manifest has a config, so that images without one read as before in older dsec.
std::string manifest_to_json(const Manifest& m);
// INVALID_ARGUMENT naming the field for anything malformed (wrong schema version, bad digest, unknown role, no
// layers...).
Manifest manifest_from_json(std::string_view text);

// What a user writes to name an image: "busybox", "busybox:1", "swe/task-17:latest", or with a pinned manifest
// "swe/task-17@sha256:..." / "swe/task-17:latest@sha256:...". A name whose first '/'-part names a host (it has a '.'
// or a ':' port, or is "localhost") is an image of that OCI registry: "registry.example:5000/swebench/task:v1"; the
// host is part of the name (lowercased), so its images sit in dsec's stores under the whole name.
struct ImageReference {
  std::string name;    // normalised repository, with its registry host first when it names one
  std::string tag;     // "latest" when not given
  std::string digest;  // manifest digest when pinned, else empty

  std::string tagged() const { return name + ":" + tag; }
  std::string to_string() const { return digest.empty() ? tagged() : tagged() + "@" + digest; }
  // The registry host ("registry.example:5000"), or empty for a name of dsec's stores.
  std::string_view registry() const;
  // The repository within the registry ("swebench/task"): the name without its host.
  std::string_view repository() const;
};
// Repositories keep letters, digits, '-', '_', '.', '/' (each '/'-part starts with a letter or digit, at most 255
// characters in all); tags letters, digits, '-', '_', '.' (starting with a letter, digit or '_', at most 128); a
// registry host is DNS labels of letters, digits and '-' joined by '.', with an optional ":port" (1-65535).
// INVALID_ARGUMENT saying what is wrong otherwise.
ImageReference parse_reference(std::string_view text);
// "swe/task-17:latest" -> "swe%2Ftask-17%3Alatest": one path component, safe in a URL and in mount options.
std::string escape_reference(std::string_view tagged);
std::string unescape_reference(std::string_view escaped);

}  // namespace dsec::image
