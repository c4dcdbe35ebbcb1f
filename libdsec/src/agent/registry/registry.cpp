// The registry's core: construction, creates (one, a batch) and their idempotency by request id (the table, its
// eviction, the request log), and the lookups of live sandboxes and tombstones. Admission, a sandbox's life after
// its create, its record on disk, restart recovery and lease groups have files of their own (this folder).
#include "agent/registry/registry.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <set>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "agent/images/image_config.hpp"
#include "agent/registry/protected_paths.hpp"
#include "agent/registry/registry_internal.hpp"
#include "common/log.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"
#include "image/store/digest.hpp"

namespace dsec::agent {
namespace {

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

bool selector_matches(const Labels& selector, const Labels& labels, std::string* why) {
  for (const auto& [key, value] : selector) {
    auto it = labels.find(key);
    if (it == labels.end()) {
      *why = fmt::format("no label '{}'", key);
      return false;
    }
    if (it->second != value) {
      *why = fmt::format("label {}={}, not {}={}", key, it->second, key, value);
      return false;
    }
  }
  return true;
}

}  // namespace

std::string spec_fingerprint(const SandboxSpec& spec) {
  SandboxSpec copy = spec;
  copy.request_id.clear();
  copy.queue_timeout = {};  // a retry waits for what is left of its deadline
  return image::sha256_digest(protocol::encode(copy).dump());
}

Registry::Registry(RegistryOptions options, Backends backends, ImageSource& images, Metrics& metrics)
    : options_(std::move(options)),
      backends_(std::move(backends)),
      images_(images),
      metrics_(metrics),
      create_ids_(options_.state_dir.empty() ? std::filesystem::path() : options_.state_dir / "requests.log"),
      exec_journal_(options_.state_dir.empty() ? std::filesystem::path() : options_.state_dir / "execs"),
      rng_(std::random_device{}()) {
  if (!options_.clock) options_.clock = unix_now;
  if (options_.batch_parallelism == 0) options_.batch_parallelism = 1;
  if (!options_.state_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options_.state_dir, ec);
    if (ec)
      throw Error(code_for_errno(ec.value()), fmt::format("create {}: {}", options_.state_dir.string(), ec.message()));
  }
}

Registry::~Registry() = default;

std::vector<std::string> Registry::kinds() const {
  std::vector<std::string> out;
  for (const auto& [kind, backend] : backends_) out.push_back(kind);
  return out;
}

CreateOutcome Registry::create(const SandboxSpec& spec, std::string_view image_manifest,
                               const ClientGone& client_gone) {
  std::shared_ptr<RequestEntry> entry;
  std::string fingerprint;
  if (!spec.request_id.empty()) {
    fingerprint = spec_fingerprint(spec);
    std::unique_lock lock(mutex_);
    evict(now());
    auto it = requests_.find(spec.request_id);
    if (it == requests_.end()) {
      entry = std::make_shared<RequestEntry>();
      entry->fingerprint = fingerprint;
      entry->at = now();
      requests_.emplace(spec.request_id, entry);
      request_order_.emplace_back(entry->at, spec.request_id);
    } else {
      std::shared_ptr<RequestEntry> first = it->second;
      if (first->fingerprint != fingerprint)
        throw Error(Code::kInvalidArgument,
                    fmt::format("request_id: '{}' was already used to create a sandbox from a different spec",
                                spec.request_id));
      // The same request again: wait for the first one to finish, then answer as it did.
      request_done_.wait(lock, [&] { return first->state != RequestEntry::State::kPending; });
      if (first->state == RequestEntry::State::kFailed) throw *first->error;
      return CreateOutcome{info_of(first->sandbox_id), false};
    }
  }

  try {
    CreateOutcome outcome = create_new(spec, image_manifest, fingerprint, nullptr, client_gone);
    double at = 0;
    if (entry) {
      std::lock_guard lock(mutex_);
      entry->state = RequestEntry::State::kDone;
      entry->sandbox_id = outcome.info.id;
      at = entry->at;
    }
    request_done_.notify_all();
    // After the entry is done (see CreateIds::rewrite). Until this line is written, the sandbox's record holds
    // its request id for a restart.
    if (entry) create_ids_.append(CreateIds::Entry{spec.request_id, outcome.info.id, fingerprint, at});
    return outcome;
  } catch (const std::exception& e) {
    Error error = as_error(e);
    // Kinds this node does not serve share one label value: the metrics must not grow with what clients send.
    metrics_.sandbox_create_error(backends_.count(spec.kind) ? std::string_view(spec.kind) : "unknown",
                                  error.code_name());
    if (entry) {
      std::lock_guard lock(mutex_);
      entry->state = RequestEntry::State::kFailed;
      entry->error = error;
      // A failed create is not remembered: the caller may retry it with the same request_id.
      auto it = requests_.find(spec.request_id);
      if (it != requests_.end() && it->second == entry) requests_.erase(it);
    }
    request_done_.notify_all();
    throw error;
  }
}

Backend& Registry::backend_for(const SandboxSpec& spec) {
  auto backend_it = backends_.find(spec.kind);
  if (backend_it == backends_.end())
    throw Error(Code::kInvalidArgument, fmt::format("kind: '{}' is not served by node '{}' (it serves: {})", spec.kind,
                                                    options_.node_id, fmt::join(kinds(), ", ")));
  Backend& backend = *backend_it->second;
  // Clients place by node labels; a create that reaches a node without them (a stale view) is refused here too.
  if (std::string why; !selector_matches(spec.node_selector, options_.node_labels, &why))
    throw Error(Code::kFailedPrecondition,
                fmt::format("node_selector: node '{}' does not match: {}", options_.node_id, why));
  return backend;
}

CreateOutcome Registry::create_new(const SandboxSpec& spec, std::string_view image_manifest,
                                   const std::string& fingerprint, std::shared_ptr<const ForkSource> fork_of,
                                   const ClientGone& client_gone) {
  auto started = std::chrono::steady_clock::now();
  Backend& backend = backend_for(spec);

  std::string id;
  double lease_deadline = 0;
  bool persist_lease = false;
  {
    std::unique_lock lock(mutex_);
    admit_or_wait(spec, lock, client_gone);
    reserve(spec, +1);
    id = new_id();
    if (!spec.group.empty()) lease_deadline = join_group(spec, now(), persist_lease);
  }
  // Until the record is in the table, the resources are a reservation; it is released on every failure path.
  auto record = std::make_shared<Record>();
  try {
    if (persist_lease) persist_group(spec.group);
    make_sandbox(*record, backend, id, spec, image_manifest, fingerprint, std::move(fork_of));
  } catch (...) {
    std::lock_guard lock(mutex_);
    reserve(spec, -1);
    throw;
  }

  if (enter_record(record, spec, lease_deadline)) {
    try {
      persist_group(spec.group);
    } catch (const std::exception& e) {
      log_warn("group {}: {}", spec.group, e.what());
    }
  }
  metrics_.sandbox_created(spec.kind, seconds_since(started));
  return CreateOutcome{record->snapshot(), true};
}

void Registry::make_sandbox(Record& record, Backend& backend, const std::string& id, const SandboxSpec& asked,
                            std::string_view image_manifest, const std::string& fingerprint,
                            std::shared_ptr<const ForkSource> fork_of) {
  // A fork's copies hold its parent's image, checked when the parent was made.
  ResolvedImage image =
      images_.resolve(asked.image, image_manifest, fork_of ? ManifestOrigin::kAgent : ManifestOrigin::kCaller);
  // The image's Env, WorkingDir and User under the spec's own: every exec, session and process starts from them.
  const SandboxSpec spec = apply_image_config(asked, image.config ? &*image.config : nullptr);
  CreateParams params{id, spec, image.layers, image.layer_images, std::move(fork_of)};
  SandboxInfo& info = record.info;
  info.id = id;
  info.node = options_.node_id;
  info.kind = spec.kind;
  info.image = image.name;
  if (image.config) {
    info.image_command = image.config->entrypoint;
    info.image_command.insert(info.image_command.end(), image.config->cmd.begin(), image.config->cmd.end());
  }
  // The record goes to disk before the backend starts anything: an agent that dies in between leaves a record,
  // and the next start removes whatever the half-made sandbox left (Backend::remove_leftovers).
  info.state = "creating";
  record.spec = spec;
  record.layers = image.layers;
  record.image_manifest = std::string(image_manifest);
  record.fingerprint = fingerprint;
  write_record(record);
  try {
    record.sandbox = backend.create(params);
  } catch (...) {
    remove_record_file(record);
    throw;
  }
  if (!record.sandbox) {
    remove_record_file(record);
    throw Error(Code::kInternal, fmt::format("backend '{}' returned no sandbox", spec.kind));
  }

  try {
    // Before anything else runs in it; a fork's copy has them already (and its processes run on).
    if (!params.fork_of) protect_paths(*record.sandbox, spec);
    record.backend_state = record.sandbox->recovery_state();
  } catch (...) {
    record.sandbox->destroy();
    remove_record_file(record);
    throw;
  }
  double created_at = now();
  info.state = "running";
  info.tenant = spec.tenant;
  info.labels = spec.labels;
  info.group = spec.group;
  info.resources = spec.resources;
  info.network = spec.network;
  info.qos = record.sandbox->qos_grant();
  info.created_at = created_at;
  info.expires_at = spec.ttl.count() > 0 ? created_at + static_cast<double>(spec.ttl.count()) : 0;
  record.image_hold = std::move(image.hold);
  try {
    write_record(record);
  } catch (...) {
    record.sandbox->destroy();
    remove_record_file(record);
    throw;
  }
}

bool Registry::enter_record(const std::shared_ptr<Record>& record, const SandboxSpec& spec, double lease_deadline) {
  const std::string& id = record->info.id;
  bool group_came_back = false;
  std::lock_guard lock(mutex_);
  reserve(spec, -1);
  live_cpu_ += spec.resources.cpu;
  live_memory_ += spec.resources.memory_bytes;
  live_gpus_ += spec.resources.gpus;
  records_.emplace(id, record);
  if (!spec.group.empty()) {
    // The group went (deleted, or reaped) while this sandbox was made: it comes back with the lease this create
    // started, so the sandbox still dies with it unless the lease is renewed.
    auto [it, fresh] = groups_.try_emplace(spec.group);
    if (fresh) {
      it->second.ttl = static_cast<double>(spec.group_ttl.count());
      it->second.expires_at = lease_deadline;
      group_came_back = true;
    }
    it->second.members.insert(id);
  }
  return group_came_back;
}

std::string Registry::new_id() {
  for (;;) {
    std::string id = fmt::format("{}-{:012x}", options_.node_id, rng_() & 0xffffffffffffull);
    if (!records_.count(id) && !tombstones_.count(id)) return id;
  }
}

std::vector<CreateOutcome> Registry::create_batch(const SandboxSpec& spec, std::size_t count,
                                                  std::string_view image_manifest, const ClientGone& client_gone) {
  if (count == 0) return {};
  // Elements that wait for room share the batch's deadline.
  const auto queue_deadline = std::chrono::steady_clock::now() + spec.queue_timeout;
  auto element_spec = [&](std::size_t i) {
    SandboxSpec s = spec;
    if (!spec.request_id.empty()) s.request_id = fmt::format("{}/{}", spec.request_id, i);
    if (spec.queue_timeout.count() > 0)
      s.queue_timeout = std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                   queue_deadline - std::chrono::steady_clock::now()));
    return s;
  };
  // Refuse a batch that cannot fit before making any of it (elements an earlier request already made are free).
  {
    std::lock_guard lock(mutex_);
    std::size_t fresh = count;
    if (!spec.request_id.empty())
      for (std::size_t i = 0; i < count; ++i)
        if (requests_.count(fmt::format("{}/{}", spec.request_id, i))) --fresh;
    if (fresh > 0 && backends_.count(spec.kind)) {
      try {
        admit(spec.resources, fresh, spec.tenant);
      } catch (const Error& e) {
        // A batch that may wait goes on when it could fit some day: its elements wait for room one by one.
        if (spec.queue_timeout.count() == 0 || !e.retryable()) {
          metrics_.sandbox_create_error(spec.kind, e.code_name());
          throw;
        }
      }
    }
  }

  std::vector<std::optional<CreateOutcome>> results(count);
  std::optional<Error> first_error;
  std::mutex error_mutex;
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  auto work = [&] {
    for (;;) {
      std::size_t i = next.fetch_add(1);
      if (i >= count || failed.load()) return;
      try {
        results[i] = create(element_spec(i), image_manifest, client_gone);
      } catch (const std::exception& e) {
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = as_error(e);
        failed = true;
      }
    }
  };
  std::size_t workers = std::min(count, options_.batch_parallelism);
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();

  if (first_error) {
    for (std::size_t i = 0; i < count; ++i) {
      if (!results[i] || !results[i]->created) continue;
      try {
        destroy(results[i]->info.id, "batch create failed");
      } catch (const std::exception& e) {
        log_warn("batch rollback: destroy {}: {}", results[i]->info.id, e.what());
      }
      if (!spec.request_id.empty()) forget_request_id(element_spec(i).request_id, results[i]->info.id);
    }
    throw *first_error;
  }
  std::vector<CreateOutcome> out;
  out.reserve(count);
  for (auto& r : results) out.push_back(std::move(*r));
  return out;
}

void Registry::forget_request_id(const std::string& request_id, const std::string& sandbox_id) {
  {
    std::lock_guard lock(mutex_);
    auto it = requests_.find(request_id);
    if (it != requests_.end() && it->second->sandbox_id == sandbox_id) requests_.erase(it);
  }
  create_ids_.forget(request_id, sandbox_id);
}

SandboxInfo Registry::info_of(const std::string& id) const {
  if (auto it = records_.find(id); it != records_.end()) return it->second->snapshot();
  if (auto it = tombstones_.find(id); it != tombstones_.end()) return it->second.info;
  SandboxInfo info;
  info.id = id;
  info.node = options_.node_id;
  info.state = "destroyed";
  return info;
}

SandboxInfo Registry::get(const std::string& id) {
  std::optional<SandboxInfo> destroyed;
  std::shared_ptr<Record> record = find_or_tombstone(id, destroyed);
  if (!record) return *destroyed;
  check_alive(*record);
  SandboxInfo info = record->snapshot();
  if (record->sandbox && info.state != "creating") {
    try {
      info.cold_memory.refaults = record->sandbox->refaults();
    } catch (const std::exception&) {
    }
  }
  return info;
}

std::vector<SandboxInfo> Registry::list(const Labels& labels, const std::string& tenant) const {
  std::vector<SandboxInfo> out;
  std::lock_guard lock(mutex_);
  for (const auto& [id, record] : records_) {
    SandboxInfo info = record->snapshot();
    if (!tenant.empty() && info.tenant != tenant) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      auto it = info.labels.find(k);
      if (it == info.labels.end() || it->second != v) {
        match = false;
        break;
      }
    }
    if (match) out.push_back(std::move(info));
  }
  std::sort(out.begin(), out.end(), [](const SandboxInfo& a, const SandboxInfo& b) {
    return a.created_at != b.created_at ? a.created_at < b.created_at : a.id < b.id;
  });
  return out;
}

SandboxHandle Registry::acquire(const std::string& id) const {
  std::lock_guard lock(mutex_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    if (tombstones_.count(id)) throw Error(Code::kNotFound, fmt::format("sandbox '{}' was destroyed", id));
    throw Error(Code::kNotFound, fmt::format("sandbox '{}' not found on node '{}'", id, options_.node_id));
  }
  const std::shared_ptr<Record>& record = it->second;
  if (record->destroying.load()) throw Error(Code::kNotFound, fmt::format("sandbox '{}' is being destroyed", id));
  record->last_used_ms.store(steady_ms(), std::memory_order_relaxed);
  // Aliasing: the handle points at the backend object and owns the whole record.
  return SandboxHandle{std::shared_ptr<BackendSandbox>(record, record->sandbox.get()), record->info.kind};
}

SandboxSpec Registry::spec(const std::string& id) const { return find_live(id)->spec; }

std::shared_ptr<Registry::Record> Registry::find_or_tombstone(const std::string& id,
                                                              std::optional<SandboxInfo>& destroyed) const {
  std::lock_guard lock(mutex_);
  auto it = records_.find(id);
  if (it != records_.end()) return it->second;
  if (auto t = tombstones_.find(id); t != tombstones_.end()) {
    destroyed = t->second.info;
    return nullptr;
  }
  throw Error(Code::kNotFound, fmt::format("sandbox '{}' not found on node '{}'", id, options_.node_id));
}

std::shared_ptr<Registry::Record> Registry::find_live(const std::string& id) const {
  std::lock_guard lock(mutex_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    if (tombstones_.count(id)) throw Error(Code::kNotFound, fmt::format("sandbox '{}' was destroyed", id));
    throw Error(Code::kNotFound, fmt::format("sandbox '{}' not found on node '{}'", id, options_.node_id));
  }
  if (it->second->destroying.load()) throw Error(Code::kNotFound, fmt::format("sandbox '{}' is being destroyed", id));
  return it->second;
}

void Registry::forget_requests() {
  {
    std::lock_guard lock(mutex_);
    for (auto it = requests_.begin(); it != requests_.end();) {
      if (it->second->state == RequestEntry::State::kPending) ++it;
      else it = requests_.erase(it);
    }
  }
  create_ids_.remove();
  // The sandboxes are gone: so are their exec request ids (a sandbox whose destroy raced an exec may have left
  // some).
  std::set<std::string> live;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [id, record] : records_) live.insert(id);
  }
  exec_journal_.retain(live);
}

void Registry::evict(double t) {
  auto expired = [&](double at, std::chrono::seconds retention) {
    return t - at >= static_cast<double>(retention.count());
  };
  while (!request_order_.empty()) {
    auto& [at, key] = request_order_.front();
    auto it = requests_.find(key);
    bool stale = it == requests_.end() || it->second->at != at;  // erased, or re-used since
    if (!stale) {
      bool over = requests_.size() > options_.max_request_ids || expired(at, options_.request_id_retention);
      if (!over || it->second->state == RequestEntry::State::kPending) break;
      requests_.erase(it);
    }
    request_order_.pop_front();
  }
  while (!tombstone_order_.empty()) {
    auto& [at, id] = tombstone_order_.front();
    auto it = tombstones_.find(id);
    bool stale = it == tombstones_.end() || it->second.at != at;
    if (!stale) {
      if (tombstones_.size() <= options_.max_tombstones && !expired(at, options_.tombstone_retention)) break;
      tombstones_.erase(it);
    }
    tombstone_order_.pop_front();
  }
}

}  // namespace dsec::agent
