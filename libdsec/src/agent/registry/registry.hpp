// The node's sandboxes: one record per live sandbox (its SandboxInfo and its backend object), the idempotency table
// of request ids, tombstones of destroyed sandboxes, admission against the node's capacity, the on-disk record
// of every live sandbox (<home>/state/sandboxes/<id>.json), and lease groups: sandboxes created with a group live
// while their trainer renews the group's lease, and are destroyed together when it stops (<state>/groups/<id>.json
// keeps the lease's deadline).
//
// Thread-safe. Calls on one sandbox run concurrently (several execs at once): acquire() hands out a reference that
// keeps the backend object alive, so a destroy that races an exec makes the exec fail (the backend's destroy() ends
// what runs inside) but never frees memory under it.
//
// Its member functions are defined across registry.cpp (creates, request ids, lookups) and the other files of this
// folder (admission, lifecycle, records, recovery, groups); registry_internal.hpp holds what they share.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "agent/backends/backend.hpp"
#include "agent/images/image_source.hpp"
#include "agent/metrics.hpp"
#include "agent/registry/create_ids.hpp"
#include "agent/registry/exec_journal.hpp"
#include "agent/registry/tenant_quota.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent {

struct RegistryOptions {
  std::string node_id = "node";
  std::filesystem::path state_dir;  // where live sandboxes' records go; empty: nowhere
  std::uint32_t cores = 1;          // the node's capacity, before overcommit
  std::uint64_t memory_bytes = 1ull << 30;
  double cpu_overcommit = 8.0;
  double memory_overcommit = 1.0;
  std::uint32_t gpus = 0;      // GPUs the node can hand out, whole
  Labels node_labels;          // a create's node_selector must match them
  TenantQuotas tenant_quotas;  // per tenant: sandboxes, cpu and memory on this node (tenant_quota.hpp)
  // Request ids are remembered this long, and at most this many (the oldest finished ones go first beyond it).
  std::chrono::seconds request_id_retention{3600};
  std::size_t max_request_ids = 1u << 18;
  // Destroyed sandboxes are remembered (DELETE stays idempotent, GET says "destroyed") this long, at most this many.
  std::chrono::seconds tombstone_retention{3600};
  std::size_t max_tombstones = 1u << 16;
  // Creates of one batch run this many at a time.
  std::size_t batch_parallelism = 4;
  // Unix time in seconds; tests pass a fake clock.
  std::function<double()> clock;
  // Called (outside the registry's locks) when a destroyed sandbox carried protocol::kForkSnapshotLabel with a
  // "fork/..." value and no live sandbox of this node carries that value any more: the fork's snapshot is unused.
  std::function<void(const std::string& snapshot)> on_fork_snapshot_unused;
};

// What the registry found of an earlier run of the agent at start-up (Registry::recover_earlier_run).
struct RecoveryReport {
  std::size_t adopted = 0;      // alive and verifiably the same: running or sleeping again under this agent
  std::size_t failed = 0;       // died while the agent was down, or could not be taken over: state "failed"
  std::size_t rolled_back = 0;  // creates the old agent never finished: everything they made removed
  std::size_t destroyed = 0;    // destroys the old agent never finished (or, when not adopting, every sandbox)
  std::size_t kept = 0;         // of a kind this agent does not serve, or whose clean-up failed: record kept
  std::size_t unreadable = 0;   // records that do not parse: removed, with what any backend knows of their id
  std::size_t request_ids = 0;  // request ids of finished creates remembered again
};

struct CreateOutcome {
  SandboxInfo info;
  bool created = false;  // false: an earlier request with the same request_id made it
};

struct NodeLoad {
  std::uint32_t sandboxes = 0;
  double cpu_requested = 0;
  std::uint64_t memory_requested = 0;
  std::uint32_t gpus_requested = 0;
  std::map<std::string, std::uint64_t, std::less<>> by_kind;
};

// A lease group on this node.
struct GroupInfo {
  std::string id;
  std::string node;
  double ttl = 0;                      // seconds a renewal (or a create into the group) extends the lease to
  double expires_at = 0;               // unix seconds; the reaper destroys the group's sandboxes from then on
  std::size_t sandbox_count = 0;       // live sandboxes of the group
  std::vector<SandboxInfo> sandboxes;  // filled by get_group() only, oldest first
};

// A live sandbox's backend object, kept alive while the holder uses it.
struct SandboxHandle {
  std::shared_ptr<BackendSandbox> sandbox;
  std::string kind;
};

class Registry {
 public:
  using Backends = std::map<std::string, Backend*, std::less<>>;

  Registry(RegistryOptions options, Backends backends, ImageSource& images, Metrics& metrics);
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;
  // Forgets the sandboxes without destroying them: call destroy_all() first when they must go.
  ~Registry();

  // Creates one sandbox from a validated spec. With a request_id, a repeat (also one that arrives while the first
  // is still being made) returns the first one's sandbox with created = false; a request_id reused for a different
  // spec is INVALID_ARGUMENT. Errors: INVALID_ARGUMENT (kind), NOT_FOUND (image), RESOURCE_EXHAUSTED (admission),
  // and whatever the backend throws. `image_manifest` is the image's manifest as the client resolved it (for a pinned
  // spec.image), or empty.
  // A spec with a queue_timeout waits that long for room when the node is full, in order with other such creates;
  // `client_gone`, when given, is asked while it waits: a create whose caller went away stops waiting (CANCELLED)
  // and makes nothing.
  using ClientGone = std::function<bool()>;
  CreateOutcome create(const SandboxSpec& spec, std::string_view image_manifest = {},
                       const ClientGone& client_gone = {});
  // `count` sandboxes from one spec; element i uses request_id + "/" + i. All or nothing: when one fails, the ones
  // this call made are destroyed (and their request ids forgotten) and the first error is thrown.
  std::vector<CreateOutcome> create_batch(const SandboxSpec& spec, std::size_t count,
                                          std::string_view image_manifest = {}, const ClientGone& client_gone = {});

  // The sandbox's info, checking that it is still alive (a dead one turns "failed"). A destroyed one still known
  // as a tombstone answers with state "destroyed"; an unknown id is NOT_FOUND.
  SandboxInfo get(const std::string& id);
  // Live sandboxes whose labels include every given label, and of the tenant when one is given.
  std::vector<SandboxInfo> list(const Labels& labels, const std::string& tenant) const;
  // Destroys a sandbox; returns its info with state "destroyed". Idempotent while the tombstone lasts.
  SandboxInfo destroy(const std::string& id, std::string_view reason = "destroyed by request");
  // Sleep freezes a running sandbox and releases its memory (Backend::sleep); its state becomes "sleeping" (on disk
  // too) and its cpu stops counting as requested on the node. Wake undoes both; the cpu counts again even when that
  // brings the node above its limit. FAILED_PRECONDITION for a sandbox in the wrong state, NOT_FOUND for an unknown
  // or destroyed one.
  struct SleepOutcome {
    SandboxInfo info;
    SleepReport report;
  };
  // A non-empty request_id makes the call idempotent: when the sandbox's last sleep or wake carried the same id, it
  // is answered again as it was (the client retried after losing the answer) instead of failing for the state it
  // left; the same id with the other call is INVALID_ARGUMENT.
  SleepOutcome sleep(const std::string& id, std::string_view request_id = {});
  // Replaces the sandbox's network policy (running or sleeping) and answers its info with the policy now in force;
  // the policy is in its record, so a restart keeps it. NOT_FOUND for an unknown or destroyed sandbox,
  // FAILED_PRECONDITION for a failed one; a malformed policy is INVALID_ARGUMENT and changes nothing.
  SandboxInfo set_network(const std::string& id, const NetworkPolicy& policy);
  // Its deadline becomes now + ttl (0: none), earlier or later than it was; persisted.
  SandboxInfo set_ttl(const std::string& id, std::chrono::seconds ttl);
  // Exposed ports (docs/networking.md): expose answers "host:port"; the record keeps them for a restart.
  std::string expose(const std::string& id, std::uint32_t port);
  void unexpose(const std::string& id, std::uint32_t port);
  std::map<std::uint32_t, std::string> exposed(const std::string& id);
  NetworkUsage network_usage(const std::string& id);
  SleepOutcome wake(const std::string& id, std::string_view request_id = {});
  // Copies a running sandbox, processes and memory and all, into `count` new sandboxes on this node (the backend's
  // fork_source; UNIMPLEMENTED for backends that cannot). The copies have the sandbox's spec (new ids, and without
  // its request id and group), `labels` added, and run on from the moment of the fork, as does the sandbox itself.
  // All or nothing: when one copy fails, those made are destroyed and the error is thrown.
  std::vector<CreateOutcome> fork(const std::string& id, std::size_t count, const Labels& labels = {});
  // For exec and files. NOT_FOUND for an unknown, destroyed or being-destroyed sandbox.
  SandboxHandle acquire(const std::string& id) const;
  // Execs with request ids (exactly once); a sandbox's ids go with it.
  ExecJournal& exec_journal() { return exec_journal_; }
  // The spec a live sandbox was created from (snapshots hand it on to the sandboxes made from them). NOT_FOUND like
  // acquire().
  SandboxSpec spec(const std::string& id) const;

  // Lease groups. A create whose spec names a group starts the group's lease on this node (now + group_ttl) or
  // extends it (never shortens it). NOT_FOUND for a group the node does not have: never had, deleted, or expired
  // (an expired group's sandboxes are destroyed by the next reap()).
  //
  // Extends the lease to now + ttl (never shortens it); ttl 0 means the group's own ttl.
  GroupInfo renew_group(const std::string& group, double ttl);
  GroupInfo get_group(const std::string& group) const;
  std::vector<GroupInfo> list_groups() const;  // without their sandboxes, by id
  // Destroys every sandbox of the group and forgets it; returns the group as it was.
  GroupInfo destroy_group(const std::string& group);

  // Cold-memory reclaim (qos/reclaimer.hpp): every running sandbox that allows it (spec reclaim, not latency) and
  // that nobody has used (no exec, files or other call through acquire()) for its class's age, nor was reclaimed
  // within it, gives back what memory it can (BackendSandbox::reclaim_cold), at most `max_sandboxes` per round,
  // the longest idle first. Sandboxes that are busy (an exec runs, a sleep or a capture is under way) are passed
  // over. Returns what the round did.
  struct ColdReclaimPolicy {
    std::chrono::milliseconds standard_age{120000};
    std::chrono::milliseconds batch_age{30000};
    std::chrono::milliseconds per_sandbox{1000};  // how long one sandbox's processes may stay stopped
    std::size_t max_sandboxes = 64;
  };
  struct ColdReclaimRound {
    std::size_t sandboxes = 0;         // reclaimed in this round
    std::uint64_t released_bytes = 0;  // their charge before minus after
    std::size_t busy = 0;              // idle long enough but passed over (busy, or a backend without reclaim)
  };
  ColdReclaimRound reclaim_cold(const ColdReclaimPolicy& policy);
  // The sandboxes the reclaimer has touched, with what it released and the pages read back in since (from the kernel;
  // no liveness check, so a metrics scrape changes nothing).
  struct ColdMemoryUsage {
    std::string id;
    std::uint64_t reclaimed_bytes = 0;
    std::uint64_t refaults = 0;
  };
  std::vector<ColdMemoryUsage> cold_memory_usage() const;

  // Destroys sandboxes whose TTL passed and every sandbox of a group whose lease expired (and forgets the group),
  // marks dead ones failed, forgets old request ids and tombstones.
  void reap();
  // Destroys every sandbox and forgets every group (agent shutdown); returns how many sandboxes it destroyed.
  std::size_t destroy_all(std::string_view reason);
  // Forgets every request id, on disk too (after destroy_all at a clean shutdown, which ends the node's state: a
  // create retried at the next run makes a new sandbox).
  void forget_requests();

  // Takes over what an earlier run of the agent left (it was killed or crashed), from the records in state_dir.
  // Call once, before serving. Per record, by the state it was written with:
  //   running, sleeping: the backend adopts the sandbox if it is alive and verifiably the same (Backend::adopt); its
  //     image is acquired again, its group's lease (from <state>/groups) and its TTL apply as before, it counts
  //     toward the node's load. A sandbox that died, or cannot be taken over, turns "failed" (the message says why)
  //     and its backend removes what is left of it.
  //   creating: the create never answered; everything it made is removed, its request id is not remembered.
  //   destroying: the destroy is finished; the sandbox is remembered as destroyed.
  //   failed: stays failed (its leftovers are removed once more).
  // Records of kinds this agent does not serve are kept for a later start. Request ids of finished creates come
  // back from the records and the request log, so a retried create returns the sandbox the first one made.
  RecoveryReport recover_earlier_run();
  // The other choice (dsecd --on-restart remove): every sandbox of the earlier run is destroyed (its backend removes
  // what is left; it is remembered as destroyed), nothing is taken over. Returns how many were cleaned up.
  std::size_t remove_leftovers_of_earlier_run();

  NodeLoad load() const;
  // The memory overcommit ratio admission uses from now on (qos/usage_overcommit.hpp; starts at the options').
  void set_memory_overcommit(double ratio);
  double memory_overcommit() const;
  std::vector<std::string> kinds() const;
  const RegistryOptions& options() const noexcept { return options_; }

 private:
  struct Record;
  struct RequestEntry;
  // `record`'s fork snapshot (protocol::kForkSnapshotLabel) when no live sandbox carries it any more, else empty.
  // Caller holds mutex_ and has taken `record` out of records_.
  std::string last_fork_snapshot_user(const Record& record) const;
  struct LoadedRecord;
  struct Recovered;
  struct Tombstone {
    SandboxInfo info;
    double at = 0;
  };

  // Asks the backend again what its record must say (a VM's QEMU changes at a wake or a fork).
  void refresh_backend_state(Record& record);
  CreateOutcome create_new(const SandboxSpec& spec, std::string_view image_manifest, const std::string& fingerprint,
                           std::shared_ptr<const ForkSource> fork_of = nullptr, const ClientGone& client_gone = {});
  // The backend serving spec.kind, on a node that matches spec.node_selector.
  Backend& backend_for(const SandboxSpec& spec);
  // create_new's making of sandbox `id` into `record`: its record on disk first, then the backend's sandbox, then
  // the record as running. What fails leaves nothing of it (the caller releases its reservation).
  void make_sandbox(Record& record, Backend& backend, const std::string& id, const SandboxSpec& spec,
                    std::string_view image_manifest, const std::string& fingerprint,
                    std::shared_ptr<const ForkSource> fork_of);
  // The sandbox made into the table: its reservation becomes live resources, it joins its group. True when the
  // group had gone meanwhile and came back with this create's lease (to be written to disk).
  bool enter_record(const std::shared_ptr<Record>& record, const SandboxSpec& spec, double lease_deadline);
  // admit() for one sandbox of `spec`; with its queue_timeout, waits for room in order (caller holds `lock` on
  // mutex_, released while it waits).
  void admit_or_wait(const SandboxSpec& spec, std::unique_lock<std::mutex>& lock, const ClientGone& client_gone);
  // Admission: throws RESOURCE_EXHAUSTED unless `count` more sandboxes of these resources fit beside the live ones
  // and the creates in flight, on the node and within the quota of `tenant`. Caller holds mutex_.
  void admit(const Resources& resources, std::size_t count, const std::string& tenant) const;
  void reserve(const SandboxSpec& spec, int sign);   // a create in flight (+1) or no longer (-1); holds mutex_
  std::string new_id();                              // caller holds mutex_
  SandboxInfo info_of(const std::string& id) const;  // caller holds mutex_
  void check_alive(Record& record);
  void write_record(const Record& record) const;
  // The same, a failure logged (the change it records has happened; the next write catches up).
  void write_record_or_warn(const Record& record, std::string_view what) const;
  RecoveryReport recover(bool adopt);
  Recovered recover_one(LoadedRecord& loaded, bool adopt);
  // The steps of recover() (recovery.cpp), in order.
  std::vector<LoadedRecord> load_records(RecoveryReport& report);
  void forget_unreadable_record(const std::string& id, const std::filesystem::path& path, std::string_view why);
  std::vector<Recovered> recover_all(std::vector<LoadedRecord>& loaded, bool adopt);
  void enter_recovered(const std::vector<LoadedRecord>& loaded, const std::vector<Recovered>& results, double t,
                       RecoveryReport& report, std::map<std::string, double>& group_ttls,
                       std::set<std::string>& kept_groups);
  void restore_group_leases(const std::map<std::string, double>& group_ttls, const std::set<std::string>& kept_groups,
                            double t);
  void compact_create_ids();
  void count_recovered(const std::vector<LoadedRecord>& loaded, const std::vector<Recovered>& results,
                       const RecoveryReport& report);
  // A record file's text, parsed; throws when it is not a record.
  static std::shared_ptr<Record> parse_record(const std::string& text);
  // Acquires the image of an adopted sandbox again; false (logged) when it cannot now: the reaper retries.
  bool hold_image(Record& record);
  void remove_record_file(const std::string& id) const;
  void remove_record_file(const Record& record) const;  // and no later write_record brings it back
  // A destroy under way is on disk as the record renamed to <id>.destroying (destroying = true), or renamed back
  // when the destroy failed (false).
  void mark_destroying(const Record& record, bool destroying) const;
  void forget_request_id(const std::string& request_id, const std::string& sandbox_id);
  void evict(double now);  // caller holds mutex_
  double now() const { return options_.clock(); }
  // Destroys the sandboxes (batch_parallelism at a time), logging failures; returns how many it destroyed.
  std::shared_ptr<Record> find_live(const std::string& id) const;  // NOT_FOUND unless live and not being destroyed
  // The record of `id`, or nullptr with `destroyed` set to its tombstone's info when it was destroyed here (get and
  // destroy answer with that); NOT_FOUND when the node has neither.
  std::shared_ptr<Record> find_or_tombstone(const std::string& id, std::optional<SandboxInfo>& destroyed) const;
  std::size_t destroy_ids(const std::vector<std::string>& ids, std::string_view reason);

  struct Group {
    double ttl = 0;
    double expires_at = 0;
    double persisted_expires_at = 0;          // the deadline last written to disk
    std::unordered_set<std::string> members;  // live sandboxes
  };
  // Starts or extends the lease of spec.group for a create; returns the deadline. Caller holds mutex_.
  // `persist` says whether the lease on disk is now behind (a new group, or a deadline a second or more later).
  double join_group(const SandboxSpec& spec, double t, bool& persist);
  // An expired group found by a call before the reaper: its members go to doomed_, the group is forgotten.
  void retire_group(std::unordered_map<std::string, Group>::iterator it);  // caller holds mutex_
  GroupInfo group_info(const std::string& id, const Group& group) const;   // caller holds mutex_
  // Writes the group's lease to <state>/groups/<id>.json, or removes the file when the group is gone.
  void persist_group(const std::string& group);
  std::filesystem::path groups_dir() const { return options_.state_dir / "groups"; }

  RegistryOptions options_;
  Backends backends_;
  ImageSource& images_;
  Metrics& metrics_;
  CreateIds create_ids_;      // <state>/requests.log
  ExecJournal exec_journal_;  // <state>/execs/

  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<Record>> records_;
  double live_cpu_ = 0;
  std::uint64_t live_memory_ = 0;
  double memory_overcommit_now_ = 0;  // set_memory_overcommit; 0: options_.memory_overcommit
  // Creates waiting for room (admit_or_wait), by ticket in arrival order; room_ is notified whenever room frees.
  std::deque<std::uint64_t> waiting_;
  std::uint64_t next_ticket_ = 0;
  std::condition_variable room_;
  std::uint32_t live_gpus_ = 0;
  double reserved_cpu_ = 0;  // creates in flight
  std::uint64_t reserved_memory_ = 0;
  std::uint32_t reserved_gpus_ = 0;
  struct TenantReservation {
    std::uint64_t sandboxes = 0;
    double cpu = 0;
    std::uint64_t memory_bytes = 0;
  };
  std::unordered_map<std::string, TenantReservation> reserved_by_tenant_;  // creates in flight, of tenants with quotas
  std::unordered_map<std::string, Group> groups_;
  std::vector<std::pair<std::string, std::string>> doomed_;  // (sandbox id, group) of retired groups, for reap()
  std::mutex group_file_mutex_;  // one writer of group files at a time (taken before mutex_, never inside it)
  std::unordered_map<std::string, std::shared_ptr<RequestEntry>> requests_;
  std::deque<std::pair<double, std::string>> request_order_;
  std::condition_variable request_done_;
  std::unordered_map<std::string, Tombstone> tombstones_;
  std::deque<std::pair<double, std::string>> tombstone_order_;
  std::mt19937_64 rng_;
};

}  // namespace dsec::agent
