#include "agent/images/snapshots.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <random>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"
#include "image/build.hpp"
#include "image/fs_tree.hpp"
#include "image/store/catalog.hpp"

namespace dsec::agent {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::size_t kMaxRequestId = 128;

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string random_hex() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{:012x}", rng() & 0xffffffffffffull);
}

// The same failure with what was being done in front; a full disk is not worth an automatic retry.
[[noreturn]] void rethrow_with(const Error& e, const std::string& what) {
  bool retryable = e.retryable() && e.code() != Code::kResourceExhausted;
  throw Error(e.code(), fmt::format("{}: {}", what, e.what()), retryable);
}

}  // namespace

struct Snapshots::Pending {
  std::string fingerprint;  // sandbox id and name: a request id names one snapshot
  bool done = false;
  std::optional<SnapshotOutcome> outcome;
  std::optional<Error> error;
  Clock::time_point at;
};

fs::path default_snapshot_staging_dir(const fs::path& run_dir) { return run_dir / ".snapshots"; }

Snapshots::Snapshots(SnapshotOptions options, Registry& registry, ImageSource& images)
    : options_(std::move(options)), registry_(registry), images_(images) {
  if (options_.store.empty()) throw Error(Code::kInvalidArgument, "snapshots: no snapshot store is configured");
  if (options_.staging_dir.empty()) throw Error(Code::kInvalidArgument, "snapshots: no staging directory");
  store_ = image::open_store(options_.store, options_.store_options);
  // What an agent that died mid-snapshot left: its staging files (never a tag). The directory itself is made by
  // the first snapshot.
  image::remove_tree(options_.staging_dir);
}

Snapshots::~Snapshots() { ::rmdir(options_.staging_dir.c_str()); }

void Snapshots::evict(Clock::time_point now) {
  while (!request_order_.empty()) {
    auto& [at, id] = request_order_.front();
    auto it = requests_.find(id);
    bool stale = it == requests_.end() || it->second->at != at;
    if (!stale) {
      bool over = requests_.size() > options_.max_request_ids || now - at >= options_.request_id_retention;
      if (!over || !it->second->done) break;
      requests_.erase(it);
    }
    request_order_.pop_front();
  }
}

SnapshotOutcome Snapshots::take(const SnapshotRequest& request) {
  image::ImageReference ref = image::parse_reference(request.name);
  if (!ref.digest.empty())
    throw Error(Code::kInvalidArgument,
                fmt::format("name: '{}' pins a digest; a snapshot is named by a repository and a tag (repo:tag)",
                            request.name));
  if (request.request_id.size() > kMaxRequestId)
    throw Error(Code::kInvalidArgument, fmt::format("request_id: longer than {} bytes", kMaxRequestId));
  const std::string tagged = ref.tagged();

  std::shared_ptr<Pending> pending;
  {
    std::unique_lock lock(mutex_);
    evict(Clock::now());
    if (!request.request_id.empty()) {
      const std::string fingerprint = request.sandbox_id + "\n" + tagged;
      auto it = requests_.find(request.request_id);
      if (it != requests_.end()) {
        std::shared_ptr<Pending> first = it->second;
        if (first->fingerprint != fingerprint)
          throw Error(Code::kInvalidArgument,
                      fmt::format("request_id: '{}' was already used for another snapshot", request.request_id));
        done_.wait(lock, [&] { return first->done; });
        if (first->error) throw *first->error;
        SnapshotOutcome repeat = *first->outcome;
        repeat.created = false;
        return repeat;
      }
      pending = std::make_shared<Pending>();
      pending->fingerprint = fingerprint;
      pending->at = Clock::now();
      requests_.emplace(request.request_id, pending);
      request_order_.emplace_back(pending->at, request.request_id);
    }
    if (!names_in_flight_.insert(tagged).second) {
      Error busy(Code::kAlreadyExists,
                 fmt::format("a snapshot named {} is being taken on node {} now", tagged, options_.node_id));
      if (pending) {
        pending->done = true;
        pending->error = busy;
        requests_.erase(request.request_id);
        done_.notify_all();
      }
      throw busy;
    }
  }

  std::optional<SnapshotOutcome> outcome;
  std::optional<Error> error;
  try {
    outcome = make(request, ref);
  } catch (const Error& e) {
    error = e;
  } catch (const std::exception& e) {
    error = Error(Code::kInternal, e.what());
  }
  {
    std::lock_guard lock(mutex_);
    names_in_flight_.erase(tagged);
    if (pending) {
      pending->done = true;
      pending->outcome = outcome;
      pending->error = error;
      // A failed snapshot is not remembered: the caller may try again with the same request id.
      if (error) {
        auto it = requests_.find(request.request_id);
        if (it != requests_.end() && it->second == pending) requests_.erase(it);
      }
    }
  }
  done_.notify_all();
  if (error) throw *error;
  return *outcome;
}

void Snapshots::release_fork_snapshot(const std::string& tagged) {
  if (!tagged.starts_with(protocol::kForkSnapshotPrefix)) return;
  const std::string name = image::parse_reference(tagged).tagged();
  if (store_->remove_ref(name))
    log_info("fork snapshot {}: its last sandbox on this node is gone; tag removed from {}", name, store_->url());
}

void Snapshots::check_name_free(const std::string& tagged, const std::string& what) {
  try {
    if (store_->read_ref(tagged))
      throw Error(Code::kAlreadyExists,
                  fmt::format("image {} exists in store {}; a snapshot never moves a tag: choose another name or "
                              "remove it first (dsec image rm)",
                              tagged, store_->url()));
  } catch (const Error& e) {
    if (e.code() == Code::kAlreadyExists) throw;
    rethrow_with(e, what);
  }
}

void Snapshots::make_staging_dir(const fs::path& staging, const std::string& what) {
  std::error_code ec;
  fs::create_directories(options_.staging_dir, ec);
  if (ec)
    throw Error(code_for_errno(ec.value()),
                fmt::format("{}: mkdir {}: {}", what, options_.staging_dir.string(), ec.message()));
  ::chmod(options_.staging_dir.c_str(), 0700);
  if (::mkdir(staging.c_str(), 0700) != 0) throw_errno_fmt(errno, "{}: mkdir {}", what, staging.string());
}

void Snapshots::copy_parent_layers(const image::Manifest& parent, const std::string& what) {
  for (const image::LayerDescriptor& layer : parent.layers) {
    try {
      image::copy_layer_blobs(images_.stores(), *store_, layer);
    } catch (const Error& e) {
      if (e.code() == Code::kNotFound)
        throw Error(Code::kFailedPrecondition,
                    fmt::format("{}: its image's layers cannot be put into the snapshot store: {}", what, e.what()));
      rethrow_with(e, fmt::format("{}: copying its image's layers into {}", what, store_->url()));
    }
  }
}

std::string Snapshots::commit_snapshot(const image::ImageReference& ref, const image::Manifest& parent,
                                       const SnapshotOutcome& out, const std::string& what) {
  image::Manifest m;
  m.name = ref.name;
  m.tag = ref.tag;
  m.layers = parent.layers;
  m.layers.push_back(out.layer);
  m.parent = out.parent;
  m.created_at = unix_now();
  m.source = fmt::format("snapshot of sandbox {} on node {}", out.sandbox_id, options_.node_id);
  m.notes = out.notes;
  m.config = parent.config;  // a snapshot runs as its image did
  try {
    return image::commit_manifest_new_tag(*store_, m);
  } catch (const Error& e) {
    if (e.code() == Code::kAlreadyExists) throw;
    rethrow_with(e, fmt::format("{}: committing it to {}", what, store_->url()));
  }
}

SnapshotOutcome Snapshots::make(const SnapshotRequest& request, const image::ImageReference& ref) {
  const auto started = Clock::now();
  const std::string tagged = ref.tagged();
  const std::string& id = request.sandbox_id;
  const std::string what = fmt::format("snapshot {} of sandbox {}", tagged, id);

  SandboxHandle handle = registry_.acquire(id);  // NOT_FOUND for an unknown or destroyed sandbox
  SandboxInfo info = registry_.get(id);
  if (info.state == "failed")
    throw Error(Code::kFailedPrecondition, fmt::format("{}: the sandbox has failed ({})", what, info.message));
  if (info.state != "running" && info.state != "sleeping")
    throw Error(Code::kFailedPrecondition, fmt::format("{}: the sandbox is {}", what, info.state));

  SnapshotOutcome out;
  out.sandbox_id = id;
  out.node = options_.node_id;
  out.parent = info.image;
  out.store = store_->url();
  out.spec = registry_.spec(id);

  // Early, before anything is frozen or written: a taken name fails at once (the commit checks again).
  check_name_free(tagged, what);
  std::shared_ptr<const image::Manifest> parent;
  try {
    parent = images_.manifest(info.image);
  } catch (const Error& e) {
    rethrow_with(e, fmt::format("{}: the manifest of its image {}", what, info.image));
  }

  const fs::path staging = options_.staging_dir / fmt::format("{}-{}", id, random_hex());
  struct RemoveStaging {
    fs::path path;
    ~RemoveStaging() {
      try {
        image::remove_tree(path);
      } catch (const std::exception& e) {
        log_warn("removing snapshot staging {}: {}", path.string(), e.what());
      }
    }
  } remove_staging{staging};
  make_staging_dir(staging, what);

  // 1. The sandbox's files, frozen for the copy.
  const fs::path tree = staging / "tree";
  FilesCapture capture;
  try {
    capture = handle.sandbox->capture_files(tree, options_.limits);
  } catch (const Error& e) {
    rethrow_with(e, what);
  }
  out.files = capture.stats;
  out.notes = capture.notes;
  out.frozen_seconds = capture.frozen_seconds;
  out.capture_seconds = since(started);

  // 2. The image's own layers into the snapshot store, where it lacks them (usually it has them: it is the first
  // store); then the new layer.
  const auto build_started = Clock::now();
  copy_parent_layers(*parent, what);
  try {
    out.layer = image::store_tree_as_layer(*store_, tree, image::LayerRole::kSnapshot, staging, out.notes, {},
                                           &out.layer_existed, options_.chunk_size);
  } catch (const Error& e) {
    rethrow_with(e, fmt::format("{}: storing its layer in {}", what, store_->url()));
  }
  image::remove_tree(tree);

  // 3. The manifest and its (new) tag.
  out.digest = commit_snapshot(ref, *parent, out, what);
  out.image = tagged + "@" + out.digest;
  out.build_seconds = since(build_started);
  out.seconds = since(started);
  log_info(
      "snapshot {} of sandbox {}: {} entries, {} bytes of files, layer {} ({} bytes stored{}); frozen {:.3f} s, "
      "{:.3f} s in all",
      out.image, id, out.files.entries, out.files.file_bytes, out.layer.digest, out.layer.stored_size,
      out.layer_existed ? ", already there" : "", out.frozen_seconds, out.seconds);
  return out;
}

}  // namespace dsec::agent
