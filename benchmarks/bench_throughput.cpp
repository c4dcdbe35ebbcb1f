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
};

// When one cycle's create started and when it completed.
struct CycleTimes {
  Clock::time_point started, created;
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
    Latency latency;
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
        }
      }
    } catch (...) {
      record_error();
    }
    std::lock_guard lock(mu);
    out.completed += completed;
    out.latency.merge(latency);
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

ThroughputResult run_throughput(const Options& options, Client& client, Peers& peers) {
  ThroughputResult result;
  result.window_seconds = options.duration_seconds;
  const SandboxSpec spec = bench_spec(options);
  const std::size_t warmup = std::max<std::size_t>(1, std::min<std::size_t>(options.warmup, 3));
  CpuMeter cpu({agent_pid_for(client)});

  for (int c : options.concurrency) {
    RatePoint point;
    point.concurrency = c;

    LoopResult d = closed_loop(c, options.duration_seconds, warmup, [&] {
      CycleTimes t;
      t.started = Clock::now();
      Sandbox sb = client.create(spec);
      t.created = Clock::now();
      sb.destroy();
      return t;
    });
    point.dsec_count = d.completed;
    point.dsec_rate = static_cast<double>(d.completed) / d.seconds;
    point.dsec_create = std::move(d.latency);
    fmt::print(stderr, "  throughput: concurrency {:>2}: dsec {:.1f} creates/s\n", c, point.dsec_rate);

    if (peers.has_crun()) {
      LoopResult r = closed_loop(c, options.duration_seconds, warmup, [&] {
        CycleTimes t;
        t.started = Clock::now();
        peers.crun_run();
        t.created = Clock::now();
        return t;
      });
      point.crun_measured = true;
      point.crun_count = r.completed;
      point.crun_rate = static_cast<double>(r.completed) / r.seconds;
      fmt::print(stderr, "  throughput: concurrency {:>2}: crun run {:.1f}/s\n", c, point.crun_rate);
    }
    if (peers.has_bwrap()) {
      LoopResult r = closed_loop(c, options.duration_seconds, warmup, [&] {
        CycleTimes t;
        t.started = Clock::now();
        peers.bwrap_run();
        t.created = Clock::now();
        return t;
      });
      point.bwrap_measured = true;
      point.bwrap_count = r.completed;
      point.bwrap_rate = static_cast<double>(r.completed) / r.seconds;
      fmt::print(stderr, "  throughput: concurrency {:>2}: bwrap {:.1f}/s\n", c, point.bwrap_rate);
    }
    result.points.push_back(std::move(point));
  }
  result.cpu = cpu.stop();
  return result;
}

}  // namespace dsec::bench
