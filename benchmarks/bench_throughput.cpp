// dsec-bench throughput: completed creates per second at rising concurrency. Each of C threads loops
// create-then-destroy (dsec) or one whole `crun run` / `bwrap` (peers) for a fixed window; a create counts when it
// completes inside the window. Before the window every thread runs warm-up cycles, and the window opens only when
// all of them are done.
#include <fmt/format.h>

#include <atomic>
#include <exception>
#include <functional>
#include <latch>
#include <mutex>
#include <thread>

#include "bench.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"
#include "peers.hpp"

namespace dsec::bench {
namespace {

struct LoopResult {
  std::size_t completed = 0;
  double seconds = 0;
  Latency latency;  // of the creates that completed inside the window
  Latency rest;     // of what each of those cycles did after its create (dsec: the destroy)
};

// When one cycle's create started and when it completed.
struct CycleTimes {
  Clock::time_point started, created, ended;  // ended: after the destroy (dsec), = created for the peers
};

LoopResult closed_loop(int concurrency, double window_seconds, std::size_t warmup_per_thread,
                       const std::function<CycleTimes()>& cycle) {
  std::latch warmed(concurrency + 1);
  std::latch go(1);
  Clock::time_point window_end;
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex mu;
  LoopResult out;

  auto record_error = [&] {
    std::lock_guard lock(mu);
    if (!error) error = std::current_exception();
    failed = true;
  };
  auto worker = [&] {
    std::size_t completed = 0;
    Latency latency, rest;
    try {
      for (std::size_t i = 0; i < warmup_per_thread && !failed.load(); ++i) cycle();
    } catch (...) {
      record_error();
    }
    warmed.count_down();
    go.wait();
    try {
      while (!failed.load() && Clock::now() < window_end) {
        CycleTimes t = cycle();
        if (t.created <= window_end) {
          ++completed;
          latency.add(ms_between(t.started, t.created));
          rest.add(ms_between(t.created, t.ended));
        }
      }
    } catch (...) {
      record_error();
    }
    std::lock_guard lock(mu);
    out.completed += completed;
    out.latency.merge(latency);
    out.rest.merge(rest);
  };

  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(concurrency));
  for (int i = 0; i < concurrency; ++i) threads.emplace_back(worker);
  warmed.arrive_and_wait();
  auto window_start = Clock::now();
  window_end =
      window_start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(window_seconds));
  go.count_down();
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  out.seconds = window_seconds;
  return out;
}

}  // namespace

ThroughputResult run_throughput(const Options& options, Client& client, Peers& peers,
                                const std::optional<SandboxSpec>& spec_in) {
  ThroughputResult result;
  result.window_seconds = options.duration_seconds;
  result.rounds = options.rounds;
  const SandboxSpec spec = spec_in ? *spec_in : bench_spec(options);
  const double window = options.duration_seconds / static_cast<double>(options.rounds);
  const std::size_t warmup = std::max<std::size_t>(1, std::min<std::size_t>(options.warmup, 3));
  const int agent = agent_pid_for(client);
  CpuMeter cpu({agent});

  auto dsec_cycle = [&] {
    CycleTimes t;
    t.started = Clock::now();
    Sandbox sb = client.create(spec);
    t.created = Clock::now();
    sb.destroy();
    t.ended = Clock::now();
    return t;
  };
  auto peer_cycle = [](auto run) {
    return [run] {
      CycleTimes t;
      t.started = Clock::now();
      run();
      t.created = t.ended = Clock::now();
      return t;
    };
  };
  const auto crun_cycle = peer_cycle([&peers] { peers.crun_run(); });
  const auto bwrap_cycle = peer_cycle([&peers] { peers.bwrap_run(); });

  for (int c : options.concurrency) {
    RatePoint point;
    point.concurrency = c;
    point.crun_measured = peers.has_crun();
    point.bwrap_measured = peers.has_bwrap();
    CpuMeter level_cpu({agent});
    double dsec_seconds = 0, crun_seconds = 0, bwrap_seconds = 0;
    // The systems take turns in short windows, so a change in the machine's load reaches all of them alike.
    for (std::size_t round = 0; round < options.rounds; ++round) {
      LoopResult d = closed_loop(c, window, warmup, dsec_cycle);
      point.dsec_count += d.completed;
      dsec_seconds += d.seconds;
      point.dsec_create.merge(d.latency);
      point.dsec_destroy.merge(d.rest);
      if (point.crun_measured) {
        LoopResult r = closed_loop(c, window, warmup, crun_cycle);
        point.crun_count += r.completed;
        crun_seconds += r.seconds;
      }
      if (point.bwrap_measured) {
        LoopResult r = closed_loop(c, window, warmup, bwrap_cycle);
        point.bwrap_count += r.completed;
        bwrap_seconds += r.seconds;
      }
    }
    point.dsec_rate = static_cast<double>(point.dsec_count) / dsec_seconds;
    if (point.crun_measured) point.crun_rate = static_cast<double>(point.crun_count) / crun_seconds;
    if (point.bwrap_measured) point.bwrap_rate = static_cast<double>(point.bwrap_count) / bwrap_seconds;
    point.cpu = level_cpu.stop();
    fmt::print(stderr, "  throughput: concurrency {:>2}: dsec {:.1f}/s, crun run {:.1f}/s, bwrap {:.1f}/s\n", c,
               point.dsec_rate, point.crun_rate, point.bwrap_rate);
    result.points.push_back(std::move(point));
  }
  result.cpu = cpu.stop();
  return result;
}

}  // namespace dsec::bench
