// Images in a store: resolving a reference to its manifest, adding and removing tags, copying an image from one
// store to another (push, pull), and collecting the blobs no image needs any more.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "image/store/blob_store.hpp"
#include "image/store/manifest.hpp"

namespace dsec::image {

struct ResolvedManifest {
  ImageReference reference;  // with digest filled in
  std::string digest;        // of `json`
  std::string json;          // the manifest blob as stored
  Manifest manifest;
};

// The manifest a reference names: its pinned digest, or the digest its tag points to. NOT_FOUND names the image and
// the store ("image swe/task-17:latest is not in store http://..."), DATA_LOSS when the manifest blob is damaged.
ResolvedManifest fetch_manifest(BlobStore& store, const ImageReference& reference);
// Like fetch_manifest, trying each store in turn; NOT_FOUND naming all of them when none has it. UNAVAILABLE from a
// store is remembered and rethrown only when no other store had the image.
ResolvedManifest fetch_manifest(const std::vector<BlobStore*>& stores, const ImageReference& reference);

// Whether a store ref names a registry layer converted by an import ("oci-layer/sha256:..." or "oci-layers/..."; see
// image/registry/import.hpp) rather than an image: listings of images leave them out.
bool is_oci_layer_ref(std::string_view tagged);

// Stores the manifest blob and points the tag m.name:m.tag at it; returns the manifest digest. The blobs of every
// layer must be in the store already (FAILED_PRECONDITION naming the first missing one otherwise), so a tag never
// names an image that cannot be read.
std::string commit_manifest(BlobStore& store, const Manifest& m);

// Like commit_manifest, but the tag must be new: ALREADY_EXISTS naming it when the store has m.name:m.tag already
// (BlobStore::create_ref), and the tag is left as it was. The manifest blob is stored either way (gc collects it).
std::string commit_manifest_new_tag(BlobStore& store, const Manifest& m);

// Progress of long work: what is being done ("layer 2/3 sha256:ab12..."), bytes done and total (0: unknown).
using ProgressFn = std::function<void(std::string_view what, std::uint64_t done, std::uint64_t total)>;

// Copies an image (its layers' blobs, then its manifest, then its tag) from one store to another, skipping blobs
// the destination has. Used by push and pull. Returns bytes copied.
std::uint64_t copy_image(BlobStore& from, BlobStore& to, const ImageReference& reference,
                         const ProgressFn& progress = {});

// Puts a layer's blobs (its chunk index and data) into `to`, copied from the first store of `from` that has both,
// unless `to` has them already (then they are only touched, for gc's grace). Returns the bytes copied. NOT_FOUND
// when no store has them.
std::uint64_t copy_layer_blobs(const std::vector<BlobStore*>& from, BlobStore& to, const LayerDescriptor& layer);

struct GcResult {
  std::vector<std::string> removed;  // blob digests removed (or that would be, in a dry run)
  std::uint64_t removed_bytes = 0;
  std::size_t kept = 0;
  std::vector<std::string> damaged_refs;  // refs whose manifest could not be read (their blobs are all kept)
};
// Removes blobs that no tagged manifest needs. Blobs younger than `grace` are kept, so an image being built or
// pushed at the same time (its blobs written, its tag not yet) loses nothing.
GcResult collect_garbage(BlobStore& store, std::chrono::seconds grace = std::chrono::minutes(10), bool dry_run = false);

// The blobs an image needs: its manifest, and each layer's index and data.
std::vector<std::string> blobs_of(const ResolvedManifest& image);

}  // namespace dsec::image
