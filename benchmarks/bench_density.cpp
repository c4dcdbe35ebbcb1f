// dsec-bench density: K idle sandboxes at once, and what they cost the host. Three views of the same memory:
// MemAvailable before and after (everything the host gave up: sandbox processes, their tmpfs and overlay, page
// tables, kernel objects, the agent's bookkeeping; also any other process's growth, hence the noise gauge), the
// RSS and PSS of the sandboxes' processes, and what their memory cgroups were charged. Then all K are destroyed at
// once and the teardown is timed.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "bench.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"

namespace dsec::bench {
namespace {

// What a sandbox adds to host-wide: its processes' anonymous memory, its tmpfs (Shmem), dentries, inodes,
// namespaces and cgroups (slab), kernel stacks, page tables, and per-cpu cgroup statistics (Percpu).
constexpr const char* kKernelFields[] = {"AnonPages",   "Shmem",      "SReclaimable", "SUnreclaim",
                                         "KernelStack", "PageTables", "Percpu"};

}  // namespace

DensityResult run_density(const Options& options, Client& client) {
  DensityResult result;
  result.count = options.density_count;
  result.cpu_per_sandbox = options.density_cpu;
  result.memory_limit = options.density_memory;

  SandboxSpec spec = bench_spec(options);
  spec.resources.cpu = options.density_cpu;
  spec.resources.memory_bytes = options.density_memory;
  spec.ttl = std::chrono::seconds(3600);

  const int agent = agent_pid_for(client);
  const int self = static_cast<int>(::getpid());
  CpuMeter cpu({agent});
  const std::uint64_t agent_rss_before = agent > 0 ? rss_bytes(agent) : 0;
  const std::uint64_t others_before = rss_of_all_but({self, agent});
  const std::map<std::string, double> slab_before = slab_bytes();
  const std::map<std::string, double> meminfo_before = meminfo_settled();

  fmt::print(stderr, "  density: creating {} sandboxes\n", options.density_count);
  auto t0 = Clock::now();
  std::vector<Sandbox> sandboxes = client.create_many(options.density_count, spec);
  result.create_seconds = ms_since(t0) / 1000;

  // Let the kernel finish what it defers (RCU frees, per-cpu caches) before reading the memory it reports.
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const std::map<std::string, double> meminfo_after = meminfo_settled();
  const std::map<std::string, double> slab_after = slab_bytes();

  std::set<std::string> ids;
  for (const auto& sb : sandboxes) ids.insert(sb.id());
  SandboxProcesses found = find_sandbox_processes(ids);
  std::set<int> exclude{self, agent};
  for (const auto& [id, pids] : found.pids) {
    for (int pid : pids) {
      result.rss_total += static_cast<double>(rss_bytes(pid));
      result.pss_total += static_cast<double>(pss_bytes(pid));
      exclude.insert(pid);
      ++result.processes;
    }
  }
  result.sandboxes_found = found.pids.size();
  for (const auto& [id, dir] : found.memory_cgroup)
    result.cgroup_charge_total += static_cast<double>(cgroup_memory_bytes(dir));
  result.agent_rss_delta = agent > 0 ? static_cast<double>(rss_bytes(agent)) - static_cast<double>(agent_rss_before)
                                     : std::numeric_limits<double>::quiet_NaN();
  result.others_rss_delta = static_cast<double>(rss_of_all_but(exclude)) - static_cast<double>(others_before);
  auto field = [](const std::map<std::string, double>& m, const std::string& name) {
    auto it = m.find(name);
    return it == m.end() ? 0.0 : it->second;
  };
  result.mem_available_delta = field(meminfo_before, "MemAvailable") - field(meminfo_after, "MemAvailable");
  result.itemised_total = result.pss_total + (agent > 0 ? result.agent_rss_delta : 0);
  for (const char* name : kKernelFields) {
    if (!meminfo_before.count(name)) continue;  // a field this kernel does not have
    double growth = field(meminfo_after, name) - field(meminfo_before, name);
    result.meminfo_growth.emplace_back(name, growth);
    if (std::string_view(name) != "AnonPages") result.itemised_total += growth;
  }
  for (const auto& [name, bytes] : slab_after) {
    double growth = bytes - field(slab_before, name);
    if (growth > 0) result.slab_growth.emplace_back(name, growth);
  }
  std::sort(result.slab_growth.begin(), result.slab_growth.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });
  if (result.slab_growth.size() > 8) result.slab_growth.resize(8);

  fmt::print(stderr, "  density: destroying {} sandboxes with {} threads\n", sandboxes.size(),
             options.teardown_concurrency);
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::string first_error;
  std::mutex mu;
  auto t1 = Clock::now();
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < options.teardown_concurrency; ++i) {
    threads.emplace_back([&] {
      for (std::size_t k = next++; k < sandboxes.size() && !failed.load(); k = next++) {
        try {
          sandboxes[k].destroy();
        } catch (const std::exception& e) {
          std::lock_guard lock(mu);
          if (first_error.empty()) first_error = e.what();
          failed = true;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  result.teardown_seconds = ms_since(t1) / 1000;
  if (failed) throw Error(Code::kInternal, fmt::format("density: destroying the sandboxes failed: {}", first_error));

  std::this_thread::sleep_for(std::chrono::seconds(2));
  result.mem_returned = static_cast<double>(mem_available_settled()) - field(meminfo_after, "MemAvailable");
  result.cpu = cpu.stop();
  return result;
}

}  // namespace dsec::bench
