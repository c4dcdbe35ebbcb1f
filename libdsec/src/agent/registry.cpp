#include "agent/registry.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "agent/log.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent {
namespace {

constexpr double kEpsilon = 1e-9;

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Two creates with one request_id must ask for the same thing; the request_id itself is not part of it.
std::string spec_fingerprint(const SandboxSpec& spec) {
  SandboxSpec copy = spec;
  copy.request_id.clear();
  return protocol::encode(copy).dump();
}

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

}  // namespace

struct Registry::Record {
  mutable std::mutex mutex;  // guards info.state and info.message
  SandboxInfo info;
  SandboxSpec spec;
  std::vector<std::filesystem::path> layers;
  std::shared_ptr<const void> image_hold;  // the image's files stay while the sandbox lives
  std::unique_ptr<BackendSandbox> sandbox;
  std::atomic<bool> destroying{false};

  SandboxInfo snapshot() const {
    std::lock_guard lock(mutex);
    return info;
  }
};

struct Registry::RequestEntry {
  enum class State { kPending, kDone, kFailed };
  State state = State::kPending;
  std::string fingerprint;
  std::string sandbox_id;
  std::optional<Error> error;
  double at = 0;
};

Registry::Registry(RegistryOptions options, Backends backends, ImageSource& images, Metrics& metrics)
    : options_(std::move(options)), backends_(std::move(backends)), images_(images), metrics_(metrics),
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
  if (!spec.request_id.empty()) {
    std::string fingerprint = spec_fingerprint(spec);
    std::unique_lock lock(mutex_);
    evict(now());
    auto it = requests_.find(spec.request_id);
    if (it == requests_.end()) {
      entry = std::make_shared<RequestEntry>();
      entry->fingerprint = std::move(fingerprint);
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
    CreateOutcome outcome = create_new(spec, image_manifest);
    if (entry) {
      std::lock_guard lock(mutex_);
      entry->state = RequestEntry::State::kDone;
      entry->sandbox_id = outcome.info.id;
    }
    request_done_.notify_all();
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

CreateOutcome Registry::create_new(const SandboxSpec& spec, std::string_view image_manifest) {
  auto started = std::chrono::steady_clock::now();
  auto backend_it = backends_.find(spec.kind);
  if (backend_it == backends_.end())
    throw Error(Code::kInvalidArgument,
                fmt::format("kind: '{}' is not served by node '{}' (it serves: {})", spec.kind, options_.node_id,
                            fmt::join(kinds(), ", ")));
  Backend& backend = *backend_it->second;

  std::string id;
  {
    std::lock_guard lock(mutex_);
    admit(spec.resources, 1);
    reserved_cpu_ += spec.resources.cpu;
    reserved_memory_ += spec.resources.memory_bytes;
    id = new_id();
  }
  // Until the record is in the table, the resources are a reservation; it is released on every failure path.
  bool reserved = true;
  auto release = [&] {
    if (!reserved) return;
    std::lock_guard lock(mutex_);
    reserved_cpu_ -= spec.resources.cpu;
    reserved_memory_ -= spec.resources.memory_bytes;
    reserved = false;
  };

  auto record = std::make_shared<Record>();
  try {
    ResolvedImage image = images_.resolve(spec.image, image_manifest);
    CreateParams params{id, spec, image.layers};
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
    write_record(*record);
    try {
      record->sandbox = backend.create(params);
    } catch (...) {
      remove_record_file(id);
      throw;
    }
    if (!record->sandbox) {
      remove_record_file(id);
      throw Error(Code::kInternal, fmt::format("backend '{}' returned no sandbox", spec.kind));
    }

    double created_at = now();
    info.state = "running";
    info.tenant = spec.tenant;
    info.labels = spec.labels;
    info.resources = spec.resources;
    info.created_at = created_at;
    info.expires_at = spec.ttl.count() > 0 ? created_at + static_cast<double>(spec.ttl.count()) : 0;
    record->image_hold = std::move(image.hold);
    try {
      write_record(*record);
    } catch (...) {
      record->sandbox->destroy();
      remove_record_file(id);
      throw;
    }
  } catch (...) {
    release();
    throw;
  }

  {
    std::lock_guard lock(mutex_);
    reserved_cpu_ -= spec.resources.cpu;
    reserved_memory_ -= spec.resources.memory_bytes;
    reserved = false;
    live_cpu_ += spec.resources.cpu;
    live_memory_ += spec.resources.memory_bytes;
    records_.emplace(id, record);
  }
  metrics_.sandbox_created(spec.kind, seconds_since(started));
  return CreateOutcome{record->snapshot(), true};
}

void Registry::admit(const Resources& r, std::size_t count) const {
  const double n = static_cast<double>(count);
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

void Registry::forget_request_id(const std::string& request_id, const std::string& sandbox_id) {
  std::lock_guard lock(mutex_);
  auto it = requests_.find(request_id);
  if (it != requests_.end() && it->second->sandbox_id == sandbox_id) requests_.erase(it);
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
      record.info.message = "the sandbox's processes are gone (its init exited or it was killed as a whole)";
      changed = true;
    }
  }
  if (changed) metrics_.sandbox_failed(record.info.kind);
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
  record->destroying = true;
  try {
    record->sandbox->destroy();
  } catch (...) {
    record->destroying = false;
    throw;
  }
  record->image_hold.reset();

  SandboxInfo info = record->snapshot();
  info.state = "destroyed";
  info.message = std::string(reason);
  bool erased = false;
  {
    std::lock_guard lock(mutex_);
    auto it = records_.find(id);
    if (it != records_.end() && it->second == record) {
      records_.erase(it);
      live_cpu_ -= record->spec.resources.cpu;
      if (live_cpu_ < kEpsilon) live_cpu_ = 0;
      live_memory_ -= record->spec.resources.memory_bytes;
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
    remove_record_file(id);
    metrics_.sandbox_destroyed(info.kind);
  }
  return info;
}

void Registry::reap() {
  std::vector<std::shared_ptr<Record>> records;
  double t = now();
  {
    std::lock_guard lock(mutex_);
    evict(t);
    records.reserve(records_.size());
    for (const auto& [id, record] : records_) records.push_back(record);
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
  {
    std::lock_guard lock(mutex_);
    for (const auto& [id, record] : records_) ids.push_back(id);
  }
  std::atomic<std::size_t> next{0}, destroyed{0};
  auto work = [&] {
    for (std::size_t i = next.fetch_add(1); i < ids.size(); i = next.fetch_add(1)) {
      try {
        destroy(ids[i], reason);
        ++destroyed;
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
  protocol::json layers = protocol::json::array();
  for (const auto& l : record.layers) layers.push_back(l.string());
  protocol::json j{{"version", 1},
                   {"info", protocol::encode(record.info)},
                   {"spec", protocol::encode(record.spec)},
                   {"layers", layers}};
  std::string text = j.dump(2) + "\n";
  auto path = options_.state_dir / (record.info.id + ".json");
  auto tmp = options_.state_dir / (record.info.id + ".json.tmp");
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) throw_errno_fmt(errno, "create sandbox record {}", tmp.string());
    write_all(fd.get(), text, tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw_errno_fmt(err, "rename {} to {}", tmp.string(), path.string());
  }
}

std::size_t Registry::remove_leftovers_of_earlier_run() {
  if (options_.state_dir.empty()) return 0;
  std::size_t cleaned = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(options_.state_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(".json.tmp")) {  // a record never completed: its create never answered
      std::filesystem::remove(entry.path(), ec);
      continue;
    }
    if (name.size() <= 5 || !name.ends_with(".json")) continue;
    const std::string id = name.substr(0, name.size() - 5);
    {
      std::lock_guard lock(mutex_);
      if (records_.count(id)) continue;
    }
    std::string kind;
    try {
      std::ifstream in(entry.path());
      kind = protocol::json::parse(in).at("info").at("kind").get<std::string>();
    } catch (const std::exception& e) {
      log_warn("sandbox record {} is unreadable ({}); removed", entry.path().string(), e.what());
      std::filesystem::remove(entry.path(), ec);
      continue;
    }
    auto backend = backends_.find(kind);
    if (backend == backends_.end()) {
      log_warn("sandbox {} of an earlier agent run is of kind '{}', which this agent does not serve; its record is "
               "kept",
               id, kind);
      continue;
    }
    try {
      backend->second->remove_leftovers(id);
    } catch (const std::exception& e) {
      log_warn("sandbox {} of an earlier agent run: removing what it left failed: {}; its record is kept", id,
               e.what());
      continue;
    }
    log_info("removed sandbox {} left by an earlier agent run", id);
    std::filesystem::remove(entry.path(), ec);
    ++cleaned;
  }
  return cleaned;
}

void Registry::remove_record_file(const std::string& id) const {
  if (options_.state_dir.empty()) return;
  auto path = options_.state_dir / (id + ".json");
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    log_warn("remove sandbox record {}: {}", path.string(), std::strerror(errno));
}

}  // namespace dsec::agent
