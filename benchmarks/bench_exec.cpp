// dsec-bench exec: the round trip of `true` in a live sandbox (client -> agent -> the sandbox's init -> fork/exec
// -> exit -> back), next to a plain posix_spawn + wait of the same static binary on the host, from this process.
// The two alternate, so both see the same load.
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "bench.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"
#include "peers.hpp"

namespace dsec::bench {

ExecBenchResult run_exec(const Options& options, Client& client, Peers& peers) {
  ExecBenchResult result;
  result.n = options.n;
  result.warmup = options.warmup;
  result.host_binary = peers.host_binary();

  Sandbox sb = client.create(bench_spec(options));
  ExecRequest request;
  request.argv = {"true"};
  request.timeout_seconds = 30;

  CpuMeter cpu({agent_pid_for(client)});
  const std::size_t total = options.warmup + options.n;
  for (std::size_t i = 0; i < total; ++i) {
    auto t0 = Clock::now();
    ExecResult r = sb.exec(request);
    double dsec = ms_since(t0);
    if (r.exit_code != 0 || r.timed_out)
      throw Error(Code::kInternal, fmt::format("exec of `true` in sandbox {} ended with exit code {} (signal {}): {}",
                                               sb.id(), r.exit_code, r.signal, r.stderr_data));
    auto t1 = Clock::now();
    peers.host_spawn();
    double host = ms_since(t1);
    if (i >= options.warmup) {
      result.dsec.add(dsec);
      result.dsec_agent_side.add(r.duration_seconds * 1000);
      result.host.add(host);
    }
  }
  result.cpu = cpu.stop();

  // Think time: an agent loop leaves seconds between steps, and what the kernel does for the first exec after a
  // pause can differ from back to back. Fewer samples for the long gap, so that the run stays short.
  for (double gap_ms : {50.0, 1000.0}) {
    ExecBenchResult::AfterGap g;
    g.gap_ms = gap_ms;
    const std::size_t n = gap_ms >= 1000 ? std::max<std::size_t>(10, options.n / 10) : options.n;
    for (std::size_t i = 0; i < n; ++i) {
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(gap_ms));
      auto t0 = Clock::now();
      ExecResult r = sb.exec(request);
      g.dsec.add(ms_since(t0));
      g.dsec_agent_side.add(r.duration_seconds * 1000);
      std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(gap_ms));
      auto t1 = Clock::now();
      peers.host_spawn();
      g.host.add(ms_since(t1));
    }
    result.after_gaps.push_back(std::move(g));
  }
  sb.destroy();
  return result;
}

}  // namespace dsec::bench
