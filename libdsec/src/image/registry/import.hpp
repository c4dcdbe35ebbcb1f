// Importing a registry image into a dsec store: one dsec layer per OCI layer, shared across images.
//
// Each OCI layer becomes an EROFS layer of the store, converted once and found again by its OCI digest: the store
// ref "oci-layer/sha256:<hex>" names a one-layer dsec manifest holding it (so garbage collection keeps it while the
// ref stands). Whiteouts become overlayfs ones (layer_tar.hpp, kOverlay), so the layers stack as the image's do. A
// second image that shares layers converts only its own. Layers are converted several at a time, each streamed from
// the registry to a scratch file (resumed when cut, its digest checked), unpacked with dsec's refusals of hostile tar
// members, made into an EROFS image, chunked and compressed into the store; the scratch files go as soon as each
// layer is stored.
//
// Images deeper than `max_layers` have their topmost layers merged into one dsec layer (ref "oci-layers/sha256:<hex
// of their digests>"): overlayfs's mount options fit in one page (4 KiB, some 80 layer paths of a sandbox's run
// directory), and a sandbox's snapshots stack more layers on top, up to the 64 a dsec manifest holds.
//
// The image's manifest then names those layers, keeps the image's configuration (Env, Entrypoint, Cmd, WorkingDir,
// User, ExposedPorts, Labels, StopSignal) and is tagged under the reference's whole name: "host/repo:tag", or for a
// reference pinned by a registry digest "host/repo:sha256-<hex>". Nothing is tagged unless every layer is stored;
// a failed import leaves converted layers (useful to a rerun) and no scratch files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "image/registry/registry_client.hpp"
#include "image/rootfs_builders.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"

namespace dsec::image::registry {

struct ImportOptions {
  std::filesystem::path work_dir;            // scratch space (required)
  std::uint64_t max_bytes = 64ull << 30;     // file content one layer may unpack to
  std::uint64_t max_download = 64ull << 30;  // compressed bytes of all the image's layers
  std::size_t max_layers = 32;               // deeper images have their top layers merged
  unsigned parallel = 3;                     // layers converted at once
  ProgressFn progress;                       // ("layer 2/5 sha256:12ab..", bytes done, bytes total)
  LogSink log;
  CancelFn cancelled;
};

struct ImportResult {
  ResolvedManifest image;       // tagged in the store
  std::string registry_digest;  // what the registry's tag named (an index's digest, or the manifest's)
  std::size_t layers_converted = 0;
  std::size_t layers_reused = 0;
  std::uint64_t bytes_downloaded = 0;
  double seconds = 0;  // wall time of the whole import
  // Where the converted layers' time went, summed over layers (they run three at a time, so these add up to more
  // than `seconds`): downloading, unpacking the tars, and making EROFS images, chunks and blobs of the trees.
  double seconds_download = 0, seconds_unpack = 0, seconds_store = 0;
  std::vector<std::string> notes;
};

// The store ref of a converted OCI layer (or of merged layers, given all their digests lowest first).
std::string oci_layer_ref(const std::vector<std::string>& oci_digests);
// The dsec tag an import writes for a reference: its own, or "sha256-<hex>" for one pinned by a registry digest.
ImageReference import_tag(const ImageReference& ref);
// The registry digest an imported image's manifest says it came from (its source), or empty.
std::string registry_digest_of(const Manifest& m);

// Imports `ref` (a reference that names a registry) into `store`. Errors as the registry client's, plus
// RESOURCE_EXHAUSTED when the image is larger than the budgets or the disk is full, INVALID_ARGUMENT for hostile
// layers (layer_tar.hpp), CANCELLED when `cancelled` said so.
ImportResult import_image(RegistryClient& client, BlobStore& store, const ImageReference& ref,
                          const ImportOptions& options);

}  // namespace dsec::image::registry
