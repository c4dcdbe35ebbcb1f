// dsec-bench: dsec's container sandboxes measured side by side with their peers on this machine (crun, bubblewrap,
// a plain host fork+exec), in one run, so that every comparison shares the same machine, kernel and load.
#pragma once

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/client.hpp"
#include "dsec/spec.hpp"

namespace dsec::bench {

using Clock = std::chrono::steady_clock;

inline double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}
inline double ms_since(Clock::time_point a) { return ms_between(a, Clock::now()); }

// Latency samples in milliseconds. Percentiles are nearest-rank: p99 of 200 samples is the 198th smallest.
class Latency {
 public:
  void add(double ms) { ms_.push_back(ms); }
  void merge(const Latency& other) { ms_.insert(ms_.end(), other.ms_.begin(), other.ms_.end()); }
  std::size_t count() const noexcept { return ms_.size(); }
  bool empty() const noexcept { return ms_.empty(); }
  double percentile(double p) const;  // p in [0, 100]
  double max() const;
  double mean() const;

 private:
  std::vector<double> ms_;
};

struct Options {
  std::string command;  // create | throughput | exec | density | cgroup-join | image | pulse | fncall | all
  std::vector<std::string> endpoints;   // empty: an embedded agent
  std::string home;                     // image store (and embedded agent state)
  std::string agent_binary;             // embedded dsecd; empty: the library's default search
  std::vector<std::string> agent_args;  // more flags for the embedded agent (--agent-arg), e.g. --userns off
  std::string image = "busybox";
  std::string rootfs;    // peers' root; empty: the image's root in the store under home
  std::string work_dir;  // crun bundle and state; empty: a private directory under /tmp
  std::vector<std::string> peers{"crun", "bwrap"};
  bool peers_explicit = false;  // --peers given: a peer that cannot run is an error
  std::size_t n = 200;          // samples per latency measure
  std::size_t warmup = 10;      // discarded iterations before each measure
  std::vector<int> concurrency{1, 2, 4, 8, 16};
  double duration_seconds = 5;  // throughput: measured time per system and concurrency
  std::size_t rounds = 5;       // throughput: the systems take turns in this many windows
  std::size_t density_count = 500;
  double density_cpu = 0.01;                   // cores per idle sandbox
  std::uint64_t density_memory = 16ull << 20;  // memory limit per idle sandbox
  std::size_t teardown_concurrency = 8;
  // image: cold starts of the bench/task image (base, toolchain and task layers; built when missing)
  std::size_t cold_runs = 3;                                // single cold starts per layer mode
  std::size_t starts = 32;                                  // concurrent cold starts per layer mode
  std::vector<std::string> layer_modes{"lazy", "extract"};  // the agent's --layer-mode values to compare
  std::string dsec_cli;                                     // the dsec CLI that builds the images; empty: beside
                                                            // dsec-bench
  // pulse: a pulse of creates over many agents found through etcd (a private etcd and agents this run starts)
  std::size_t pulse_sandboxes = 32000;  // null sandboxes in the control-plane pulse
  std::size_t pulse_agents = 16;        // agents serving the null backend
  std::size_t real_sandboxes = 500;     // container sandboxes in the real pulse (0 skips it)
  std::size_t real_agents = 4;          // agents serving the container backend
  std::string pulse_api = "group";      // group: Client::create_group; many: Client::create_many
  std::string pulse_dir;  // where the agents' homes, records and run directories go; empty: a new dir on /dev/shm
  // sleep: sandboxes holding anonymous memory sleep and wake in place, with swap the embedded agent sets up
  std::vector<std::size_t> sleep_sizes_mib{64, 256, 1024};  // memory each sandbox holds
  std::size_t sleep_rounds = 2;                             // sleep/wake cycles per size
  std::uint64_t sleep_swap_bytes = 0;                       // the swap file's size; 0: the largest size + 512 MiB
  // snapshot: snapshots of sandboxes that wrote this many MiB, each size `snapshot_repeat` times (256 MiB and up
  // at most twice), then fork_count forks (0 skips them)
  std::vector<std::size_t> snapshot_sizes{1, 16, 64, 256};
  std::size_t snapshot_repeat = 3;
  std::size_t fork_count = 16;
  // fncall: the image of the function calls and of the container sandbox they are compared with (needs python3)
  std::string fncall_image = "bookworm-python";
  // microvm: N sequential creates per kind (-n, default 20 for this command), idle VMs measured for memory
  // (--idle clones, --idle-cold cold boots), and the density run's target (--density; 0 skips it)
  std::size_t microvm_idle = 16;
  std::size_t microvm_idle_cold = 4;
  std::size_t microvm_density = 200;
  std::size_t microvm_batch = 10;  // density: creates per create_many batch
  // vm: full VMs of the desktop image, --vm-n creates (the first boots the shape's template; -n screenshots)
  std::size_t vm_creates = 3;
  // qos: a latency-class sandbox's step (-n steps per row, default 500) beside -k batch spinners (default 2 per core)
  double qos_think_ms = 20;      // think time between two steps
  std::string qos_latency_cpus;  // --latency-cpus of the reserved-CPU rows' agent; empty: the last CPU; "none": no
                                 // such rows
  // reclaim: -k idle Python sandboxes (default 200) and `reclaim_control` more with reclaim=false; the embedded
  // agent's cold-memory reclaimer (--reclaim-age) puts them in a swap file of --swap-size (default: enough for all)
  std::string reclaim_image = "bookworm-numpy";  // needs python3; with numpy the worker imports it
  std::size_t reclaim_control = 8;
  std::size_t reclaim_age_seconds = 10;
  std::optional<std::size_t> reclaim_hold_mib;  // random bytes each worker holds; default 0 with numpy, else 48
  // pulse-node: --pulse-n creates at once from --pulse-threads threads on one node, without and with a warm pool
  std::size_t pulse_node_n = 1000;
  std::size_t pulse_node_threads = 32;
  bool markdown = false;        // print the Markdown summary after a single benchmark too
  std::set<std::string> given;  // the flags given on the command line (a command's own defaults yield to them)
  bool null_backend = false;    // the agent serves kind "null": time its create as the floor of
                                // the control plane (client, HTTP, registry), no sandbox made
};

// How busy the machine was while a benchmark ran, from /proc/stat and the CPU time of dsec-bench, its children
// (crun, bwrap, host spawns) and the agent (with the sandboxes it reaped).
struct CpuUse {
  double seconds = 0;
  double busy_cores = 0;    // all CPUs, average over the window
  double ours_cores = 0;    // dsec-bench + children + agent
  double kernel_cores = 0;  // kernel threads (e.g. workers tearing down namespaces and cgroups) + irq/softirq
  double steal_cores = 0;   // taken by the hypervisor for other guests
  double others_cores = 0;  // everything else: other users' processes
};

struct MachineInfo {
  int cores = 0;
  std::string cpu_model;
  std::uint64_t mem_total = 0;
  std::string kernel;
  std::string cgroup;        // the host's cgroup layout
  std::string agent_cgroup;  // the driver the agent chose ("v1" / "v2")
  std::string agent;         // "embedded dsecd (home ...)" or the endpoint
  int agent_pid = -1;        // -1: not on this host (or not found)
  std::string crun_version, bwrap_version;
  double load1 = 0, load5 = 0, load15 = 0;
  CpuUse before;           // one second before the run (dsec-bench idle, no agent yet)
  std::string started_at;  // local wall time of the run
};

struct CreateResult {
  std::size_t n = 0, warmup = 0;
  Latency dsec_ready, dsec_destroy, dsec_lifecycle, dsec_null, crun, bwrap;
  CpuUse cpu;
};

struct RatePoint {
  int concurrency = 0;
  double dsec_rate = 0, crun_rate = 0, bwrap_rate = 0;  // completed creates per second
  std::size_t dsec_count = 0, crun_count = 0, bwrap_count = 0;
  bool crun_measured = false, bwrap_measured = false;
  Latency dsec_create;   // create latency under this concurrency
  Latency dsec_destroy;  // destroy latency under this concurrency
  CpuUse cpu;            // the machine while this level ran
};

struct ThroughputResult {
  double window_seconds = 0;  // per system and level, split into `rounds` turns
  std::size_t rounds = 0;
  std::vector<RatePoint> points;
  CpuUse cpu;
};

struct ExecBenchResult {
  std::size_t n = 0, warmup = 0;
  Latency dsec, dsec_agent_side, host;
  std::string host_binary;
  CpuUse cpu;
  // After an idle gap (an agent loop's think time between steps): the same exec and host spawn, each after
  // sleeping gap_ms.
  struct AfterGap {
    double gap_ms = 0;
    Latency dsec, dsec_agent_side, host;
  };
  std::vector<AfterGap> after_gaps;
};

struct DensityResult {
  std::size_t count = 0;
  double cpu_per_sandbox = 0;
  std::uint64_t memory_limit = 0;
  double create_seconds = 0;        // create_many of all of them
  std::size_t sandboxes_found = 0;  // sandboxes with a live process found in /proc
  std::size_t processes = 0;
  double mem_available_delta = 0;  // bytes, before creating minus after (settled)
  // Host-wide /proc/meminfo growth of the fields sandboxes add to (kernel objects, page tables, tmpfs), in bytes;
  // these move little with other users' compile jobs, unlike MemAvailable.
  std::vector<std::pair<std::string, double>> meminfo_growth;
  std::vector<std::pair<std::string, double>> slab_growth;  // the slab caches that grew most (empty: unreadable)
  double itemised_total = 0;            // kernel growth (above, less AnonPages) + sandbox PSS + agent RSS growth
  double rss_total = 0, pss_total = 0;  // bytes, summed over the sandboxes' processes
  double cgroup_charge_total = 0;       // bytes, summed over the sandboxes' memory cgroups
  double agent_rss_delta = 0;           // bytes; NaN when the agent's process is not on this host
  double others_rss_delta = 0;          // bytes: RSS change of every other process, a noise gauge
  double teardown_seconds = 0;
  double mem_returned = 0;  // bytes of MemAvailable back after teardown (settled)
  CpuUse cpu;
};

struct CgroupJoinPoint {
  int gap_ms = 0;      // idle time before each join
  Latency first, all;  // the first write to cgroup.procs; all of them together
};

struct CgroupJoinResult {
  std::string layout;  // which hierarchies were joined
  std::size_t samples = 0;
  std::vector<CgroupJoinPoint> points;
};

// One cold start: a fresh agent with an empty layer cache, the store's blobs out of the page cache.
struct ColdStart {
  double create_ms = 0;             // create() until the sandbox is ready
  double first_exec_ms = 0;         // the task's exec, first in the sandbox
  double total_ms = 0;              // create() called until the first exec's result is back
  double warm_exec_ms = 0;          // the same exec again in the same sandbox (the task's own run time)
  std::uint64_t fetched_bytes = 0;  // stored (compressed) layer bytes the agent read from the store
  std::uint64_t fetched_chunks = 0;
  std::uint64_t cached_bytes = 0;  // the layers' bytes on the node's disk afterwards
};

struct ConcurrentStarts {
  std::size_t count = 0;
  double wall_ms = 0;                    // the first create() called until the last exec result is back
  Latency per_start;                     // create + first exec of each sandbox
  std::uint64_t agent_write_bytes = 0;   // /proc/<agent>/io write_bytes less cancelled_write_bytes, with its
                                         // reaped children, over the run
  std::uint64_t device_write_bytes = 0;  // sectors written to the agent's block device (/sys/block/*/stat) x 512
  std::uint64_t fetched_bytes = 0;
  std::uint64_t cached_bytes = 0;
};

struct LayerModeResult {
  std::string mode;       // the agent's --layer-mode
  std::string node_mode;  // what the node reported (NodeInfo.layer_mode)
  std::vector<ColdStart> cold;
  ConcurrentStarts concurrent;
  CpuUse cpu;  // the machine while this mode ran (the agents are dsec-bench's children)
};

struct ImageLayerInfo {
  std::string role, digest;
  std::uint64_t size = 0, stored_size = 0, files_size = 0, chunks = 0, prefetch_chunks = 0;
};

struct ImageBenchResult {
  std::string image;               // reference with its digest
  std::uint64_t image_bytes = 0;   // sum of layer sizes (EROFS, uncompressed)
  std::uint64_t stored_bytes = 0;  // sum of stored (zstd chunk) sizes
  std::uint32_t chunk_size = 0;
  std::vector<ImageLayerInfo> layers;
  std::string task;          // the shell command each sandbox runs
  std::string store;         // where the layers come from
  std::string block_device;  // whose sectors-written counter was read
  std::vector<LayerModeResult> modes;
  int cores = 0;
  std::vector<std::string> notes;
};

// One pulse: a private etcd, N agents registered in it, and one Client that finds them through etcd alone and
// creates `sandboxes` at once. The client runs in a forked child of dsec-bench, so its CPU time and memory high
// water mark are its own.
struct PulseRun {
  std::string backend;  // "null" (control-plane simulation: nothing started) or "container"
  std::string api;      // "create_group" or "create_many"
  std::size_t agents = 0, sandboxes = 0;
  double agents_ready_seconds = 0;                       // spawning the agents until all N are registered in etcd
  double discovery_seconds = 0;                          // the Client constructed until it sees all N nodes
  double create_seconds = 0;                             // the create call until every sandbox is acknowledged
  double destroy_seconds = 0;                            // destroying them all (one request per node for a group)
  double client_cpu_create = 0, client_cpu_destroy = 0;  // user + system seconds of the client process
  double client_user_create = 0, client_sys_create = 0;
  std::uint64_t client_rss_before = 0;                    // VmRSS before the create
  std::uint64_t client_hwm_create = 0;                    // VmHWM after the create (reset when the child started)
  std::uint64_t client_hwm = 0;                           // VmHWM at the end (destroy included)
  double agents_cpu_create = 0, agents_cpu_destroy = 0;   // summed over the agents
  double agent_cpu_create_max = 0;                        // the busiest agent
  double etcd_cpu = 0;                                    // etcd over create + destroy
  std::uint64_t agents_rss_total = 0, agent_rss_max = 0;  // VmRSS of the agents with every sandbox live
  std::size_t per_agent_min = 0, per_agent_max = 0;       // sandboxes acknowledged per agent
  std::size_t agents_used = 0;                            // agents that got at least one
  std::size_t left_after_destroy = 0;                     // sandboxes the agents still report after destroy
  std::size_t agents_report = 0;   // live sandboxes the agents report after the create (pulse + one warm-up each)
  std::size_t alive = 0;           // container: the pulse's sandboxes with a live process on this host
  double sandboxes_cpu = 0;        // container: CPU seconds of those processes (all spent since the pulse began)
  CpuUse cpu_create, cpu_destroy;  // the machine in those windows
};

struct PulseBenchResult {
  std::vector<PulseRun> runs;
  std::string etcd_version;
  std::string scratch;     // where the agents' homes, state and run directories were
  std::string scratch_fs;  // "tmpfs", or the device and file system type holding them
  std::vector<std::string> notes;
  int cores = 0;
};

// One sleep/wake cycle of a sandbox that holds memory (memhold: pseudo-random anonymous pages and a checksum).
struct SleepRound {
  double before_bytes = 0, after_bytes = 0;  // memory charged to the sandbox before and after the sleep
  double swap_bytes = 0;                     // its memory in swap after the sleep
  double sleep_ms = 0;                       // the agent's time for the sleep (freeze + release)
  double sleep_call_ms = 0;                  // Sandbox::sleep() as the client saw it
  double wake_ms = 0;                        // the agent's time for the wake
  double wake_call_ms = 0;                   // Sandbox::wake() as the client saw it
  double first_exec_ms = 0;                  // the first exec after the wake (`true`)
  double wake_to_exec_ms = 0;                // wake() called until that exec's result is back
  double touch_ms = 0;                       // an exec that has memhold read and rewrite all of its memory
  double touch_self_ms = 0;                  // memhold's own time for that, inside the exec
  double after_touch_bytes = 0;              // charged once it is all back (read before the next sleep)
  bool intact = false;                       // memhold found the same checksum
};

struct SleepSize {
  std::size_t mib = 0;
  std::uint64_t memory_limit = 0;  // the sandbox's memory limit
  double fill_ms = 0;              // memhold writing its memory at the start
  double awake_exec_ms = 0;        // median exec of `true` while awake, before any sleep
  double awake_touch_ms = 0;       // the touch exec with everything resident: the floor of touch_ms
  double awake_touch_self_ms = 0;
  std::vector<SleepRound> rounds;
};

struct SleepBenchResult {
  std::string swap;  // the swap the sleeping sandboxes used
  std::uint64_t node_swap_bytes = 0;
  std::string agent;   // "embedded dsecd ..." or the endpoint
  std::string cgroup;  // the agent's cgroup driver
  std::vector<SleepSize> sizes;
  std::vector<std::string> notes;
  CpuUse cpu;
  int cores = 0;
};

struct SnapshotSizePoint {
  std::size_t mib = 0;             // written in the sandbox before the snapshots
  std::vector<double> frozen_ms;   // per run: the sandbox's processes stood still
  std::vector<double> agent_ms;    // per run: the whole snapshot on the agent
  std::vector<double> client_ms;   // per run: the call as the client sees it
  std::uint64_t stored_bytes = 0;  // the snapshot layer in the store
  std::uint64_t file_bytes = 0;    // what the snapshot captured
};

struct SnapshotBenchResult {
  std::string store;
  std::vector<SnapshotSizePoint> sizes;
  double start_from_snapshot_ms = 0;  // create from the largest snapshot to its first exec
  std::size_t start_mib = 0;
  std::size_t forks = 0;
  std::vector<double> fork_call_ms;   // fork() until it returned
  std::vector<double> fork_total_ms;  // fork() until all forks answered an exec
  CpuUse cpu;
};

struct FnCallRatePoint {
  int concurrency = 0;
  double fncall_rate = 0, host_rate = 0, exec_rate = 0;  // completed calls per second
  std::size_t fncall_count = 0, host_count = 0, exec_count = 0;
  Latency fncall, host, exec;  // latency under this concurrency
  CpuUse cpu;                  // the machine while this level ran
};

// Function calls (the fncall backend's warm pools) next to a cold host `python3 -c` and a container sandbox exec.
struct FnCallBenchResult {
  std::size_t n = 0, warmup = 0;
  std::string image;        // the calls' image and the sandbox's
  std::string host_python;  // "Python 3.11.2"
  std::string node;         // the node that ran the calls
  int cores = 0;
  Latency fncall, fncall_agent, host, exec;  // sequential, the three alternating
  CpuUse sequential_cpu;
  double window_seconds = 0;  // per system and level, split into `rounds` turns
  std::size_t rounds = 0;
  std::vector<FnCallRatePoint> points;
  CpuUse cpu;
};

// dsec-bench microvm: QEMU microVMs (templates on, and cold boots of a second agent with --microvm-templates off)
// next to a plain QEMU boot of the same guest kernel and a container.
struct MicroVmIdleMemory {
  std::string what;           // "template clones" or "cold boots"
  std::size_t count = 0;      // VMs measured
  double create_seconds = 0;  // making all of them
  double settle_seconds = 0;
  // Per VM, the mean over the VMs' QEMU processes (/proc/<pid>/smaps_rollup), in bytes.
  double rss = 0, pss = 0, pss_anon = 0, pss_file = 0, pss_shmem = 0;
  double pss_min = 0, pss_max = 0;
  // The guest-RAM mapping (a memfd: the template's for a clone, its own for a cold boot), per VM: its PSS, and its
  // pages that are the VM's own (Anonymous: copied on write; for a memfd of its own, its Private pages).
  double ram_pss = 0, ram_rss = 0, ram_private = 0;
  double template_resident = 0;     // the templates' memfds' pages on the node, counted once (held by the agent)
  double cgroup_charge = 0;         // per VM, the VM's memory cgroup
  double mem_available_per_vm = 0;  // MemAvailable before - after, over count
  double agent_rss_delta = 0;
  double others_rss_delta = 0;  // RSS change of every other process over the same window: a noise gauge
  double vm_cpu_pct = 0;        // % of one core per idle VM while settling
  double load1 = 0;
  std::size_t found = 0;             // QEMU processes found for the VMs
  std::size_t discard_failures = 0;  // VMs whose qemu.log says ram_block_discard_range failed (free page reporting)
  std::string discard_example;
};

struct MicroVmDensityRun {
  std::size_t target = 0, ran = 0;
  std::string stop_reason;
  double create_seconds = 0;
  Latency batch_per_vm;  // ms per VM, per batch (create_many of a batch / its size)
  double mem_available_start = 0, mem_available_end = 0;
  double pss_per_vm = 0, rss_per_vm = 0, mem_available_per_vm = 0, cgroup_per_vm = 0;
  double others_rss_delta = 0;  // every other process's RSS change meanwhile (noise gauge for MemAvailable)
  std::size_t qemu_found = 0;
  // CPU while they idle, over `cpu_window` seconds.
  double cpu_window = 0;
  double vms_cores = 0, vm_cpu_pct = 0, agent_cores = 0, node_busy_cores = 0;
  double load1 = 0, load5 = 0, load15 = 0;
  std::size_t exec_ok = 0, exec_failed = 0;
  std::vector<std::string> exec_errors;
  Latency exec_check;
  double exec_check_seconds = 0;
  double destroy_seconds = 0;
  std::size_t qemu_left = 0;  // QEMU processes of the agent's cgroup after the teardown
  std::uint32_t vms_reported_left = 0;
  std::size_t sandboxes_listed_left = 0;
};

struct MicroVmSleepRun {
  std::size_t mib = 0;  // memory held by memhold
  std::uint64_t guest_memory = 0;
  double fill_ms = 0;
  bool intact_before = false, intact_after = false;
  double before_bytes = 0, after_bytes = 0;  // SleepReport: charged before and after the sleep
  double sleep_seconds = 0, sleep_call_ms = 0;
  double state_file_bytes = -1;  // <run dir>/<id>/sleep.state while asleep; -1: not found
  double wake_seconds = 0, wake_call_ms = 0, first_exec_ms = 0, wake_to_exec_ms = 0;
  double charged_after_wake = 0;  // the VM's cgroup after the wake and the touch
  double shmem_before_sleep = std::nan(""), shmem_after_sleep = std::nan("");  // of the charge (memory.stat shmem)
  double template_growth = std::nan("");  // the templates' memfds' resident pages: after the run less before
  double touch_ms = 0, awake_touch_ms = 0;
  std::string error;
};

struct MicroVmForkRun {
  std::size_t count = 0;
  double call_ms = 0, all_answered_ms = 0;
  std::size_t answered = 0, alive = 0, inherited = 0;
  bool parent_alive = false;
  std::vector<std::string> details;
};

struct MicroVmBenchResult {
  std::string accelerator, accelerator_reason, kernel_release, kernel_path, qemu_version, agent_version;
  std::uint64_t tsc_khz = 0;
  std::string peer_command;
  std::size_t n = 0, warmup = 0;
  // 1. create to first exec (ms): the template-making first create; clones; cold boots; the plain QEMU; container.
  double first_create_ms = 0, first_exec_ms = 0;
  Latency tmpl_total, tmpl_create, tmpl_exec, tmpl_second_exec;
  // From a pre-booted pool (a third agent with --microvm-pool pool_size): claims and misses as its node info
  // counted them (a miss starts from the template instead).
  Latency pool_total, pool_create, pool_exec, pool_second_exec;
  std::uint32_t pool_size = 0;
  std::uint64_t pool_claims = 0, pool_misses = 0;
  Latency cold_total, cold_create, cold_exec;
  Latency peer_marker, peer_exit;
  Latency ct_total, ct_create, ct_exec;
  CpuUse create_cpu;
  // 2. exec round trips of `true` (ms)
  std::size_t exec_n = 0, think_n = 0;
  Latency vm_exec, vm_exec_agent, ct_exec_b2b, vm_think, vm_think_agent, ct_think;
  CpuUse exec_cpu;
  std::vector<MicroVmIdleMemory> memory;
  std::optional<MicroVmDensityRun> density;
  std::vector<MicroVmSleepRun> sleeps;
  std::optional<MicroVmForkRun> fork;
  std::vector<std::pair<std::string, std::string>> section_load;  // section -> its load and CPU
  std::vector<std::pair<std::string, double>> template_resident;  // when -> the templates' memfds' resident bytes
  // when -> memory charged to the agent's cgroup subtree (its VMs' groups, live and removed), with no VM running
  std::vector<std::pair<std::string, double>> subtree_charge;
  std::vector<std::string> notes;
  std::vector<std::string> problems;  // what went wrong in the backend (a section that failed, VMs not answering)
  int cores = 0;
};

// dsec-bench vm: full VMs (kind "vm": q35, the desktop image's own kernel and systemd, a screen), every figure
// naming the accelerator (GET /v1/node: vm.accelerator) and the load it ran under.
struct VmIdleMemory {
  std::string id;
  double cgroup_charge = std::nan("");  // the sandbox's memory cgroup (its QEMU: guest RAM touched, heap, TCG cache)
  double shmem = std::nan("");          // of which shmem (memory.stat)
  double qemu_rss = std::nan(""), qemu_pss = std::nan("");  // its QEMU process (/proc/<pid>/smaps_rollup)
};

struct VmBenchResult {
  std::string accelerator, accelerator_reason, qemu_version, agent_version;
  std::string image, display;  // the desktop image (pinned) and the screen asked for
  double cpu = 0;
  std::uint64_t memory_bytes = 0;
  int cores = 0;
  // 1. create to ready: the shape's first (a boot of the whole system, frozen as the template, then the sandbox
  // started from it) and the next ones (clones of the template).
  std::size_t creates = 0;
  double first_create_ms = std::nan("");
  std::string first_load;  // load averages when it returned
  Latency next_create;
  std::string next_load;
  // 2. screenshots (PNG) of an idle desktop
  Latency screenshot;
  std::uint32_t png_width = 0, png_height = 0;
  std::size_t png_bytes = 0;  // the last one's size
  std::string screenshot_load;
  // 3. one key typed into the focused terminal until a screenshot differs (polling back to back), and the input
  // call alone; samples whose screen did not change within the timeout are counted apart.
  Latency input_to_screen, input_call;
  std::size_t input_unchanged = 0;
  std::string input_load;
  // 4. the VMs of (1), idle and settled
  std::vector<VmIdleMemory> idle;
  double idle_settle_seconds = 0;
  double template_resident = std::nan("");  // the templates' memfds' pages held by the agent
  std::uint32_t node_templates = 0;         // GET /v1/node vm.templates and the guest RAM they hold
  std::uint64_t node_template_bytes = 0;
  double subtree_charge = std::nan("");  // the agent's whole cgroup subtree with the VMs up
  std::string idle_load;
  // 5. sleep and wake of one VM, then snapshots of it (the first into an empty store copies the image's layers too)
  std::string sleep_error;
  double sleep_seconds = 0, sleep_call_ms = 0, wake_seconds = 0, wake_call_ms = 0;
  double sleep_before_bytes = 0, sleep_after_bytes = 0, wake_after_bytes = 0;
  double wake_to_screenshot_ms = std::nan(""), wake_to_exec_ms = std::nan("");
  std::string sleep_load;
  struct Snapshot {
    std::string what, error;
    double call_ms = 0, seconds = 0, frozen_seconds = 0;
    std::uint64_t layer_bytes = 0, stored_bytes = 0, file_bytes = 0, entries = 0;
  };
  std::vector<Snapshot> snapshots;
  std::string snapshot_load;
  std::vector<std::pair<std::string, std::string>> section_load;  // section -> its CPU and load
  std::vector<std::string> notes;
  std::vector<std::string> problems;  // a section that failed, with its error
};

// dsec-bench qos: the step of an agent loop in a latency-class sandbox, idle and beside CPU spinners.
struct QosRow {
  std::string name;
  std::string baseline;  // the idle row its inflation is taken against; empty: it is a baseline itself
  std::size_t spinners = 0;
  std::string latency_class, spinner_class;
  Latency step;      // the exec's round trip as the client sees it
  Latency agent;     // the exec inside the agent (ExecResult::duration_seconds)
  Latency inside;    // the loop's own time inside the sandbox (empty: its shell has no $EPOCHREALTIME)
  CpuUse cpu;        // the machine while the steps ran (its turns together)
  double load1 = 0;  // at the end of its last turn
  std::vector<std::string> granted, missing;                  // the latency sandbox's qos on its node
  std::vector<std::string> spinner_granted, spinner_missing;  // one spinner's
};

struct QosBenchResult {
  std::string agent, cgroup;
  QosNodeInfo node_qos;        // the first agent's
  std::string reserved_agent;  // the second agent's --latency-cpus; empty: no such rows
  std::string reserved_cpus;   // what it reported
  std::string image;
  std::size_t loop_iterations = 0;  // the step: a shell loop of this many iterations
  double think_ms = 0;
  std::size_t steps = 0, warmup = 0;
  std::size_t rounds = 0;  // the rows took turns this many times, steps / rounds each
  std::vector<QosRow> rows;
  std::vector<std::string> notes;
  int cores = 0;
};

// dsec-bench reclaim: idle sandboxes holding a Python process's memory, before and after the cold-memory reclaimer.
struct ReclaimBenchResult {
  std::string skipped;   // why nothing was measured (no swap, reclaim off); empty: measured
  std::string workload;  // what each sandbox runs
  std::string image, swap, agent, cgroup;
  std::string reclaim_mode, reclaim_reason;  // the node's
  std::size_t count = 0, control = 0, age_seconds = 0;
  std::uint64_t memory_limit = 0;
  std::size_t modules = 0;          // modules the first worker had loaded
  double create_seconds = 0;        // create_many of all of them
  double ready_seconds = 0;         // from the first create until every worker idled
  std::size_t reclaimed_early = 0;  // sandboxes reclaimed after their worker started, before `before` (should be 0)
  // Host and sandboxes: before (every worker idle, none reclaimed) and after the reclaimer took them all once.
  double mem_available_start = 0, mem_available_before = 0, mem_available_after = 0;
  double charge_before = 0, charge_after = 0;                  // the reclaimable sandboxes' cgroups, summed
  double control_charge_before = 0, control_charge_after = 0;  // the control's
  double rss_before = 0, rss_after = 0;                        // the reclaimable sandboxes' processes, summed
  double swap_used_before = 0, swap_used_after = 0;            // host-wide (SwapTotal - SwapFree)
  double reclaim_seconds = 0;      // from `before` until every sandbox was reclaimed once (or the timeout)
  std::size_t reclaimed_once = 0;  // reclaimable sandboxes reclaimed after `before` was read
  std::uint64_t reclaimed_bytes = 0, reclaims = 0, refaults = 0;  // summed over the reclaimable sandboxes
  std::uint64_t node_reclaimed_bytes = 0;
  // The first step after the idle time (an exec signalling the worker, which walks its objects and touches its
  // memory) and the next one, on reclaimed sandboxes and on the control: exec round trip, and the worker's own time.
  Latency first_reclaimed, first_reclaimed_inside, second_reclaimed, second_reclaimed_inside;
  Latency first_control, first_control_inside, second_control, second_control_inside;
  std::uint64_t probe_refaults = 0;  // pages the probed reclaimed sandboxes read back during their two steps
  CpuUse cpu;
  std::vector<std::string> notes;
  int cores = 0;
};

// dsec-bench pulse-node: one pulse of creates on one node, on an agent without a pool and on one with a warm pool.
struct PulseNodeRun {
  std::string label;
  std::size_t pool = 0;
  double fill_seconds = 0;   // until the pool was full
  double pulse_seconds = 0;  // the first create called until the last answered
  Latency per_create;
  std::uint64_t claims = 0, misses = 0;
  std::size_t made = 0, working = 0;  // made, and answered an exec afterwards
  std::string error;                  // the first create that failed, if one did
  CpuUse cpu;
};

struct PulseNodeResult {
  std::size_t n = 0, threads = 0;
  std::string cgroup;
  std::vector<PulseNodeRun> runs;
  // After the pulse, on the agent with the pool: creates/s in a closed loop against `crun run` and `bwrap`.
  std::optional<ThroughputResult> closed_loop;
  std::uint64_t closed_loop_claims = 0, closed_loop_misses = 0;  // of the pool, during the closed loop
};

struct Report {
  std::string command_line;
  MachineInfo machine;
  std::optional<CreateResult> create;
  std::optional<ThroughputResult> throughput;
  std::optional<ExecBenchResult> exec;
  std::optional<DensityResult> density;
  std::optional<CgroupJoinResult> cgroup_join;
  std::optional<ImageBenchResult> image;
  std::optional<PulseBenchResult> pulse;
  std::optional<SleepBenchResult> sleep;
  std::optional<SnapshotBenchResult> snapshot;
  std::optional<FnCallBenchResult> fncall;
  std::optional<MicroVmBenchResult> microvm;
  std::optional<VmBenchResult> vm;
  std::optional<QosBenchResult> qos;
  std::optional<ReclaimBenchResult> reclaim;
  std::optional<PulseNodeResult> pulse_node;
  std::vector<std::string> notes;  // peers skipped and why, workarounds applied
};

class Peers;

// The spec every latency and throughput benchmark creates: the image, a modest limit, a TTL that reaps what a
// crashed run leaves behind, and a label that names the benchmark.
SandboxSpec bench_spec(const Options& options);

CreateResult run_create(const Options& options, Client& client, Peers& peers);
// `spec`: what each cycle creates (default bench_spec(options)).
ThroughputResult run_throughput(const Options& options, Client& client, Peers& peers,
                                const std::optional<SandboxSpec>& spec = std::nullopt);
ExecBenchResult run_exec(const Options& options, Client& client, Peers& peers);
DensityResult run_density(const Options& options, Client& client);
CgroupJoinResult run_cgroup_join(const Options& options);
// Builds the bench images in <home>/store when missing (with the dsec CLI), then measures cold starts of them.
ImageBenchResult run_image(const Options& options, const std::string& home);
// An OCI registry's image (made and cached under <home>/cache, pushed to a private docker-registry): dsec's import
// next to skopeo copy + umoci unpack, a second image sharing its layers, first creates of it. Prints as it goes.
void run_registry(const Options& options, const std::string& home);
// Starts a private etcd and agents (null backend, then container), and times a pulse of creates over them.
PulseBenchResult run_pulse(const Options& options);

// Starts an agent with a swap file of its own under <home> (or uses --endpoint's), and puts sandboxes holding
// anonymous memory to sleep and wakes them; removes the swap file after.
SleepBenchResult run_sleep(const Options& options, const std::string& home);
// Snapshots of sandboxes that wrote each of options.snapshot_sizes MiB, then a fork. `snapshot_store` is the
// agent's snapshot store when the benchmark chose it (it is emptied as the run goes), else empty.
SnapshotBenchResult run_snapshot(const Options& options, Client& client, const std::string& snapshot_store);
// A trivial python call through run_code, a cold host `python3 -c` and a sandbox exec: latency, then calls/s.
FnCallBenchResult run_fncall(const Options& options, Client& client);
// Prints as it goes (no Markdown summary).
void run_network(const Options& options, Client& client);
// The embedded agent's flags for `network`: its sandboxes' resolver asks a name server of the benchmark's own on
// loopback (started by the first call; it answers every name under bench.test with an address of 198.18.0.0/15).
std::vector<std::string> network_agent_args();
// QEMU microVMs: starts its own agents (templates on, serving container and microvm; and one with
// --microvm-templates off), builds the image in <home>/store when missing.
MicroVmBenchResult run_microvm(const Options& options, const std::string& home);
// Full VMs of the desktop image (scripts/desktop-image.sh builds it into <home>/store): starts its own agent
// (--backends container,vm) on <home>.
VmBenchResult run_vm(const Options& options, const std::string& home);

// Text for the terminal, and the Markdown summary for docs/benchmarks.md.
void print_create(const CreateResult& r);
void print_throughput(const ThroughputResult& r);
std::string markdown_throughput(const ThroughputResult& r, int cores);
void print_exec(const ExecBenchResult& r);
// A latency table: its header (p50, p90, p99, max, mean) and one row.
void print_header();
void print_row(const std::string& name, const Latency& l);
// dsec-bench session: shell sessions next to exec (round trips, after think time, a 40-step episode); prints.
void run_session(const Options& options, Client& client);
void print_density(const DensityResult& r);
void print_cgroup_join(const CgroupJoinResult& r);
void print_image(const ImageBenchResult& r);
std::string markdown_image(const ImageBenchResult& r);
void print_pulse(const PulseBenchResult& r);
std::string markdown_pulse(const PulseBenchResult& r);
void print_sleep(const SleepBenchResult& r);
std::string markdown_sleep(const SleepBenchResult& r);
void print_snapshot(const SnapshotBenchResult& r);
std::string markdown_snapshot(const SnapshotBenchResult& r, int cores);
void print_fncall(const FnCallBenchResult& r);
std::string markdown_fncall(const FnCallBenchResult& r);
void print_microvm(const MicroVmBenchResult& r);
std::string markdown_microvm(const MicroVmBenchResult& r);
void print_vm(const VmBenchResult& r);
std::string markdown_vm(const VmBenchResult& r);
// A latency-class sandbox's step idle and beside batch (then standard) spinners; starts its own agents (a second
// one with --latency-cpus for the reserved-CPU rows), or uses --endpoint's.
QosBenchResult run_qos(const Options& options, const std::string& home);
void print_qos(const QosBenchResult& r);
std::string markdown_qos(const QosBenchResult& r);
// Idle Python sandboxes before and after the cold-memory reclaimer; starts an agent with a swap file of its own
// under <home> and a short --reclaim-age (or uses --endpoint's node as it is).
ReclaimBenchResult run_reclaim(const Options& options, const std::string& home);
void print_reclaim(const ReclaimBenchResult& r);
std::string markdown_reclaim(const ReclaimBenchResult& r);

PulseNodeResult run_pulse_node(const Options& options, const std::string& home, Peers& peers);
void print_pulse_node(const PulseNodeResult& r);
std::string markdown_pulse_node(const PulseNodeResult& r, int cores);
// "12.3 s; CPU busy 1.98 of 2 cores: dsec-bench, its children and the agent 0.40, kernel threads ..."
std::string cpu_text(const CpuUse& cpu, int cores);
void print_cpu(const CpuUse& cpu, int cores, std::string_view prefix = "  load: ");
std::string markdown_report(const Report& report, const Options& options);

// The agent's pid when it runs on this host (found by its unix socket on the command line), else -1.
int agent_pid_for(const Client& client);

}  // namespace dsec::bench
