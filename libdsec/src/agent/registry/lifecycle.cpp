// A sandbox's life after its create: liveness checks (a dead one turns "failed"), sleep and wake, fork, destroy
// (one, a list, all), and the reaper's pass (TTLs, expired group leases, images to hold again, the request log).
#include "agent/registry/registry.hpp"
#include "common/network_rules.hpp"

#include <algorithm>
#include <atomic>
#include <map>
#include <thread>

#include <fmt/format.h>

#include "agent/registry/registry_internal.hpp"
#include "common/log.hpp"
#include "common/network_rules.hpp"
#include "common/protocol.hpp"

namespace dsec::agent {

void Registry::write_record_or_warn(const Record& record, std::string_view what) const {
  try {
    write_record(record);
  } catch (const std::exception& e) {
    log_warn("sandbox {}: record of its {}: {}", record.info.id, what, e.what());
  }
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
    admit(spec.resources, count, spec.tenant);
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
      record.info.message = why.empty()
                                ? "the sandbox's processes are gone (its init exited or it was killed as a whole)"
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

namespace {

// A sleep or wake whose request id is that of the sandbox's last one: the answer it got, again.
template <typename Record, typename Outcome>
bool repeated_power_request(Record& record, std::string_view request_id, bool sleep, Outcome& out) {
  if (request_id.empty() || record.power_request_id != request_id) return false;
  if (record.power_request_sleep != sleep)
    throw Error(Code::kInvalidArgument,
                fmt::format("request_id '{}' was a {} of sandbox {}, not a {}", request_id, sleep ? "wake" : "sleep",
                            record.snapshot().id, sleep ? "sleep" : "wake"));
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
    throw Error(Code::kFailedPrecondition,
                fmt::format("sandbox {} is {}; only a running sandbox can sleep", id, state));
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
      room_.notify_all();
    }
  }
  write_record_or_warn(*record, "sleep");
  out.info = record->snapshot();
  return out;
}

SandboxInfo Registry::set_network(const std::string& id, const NetworkPolicy& policy) {
  network::validate(policy);
  std::shared_ptr<Record> record = find_live(id);
  check_alive(*record);
  // One change at a time, and none during a sleep or a wake.
  std::lock_guard power(record->power_mutex);
  const std::string state = record->snapshot().state;
  if (state != "running" && state != "sleeping")
    throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is {}; its network cannot change", id, state));
  record->sandbox->set_network(policy);
  {
    std::lock_guard lock(record->mutex);
    record->info.network = policy;
  }
  refresh_backend_state(*record);
  write_record_or_warn(*record, "network");
  return record->snapshot();
}

SandboxInfo Registry::set_ttl(const std::string& id, std::chrono::seconds ttl) {
  std::shared_ptr<Record> record = find_live(id);
  {
    std::lock_guard lock(record->mutex);
    record->info.expires_at = ttl.count() > 0 ? now() + static_cast<double>(ttl.count()) : 0;
  }
  write_record_or_warn(*record, "ttl");
  return record->snapshot();
}

std::string Registry::expose(const std::string& id, std::uint32_t port) {
  std::shared_ptr<Record> record = find_live(id);
  check_alive(*record);
  std::lock_guard power(record->power_mutex);
  std::string address = record->sandbox->expose(port);
  refresh_backend_state(*record);
  write_record_or_warn(*record, "exposed port");
  return address;
}

void Registry::unexpose(const std::string& id, std::uint32_t port) {
  std::shared_ptr<Record> record = find_live(id);
  std::lock_guard power(record->power_mutex);
  record->sandbox->unexpose(port);
  refresh_backend_state(*record);
  write_record_or_warn(*record, "exposed port");
}

std::map<std::uint32_t, std::string> Registry::exposed(const std::string& id) {
  std::shared_ptr<Record> record = find_live(id);
  return record->sandbox->exposed();
}

NetworkUsage Registry::network_usage(const std::string& id) {
  std::shared_ptr<Record> record = find_live(id);
  return record->sandbox->network_usage();
}

Registry::SleepOutcome Registry::wake(const std::string& id, std::string_view request_id) {
  std::shared_ptr<Record> record = find_live(id);
  std::lock_guard power(record->power_mutex);
  SleepOutcome out;
  if (repeated_power_request(*record, request_id, false, out)) return out;
  std::string state = record->snapshot().state;
  if (state != "sleeping")
    throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is {}, not sleeping; only a sleeping sandbox can "
                                                       "wake",
                                                       id, state));
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
  write_record_or_warn(*record, "wake");
  out.info = record->snapshot();
  return out;
}

SandboxInfo Registry::destroy(const std::string& id, std::string_view reason) {
  std::optional<SandboxInfo> destroyed;
  std::shared_ptr<Record> record = find_or_tombstone(id, destroyed);
  if (!record) return *destroyed;
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
  std::string unused_snapshot;  // the fork snapshot this sandbox was the last user of on this node
  {
    std::lock_guard lock(mutex_);
    auto it = records_.find(id);
    if (it != records_.end() && it->second == record) {
      records_.erase(it);
      if (!record->cpu_released) live_cpu_ -= record->spec.resources.cpu;
      if (live_cpu_ < kEpsilon) live_cpu_ = 0;
      live_memory_ -= record->spec.resources.memory_bytes;
      live_gpus_ -= record->spec.resources.gpus;
      room_.notify_all();
      if (!record->spec.group.empty())
        if (auto g = groups_.find(record->spec.group); g != groups_.end()) g->second.members.erase(id);
      double at = now();
      tombstones_[id] = Tombstone{info, at};
      tombstone_order_.emplace_back(at, id);
      evict(at);
      erased = true;
      unused_snapshot = last_fork_snapshot_user(*record);
    }
  }
  if (erased) {
    {
      std::lock_guard lock(record->mutex);
      record->info.state = "destroyed";
      record->info.message = info.message;
    }
    remove_record_file(*record);
    exec_journal_.drop(id);
    metrics_.sandbox_destroyed(info.kind);
  }
  if (!unused_snapshot.empty() && options_.on_fork_snapshot_unused) {
    try {
      options_.on_fork_snapshot_unused(unused_snapshot);
    } catch (const std::exception& e) {
      log_warn("fork snapshot {}: {}", unused_snapshot, e.what());
    }
  }
  return info;
}

std::string Registry::last_fork_snapshot_user(const Record& record) const {
  auto label = record.spec.labels.find(std::string(protocol::kForkSnapshotLabel));
  if (label == record.spec.labels.end() || !label->second.starts_with(protocol::kForkSnapshotPrefix)) return {};
  for (const auto& [id, other] : records_) {
    auto it = other->spec.labels.find(label->first);
    if (it != other->spec.labels.end() && it->second == label->second) return {};
  }
  return label->second;
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
  if (create_ids_.appended() > std::max<std::size_t>(4096, 2 * remembered)) {
    try {
      compact_create_ids();
    } catch (const std::exception& e) {
      log_warn("reaper: request log: {}", e.what());
    }
  }
  for (const auto& record : records) {
    double expires_at = record->snapshot().expires_at;
    try {
      if (expires_at > 0 && t >= expires_at) {
        destroy(record->info.id, "ttl expired");
      } else {
        check_alive(*record);
        if (!record->destroying.load()) record->sandbox->upkeep();
      }
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

}  // namespace dsec::agent
