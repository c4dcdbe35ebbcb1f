// Restart recovery: what an earlier run of the agent left, taken over at start-up. Its records are read back, each
// sandbox adopted, failed, rolled back or its destroy finished, and the tables, group leases and request ids
// restored; or, with --on-restart remove, every sandbox of that run removed.
#include "agent/registry/registry.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "agent/registry/registry_internal.hpp"
#include "common/log.hpp"
#include "common/protocol.hpp"

namespace dsec::agent {

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
  Processes* processes() override { throw gone(); }
  Screen* screen() override { throw gone(); }
  bool alive() override { return false; }
  void destroy() override {
    std::lock_guard lock(mutex_);
    if (destroyed_) return;
    backend_.remove_leftovers(id_);
    destroyed_ = true;
  }

 private:
  Error gone() const {
    return Error(Code::kFailedPrecondition, fmt::format("sandbox {} is not running: {}", id_, why_), false,
                 Fault::kInfrastructure);
  }
  std::string id_;
  Backend& backend_;
  std::string why_;
  std::mutex mutex_;
  bool destroyed_ = false;
};

// Whether a record's file name can be a sandbox id (and so be handed to a backend): <node>-<hex>, plain characters.
bool plausible_sandbox_id(std::string_view id) {
  if (id.empty() || id.size() > 128 || id.front() == '.') return false;
  for (char c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

}  // namespace

std::size_t Registry::remove_leftovers_of_earlier_run() {
  RecoveryReport report = recover(false);
  return report.destroyed + report.rolled_back;
}

RecoveryReport Registry::recover_earlier_run() { return recover(true); }

bool Registry::hold_image(Record& record) {
  const SandboxInfo info = record.snapshot();
  try {
    ResolvedImage image = images_.resolve(info.image, record.image_manifest, ManifestOrigin::kAgent);
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
    params.spec.network = r.info.network;  // what set_network last put in force
    try {
      r.sandbox = backend.adopt(params);
      if (!r.sandbox) throw Error(Code::kInternal, fmt::format("backend '{}' adopted no sandbox", r.info.kind));
      r.info.qos = r.sandbox->qos_grant();
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

// 1. The records, read back: <id>.json, or <id>.destroying for a destroy under way (which wins over the other).
std::vector<Registry::LoadedRecord> Registry::load_records(RecoveryReport& report) {
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
      forget_unreadable_record(id, path, e.what());
      ++report.unreadable;
    }
  }
  return loaded;
}

// A record that cannot be read: whatever its kind was, no backend keeps anything of an id it never made, so all of
// them are asked to remove what they left of it.
void Registry::forget_unreadable_record(const std::string& id, const std::filesystem::path& path,
                                        std::string_view why) {
  log_warn("sandbox record {} is unreadable ({}); removing what any backend left of {}", path.string(), why, id);
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
}

// 2. Each one taken over, rolled back or finished; adoptions check processes and sockets, so a few at a time.
std::vector<Registry::Recovered> Registry::recover_all(std::vector<LoadedRecord>& loaded, bool adopt) {
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
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < std::min(loaded.size(), options_.batch_parallelism); ++w) threads.emplace_back(work);
  work();
  for (auto& th : threads) th.join();
  return results;
}

// 3. Into the tables: live sandboxes and their load, groups, request ids, tombstones. Fills the groups' longest TTLs
// and the groups of records kept for a later start (their lease files stay).
void Registry::enter_recovered(const std::vector<LoadedRecord>& loaded, const std::vector<Recovered>& results, double t,
                               RecoveryReport& report, std::map<std::string, double>& group_ttls,
                               std::set<std::string>& kept_groups) {
  std::vector<std::pair<double, std::string>> new_requests;
  // The request log is read before the registry's lock is taken: its lock comes first wherever both are held
  // (compact_create_ids takes the registry's inside the log's).
  std::vector<CreateIds::Entry> logged = create_ids_.load();
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
  for (auto& e : logged) {
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

// 4. Group leases, as they were on disk; a group whose lease file is missing gets a fresh lease. Lease files of
// groups with no sandbox left here go: a trainer that renews learns (NOT_FOUND) that they are gone.
void Registry::restore_group_leases(const std::map<std::string, double>& group_ttls,
                                    const std::set<std::string>& kept_groups, double t) {
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
  std::error_code ec;
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
}

// The request log, rewritten from the creates the registry remembers (at a start, and when the reaper finds the log
// far longer than that). Throws what writing it throws.
void Registry::compact_create_ids() {
  create_ids_.rewrite([this] {
    std::vector<CreateIds::Entry> entries;
    std::lock_guard lock(mutex_);
    for (const auto& [at, request_id] : request_order_) {
      auto it = requests_.find(request_id);
      if (it == requests_.end() || it->second->at != at || it->second->state != RequestEntry::State::kDone) continue;
      entries.push_back(CreateIds::Entry{request_id, it->second->sandbox_id, it->second->fingerprint, at});
    }
    return entries;
  });
}

void Registry::count_recovered(const std::vector<LoadedRecord>& loaded, const std::vector<Recovered>& results,
                               const RecoveryReport& report) {
  for (std::size_t i = 0; i < results.size(); ++i) {
    const std::string& kind = loaded[i].record->info.kind;
    switch (results[i].outcome) {
      case Recovered::Outcome::kAdopted:
        metrics_.sandbox_recovered(kind, "adopted");
        break;
      case Recovered::Outcome::kFailed:
        metrics_.sandbox_recovered(kind, "failed");
        metrics_.sandbox_failed(kind);
        break;
      case Recovered::Outcome::kRolledBack:
        metrics_.sandbox_recovered(kind, "rolled_back");
        break;
      case Recovered::Outcome::kDestroyed:
        metrics_.sandbox_recovered(kind, "destroyed");
        break;
      case Recovered::Outcome::kKept:
        break;
    }
  }
  if (report.adopted + report.failed + report.rolled_back + report.destroyed + report.kept + report.unreadable > 0)
    log_info(
        "earlier run: {} sandbox{} taken over, {} failed, {} create{} rolled back, {} destroyed, {} kept for a "
        "later start, {} unreadable record{}; {} request ids remembered",
        report.adopted, report.adopted == 1 ? "" : "es", report.failed, report.rolled_back,
        report.rolled_back == 1 ? "" : "s", report.destroyed, report.kept, report.unreadable,
        report.unreadable == 1 ? "" : "s", report.request_ids);
}

RecoveryReport Registry::recover(bool adopt) {
  RecoveryReport report;
  if (options_.state_dir.empty()) return report;
  const double t = now();
  std::vector<LoadedRecord> loaded = load_records(report);
  std::vector<Recovered> results = recover_all(loaded, adopt);
  std::map<std::string, double> group_ttls;
  std::set<std::string> kept_groups;
  enter_recovered(loaded, results, t, report, group_ttls, kept_groups);
  restore_group_leases(group_ttls, kept_groups, t);
  try {
    compact_create_ids();  // 5. to what is remembered
  } catch (const std::exception& e) {
    log_warn("request log: {}", e.what());
  }
  count_recovered(loaded, results, report);
  // Exec request ids are kept for the sandboxes that still have a record (taken over, failed, or kept for a later
  // start); the others' are forgotten.
  std::set<std::string> with_records;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(options_.state_dir, ec))
    if (e.path().extension() == ".json") with_records.insert(e.path().stem().string());
  exec_journal_.retain(with_records);
  return report;
}
}  // namespace dsec::agent
