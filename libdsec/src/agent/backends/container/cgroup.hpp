// Per-sandbox cgroups behind one interface, with a driver for cgroup v2 (the unified hierarchy) and one for v1
// (a hierarchy per controller). The driver is chosen at run time from what the host mounts.
//
// Every sandbox gets a group with cpu, memory and pids limits. Every exec gets a child group of it, so a timed-out
// exec's whole process tree, including processes that left its session or process group, can be found and killed.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "common/unique_fd.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent::container {

// CPU weight by class of service: latency 4x a standard sandbox's, batch the least there is.
constexpr std::uint32_t cpu_weight_v1(Priority p) {  // cpu.shares: 2 to 262144, 1024 the default
  return p == Priority::kLatency ? 4096 : p == Priority::kBatch ? 2 : 1024;
}
constexpr std::uint32_t cpu_weight_v2(Priority p) {  // cpu.weight: 1 to 10000, 100 the default
  return p == Priority::kLatency ? 400 : p == Priority::kBatch ? 1 : 100;
}

class SandboxCgroup {
 public:
  virtual ~SandboxCgroup() = default;
  // cgroup.procs of the sandbox's group(s), opened for writing: the sandbox's first process joins by writing "0".
  virtual std::vector<UniqueFd> open_procs() = 0;
  // Creates the child group for one exec and opens its cgroup.procs file(s), and (v2) the group's directory, which
  // the command is started in by clone3 (CLONE_INTO_CGROUP): no move, which waits on the kernel after an idle spell.
  // let_join_as(uid): the sandbox's init runs as host uid `uid` (a user namespace) and must still be able to start
  // commands in exec groups that way (v2; v1 has no such start).
  virtual std::vector<UniqueFd> create_exec_group(const std::string& name) = 0;
  // Kills every process in the exec's group and stops new forks there (the spared process excepted).
  virtual void kill_exec_group(const std::string& name) = 0;
  // Moving a process between groups waits on the kernel after an idle spell (on cgroup v1 the write to
  // cgroup.procs waits for an RCU grace period: 6-10 ms here, against 0.08 ms back to back), so an agent loop's
  // exec after think time would pay it. place_in_exec_group moves `pid` (the sandbox's init) into a new exec group
  // `name` off the exec's path, so that the next command init forks starts there with no move at all; false where
  // the driver does not do this. spare(pid): the process kills of exec groups leave alone (init, which may sit in
  // one).
  virtual bool place_in_exec_group(const std::string& name, pid_t pid) { return false; }
  // release_exec_group without removing anything now: the next release (or placement) does. A removal waits for
  // the kernel's cgroup lock, which a placement under way holds through its wait.
  virtual void end_exec_group(const std::string& name) { release_exec_group(name); }
  virtual void spare(pid_t pid) {}
  virtual void let_join_as(uid_t uid) {}
  // The exec of group `name` has ended: its group is removed once its processes have all ended (background processes
  // keep it), and so are earlier ended execs' groups that are empty now. Groups of execs still starting or running
  // are never touched (an empty group may be one whose command is about to join it).
  virtual void release_exec_group(const std::string& name) = 0;
  // Kills every process of the sandbox, waits until they are gone, and removes all its groups. Idempotent.
  virtual void destroy() = 0;
  // Lifts its CPU limit: a sandbox being destroyed runs its processes' exits at once instead of waiting for its
  // next quota period (up to 100 ms at 0.01 cores). Best effort.
  virtual void unthrottle() = 0;
  // Its CPU limit, in cores (a CFS quota per 100 ms period, at least 1 ms). create() sets it; a container's start
  // lifts it (unthrottle) while the agent builds the sandbox's root, which runs in the group, and sets it again.
  virtual void limit_cpu(double cores) = 0;
  // Stops every process of the sandbox (the freezer) and returns once all of them are frozen; thaw() lets them run
  // on. Files of a frozen sandbox stay reachable through /proc/<pid>/root.
  virtual void freeze() = 0;
  virtual void thaw() = 0;
  // Pushes the sandbox's memory out, as far as the kernel can without killing anything: page cache goes; anonymous
  // memory (and the tmpfs of its writable layer) goes only to swap, so on a host without swap it stays. First it
  // lets the sandbox use swap (an awake sandbox may not: v1 memory.swappiness 0, v2 memory.swap.max 0); then v1
  // lowers the memory limit in steps of at most 64 MiB (kept lowered until restore_memory()), v2 asks
  // memory.reclaim for at most 64 MiB at a time. Between steps it checks the deadline: true when it stopped there
  // with memory left to release. Call on a frozen sandbox.
  virtual bool reclaim_memory(std::chrono::steady_clock::time_point deadline) = 0;
  // Puts back the memory limit reclaim_memory() lowered and keeps the sandbox out of swap again. Pages already in
  // swap stay there until the sandbox touches them.
  virtual void restore_memory() = 0;
  // The sandbox's memory in swap now (0 where the host does not account swap per cgroup).
  virtual std::uint64_t swap_current() = 0;
  // Pages of the group (and below) read back in after reclaim (memory.stat workingset_refault_anon + _file; v1 its
  // hierarchical total_ counts), since it was made.
  virtual std::uint64_t refaults() = 0;
  // Whether the sandbox's processes are frozen, or being frozen (the freezer was asked to).
  virtual bool frozen() = 0;
  // Memory charged to the sandbox now, and the number of OOM kills inside it so far.
  virtual std::uint64_t memory_current() = 0;
  virtual std::uint64_t oom_kills() = 0;

  // Taking a sandbox over after an agent restart. path(): the group's path below each hierarchy's root
  // ("/dsec/<id>"), which the sandbox's record keeps. exec_groups(): the exec groups that exist now (execs that were
  // running when the old agent died, and ended ones whose background processes keep their group). adopt_exec_group:
  // an exec group of the old agent becomes this object's, as an ended exec's; with `kill`, its processes are killed
  // first (their exec's caller is gone). set_restore_limit: the memory limit restore_memory() puts back (what a
  // lowered limit was before reclaim_memory() is lost with the old agent; the sandbox's own limit is in its spec).
  virtual std::string path() const = 0;
  virtual std::vector<std::string> exec_groups() = 0;
  virtual void adopt_exec_group(const std::string& name, bool kill) = 0;
  virtual void set_restore_limit(std::uint64_t bytes) = 0;
  // The most memory charged to the group at once since it was made or since reset_memory_peak() (v2 kernels
  // without memory.peak: the current charge); 0 when unknown.
  virtual std::uint64_t memory_peak() = 0;
  virtual void reset_memory_peak() = 0;
  // CPU time used by the group's processes so far, in seconds (v2: cpu.stat; v1: cpuacct when the driver was made
  // with cpu accounting, else 0).
  virtual double cpu_usage_seconds() = 0;
  // Changes the memory and pids limits of a live group (the fncall backend sets each call's own on a group made
  // ahead of time). Lowering the memory limit below what is charged fails with RESOURCE_EXHAUSTED once the kernel
  // could not reclaim enough.
  virtual void set_limits(std::uint64_t memory_bytes, std::uint32_t pids) = 0;
  // Renames the sandbox's groups to `id` (a warm pool's sandbox claimed by a create); path() follows. False where
  // the hierarchy cannot rename groups (cgroup v2): they keep their name. Throws when a rename failed (none is left
  // half done).
  virtual bool rename(const std::string& id) = 0;
  // Whether any process is in the group or below it.
  virtual bool has_processes() = 0;
};

class CgroupDriver {
 public:
  virtual ~CgroupDriver() = default;
  virtual std::string version() const = 0;  // "v1" or "v2"
  virtual std::unique_ptr<SandboxCgroup> create(const std::string& id, const Resources& resources) = 0;
  // Reserves CPUs for latency sandboxes (the cpuset fallback for core scheduling, docs/qos.md): groups made from
  // now on run on `latency` (cpu list) when their class is latency and on `shared` otherwise. Call before any
  // create. FAILED_PRECONDITION where the host has no cpuset controller to do it with.
  virtual void reserve_cpus(const std::string& latency, const std::string& shared) = 0;
  // Whether the kernel has cpu.idle for the agent's groups (v2, and v1's cpu controller on Linux 5.15+): a batch
  // sandbox's group is then idle-scheduled as a whole, so any other group's waking task preempts it at once.
  virtual bool cpu_idle() const = 0;
  // Removes groups with no processes under the agent's subtree (left by an earlier run). Groups that still hold
  // processes are left alone: they may belong to another agent that uses the same subtree name.
  virtual void remove_empty_groups() = 0;
  // Removes the agent's subtree itself if it is empty (at shutdown; another agent may still use it).
  virtual void remove_subtree_if_empty() = 0;
  // Kills whatever is left of sandbox `id` (an earlier run of this agent crashed) and removes its groups.
  virtual void remove_sandbox_groups(const std::string& id) = 0;
  // The groups of a sandbox an earlier run of the agent made, at `path` (SandboxCgroup::path()), taken over as they
  // are. NOT_FOUND when one of them is missing; INVALID_ARGUMENT for a path outside every hierarchy's dsec groups.
  virtual std::unique_ptr<SandboxCgroup> adopt(const std::string& path) = 0;
};

// Picks v2 when /sys/fs/cgroup is a cgroup2 mount with the cpu, memory and pids controllers available, else v1 with
// cpu, memory, pids and freezer hierarchies. `name` is the agent's subtree ("dsec"). Throws FAILED_PRECONDITION when
// neither is usable.
// `cpu_accounting`: v1 groups are also made in the cpuacct hierarchy (when it is not the cpu one), so that
// cpu_usage_seconds() can read them; v2 has it in every group.
std::unique_ptr<CgroupDriver> make_cgroup_driver(const std::string& name, bool cpu_accounting = false);
std::unique_ptr<CgroupDriver> make_cgroup_v1_driver(const std::string& root_mount, const std::string& name,
                                                    bool cpu_accounting = false);
std::unique_ptr<CgroupDriver> make_cgroup_v2_driver(const std::string& root_mount, const std::string& name);

// Puts the kernel's cgroup locking in favour of frequent migrations (the favordynmods mount option, Linux 6.0+):
// a sandbox's first process joining its cgroups then no longer waits for an RCU grace period, which costs 4-20 ms
// after an idle spell and sets create's tail latency. The price is a slightly slower fork and exit everywhere on the
// host, so the agent does it only when told to (dsecd --cgroup-favordynmods); the kernel keeps the mode until reboot.
// Returns a line saying what it did; throws FAILED_PRECONDITION when the kernel lacks the option.
std::string enable_cgroup_favordynmods();

// Small file helpers shared by both drivers.
void write_cgroup_file(const std::string& path, const std::string& value);
std::string read_cgroup_file(const std::string& path);
// Throws INVALID_ARGUMENT unless `path` is "/<name>/<id>": two plain names below a hierarchy's root, as
// SandboxCgroup::path() gives them (a record on disk names the groups to take over; it never names others).
void check_adoptable_path(const std::string& path);
// Reads cgroup.procs and returns the pids in it.
std::vector<int> read_pids(const std::string& procs_path);
// The names of the groups directly below `dir` (SandboxCgroup::exec_groups of both drivers); none when unreadable.
std::vector<std::string> child_groups(const std::string& dir);
// SandboxCgroup::release_exec_group, as both drivers do it under their lock: `name` is marked ended if it is one of
// `exec_groups`, then every ended group below `parent` that is empty now (its rmdir succeeds, or it is gone) is
// forgotten from both sets.
void release_ended_groups(const std::string& parent, const std::string& name, std::set<std::string>& exec_groups,
                          std::set<std::string>& ended_groups);

}  // namespace dsec::agent::container
