// dsec-bench pulse-node: a pulse of creates on one node, issued all at once, with and without a warm pool.
//
// Two embedded agents, one after the other: the first keeps no pool, the second keeps --pulse-n sandboxes of the
// pulse's shape started ahead (dsecd --warm-pool) and the bench waits until the pool is full. Each gets the same
// pulse: --pulse-n creates from `--pulse-threads` threads at once, each create a call of its own (the way many
// trainers' workers would ask), until every sandbox is ready. Reported: the time from the first call to the last
// answer, per-create latency, creates a second, the pool's claims and misses, and one exec in each sandbox to show
// they all work. Then, on the pooled agent, creates/s in a closed loop against `crun run` and `bwrap` in the same
// run (dsec-bench throughput's loop). Sandboxes are small and idle (0.01 cores, 16 MiB), the density run's shape; the
// agents get the overcommit that admits them.
#include <atomic>
#include <cmath>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "bench.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"
#include "peers.hpp"

namespace dsec::bench {
namespace {

constexpr double kCpu = 0.01;
constexpr std::uint64_t kMemory = 16ull << 20;

SandboxSpec pulse_spec(const Options& o) {
  SandboxSpec spec;
  spec.image = o.image;
  spec.resources.cpu = kCpu;
  spec.resources.memory_bytes = kMemory;
  spec.ttl = std::chrono::seconds(1800);
  return spec;
}

ClientOptions pulse_agent(const Options& o, const std::string& home, std::size_t pool) {
  ClientOptions copts;
  copts.home = home;
  copts.agent_binary = o.agent_binary;
  // Room for the pulse and the pool together, whatever the machine: the limits are not what is measured.
  const double need_cpu = kCpu * static_cast<double>(2 * o.pulse_node_n + 16);
  const double need_memory = static_cast<double>(kMemory) * static_cast<double>(2 * o.pulse_node_n + 16);
  MachineInfo m = read_machine();
  const double cpu_ratio = std::max(32.0, std::ceil(need_cpu / std::max(1, m.cores)));
  const double memory_ratio = std::max(2.0, std::ceil(need_memory / static_cast<double>(m.mem_total) * 10) / 10);
  copts.agent_args = {"--backends",          "container",
                      "--cpu-overcommit",    fmt::format("{}", cpu_ratio),
                      "--memory-overcommit", fmt::format("{}", memory_ratio),
                      "--reclaim",           "off"};
  if (pool > 0)
    copts.agent_args.insert(copts.agent_args.end(),
                            {"--warm-pool", fmt::format("{},size={},cpu={},memory={}", o.image, pool, kCpu, kMemory)});
  copts.agent_args.insert(copts.agent_args.end(), o.agent_args.begin(), o.agent_args.end());
  copts.call_deadline = std::chrono::minutes(5);
  copts.request_timeout = std::chrono::minutes(2);
  copts.create_concurrency = o.pulse_node_threads;
  return copts;
}

PulseNodeRun one_pulse(const Options& o, Client& client, const std::string& label, std::size_t pool) {
  PulseNodeRun run;
  run.label = label;
  run.pool = pool;
  if (pool > 0) {
    auto t0 = Clock::now();
    for (;;) {
      NodeInfo n = client.nodes().front();
      if (n.warm_pool_ready >= pool) break;
      if (ms_since(t0) > 600'000) throw Error(Code::kDeadlineExceeded, "the warm pool did not fill in 10 minutes");
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    run.fill_seconds = ms_since(t0) / 1000;
    std::this_thread::sleep_for(std::chrono::seconds(2));  // the refill's last sandbox settles
  }
  const NodeInfo before = client.nodes().front();
  const SandboxSpec spec = pulse_spec(o);
  std::vector<std::optional<Sandbox>> made(o.pulse_node_n);
  std::atomic<std::size_t> next{0};
  std::mutex mu;
  std::optional<Error> failed;
  CpuMeter cpu({agent_pid_for(client)}, true);
  cpu.start();
  const auto started = Clock::now();
  auto work = [&] {
    for (;;) {
      const std::size_t i = next.fetch_add(1);
      if (i >= made.size()) return;
      const auto t = Clock::now();
      try {
        made[i].emplace(client.create(spec));
      } catch (const Error& e) {
        std::lock_guard lock(mu);
        if (!failed) failed = e;
        continue;
      }
      std::lock_guard lock(mu);
      run.per_create.add(ms_since(t));
    }
  };
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < o.pulse_node_threads; ++t) threads.emplace_back(work);
  for (auto& t : threads) t.join();
  run.pulse_seconds = ms_since(started) / 1000;
  run.cpu = cpu.stop();
  const NodeInfo after = client.nodes().front();
  run.claims = after.warm_pool_claims - before.warm_pool_claims;
  run.misses = after.warm_pool_misses - before.warm_pool_misses;
  for (auto& sb : made) {
    if (!sb) continue;
    ++run.made;
    ExecRequest r;
    r.argv = {"true"};
    if (sb->exec(r).exit_code == 0) ++run.working;
  }
  if (failed) run.error = failed->what();
  std::vector<std::thread> destroyers;
  destroyers.reserve(8);
  std::atomic<std::size_t> d{0};
  for (int t = 0; t < 8; ++t)
    destroyers.emplace_back([&] {
      for (std::size_t i = d.fetch_add(1); i < made.size(); i = d.fetch_add(1))
        if (made[i]) try {
            made[i]->destroy();
          } catch (const Error&) {
          }
    });
  for (auto& t : destroyers) t.join();
  return run;
}

}  // namespace

PulseNodeResult run_pulse_node(const Options& o, const std::string& home, Peers& peers) {
  if (!o.endpoints.empty())
    throw Error(Code::kInvalidArgument,
                "pulse-node starts agents of its own (with and without a warm pool): no --endpoint");
  PulseNodeResult result;
  result.n = o.pulse_node_n;
  result.threads = o.pulse_node_threads;
  for (std::size_t pool : {std::size_t{0}, o.pulse_node_n}) {
    fmt::print(stderr, "dsec-bench: pulse-node: an agent {}\n",
               pool ? fmt::format("with a warm pool of {}", pool) : std::string("without a pool"));
    Client client(pulse_agent(o, home, pool));
    result.runs.push_back(one_pulse(o, client, pool ? fmt::format("warm pool of {}", pool) : "no pool", pool));
    result.cgroup = client.nodes().front().cgroup_version;
    if (pool == 0) continue;
    // The same node's steady rate, against the peers in the same run: C threads each create then destroy (a create
    // claims from the pool while it has sandboxes, and the pool refills in the background), the systems taking
    // turns. The pulse's shape, so the pool matches.
    fmt::print(stderr, "dsec-bench: pulse-node: creates/s in a closed loop against the peers\n");
    const NodeInfo before = client.nodes().front();
    result.closed_loop = run_throughput(o, client, peers, pulse_spec(o));
    const NodeInfo after = client.nodes().front();
    result.closed_loop_claims = after.warm_pool_claims - before.warm_pool_claims;
    result.closed_loop_misses = after.warm_pool_misses - before.warm_pool_misses;
  }
  return result;
}

void print_pulse_node(const PulseNodeResult& r) {
  fmt::print("\n== pulse-node: {} creates at once from {} threads on one node (cgroup {}) ==\n", r.n, r.threads,
             r.cgroup);
  for (const auto& run : r.runs) {
    fmt::print(
        "  {:<20} all ready in {:.2f} s ({:.0f} creates/s); per create p50 {:.2f} ms, p99 {:.2f} ms; pool "
        "claims {}, misses {}; {} made, {} answered an exec{}\n",
        run.label, run.pulse_seconds, run.pulse_seconds > 0 ? static_cast<double>(run.made) / run.pulse_seconds : 0,
        run.per_create.empty() ? 0 : run.per_create.percentile(50),
        run.per_create.empty() ? 0 : run.per_create.percentile(99), run.claims, run.misses, run.made, run.working,
        run.error.empty() ? "" : fmt::format(" (first error: {})", run.error));
    if (run.pool) fmt::print("  {:<20} the pool filled in {:.1f} s\n", "", run.fill_seconds);
  }
  if (r.closed_loop) {
    print_throughput(*r.closed_loop);
    fmt::print("  (the pool during the closed loop: {} claims, {} misses)\n", r.closed_loop_claims,
               r.closed_loop_misses);
  }
}

std::string markdown_pulse_node(const PulseNodeResult& r, int cores) {
  std::string out = fmt::format(
      "### Pulse on one node: {} creates at once ({} threads, 0.01 cores and 16 MiB each, "
      "cgroup {})\n\n| agent | all ready | creates/s | per create p50 | p99 | pool claims | "
      "misses | answered an exec |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n",
      r.n, r.threads, r.cgroup);
  for (const auto& run : r.runs)
    out += fmt::format("| {} | {:.2f} s | {:.0f} | {:.2f} ms | {:.2f} ms | {} | {} | {} of {} |\n", run.label,
                       run.pulse_seconds, run.pulse_seconds > 0 ? static_cast<double>(run.made) / run.pulse_seconds : 0,
                       run.per_create.empty() ? 0 : run.per_create.percentile(50),
                       run.per_create.empty() ? 0 : run.per_create.percentile(99), run.claims, run.misses, run.working,
                       r.n);
  if (r.closed_loop) {
    out += "\nThen, on the agent with the pool, in a closed loop against the peers:\n\n";
    out += markdown_throughput(*r.closed_loop, cores);
    out += fmt::format("The pool during the closed loop: {} claims, {} misses.\n", r.closed_loop_claims,
                       r.closed_loop_misses);
  }
  return out;
}

}  // namespace dsec::bench
