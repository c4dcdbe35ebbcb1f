#include "agent/node/qos/kernel_qos.hpp"

#include <sched.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <set>

#include <fmt/format.h>

#include "agent/backends/container/cgroup.hpp"
#include "dsec/error.hpp"

#ifndef PR_SCHED_CORE
#define PR_SCHED_CORE 62
#define PR_SCHED_CORE_GET 0
#endif
#ifndef PR_GET_MEMORY_MERGE
#define PR_SET_MEMORY_MERGE 67
#define PR_GET_MEMORY_MERGE 68
#endif

namespace dsec::agent::qos {
namespace {

std::string read_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::vector<int> affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (::sched_getaffinity(0, sizeof(set), &set) != 0) return out;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
    if (CPU_ISSET(cpu, &set)) out.push_back(cpu);
  return out;
}

KernelQos probe() {
  KernelQos k;
  unsigned long cookie = 0;
  // PIDTYPE_PID (0) of this thread: a kernel with core scheduling answers its cookie (0), one without EINVAL.
  if (::prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, 0, reinterpret_cast<unsigned long>(&cookie)) == 0) {
    const std::string smt = read_line("/sys/devices/system/cpu/smt/active");
    if (smt == "0") {
      k.core_scheduling_reason = "the kernel has it, but the CPUs run no SMT siblings: no core is shared to begin with";
    } else {
      k.core_scheduling = true;
    }
  } else {
    k.core_scheduling_reason = errno == EINVAL ? "the kernel has none (CONFIG_SCHED_CORE)"
                                               : fmt::format("PR_SCHED_CORE: {}", std::strerror(errno));
  }
  // The current setting of this process is read, never changed: PR_GET_MEMORY_MERGE fails with EINVAL on kernels
  // before 6.4.
  if (::prctl(PR_GET_MEMORY_MERGE, 0, 0, 0, 0) >= 0) {
    if (::access("/sys/kernel/mm/ksm/run", W_OK) == 0) k.memory_merge = true;
    else k.memory_merge_reason = "no writable /sys/kernel/mm/ksm/run (a kernel without CONFIG_KSM, or no root)";
  } else {
    k.memory_merge_reason = "the kernel has no PR_SET_MEMORY_MERGE (Linux 6.4+)";
  }
  k.psi = ::access("/proc/pressure/cpu", R_OK) == 0;
  return k;
}

}  // namespace

const KernelQos& probe_kernel_qos() {
  static const KernelQos probed = probe();  // the agent, its container backend and each QEMU tier ask once
  return probed;
}

std::vector<int> parse_cpu_list(std::string_view list) {
  std::set<int> cpus;
  auto number = [&](std::string_view s) {
    int v = -1;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || v < 0 || v >= CPU_SETSIZE)
      throw Error(Code::kInvalidArgument, fmt::format("cpu list '{}': '{}' is not a CPU number", list, s));
    return v;
  };
  std::size_t at = 0;
  while (at <= list.size()) {
    std::size_t comma = list.find(',', at);
    std::string_view item = list.substr(at, comma == std::string_view::npos ? std::string_view::npos : comma - at);
    if (item.empty()) throw Error(Code::kInvalidArgument, fmt::format("cpu list '{}' has an empty item", list));
    std::size_t dash = item.find('-');
    if (dash == std::string_view::npos) {
      cpus.insert(number(item));
    } else {
      int from = number(item.substr(0, dash)), to = number(item.substr(dash + 1));
      if (from > to)
        throw Error(Code::kInvalidArgument, fmt::format("cpu list '{}': range {} runs backwards", list, item));
      for (int c = from; c <= to; ++c) cpus.insert(c);
    }
    if (comma == std::string_view::npos) break;
    at = comma + 1;
  }
  return {cpus.begin(), cpus.end()};
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::string out;
  for (std::size_t i = 0; i < cpus.size();) {
    std::size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1) ++j;
    if (!out.empty()) out += ',';
    out += j == i ? std::to_string(cpus[i]) : fmt::format("{}-{}", cpus[i], cpus[j]);
    i = j + 1;
  }
  return out;
}

CpuReservation resolve_cpu_reservation(std::string_view setting, const KernelQos& kernel) {
  const std::vector<int> all = affinity_cpus();
  std::vector<int> latency;
  if (setting == "none" || setting.empty()) return {};
  if (setting == "auto") {
    if (kernel.core_scheduling || all.size() < 8) return {};
    std::size_t n = std::max<std::size_t>(1, all.size() / 16);
    latency.assign(all.end() - static_cast<std::ptrdiff_t>(n), all.end());
  } else {
    latency = parse_cpu_list(setting);
    for (int cpu : latency)
      if (!std::binary_search(all.begin(), all.end(), cpu))
        throw Error(Code::kInvalidArgument,
                    fmt::format("--latency-cpus {}: CPU {} is not one the agent may run on ({})", setting, cpu,
                                format_cpu_list(all)));
  }
  std::vector<int> shared;
  std::set_difference(all.begin(), all.end(), latency.begin(), latency.end(), std::back_inserter(shared));
  if (shared.empty())
    throw Error(Code::kInvalidArgument,
                fmt::format("--latency-cpus {}: reserves all {} CPUs of the agent ({}), none would be left for the "
                            "other sandboxes",
                            setting, all.size(), format_cpu_list(all)));
  return CpuReservation{format_cpu_list(latency), format_cpu_list(shared)};
}

QosGrant describe_grant(const Resources& r, const GrantInputs& in) {
  QosGrant g;
  const bool v2 = in.cgroup_version == "v2";
  const std::string who = in.vm ? "its QEMU" : "every process";
  if (v2) g.granted.push_back(fmt::format("cpu.weight {}", container::cpu_weight_v2(r.priority)));
  else g.granted.push_back(fmt::format("cpu.shares {}", container::cpu_weight_v1(r.priority)));
  switch (r.priority) {
    case Priority::kLatency:
      if (v2) g.granted.push_back("memory.low (its whole limit)");
      else g.missing.push_back("memory protection: cgroup v1 has no memory.low");
      if (in.kernel && in.kernel->core_scheduling) g.granted.push_back("core scheduling (a core cookie of its own)");
      else g.missing.push_back("core scheduling: " + (in.kernel ? in.kernel->core_scheduling_reason : "not probed"));
      if (in.cpus && !in.cpus->empty()) g.granted.push_back("cpuset " + in.cpus->latency + " (reserved for latency)");
      else g.missing.push_back("reserved CPUs: none on this node (dsecd --latency-cpus)");
      g.granted.push_back("never cold-reclaimed");
      break;
    case Priority::kBatch:
      g.granted.push_back("SCHED_IDLE (" + who + ")");
      if (in.cpu_idle) g.granted.push_back("cpu.idle (its group yields to every other group)");
      else g.missing.push_back("cpu.idle: the kernel's cpu controller has none (Linux 5.15+)");
      if (v2) g.granted.push_back("memory.high (90% of its limit)");
      else g.granted.push_back("memory.soft_limit_in_bytes (half its limit)");
      [[fallthrough]];
    case Priority::kStandard:
      if (in.cpus && !in.cpus->empty()) g.granted.push_back("cpuset " + in.cpus->shared + " (off the latency CPUs)");
      break;
  }
  if (r.ksm) {
    if (in.ksm) g.granted.push_back("ksm");
    else if (in.kernel && !in.kernel->memory_merge) g.missing.push_back("ksm: " + in.kernel->memory_merge_reason);
    else g.missing.push_back(in.vm ? "ksm: not offered for VMs" : "ksm: not set");
  }
  return g;
}

}  // namespace dsec::agent::qos
