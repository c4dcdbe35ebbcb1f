// What the running kernel gives the node's classes of service and memory policies (docs/qos.md), probed once when
// the agent starts, and what each sandbox's class got from it.
#pragma once

#include <string>
#include <string_view>

#include "dsec/sandbox_info.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent::qos {

struct KernelQos {
  // Core scheduling (PR_SCHED_CORE, CONFIG_SCHED_CORE): a cookie of its own keeps a latency sandbox's tasks from
  // sharing a physical core's SMT sibling with anybody else's. Only worth anything on CPUs with SMT.
  bool core_scheduling = false;
  std::string core_scheduling_reason;
  // Same-page merging a process can ask for itself and its children (PR_SET_MEMORY_MERGE, Linux 6.4+).
  bool memory_merge = false;
  std::string memory_merge_reason;
  bool psi = false;  // /proc/pressure
};

// Probed once per process (what the kernel offers does not change while the agent runs).
const KernelQos& probe_kernel_qos();

// The CPUs reserved for latency sandboxes (the cpuset fallback for core scheduling), as cpu lists ("3", "6-7").
// Both empty: nothing reserved, every sandbox may run on every CPU of the agent.
struct CpuReservation {
  std::string latency;  // where latency sandboxes run
  std::string shared;   // where every other sandbox runs
  bool empty() const { return latency.empty(); }
};

// From dsecd --latency-cpus: "auto" (the default) reserves 1 CPU in 16 (at least 1) on a node of 8 or more CPUs
// whose kernel has no core scheduling, nothing elsewhere; "none" reserves nothing; a cpu list ("1", "4-5,7")
// reserves exactly those. Throws INVALID_ARGUMENT for a list that does not parse, names a CPU the agent may not
// run on, or leaves no CPU for the other sandboxes, with the arithmetic.
CpuReservation resolve_cpu_reservation(std::string_view setting, const KernelQos& kernel);

// Parses a kernel cpu list ("0-3,8,10-11") into the CPU numbers; throws INVALID_ARGUMENT when it does not parse.
std::vector<int> parse_cpu_list(std::string_view list);
std::string format_cpu_list(const std::vector<int>& cpus);

// What the node gives one sandbox's class: the mechanisms in force, and what its class asks for that the node
// cannot give (never silently). `cgroup_version` "v1" or "v2"; `vm` for the QEMU tiers (the class applies to the
// VM's QEMU process).
struct GrantInputs {
  const KernelQos* kernel = nullptr;
  const CpuReservation* cpus = nullptr;
  std::string cgroup_version;
  bool cpu_idle = false;  // the node's groups have cpu.idle (CgroupDriver::cpu_idle)
  bool vm = false;
  bool ksm = false;  // the sandbox's memory is offered to KSM (its processes asked the kernel, successfully)
};
QosGrant describe_grant(const Resources& resources, const GrantInputs& in);

}  // namespace dsec::agent::qos
