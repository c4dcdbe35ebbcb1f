// dsec-bench exec: the round trip of `true` in a live sandbox (client -> agent -> the sandbox's init -> fork/exec
// -> exit -> back), next to a plain posix_spawn + wait of the same static binary on the host, from this process.
// The two alternate, so both see the same load.
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
  sb.destroy();
  return result;
}

}  // namespace dsec::bench
