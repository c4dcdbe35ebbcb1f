// Snapshots of sandboxes (POST /v1/sandboxes/{id}/snapshot): a sandbox's files, captured mid-trajectory, become a
// new image that any node able to read the store can start sandboxes from.
//
// A snapshot freezes the sandbox, copies its writable layer (what it changed on top of its image) into a staging
// directory and lets it run on (BackendSandbox::capture_files), then makes an EROFS layer of role `snapshot` from
// the copy (image::store_tree_as_layer), stores it, and commits a manifest that is the sandbox's image's layers plus
// the new one under the name asked for, in the agent's snapshot store. Files only: processes, memory and open
// descriptors are not part of a snapshot.
//
// Staging: each snapshot in progress works in <staging dir>/<sandbox id>-<random>/ (default <run dir>/.snapshots),
// removed when it ends, whatever the outcome; the directory is emptied when the agent starts, so a snapshot cut
// short by a crash leaves nothing behind there. Blobs it had already stored stay in the store without a tag, for
// `dsec image gc`.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "agent/images/image_source.hpp"
#include "agent/registry/registry.hpp"
#include "dsec/error.hpp"
#include "dsec/spec.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/manifest.hpp"
#include "image/upper_tree.hpp"

namespace dsec::agent {

struct SnapshotOptions {
  std::string node_id;
  std::string store;  // URL of the store snapshots are committed to
  image::StoreOptions store_options;
  std::filesystem::path staging_dir;  // one directory per snapshot in progress; emptied at start
  image::UpperTreeLimits limits;
  std::uint32_t chunk_size = image::ChunkIndex::kDefaultChunkSize;
  // Request ids are remembered this long, and at most this many (the oldest finished ones go first beyond it).
  std::chrono::seconds request_id_retention{3600};
  std::size_t max_request_ids = 4096;
};

struct SnapshotRequest {
  std::string sandbox_id;
  std::string name;        // "repo[:tag]" (tag "latest" when none); never a pinned reference
  std::string request_id;  // optional: a repeat returns the first one's snapshot
};

struct SnapshotOutcome {
  std::string image;   // the new image, pinned: "repo:tag@sha256:<manifest digest>"
  std::string digest;  // the manifest's
  std::string sandbox_id;
  std::string node;
  std::string parent;            // the sandbox's image, pinned
  std::string store;             // where it was committed
  SandboxSpec spec;              // the sandbox's spec, for sandboxes made from the snapshot
  image::LayerDescriptor layer;  // the new layer
  bool layer_existed = false;    // the store had a layer of exactly these bytes already
  image::UpperTreeStats files;
  std::vector<std::string> notes;
  double frozen_seconds = 0;   // the sandbox's processes stood still this long (0: it was asleep anyway)
  double capture_seconds = 0;  // copying its writable layer
  double build_seconds = 0;    // making, compressing and storing the layer, committing the manifest
  double seconds = 0;          // all of it
  bool created = true;         // false: a repeat of an earlier request id, answered with its snapshot
};

class Snapshots {
 public:
  // Opens the store (INVALID_ARGUMENT for a bad URL) and empties the staging directory.
  Snapshots(SnapshotOptions options, Registry& registry, ImageSource& images);
  // Removes the staging directory if it is empty (no snapshot is in progress).
  ~Snapshots();
  Snapshots(const Snapshots&) = delete;
  Snapshots& operator=(const Snapshots&) = delete;

  // Takes a snapshot. Errors: INVALID_ARGUMENT (a malformed or pinned name, a request id reused for another
  // snapshot), NOT_FOUND (an unknown or destroyed sandbox), ALREADY_EXISTS (the name is taken in the store, or
  // another snapshot is being taken under it; tags are never moved), FAILED_PRECONDITION (a failed sandbox, an
  // image whose layers cannot be put into the snapshot store), UNIMPLEMENTED (a backend that cannot snapshot),
  // RESOURCE_EXHAUSTED, not retryable (a full store or staging disk, files beyond the size limit). Whatever fails,
  // no tag is written, the staging directory is removed and the sandbox runs on.
  SnapshotOutcome take(const SnapshotRequest& request);

  // Removes the tag of a fork's snapshot (a "fork/..." name; others are left alone) from the snapshot store once no
  // sandbox made from it lives on this node (RegistryOptions::on_fork_snapshot_unused). Its blobs stay for gc; a
  // tag already gone, or in another store, is fine.
  void release_fork_snapshot(const std::string& tagged);

  const std::string& store_url() const noexcept { return options_.store; }

 private:
  struct Pending;
  SnapshotOutcome make(const SnapshotRequest& request, const image::ImageReference& ref);
  // make()'s steps. Each error names the snapshot (`what`).
  // ALREADY_EXISTS when `tagged` is in the store already (a snapshot never moves a tag).
  void check_name_free(const std::string& tagged, const std::string& what);
  // The snapshot's staging directory, under options_.staging_dir (made, private to the agent, when missing).
  void make_staging_dir(const std::filesystem::path& staging, const std::string& what);
  // The layers of the snapshot's image into the snapshot store, where it lacks them.
  void copy_parent_layers(const image::Manifest& parent, const std::string& what);
  // The snapshot's manifest (`parent`'s layers and out.layer) committed under its new tag; returns its digest.
  std::string commit_snapshot(const image::ImageReference& ref, const image::Manifest& parent,
                              const SnapshotOutcome& out, const std::string& what);
  void evict(std::chrono::steady_clock::time_point now);  // caller holds mutex_

  SnapshotOptions options_;
  Registry& registry_;
  ImageSource& images_;
  std::unique_ptr<image::BlobStore> store_;

  std::mutex mutex_;
  std::condition_variable done_;
  std::set<std::string> names_in_flight_;                     // "repo:tag" being taken now
  std::map<std::string, std::shared_ptr<Pending>> requests_;  // by request id
  std::deque<std::pair<std::chrono::steady_clock::time_point, std::string>> request_order_;
};

// Where a node's snapshots stage their files by default: <run dir>/.snapshots.
std::filesystem::path default_snapshot_staging_dir(const std::filesystem::path& run_dir);

}  // namespace dsec::agent
