#include "agent/images/registry_imports.hpp"

#include <unistd.h>

#include <fmt/format.h>

#include "common/log.hpp"
#include "dsec/error.hpp"
#include "image/fs_tree.hpp"

namespace dsec::agent {

namespace reg = image::registry;

// One import in the background, and what its waiters learn.
struct RegistryImports::Import {
  std::mutex mu;
  std::condition_variable done_cv;
  bool done = false;
  std::optional<image::ResolvedManifest> result;
  std::optional<Error> error;
  std::atomic<std::uint64_t> bytes_done{0}, bytes_total{0};
  std::atomic<bool> finished{false};  // its thread is about to return
};

RegistryImports::RegistryImports(RegistryImportOptions options, image::BlobStore& target,
                                 std::vector<image::BlobStore*> stores)
    : options_(std::move(options)), target_(target), stores_(std::move(stores)), client_(options_.registry) {
  // Scratch an agent that was killed mid-import left behind; nothing else lives there.
  if (!options_.work_dir.empty()) image::remove_tree(options_.work_dir);
}

RegistryImports::~RegistryImports() {
  stopping_ = true;
  decltype(threads_) threads;
  {
    std::lock_guard lock(mu_);
    threads.swap(threads_);
  }
  for (auto& t : threads) t.first.join();
  // Each import removed its own scratch; the directory goes with the agent.
  if (!options_.work_dir.empty()) ::rmdir(options_.work_dir.c_str());
}

bool RegistryImports::handles(const image::ImageReference& ref) const {
  return !ref.registry().empty() || !options_.default_registry.empty();
}

RegistryImports::Stats RegistryImports::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

std::optional<image::ResolvedManifest> RegistryImports::stored(const image::ImageReference& ref) {
  try {
    return image::fetch_manifest(stores_, ref);
  } catch (const Error& e) {
    if (e.code() == Code::kNotFound) return std::nullopt;
    throw;
  }
}

bool RegistryImports::checked_lately(const std::string& tagged) {
  std::lock_guard lock(mu_);
  auto it = checked_.find(tagged);
  return it != checked_.end() && std::chrono::steady_clock::now() - it->second < options_.tag_ttl;
}

void RegistryImports::mark_checked(const std::string& tagged) {
  std::lock_guard lock(mu_);
  if (checked_.size() > 100'000) checked_.clear();
  checked_[tagged] = std::chrono::steady_clock::now();
}

image::ResolvedManifest RegistryImports::resolve(const image::ImageReference& asked) {
  image::ImageReference ref = asked;
  if (ref.registry().empty()) {
    // A bare name is a store image first; the default registry only when no store has it.
    if (auto found = stored(ref)) return *found;
    ref = reg::with_default_registry(ref, options_.default_registry);
    if (ref.registry().empty())
      throw Error(Code::kNotFound, fmt::format("image {} is not in any of the node's "
                                               "stores",
                                               asked.to_string()));
  }
  if (!ref.digest.empty()) {
    // A pinned digest is a dsec manifest's (a client resolved the name) or the registry's: the image imported under
    // the tag "sha256-<hex>". Neither is asked of the registry again.
    if (auto found = stored(ref)) return *found;
    if (auto found = stored(reg::import_tag(ref))) return *found;
    return import(ref);
  }
  if (auto found = stored(ref)) {
    const std::string tagged = ref.tagged();
    if (checked_lately(tagged)) return *found;
    try {
      std::string now = client_.tag_digest(ref);
      if (now == reg::registry_digest_of(found->manifest)) {
        mark_checked(tagged);
        return *found;
      }
      log_info("registry image {}: the tag moved to {}; importing it again", tagged, now);
    } catch (const Error& e) {
      // The registry cannot say now: the stored image serves until the next check.
      log_warn("registry image {}: cannot check its tag ({}: {}); using the stored image", tagged, e.code_name(),
               e.what());
      mark_checked(tagged);
      return *found;
    }
  }
  return import(ref);
}

image::ResolvedManifest RegistryImports::import(const image::ImageReference& ref) {
  const std::string key = ref.to_string();
  std::shared_ptr<Import> job;
  {
    std::lock_guard lock(mu_);
    if (stopping_) throw Error(Code::kUnavailable, "the agent is stopping");
    auto it = running_.find(key);
    if (it != running_.end()) {
      job = it->second;
    } else {
      job = std::make_shared<Import>();
      running_[key] = job;
      // Threads of imports that ended are joined as new ones start.
      for (auto t = threads_.begin(); t != threads_.end();) {
        if (t->second->finished) {
          t->first.join();
          t = threads_.erase(t);
        } else {
          ++t;
        }
      }
      threads_.emplace_back(
          std::thread([this, ref, key, job] {
            reg::ImportOptions o;
            o.work_dir = options_.work_dir;
            o.max_bytes = options_.max_bytes;
            o.max_layers = options_.max_layers;
            o.cancelled = [this] { return stopping_.load(); };
            o.progress = [&job](std::string_view, std::uint64_t done, std::uint64_t total) {
              job->bytes_done = done;
              job->bytes_total = total;
            };
            std::optional<image::ResolvedManifest> result;
            std::optional<Error> error;
            try {
              reg::ImportResult r = reg::import_image(client_, target_, ref, o);
              log_info("imported {} in {:.1f}s: {} layer(s) ({} converted, {} stored before), {} bytes downloaded", key,
                       r.seconds, r.image.manifest.layers.size(), r.layers_converted, r.layers_reused,
                       r.bytes_downloaded);
              std::lock_guard lock(mu_);
              ++stats_.imports;
              stats_.layers_converted += r.layers_converted;
              stats_.layers_reused += r.layers_reused;
              stats_.bytes_downloaded += r.bytes_downloaded;
              checked_[r.image.reference.tagged()] = std::chrono::steady_clock::now();
              result = std::move(r.image);
            } catch (const Error& e) {
              error = e;
            } catch (const std::exception& e) {
              error = Error(Code::kInternal, fmt::format("importing {}: {}", key, e.what()));
            }
            if (error) {
              log_warn("importing {} failed: {}: {}", key, error->code_name(), error->what());
              std::lock_guard lock(mu_);
              ++stats_.failed;
            }
            {
              std::lock_guard lock(mu_);
              running_.erase(key);
            }
            std::lock_guard lock(job->mu);
            job->result = std::move(result);
            job->error = std::move(error);
            job->done = true;
            job->done_cv.notify_all();
            job->finished = true;
          }),
          job);
    }
  }
  std::unique_lock lock(job->mu);
  if (!job->done_cv.wait_for(lock, options_.wait, [&] { return job->done; }))
    throw Error(Code::kDeadlineExceeded,
                fmt::format("image {} is still being imported ({} of {} bytes after {} s); the import goes on: try "
                            "again later, or import it ahead with `dsec image pull`",
                            key, job->bytes_done.load(), job->bytes_total.load(), options_.wait.count()));
  if (job->error) throw *job->error;
  return *job->result;
}

}  // namespace dsec::agent
