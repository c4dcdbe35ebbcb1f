#include "agent/registry.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <fstream>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "agent/log.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "image/store/digest.hpp"

namespace dsec::agent {
namespace {

constexpr double kEpsilon = 1e-9;

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Two creates with one request_id must ask for the same thing; the request_id itself is not part of it. A digest:
// request ids are remembered by the hundred thousand, and on disk.
std::string spec_fingerprint(const SandboxSpec& spec) {
  SandboxSpec copy = spec;
  copy.request_id.clear();
  return image::sha256_digest(protocol::encode(copy).dump());
}

constexpr int kRecordVersion = 2;

std::string mib(std::uint64_t bytes) { return fmt::format("{:.0f}Mi", static_cast<double>(bytes) / (1 << 20)); }

Error as_error(const std::exception& e) {
  if (const auto* err = dynamic_cast<const Error*>(&e)) return *err;
  return Error(Code::kInternal, e.what());
}

void write_all(int fd, std::string_view data, const std::filesystem::path& path) {
  while (!data.empty()) {
    ssize_t n = retry_eintr([&] { return ::write(fd, data.data(), data.size()); });
    if (n < 0) throw_errno_fmt(errno, "write {}", path.string());
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

// Writes `text` to `path` through a temporary file and a rename, so a reader sees the old content or the new one.
void write_file_replacing(const std::filesystem::path& path, std::string_view text, std::string_view what) {
  auto tmp = path;
  tmp += ".tmp";
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) throw_errno_fmt(errno, "create {} {}", what, tmp.string());
    write_all(fd.get(), text, tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw_errno_fmt(err, "rename {} to {}", tmp.string(), path.string());
  }
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

struct Registry::Record {
  mutable std::mutex mutex;  // guards info.state, info.message and image_hold
  SandboxInfo info;
  SandboxSpec spec;
  std::vector<std::filesystem::path> layers;
  std::string image_manifest;    // as the client sent it (empty: the agent resolved the image in its stores)
  std::string fingerprint;       // of the spec, for its request_id
  BackendState backend_state;    // what the backend needs to take the sandbox over after a restart
  std::shared_ptr<const void> image_hold;  // the image's files stay while the sandbox lives
  std::atomic<bool> hold_pending{false};   // adopted, but its image could not be acquired again yet
  std::unique_ptr<BackendSandbox> sandbox;
  // One writer of the record's file at a time; once it is removed (the sandbox is gone), a late writer (a sleep, a
  // liveness check racing the destroy) must not bring it back.
  mutable std::mutex file_mutex;
  mutable bool file_removed = false;
  std::atomic<bool> destroying{false};
  std::mutex power_mutex;    // one sleep or wake at a time
  // The last sleep or wake that carried a request id, and what it answered (guarded by power_mutex).
  std::string power_request_id;
  bool power_request_sleep = false;
  SleepReport power_report;
  bool cpu_released = false;  // asleep: its cpu is not in live_cpu_ (guarded by the registry's mutex_)

  SandboxInfo snapshot() const {
    std::lock_guard lock(mutex);
    return info;
  }
};

// A record read back at start-up.
struct Registry::LoadedRecord {
  std::string disk_state;  // the state it was written with
  std::shared_ptr<Record> record;
};

// What recover_one() made of a record.
struct Registry::Recovered {
  enum class Outcome { kAdopted, kFailed, kRolledBack, kDestroyed, kKept } outcome;
  std::shared_ptr<Record> record;  // adopted, failed: goes live again; destroyed: its tombstone's info
};

namespace {

// The backend object of a sandbox that an agent restart found dead or could not take over: nothing of it runs, and
// every call but destroy fails. Destroy removes what is left of it once more.
class GoneSandbox final : public BackendSandbox {
 public:
  GoneSandbox(std::string id, Backend& backend, std::string why)
      : id_(std::move(id)), backend_(backend), why_(std::move(why)) {}
  ExecResult exec(const ExecRequest&, const OutputSink&) override { throw gone(); }
  void write_file(std::string_view, std::string_view, unsigned) override { throw gone(); }
  std::string read_file(std::string_view) override { throw gone(); }
  void put_archive(std::string_view, std::string_view) override { throw gone(); }
  std::string get_archive(std::string_view) override { throw gone(); }
  bool is_directory(std::string_view) override { throw gone(); }
  SleepReport sleep() override { throw gone(); }
  SleepReport wake() override { throw gone(); }
  bool alive() override { return false; }
  void destroy() override {
    std::lock_guard lock(mutex_);
    if (destroyed_) return;
    backend_.remove_leftovers(id_);
    destroyed_ = true;
  }

 private:
  Error gone() const {
    return Error(Code::kFailedPrecondition, fmt::format("sandbox {} is not running: {}", id_, why_));
  }
  std::string id_;
  Backend& backend_;
  std::string why_;
  std::mutex mutex_;
  bool destroyed_ = false;
};

}  // namespace

struct Registry::RequestEntry {
  enum class State { kPending, kDone, kFailed };
  State state = State::kPending;
  std::string fingerprint;
  std::string sandbox_id;
  std::optional<Error> error;
  double at = 0;
};

Registry::Registry(RegistryOptions options, Backends backends, ImageSource& images, Metrics& metrics)
    : options_(std::move(options)),
      backends_(std::move(backends)),
      images_(images),
      metrics_(metrics),
      request_log_(options_.state_dir.empty() ? std::filesystem::path() : options_.state_dir / "requests.log"),
      rng_(std::random_device{}()) {
  if (!options_.clock) options_.clock = unix_now;
  if (options_.batch_parallelism == 0) options_.batch_parallelism = 1;
  if (!options_.state_dir.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(options_.state_dir, ec);
    if (ec)
      throw Error(code_for_errno(ec.value()),
                  fmt::format("create {}: {}", options_.state_dir.string(), ec.message()));
  }
}

Registry::~Registry() = default;

std::vector<std::string> Registry::kinds() const {
  std::vector<std::string> out;
  for (const auto& [kind, backend] : backends_) out.push_back(kind);
  return out;
}

CreateOutcome Registry::create(const SandboxSpec& spec, std::string_view image_manifest) {
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
    CreateOutcome outcome = create_new(spec, image_manifest, fingerprint);
    double at = 0;
    if (entry) {
      std::lock_guard lock(mutex_);
      entry->state = RequestEntry::State::kDone;
      entry->sandbox_id = outcome.info.id;
      at = entry->at;
    }
    request_done_.notify_all();
    // After the entry is done (see RequestLog::rewrite). Until this line is written, the sandbox's record holds
    // its request id for a restart.
    if (entry) request_log_.append(RequestLog::Entry{spec.request_id, outcome.info.id, fingerprint, at});
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

CreateOutcome Registry::create_new(const SandboxSpec& spec, std::string_view image_manifest,
                                   const std::string& fingerprint, std::shared_ptr<const ForkSource> fork_of) {
  auto started = std::chrono::steady_clock::now();
  auto backend_it = backends_.find(spec.kind);
  if (backend_it == backends_.end())
    throw Error(Code::kInvalidArgument,
                fmt::format("kind: '{}' is not served by node '{}' (it serves: {})", spec.kind, options_.node_id,
                            fmt::join(kinds(), ", ")));
  Backend& backend = *backend_it->second;
  // Clients place by node labels; a create that reaches a node without them (a stale view) is refused here too.
  if (std::string why; !selector_matches(spec.node_selector, options_.node_labels, &why))
    throw Error(Code::kFailedPrecondition, fmt::format("node_selector: node '{}' does not match: {}",
                                                       options_.node_id, why));

  std::string id;
  double lease_deadline = 0;
  bool persist_lease = false;
  {
    std::lock_guard lock(mutex_);
    admit(spec.resources, 1);
    reserved_cpu_ += spec.resources.cpu;
    reserved_memory_ += spec.resources.memory_bytes;
    reserved_gpus_ += spec.resources.gpus;
    id = new_id();
    if (!spec.group.empty()) lease_deadline = join_group(spec, now(), persist_lease);
  }
  // Until the record is in the table, the resources are a reservation; it is released on every failure path.
  bool reserved = true;
  auto release = [&] {
    if (!reserved) return;
    std::lock_guard lock(mutex_);
    reserved_cpu_ -= spec.resources.cpu;
    reserved_memory_ -= spec.resources.memory_bytes;
    reserved_gpus_ -= spec.resources.gpus;
    reserved = false;
  };

  auto record = std::make_shared<Record>();
  try {
    if (persist_lease) persist_group(spec.group);
    ResolvedImage image = images_.resolve(spec.image, image_manifest);
    CreateParams params{id, spec, image.layers, image.layer_images, std::move(fork_of)};
    SandboxInfo& info = record->info;
    info.id = id;
    info.node = options_.node_id;
    info.kind = spec.kind;
    info.image = image.name;
    // The record goes to disk before the backend starts anything: an agent that dies in between leaves a record,
    // and the next start removes whatever the half-made sandbox left (Backend::remove_leftovers).
    info.state = "creating";
    record->spec = spec;
    record->layers = image.layers;
    record->image_manifest = std::string(image_manifest);
    record->fingerprint = fingerprint;
    write_record(*record);
    try {
      record->sandbox = backend.create(params);
    } catch (...) {
      remove_record_file(*record);
      throw;
    }
    if (!record->sandbox) {
      remove_record_file(*record);
      throw Error(Code::kInternal, fmt::format("backend '{}' returned no sandbox", spec.kind));
    }

    try {
      record->backend_state = record->sandbox->recovery_state();
    } catch (...) {
      record->sandbox->destroy();
      remove_record_file(*record);
      throw;
    }
    double created_at = now();
    info.state = "running";
    info.tenant = spec.tenant;
    info.labels = spec.labels;
    info.group = spec.group;
    info.resources = spec.resources;
    info.created_at = created_at;
    info.expires_at = spec.ttl.count() > 0 ? created_at + static_cast<double>(spec.ttl.count()) : 0;
    record->image_hold = std::move(image.hold);
    try {
      write_record(*record);
    } catch (...) {
      record->sandbox->destroy();
      remove_record_file(*record);
      throw;
    }
  } catch (...) {
    release();
    throw;
  }

  bool group_came_back = false;
  {
    std::lock_guard lock(mutex_);
    reserved_cpu_ -= spec.resources.cpu;
    reserved_memory_ -= spec.resources.memory_bytes;
    reserved_gpus_ -= spec.resources.gpus;
    reserved = false;
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
  }
  if (group_came_back) {
    try {
      persist_group(spec.group);
    } catch (const std::exception& e) {
      log_warn("group {}: {}", spec.group, e.what());
    }
  }
  metrics_.sandbox_created(spec.kind, seconds_since(started));
  return CreateOutcome{record->snapshot(), true};
}

void Registry::admit(const Resources& r, std::size_t count) const {
  const double n = static_cast<double>(count);
  if (r.gpus > 0) {
    const std::uint64_t wanted = static_cast<std::uint64_t>(r.gpus) * count;
    const std::uint64_t held = static_cast<std::uint64_t>(live_gpus_) + reserved_gpus_;
    const std::uint64_t free = options_.gpus > held ? options_.gpus - held : 0;
    if (wanted > free)
      throw Error(Code::kResourceExhausted,
                  fmt::format("admission: {} gpus wanted, node '{}' has {} free of {}", wanted, options_.node_id,
                              free, options_.gpus));
  }
  const double cpu_limit = options_.cores * options_.cpu_overcommit;
  const double cpu_after = live_cpu_ + reserved_cpu_ + r.cpu * n;
  if (cpu_after > cpu_limit + kEpsilon)
    throw Error(Code::kResourceExhausted,
                fmt::format("admission: {} more cpu would bring node '{}' to {:.2f} cores requested, above its "
                            "limit of {:.2f} ({} cores x cpu_overcommit {})",
                            r.cpu * n, options_.node_id, cpu_after, cpu_limit, options_.cores,
                            options_.cpu_overcommit));
  const double memory_limit = static_cast<double>(options_.memory_bytes) * options_.memory_overcommit;
  const double memory_after =
      static_cast<double>(live_memory_ + reserved_memory_) + static_cast<double>(r.memory_bytes) * n;
  if (memory_after > memory_limit + 0.5)
    throw Error(Code::kResourceExhausted,
                fmt::format("admission: {} more memory would bring node '{}' to {} requested, above its limit of {} "
                            "({} x memory_overcommit {})",
                            mib(static_cast<std::uint64_t>(static_cast<double>(r.memory_bytes) * n)), options_.node_id,
                            mib(static_cast<std::uint64_t>(memory_after)),
                            mib(static_cast<std::uint64_t>(memory_limit)), mib(options_.memory_bytes),
                            options_.memory_overcommit));
}

std::string Registry::new_id() {
  for (;;) {
    std::string id = fmt::format("{}-{:012x}", options_.node_id, rng_() & 0xffffffffffffull);
    if (!records_.count(id) && !tombstones_.count(id)) return id;
  }
}

std::vector<CreateOutcome> Registry::create_batch(const SandboxSpec& spec, std::size_t count,
                                                 std::string_view image_manifest) {
  if (count == 0) return {};
  auto element_spec = [&](std::size_t i) {
    SandboxSpec s = spec;
    if (!spec.request_id.empty()) s.request_id = fmt::format("{}/{}", spec.request_id, i);
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
        admit(spec.resources, fresh);
      } catch (const Error& e) {
        metrics_.sandbox_create_error(spec.kind, e.code_name());
        throw;
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
        results[i] = create(element_spec(i), image_manifest);
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

void Registry::refresh_backend_state(Record& record) {
  try {
    BackendState state = record.sandbox->recovery_state();
    std::lock_guard lock(record.mutex);
    record.backend_state = std::move(state);
  } catch (const std::exception& e) {
    log_warn("sandbox {}: {}", record.info.id, e.what());
  }
}

std::vector<CreateOutcome> Registry::fork(const std::string& id, std::size_t count, const Labels& labels) {
  constexpr std::size_t kMaxForks = 256;
  if (count == 0 || count > kMaxForks)
    throw Error(Code::kInvalidArgument, fmt::format("count: {} copies asked; a fork makes 1 to {}", count, kMaxForks));
  std::shared_ptr<Record> parent = find_live(id);
  check_alive(*parent);
  SandboxSpec spec;
  std::string manifest;
  {
    std::lock_guard lock(parent->mutex);
    if (parent->info.state != "running")
      throw Error(Code::kFailedPrecondition,
                  fmt::format("sandbox {} is {}; only a running sandbox can be forked", id, parent->info.state));
    spec = parent->spec;
    spec.image = parent->info.image;  // pinned: the copies hold the same layers
    manifest = parent->image_manifest;
  }
  spec.request_id.clear();
  spec.group.clear();
  spec.group_ttl = std::chrono::seconds{0};
  spec.hostname.clear();
  for (const auto& [k, v] : labels) spec.labels[k] = v;
  // Refuse copies that cannot fit before stopping the sandbox for them.
  if (backends_.count(spec.kind)) {
    std::lock_guard lock(mutex_);
    admit(spec.resources, count);
  }
  std::shared_ptr<const ForkSource> source;
  {
    std::lock_guard power(parent->power_mutex);  // not during a sleep or a wake
    source = parent->sandbox->fork_source();
    // The sandbox runs on in a new process of its backend's: its record says which.
    refresh_backend_state(*parent);
    try {
      write_record(*parent);
    } catch (const std::exception& e) {
      log_warn("sandbox {}: record after its fork: {}", id, e.what());
    }
  }
  std::vector<CreateOutcome> out;
  try {
    for (std::size_t i = 0; i < count; ++i) out.push_back(create_new(spec, manifest, {}, source));
  } catch (...) {
    for (const auto& made : out) {
      try {
        destroy(made.info.id, "fork failed");
      } catch (const std::exception& e) {
        log_warn("fork rollback: destroy {}: {}", made.info.id, e.what());
      }
    }
    throw;
  }
  return out;
}

void Registry::forget_request_id(const std::string& request_id, const std::string& sandbox_id) {
  {
    std::lock_guard lock(mutex_);
    auto it = requests_.find(request_id);
    if (it != requests_.end() && it->second->sandbox_id == sandbox_id) requests_.erase(it);
  }
  request_log_.forget(request_id, sandbox_id);
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

void Registry::check_alive(Record& record) {
  {
    std::lock_guard lock(record.mutex);
    if (record.info.state != "running") return;
  }
  if (record.destroying.load() || record.sandbox->alive()) return;
  bool changed = false;
  {
    std::lock_guard lock(record.mutex);
    if (record.info.state == "running") {
      record.info.state = "failed";
      std::string why = record.sandbox->stopped_reason();
      record.info.message = why.empty() ? "the sandbox's processes are gone (its init exited or it was killed as a whole)"
                                        : "the sandbox stopped: " + why;
      changed = true;
    }
  }
  if (!changed) return;
  metrics_.sandbox_failed(record.info.kind);
  try {
    if (!record.destroying.load()) write_record(record);
  } catch (const std::exception& e) {
    log_warn("sandbox {}: record of its failure: {}", record.info.id, e.what());
  }
}

SandboxInfo Registry::get(const std::string& id) {
  std::shared_ptr<Record> record;
  {
    std::lock_guard lock(mutex_);
    auto it = records_.find(id);
    if (it == records_.end()) {
      if (auto t = tombstones_.find(id); t != tombstones_.end()) return t->second.info;
      throw Error(Code::kNotFound, fmt::format("sandbox '{}' not found on node '{}'", id, options_.node_id));
    }
    record = it->second;
  }
  check_alive(*record);
  return record->snapshot();
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
    if (tombstones_.count(id))
      throw Error(Code::kNotFound, fmt::format("sandbox '{}' was destroyed", id));
    throw Error(Code::kNotFound, fmt::format("sandbox '{}' not found on node '{}'", id, options_.node_id));
  }
  const std::shared_ptr<Record>& record = it->second;
  if (record->destroying.load())
    throw Error(Code::kNotFound, fmt::format("sandbox '{}' is being destroyed", id));
  // Aliasing: the handle points at the backend object and owns the whole record.
  return SandboxHandle{std::shared_ptr<BackendSandbox>(record, record->sandbox.get()), record->info.kind};
}

SandboxSpec Registry::spec(const std::string& id) const { return find_live(id)->spec; }

std::shared_ptr<Registry::Record> Registry::find_live(const std::string& id) const {
  std::lock_guard lock(mutex_);
  auto it = records_.find(id);
  if (it == records_.end()) {
    if (tombstones_.count(id)) throw Error(Code::kNotFound, fmt::format("sandbox '{}' was destroyed", id));
    throw Error(Code::kNotFound, fmt::format("sandbox '{}' not found on node '{}'", id, options_.node_id));
  }
  if (it->second->destroying.load())
    throw Error(Code::kNotFound, fmt::format("sandbox '{}' is being destroyed", id));
  return it->second;
}

namespace {

// A sleep or wake whose request id is that of the sandbox's last one: the answer it got, again.
template <typename Record, typename Outcome>
bool repeated_power_request(Record& record, std::string_view request_id, bool sleep, Outcome& out) {
  if (request_id.empty() || record.power_request_id != request_id) return false;
  if (record.power_request_sleep != sleep)
    throw Error(Code::kInvalidArgument, fmt::format("request_id '{}' was a {} of sandbox {}, not a {}", request_id,
                                                    sleep ? "wake" : "sleep", record.snapshot().id, sleep ? "sleep" : "wake"));
  out.report = record.power_report;
  out.info = record.snapshot();
  return true;
}

template <typename Record>
void remember_power_request(Record& record, std::string_view request_id, bool sleep, const SleepReport& report) {
  if (request_id.empty()) return;
  record.power_request_id = std::string(request_id);
  record.power_request_sleep = sleep;
  record.power_report = report;
}

}  // namespace

Registry::SleepOutcome Registry::sleep(const std::string& id, std::string_view request_id) {
  std::shared_ptr<Record> record = find_live(id);
  check_alive(*record);
  std::lock_guard power(record->power_mutex);
  SleepOutcome out;
  if (repeated_power_request(*record, request_id, true, out)) return out;
  std::string state = record->snapshot().state;
  if (state == "sleeping") throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is already sleeping", id));
  if (state != "running")
    throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is {}; only a running sandbox can sleep", id, state));
  out.report = record->sandbox->sleep();
  remember_power_request(*record, request_id, true, out.report);
  refresh_backend_state(*record);
  {
    std::lock_guard lock(record->mutex);
    record->info.state = "sleeping";
  }
  {
    std::lock_guard lock(mutex_);
    if (records_.count(id) && !record->cpu_released) {
      live_cpu_ -= record->spec.resources.cpu;
      if (live_cpu_ < kEpsilon) live_cpu_ = 0;
      record->cpu_released = true;
    }
  }
  try {
    write_record(*record);
  } catch (const std::exception& e) {
    log_warn("sandbox {}: record of its sleep: {}", id, e.what());
  }
  out.info = record->snapshot();
  return out;
}

Registry::SleepOutcome Registry::wake(const std::string& id, std::string_view request_id) {
  std::shared_ptr<Record> record = find_live(id);
  std::lock_guard power(record->power_mutex);
  SleepOutcome out;
  if (repeated_power_request(*record, request_id, false, out)) return out;
  std::string state = record->snapshot().state;
  if (state != "sleeping")
    throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is {}, not sleeping; only a sleeping sandbox can "
                                                       "wake", id, state));
  out.report = record->sandbox->wake();
  remember_power_request(*record, request_id, false, out.report);
  refresh_backend_state(*record);
  {
    std::lock_guard lock(record->mutex);
    record->info.state = "running";
  }
  {
    std::lock_guard lock(mutex_);
    if (records_.count(id) && record->cpu_released) {
      live_cpu_ += record->spec.resources.cpu;
      record->cpu_released = false;
    }
  }
  try {
    write_record(*record);
  } catch (const std::exception& e) {
    log_warn("sandbox {}: record of its wake: {}", id, e.what());
  }
  out.info = record->snapshot();
  return out;
}

SandboxInfo Registry::destroy(const std::string& id, std::string_view reason) {
  std::shared_ptr<Record> record;
  {
    std::lock_guard lock(mutex_);
    auto it = records_.find(id);
    if (it == records_.end()) {
      if (auto t = tombstones_.find(id); t != tombstones_.end()) return t->second.info;
      throw Error(Code::kNotFound, fmt::format("sandbox '{}' not found on node '{}'", id, options_.node_id));
    }
    record = it->second;
  }
  // On disk first: an agent that dies from here on finishes the destroy when it starts again. (A second destroy
  // racing this one leaves the record to it.)
  const bool first = !record->destroying.exchange(true);
  if (first) mark_destroying(*record, true);
  try {
    record->sandbox->destroy();
  } catch (...) {
    if (first) {
      mark_destroying(*record, false);
      record->destroying = false;
    }
    throw;
  }
  {
    std::lock_guard lock(record->mutex);
    record->image_hold.reset();
  }

  SandboxInfo info = record->snapshot();
  info.state = "destroyed";
  info.message = std::string(reason);
  bool erased = false;
  {
    std::lock_guard lock(mutex_);
    auto it = records_.find(id);
    if (it != records_.end() && it->second == record) {
      records_.erase(it);
      if (!record->cpu_released) live_cpu_ -= record->spec.resources.cpu;
      if (live_cpu_ < kEpsilon) live_cpu_ = 0;
      live_memory_ -= record->spec.resources.memory_bytes;
      live_gpus_ -= record->spec.resources.gpus;
      if (!record->spec.group.empty())
        if (auto g = groups_.find(record->spec.group); g != groups_.end()) g->second.members.erase(id);
      double at = now();
      tombstones_[id] = Tombstone{info, at};
      tombstone_order_.emplace_back(at, id);
      evict(at);
      erased = true;
    }
  }
  if (erased) {
    {
      std::lock_guard lock(record->mutex);
      record->info.state = "destroyed";
      record->info.message = info.message;
    }
    remove_record_file(*record);
    metrics_.sandbox_destroyed(info.kind);
  }
  return info;
}

void Registry::reap() {
  std::vector<std::shared_ptr<Record>> records;
  double t = now();
  // Groups whose lease expired: this pass's, and those a call found expired before the reaper (doomed_).
  std::map<std::string, std::vector<std::string>> expired;
  {
    std::lock_guard lock(mutex_);
    evict(t);
    for (auto it = groups_.begin(); it != groups_.end();) {
      if (t < it->second.expires_at) {
        ++it;
        continue;
      }
      auto& ids = expired[it->first];
      ids.insert(ids.end(), it->second.members.begin(), it->second.members.end());
      it = groups_.erase(it);
    }
    for (auto& [id, group] : doomed_) expired[group].push_back(std::move(id));
    doomed_.clear();
  }
  for (const auto& [group, ids] : expired) {
    if (!ids.empty())
      log_info("group {}: lease expired; destroying its {} sandbox{}", group, ids.size(), ids.size() == 1 ? "" : "es");
    destroy_ids(ids, fmt::format("group '{}' lease expired", group));
    try {
      persist_group(group);  // removes its file, unless a create started the group again meanwhile
    } catch (const std::exception& e) {
      log_warn("reaper: group {}: {}", group, e.what());
    }
  }
  {
    std::lock_guard lock(mutex_);
    records.reserve(records_.size());
    for (const auto& [id, record] : records_) records.push_back(record);
  }
  for (const auto& record : records)
    if (record->hold_pending.load() && !record->destroying.load()) hold_image(*record);
  // The request log grows by a line per create: rewrite it from what is remembered once that is far behind.
  std::size_t remembered;
  {
    std::lock_guard lock(mutex_);
    remembered = requests_.size();
  }
  if (request_log_.appended() > std::max<std::size_t>(4096, 2 * remembered)) {
    try {
      request_log_.rewrite([this] {
        std::vector<RequestLog::Entry> entries;
        std::lock_guard lock(mutex_);
        for (const auto& [at, request_id] : request_order_) {
          auto it = requests_.find(request_id);
          if (it == requests_.end() || it->second->at != at || it->second->state != RequestEntry::State::kDone)
            continue;
          entries.push_back(RequestLog::Entry{request_id, it->second->sandbox_id, it->second->fingerprint, at});
        }
        return entries;
      });
    } catch (const std::exception& e) {
      log_warn("reaper: request log: {}", e.what());
    }
  }
  for (const auto& record : records) {
    double expires_at = record->snapshot().expires_at;
    try {
      if (expires_at > 0 && t >= expires_at) destroy(record->info.id, "ttl expired");
      else check_alive(*record);
    } catch (const std::exception& e) {
      log_warn("reaper: sandbox {}: {}", record->info.id, e.what());
    }
  }
}

std::size_t Registry::destroy_all(std::string_view reason) {
  std::vector<std::string> ids;
  std::vector<std::string> groups;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [id, record] : records_) ids.push_back(id);
    // Their sandboxes go, so the groups go too (a renewal then says NOT_FOUND).
    for (const auto& [id, group] : groups_) groups.push_back(id);
    groups_.clear();
    doomed_.clear();
  }
  std::size_t destroyed = destroy_ids(ids, reason);
  for (const auto& group : groups) {
    try {
      persist_group(group);
    } catch (const std::exception& e) {
      log_warn("group {}: {}", group, e.what());
    }
  }
  return destroyed;
}

void Registry::forget_requests() {
  {
    std::lock_guard lock(mutex_);
    for (auto it = requests_.begin(); it != requests_.end();) {
      if (it->second->state == RequestEntry::State::kPending) ++it;
      else it = requests_.erase(it);
    }
  }
  request_log_.remove();
}

std::size_t Registry::destroy_ids(const std::vector<std::string>& ids, std::string_view reason) {
  if (ids.empty()) return 0;
  std::atomic<std::size_t> next{0}, destroyed{0};
  auto work = [&] {
    for (std::size_t i = next.fetch_add(1); i < ids.size(); i = next.fetch_add(1)) {
      try {
        destroy(ids[i], reason);
        ++destroyed;
      } catch (const Error& e) {
        if (e.code() != Code::kNotFound) log_warn("destroy {}: {}", ids[i], e.what());
      } catch (const std::exception& e) {
        log_warn("destroy {}: {}", ids[i], e.what());
      }
    }
  };
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < std::min(ids.size(), options_.batch_parallelism); ++w) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  return destroyed.load();
}

NodeLoad Registry::load() const {
  NodeLoad out;
  std::lock_guard lock(mutex_);
  out.sandboxes = static_cast<std::uint32_t>(records_.size());
  out.cpu_requested = live_cpu_;
  out.memory_requested = live_memory_;
  out.gpus_requested = live_gpus_;
  for (const auto& kind : kinds()) out.by_kind[kind] = 0;
  for (const auto& [id, record] : records_) ++out.by_kind[record->info.kind];
  return out;
}

void Registry::evict(double t) {
  auto expired = [&](double at, std::chrono::seconds retention) { return t - at >= static_cast<double>(retention.count()); };
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

void Registry::write_record(const Record& record) const {
  if (options_.state_dir.empty()) return;
  std::lock_guard file_lock(record.file_mutex);
  if (record.file_removed) return;
  const SandboxInfo info = record.snapshot();
  protocol::json layers = protocol::json::array();
  for (const auto& l : record.layers) layers.push_back(l.string());
  protocol::json j{{"version", kRecordVersion},
                   {"info", protocol::encode(info)},
                   {"spec", protocol::encode(record.spec)},
                   {"layers", layers}};
  if (!record.image_manifest.empty()) j["image_manifest"] = record.image_manifest;
  if (!record.fingerprint.empty()) j["request_fingerprint"] = record.fingerprint;
  if (!record.backend_state.empty()) {
    protocol::json backend = protocol::json::object();
    for (const auto& [k, v] : record.backend_state) backend[k] = v;
    j["backend"] = std::move(backend);
  }
  write_file_replacing(options_.state_dir / (info.id + ".json"), j.dump(2) + "\n", "sandbox record");
}

namespace {

// Whether a record's file name can be a sandbox id (and so be handed to a backend): <node>-<hex>, plain characters.
bool plausible_sandbox_id(std::string_view id) {
  if (id.empty() || id.size() > 128 || id.front() == '.') return false;
  for (char c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

}  // namespace

std::shared_ptr<Registry::Record> Registry::parse_record(const std::string& text) {
  const protocol::json j = protocol::json::parse(text);
  auto record = std::make_shared<Record>();
  record->info = protocol::decode_sandbox_info(j.at("info"));
  record->spec = protocol::decode_spec(j.at("spec"));
  if (auto it = j.find("layers"); it != j.end())
    for (const auto& layer : *it) record->layers.emplace_back(layer.get<std::string>());
  record->image_manifest = j.value("image_manifest", "");
  record->fingerprint = j.value("request_fingerprint", "");
  if (auto it = j.find("backend"); it != j.end())
    for (const auto& [k, v] : it->items()) record->backend_state[k] = v.get<std::string>();
  if (record->info.id.empty() || record->info.kind.empty())
    throw Error(Code::kInvalidArgument, "the record names no sandbox id or kind");
  return record;
}

std::size_t Registry::remove_leftovers_of_earlier_run() {
  RecoveryReport report = recover(false);
  return report.destroyed + report.rolled_back;
}

RecoveryReport Registry::recover_earlier_run() { return recover(true); }

bool Registry::hold_image(Record& record) {
  const SandboxInfo info = record.snapshot();
  try {
    ResolvedImage image = images_.resolve(info.image, record.image_manifest);
    std::lock_guard lock(record.mutex);
    record.image_hold = std::move(image.hold);
    record.hold_pending = false;
    return true;
  } catch (const std::exception& e) {
    if (!record.hold_pending.exchange(true))
      log_warn("sandbox {}: its image {} cannot be acquired again now ({}); the reaper retries", info.id, info.image,
               e.what());
    return false;
  }
}

Registry::Recovered Registry::recover_one(LoadedRecord& loaded, bool adopt) {
  using Outcome = Recovered::Outcome;
  Record& r = *loaded.record;
  const std::string id = r.info.id;
  const std::string& state = loaded.disk_state;
  auto backend_it = backends_.find(r.info.kind);
  if (backend_it == backends_.end()) {
    log_warn("sandbox {} of an earlier agent run is of kind '{}', which this agent does not serve; its record is kept",
             id, r.info.kind);
    return {Outcome::kKept, nullptr};
  }
  Backend& backend = *backend_it->second;
  auto remove_leftovers = [&] {
    try {
      backend.remove_leftovers(id);
      return true;
    } catch (const std::exception& e) {
      log_warn("sandbox {} of an earlier agent run: removing what it left failed: {}", id, e.what());
      return false;
    }
  };

  if (state == "creating") {
    // The create never answered: whatever it made goes, and a retry with its request id makes a new sandbox.
    if (!remove_leftovers()) return {Outcome::kKept, nullptr};
    remove_record_file(id);
    log_info("sandbox {}: its create was cut short by the end of the earlier agent run; rolled back", id);
    return {Outcome::kRolledBack, nullptr};
  }
  if (state == "destroying" || !adopt) {
    if (!remove_leftovers()) return {Outcome::kKept, nullptr};
    remove_record_file(id);
    r.info.state = "destroyed";
    if (state == "destroying") {
      r.info.message = "destroyed (the destroy, cut short by the end of the earlier agent run, was finished at start)";
      log_info("sandbox {}: finished its destroy, cut short by the end of the earlier agent run", id);
    } else {
      r.info.message = "the agent restarted and took no sandbox over (--on-restart remove)";
      log_info("removed sandbox {} left by an earlier agent run", id);
    }
    return {Outcome::kDestroyed, loaded.record};
  }

  if (state == "running" || state == "sleeping") {
    AdoptParams params{id, r.spec, r.layers, r.backend_state, state == "sleeping"};
    try {
      r.sandbox = backend.adopt(params);
      if (!r.sandbox) throw Error(Code::kInternal, fmt::format("backend '{}' adopted no sandbox", r.info.kind));
      hold_image(r);
      return {Outcome::kAdopted, loaded.record};
    } catch (const std::exception& e) {
      Error error = as_error(e);
      r.sandbox.reset();
      r.info.message =
          error.code() == Code::kNotFound
              ? fmt::format("the sandbox died while the agent was down: {}", error.what())
              : fmt::format("the sandbox could not be taken over after an agent restart: {}", error.what());
      log_warn("sandbox {}: {}", id, r.info.message);
    }
  } else if (state != "failed") {
    r.info.message = fmt::format("its record says '{}', a state an agent restart cannot take over", state);
    log_warn("sandbox {}: {}", id, r.info.message);
  }
  // Failed: it stays on the node (its resources count) until its owner, its TTL or its group destroys it.
  r.info.state = "failed";
  remove_leftovers();  // destroy tries again if this fails
  r.sandbox = std::make_unique<GoneSandbox>(id, backend, r.info.message);
  try {
    write_record(r);
  } catch (const std::exception& e) {
    log_warn("sandbox {}: record of its failure: {}", id, e.what());
  }
  return {Outcome::kFailed, loaded.record};
}

RecoveryReport Registry::recover(bool adopt) {
  RecoveryReport report;
  if (options_.state_dir.empty()) return report;
  const double t = now();

  // 1. The records, read back: <id>.json, or <id>.destroying for a destroy under way (which wins over the other).
  std::map<std::string, std::filesystem::path> files;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(options_.state_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".tmp")) {  // a record or log never completed: nothing refers to it
      std::filesystem::remove(entry.path(), ec);
      continue;
    }
    std::string id;
    if (name.size() > 5 && name.ends_with(".json")) id = name.substr(0, name.size() - 5);
    else if (name.size() > 11 && name.ends_with(".destroying")) id = name.substr(0, name.size() - 11);
    else continue;
    auto& path = files[id];
    if (path.empty() || name.ends_with(".destroying")) path = entry.path();
  }
  std::vector<LoadedRecord> loaded;
  for (const auto& [id, path] : files) {
    {
      std::lock_guard lock(mutex_);
      if (records_.count(id)) continue;
    }
    try {
      std::ifstream in(path);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::shared_ptr<Record> record = parse_record(text);
      if (record->info.id != id)
        throw Error(Code::kInvalidArgument, fmt::format("it names sandbox {}", record->info.id));
      std::string state = path.extension() == ".destroying" ? "destroying" : record->info.state;
      loaded.push_back(LoadedRecord{std::move(state), std::move(record)});
    } catch (const std::exception& e) {
      // Whatever its kind was, no backend keeps anything of an id it never made: ask them all.
      log_warn("sandbox record {} is unreadable ({}); removing what any backend left of {}", path.string(), e.what(),
               id);
      bool clean = true;
      if (plausible_sandbox_id(id)) {  // a file name that is no sandbox id is not passed on
        for (const auto& [kind, backend] : backends_) {
          try {
            backend->remove_leftovers(id);
          } catch (const std::exception& err) {
            clean = false;
            log_warn("sandbox {}: backend {}: {}", id, kind, err.what());
          }
        }
      }
      if (clean) remove_record_file(id);
      ++report.unreadable;
    }
  }

  // 2. Each one taken over, rolled back or finished; adoptions check processes and sockets, so a few at a time.
  std::vector<Recovered> results(loaded.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i = next.fetch_add(1); i < loaded.size(); i = next.fetch_add(1)) {
      try {
        results[i] = recover_one(loaded[i], adopt);
      } catch (const std::exception& e) {
        log_warn("sandbox {}: {}; its record is kept", loaded[i].record->info.id, e.what());
        results[i] = Recovered{Recovered::Outcome::kKept, nullptr};
      }
    }
  };
  {
    std::vector<std::thread> threads;
    for (std::size_t w = 1; w < std::min(loaded.size(), options_.batch_parallelism); ++w) threads.emplace_back(work);
    work();
    for (auto& th : threads) th.join();
  }

  // 3. Into the tables: live sandboxes and their load, groups, request ids, tombstones.
  std::set<std::string> kept_groups;  // of records kept for a later start: their lease files stay
  std::map<std::string, double> group_ttls;
  std::vector<std::pair<double, std::string>> new_requests;
  {
    std::lock_guard lock(mutex_);
    auto remember = [&](const Record& r) {
      if (r.spec.request_id.empty() || requests_.count(r.spec.request_id)) return;
      auto entry = std::make_shared<RequestEntry>();
      entry->state = RequestEntry::State::kDone;
      entry->fingerprint = r.fingerprint.empty() ? spec_fingerprint(r.spec) : r.fingerprint;
      entry->sandbox_id = r.info.id;
      entry->at = r.info.created_at > 0 ? r.info.created_at : t;
      requests_.emplace(r.spec.request_id, entry);
      new_requests.emplace_back(entry->at, r.spec.request_id);
    };
    for (std::size_t i = 0; i < results.size(); ++i) {
      const Recovered& out = results[i];
      switch (out.outcome) {
        case Recovered::Outcome::kAdopted:
        case Recovered::Outcome::kFailed: {
          const std::shared_ptr<Record>& r = out.record;
          const bool sleeping = r->info.state == "sleeping";
          records_.emplace(r->info.id, r);
          r->cpu_released = sleeping;
          if (!sleeping) live_cpu_ += r->spec.resources.cpu;
          live_memory_ += r->spec.resources.memory_bytes;
          live_gpus_ += r->spec.resources.gpus;
          if (!r->spec.group.empty()) {
            groups_[r->spec.group].members.insert(r->info.id);
            double& ttl = group_ttls[r->spec.group];
            ttl = std::max(ttl, static_cast<double>(r->spec.group_ttl.count()));
          }
          remember(*r);
          if (out.outcome == Recovered::Outcome::kAdopted) ++report.adopted;
          else ++report.failed;
          break;
        }
        case Recovered::Outcome::kDestroyed:
          tombstones_[out.record->info.id] = Tombstone{out.record->info, t};
          tombstone_order_.emplace_back(t, out.record->info.id);
          remember(*out.record);
          ++report.destroyed;
          break;
        case Recovered::Outcome::kRolledBack:
          ++report.rolled_back;
          break;
        case Recovered::Outcome::kKept:
          ++report.kept;
          if (!loaded[i].record->spec.group.empty()) kept_groups.insert(loaded[i].record->spec.group);
          break;
      }
    }
    // Creates that finished, including those whose sandboxes are destroyed by now, from the request log.
    const double retention = static_cast<double>(options_.request_id_retention.count());
    for (auto& e : request_log_.load()) {
      if (t - e.at >= retention || requests_.count(e.request_id)) continue;
      auto entry = std::make_shared<RequestEntry>();
      entry->state = RequestEntry::State::kDone;
      entry->fingerprint = std::move(e.fingerprint);
      entry->sandbox_id = std::move(e.sandbox_id);
      entry->at = e.at;
      requests_.emplace(e.request_id, entry);
      new_requests.emplace_back(e.at, std::move(e.request_id));
    }
    std::sort(new_requests.begin(), new_requests.end());
    for (auto& r : new_requests) request_order_.push_back(std::move(r));
    evict(t);
    report.request_ids = requests_.size();
  }

  // 4. Group leases, as they were on disk; a group whose lease file is missing gets a fresh lease.
  std::vector<std::string> fresh_leases;
  for (auto& [group_id, ttl] : group_ttls) {
    double file_ttl = 0, expires_at = 0;
    try {
      std::ifstream in(groups_dir() / (group_id + ".json"));
      protocol::json j = protocol::json::parse(in);
      file_ttl = j.at("ttl").get<double>();
      expires_at = j.at("expires_at").get<double>();
    } catch (const std::exception&) {
      file_ttl = 0;
    }
    std::lock_guard lock(mutex_);
    Group& g = groups_[group_id];
    if (file_ttl > 0) {
      g.ttl = file_ttl;
      g.expires_at = expires_at;
      g.persisted_expires_at = expires_at;
    } else {
      g.ttl = ttl;
      g.expires_at = t + ttl;
      fresh_leases.push_back(group_id);
    }
  }
  for (const auto& group_id : fresh_leases) {
    log_warn("group {}: its lease file is missing; its sandboxes get a fresh lease", group_id);
    try {
      persist_group(group_id);
    } catch (const std::exception& e) {
      log_warn("group {}: {}", group_id, e.what());
    }
  }
  // Lease files of groups with no sandbox left here: a trainer that renews learns (NOT_FOUND) that they are gone.
  for (const auto& entry : std::filesystem::directory_iterator(groups_dir(), ec)) {
    std::string name = entry.path().filename().string();
    if (!name.ends_with(".json")) {
      if (name.ends_with(".tmp")) std::filesystem::remove(entry.path(), ec);
      continue;
    }
    std::string group_id = name.substr(0, name.size() - 5);
    if (kept_groups.count(group_id) || group_ttls.count(group_id)) continue;
    std::filesystem::remove(entry.path(), ec);
  }
  ::rmdir(groups_dir().c_str());  // only when empty

  // 5. The request log, compacted to what is remembered.
  try {
    request_log_.rewrite([this] {
      std::vector<RequestLog::Entry> entries;
      std::lock_guard lock(mutex_);
      for (const auto& [at, request_id] : request_order_) {
        auto it = requests_.find(request_id);
        if (it == requests_.end() || it->second->at != at || it->second->state != RequestEntry::State::kDone) continue;
        entries.push_back(RequestLog::Entry{request_id, it->second->sandbox_id, it->second->fingerprint, at});
      }
      return entries;
    });
  } catch (const std::exception& e) {
    log_warn("request log: {}", e.what());
  }

  for (std::size_t i = 0; i < results.size(); ++i) {
    const std::string& kind = loaded[i].record->info.kind;
    switch (results[i].outcome) {
      case Recovered::Outcome::kAdopted: metrics_.sandbox_recovered(kind, "adopted"); break;
      case Recovered::Outcome::kFailed:
        metrics_.sandbox_recovered(kind, "failed");
        metrics_.sandbox_failed(kind);
        break;
      case Recovered::Outcome::kRolledBack: metrics_.sandbox_recovered(kind, "rolled_back"); break;
      case Recovered::Outcome::kDestroyed: metrics_.sandbox_recovered(kind, "destroyed"); break;
      case Recovered::Outcome::kKept: break;
    }
  }
  if (report.adopted + report.failed + report.rolled_back + report.destroyed + report.kept + report.unreadable > 0)
    log_info("earlier run: {} sandbox{} taken over, {} failed, {} create{} rolled back, {} destroyed, {} kept for a "
             "later start, {} unreadable record{}; {} request ids remembered",
             report.adopted, report.adopted == 1 ? "" : "es", report.failed, report.rolled_back,
             report.rolled_back == 1 ? "" : "s", report.destroyed, report.kept, report.unreadable,
             report.unreadable == 1 ? "" : "s", report.request_ids);
  return report;
}

double Registry::join_group(const SandboxSpec& spec, double t, bool& persist) {
  auto it = groups_.find(spec.group);
  if (it != groups_.end() && t >= it->second.expires_at) {
    retire_group(it);
    it = groups_.end();
  }
  const double ttl = static_cast<double>(spec.group_ttl.count());
  if (it == groups_.end()) it = groups_.emplace(spec.group, Group{}).first;
  Group& group = it->second;
  group.ttl = ttl;
  group.expires_at = std::max(group.expires_at, t + ttl);
  persist = group.expires_at >= group.persisted_expires_at + 1.0;
  return group.expires_at;
}

void Registry::retire_group(std::unordered_map<std::string, Group>::iterator it) {
  for (const auto& id : it->second.members) doomed_.emplace_back(id, it->first);
  groups_.erase(it);
}

GroupInfo Registry::group_info(const std::string& id, const Group& group) const {
  GroupInfo info;
  info.id = id;
  info.node = options_.node_id;
  info.ttl = group.ttl;
  info.expires_at = group.expires_at;
  info.sandbox_count = group.members.size();
  return info;
}

namespace {

Error no_group(const std::string& group, const std::string& node) {
  return Error(Code::kNotFound, fmt::format("group '{}' not found on node '{}' (it has no sandboxes here, was "
                                            "deleted, or its lease expired)",
                                            group, node));
}

Error expired_group(const std::string& group, const std::string& node, double ago) {
  return Error(Code::kNotFound, fmt::format("group '{}' on node '{}': its lease expired {:.1f} s ago; its sandboxes "
                                            "are being destroyed",
                                            group, node, ago));
}

}  // namespace

GroupInfo Registry::renew_group(const std::string& group, double ttl) {
  if (!protocol::valid_group_id(group))
    throw Error(Code::kInvalidArgument, fmt::format("group: '{}' is not a group id", group));
  if (ttl != 0 && (ttl < 1 || ttl > protocol::kMaxGroupTtlSeconds))
    throw Error(Code::kInvalidArgument, "ttl: must be from 1 to 86400 seconds");
  GroupInfo info;
  bool persist = false;
  {
    std::lock_guard lock(mutex_);
    const double t = now();
    auto it = groups_.find(group);
    if (it == groups_.end()) throw no_group(group, options_.node_id);
    if (t >= it->second.expires_at) {
      double ago = t - it->second.expires_at;
      retire_group(it);
      throw expired_group(group, options_.node_id, ago);
    }
    Group& g = it->second;
    if (ttl != 0) g.ttl = ttl;
    g.expires_at = std::max(g.expires_at, t + g.ttl);
    persist = g.expires_at != g.persisted_expires_at;
    info = group_info(group, g);
  }
  if (persist) persist_group(group);
  return info;
}

GroupInfo Registry::get_group(const std::string& group) const {
  std::vector<std::shared_ptr<Record>> members;
  GroupInfo info;
  {
    std::lock_guard lock(mutex_);
    const double t = now();
    auto it = groups_.find(group);
    if (it == groups_.end()) throw no_group(group, options_.node_id);
    if (t >= it->second.expires_at) throw expired_group(group, options_.node_id, t - it->second.expires_at);
    info = group_info(group, it->second);
    for (const auto& id : it->second.members)
      if (auto r = records_.find(id); r != records_.end()) members.push_back(r->second);
  }
  for (const auto& record : members) info.sandboxes.push_back(record->snapshot());
  std::sort(info.sandboxes.begin(), info.sandboxes.end(), [](const SandboxInfo& a, const SandboxInfo& b) {
    return a.created_at != b.created_at ? a.created_at < b.created_at : a.id < b.id;
  });
  return info;
}

std::vector<GroupInfo> Registry::list_groups() const {
  std::vector<GroupInfo> out;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [id, group] : groups_) out.push_back(group_info(id, group));
  }
  std::sort(out.begin(), out.end(), [](const GroupInfo& a, const GroupInfo& b) { return a.id < b.id; });
  return out;
}

GroupInfo Registry::destroy_group(const std::string& group) {
  GroupInfo info;
  std::vector<std::string> ids;
  {
    std::lock_guard lock(mutex_);
    auto it = groups_.find(group);
    if (it == groups_.end()) throw no_group(group, options_.node_id);
    info = group_info(group, it->second);
    ids.assign(it->second.members.begin(), it->second.members.end());
    groups_.erase(it);
  }
  destroy_ids(ids, fmt::format("group '{}' deleted", group));
  persist_group(group);
  return info;
}

void Registry::persist_group(const std::string& group) {
  if (options_.state_dir.empty()) return;
  std::lock_guard file_lock(group_file_mutex_);
  std::optional<protocol::json> lease;
  {
    std::lock_guard lock(mutex_);
    if (auto it = groups_.find(group); it != groups_.end()) {
      lease = protocol::json{{"version", 1},
                             {"id", group},
                             {"ttl", it->second.ttl},
                             {"expires_at", it->second.expires_at}};
      it->second.persisted_expires_at = it->second.expires_at;
    }
  }
  const auto path = groups_dir() / (group + ".json");
  if (!lease) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
      log_warn("remove group lease {}: {}", path.string(), std::strerror(errno));
    ::rmdir(groups_dir().c_str());  // only when it is empty: no directory stays behind a node without groups
    return;
  }
  std::error_code ec;
  std::filesystem::create_directories(groups_dir(), ec);
  if (ec) throw Error(code_for_errno(ec.value()), fmt::format("create {}: {}", groups_dir().string(), ec.message()));
  write_file_replacing(path, lease->dump() + "\n", "group lease");
}

void Registry::remove_record_file(const Record& record) const {
  std::lock_guard file_lock(record.file_mutex);
  record.file_removed = true;
  remove_record_file(record.info.id);
}

void Registry::remove_record_file(const std::string& id) const {
  if (options_.state_dir.empty()) return;
  for (const char* suffix : {".json", ".destroying"}) {
    auto path = options_.state_dir / (id + suffix);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
      log_warn("remove sandbox record {}: {}", path.string(), std::strerror(errno));
  }
}

void Registry::mark_destroying(const Record& record, bool destroying) const {
  if (options_.state_dir.empty()) return;
  std::lock_guard file_lock(record.file_mutex);
  const auto live = options_.state_dir / (record.info.id + ".json");
  const auto going = options_.state_dir / (record.info.id + ".destroying");
  if (destroying) {
    if (record.file_removed) return;
    // One rename, not a rewrite: a destroy costs the node one metadata operation more than before, not a file.
    if (::rename(live.c_str(), going.c_str()) != 0)
      log_warn("sandbox {}: mark its record as being destroyed: {}", record.info.id, std::strerror(errno));
    record.file_removed = true;  // nothing may write <id>.json again
    return;
  }
  // The destroy failed: the sandbox lives on.
  if (::rename(going.c_str(), live.c_str()) != 0 && errno != ENOENT)
    log_warn("sandbox {}: restore its record after a failed destroy: {}", record.info.id, std::strerror(errno));
  record.file_removed = false;
}

}  // namespace dsec::agent
