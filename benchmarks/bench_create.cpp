// dsec-bench create: sequential create-to-ready latency of a container sandbox, next to the whole lifecycle of
// `crun run` and `bwrap` of the same root. The systems take turns within every iteration, so a change in the
// machine's load during the run reaches all of them alike.
#include <fmt/format.h>

#include "bench.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"
#include "peers.hpp"

namespace dsec::bench {

SandboxSpec bench_spec(const Options& options) {
  SandboxSpec spec;
  spec.image = options.image;
  spec.kind = "container";
  spec.resources.cpu = 0.5;
  spec.resources.memory_bytes = 128ull << 20;
  spec.ttl = std::chrono::seconds(600);
  spec.labels = {{"dsec-bench", "1"}};
  return spec;
}

namespace {

void check_true(const ExecResult& r, const char* what) {
  if (r.exit_code != 0 || r.timed_out)
    throw Error(Code::kInternal,
                fmt::format("{}: `true` in the sandbox ended with exit code {} (signal {}){}: {}", what, r.exit_code,
                            r.signal, r.timed_out ? ", timed out" : "", r.stderr_data));
}

}  // namespace

CreateResult run_create(const Options& options, Client& client, Peers& peers) {
  CreateResult result;
  result.n = options.n;
  result.warmup = options.warmup;
  const SandboxSpec spec = bench_spec(options);
  SandboxSpec null_spec = spec;
  null_spec.kind = "null";
  ExecRequest true_request;
  true_request.argv = {"true"};
  true_request.timeout_seconds = 30;

  CpuMeter cpu({agent_pid_for(client)});
  const std::size_t total = options.warmup + options.n;
  for (std::size_t i = 0; i < total; ++i) {
    const bool keep = i >= options.warmup;

    // dsec: create returns once the sandbox's init runs in its namespaces, cgroup and root, ready for exec.
    auto t0 = Clock::now();
    Sandbox sb = client.create(spec);
    double ready = ms_since(t0);
    auto t1 = Clock::now();
    sb.destroy();
    double destroy = ms_since(t1);

    // dsec, whole lifecycle: the same work `crun run true` does (make, run `true`, tear down).
    auto t2 = Clock::now();
    {
      Sandbox life = client.create(spec);
      check_true(life.exec(true_request), "create+exec+destroy");
      life.destroy();
    }
    double lifecycle = ms_since(t2);

    double null_create = 0;
    if (options.null_backend) {
      auto t = Clock::now();
      Sandbox nothing = client.create(null_spec);
      null_create = ms_since(t);
      nothing.destroy();
    }

    double crun = 0, bwrap = 0;
    if (peers.has_crun()) {
      auto t = Clock::now();
      peers.crun_run();
      crun = ms_since(t);
    }
    if (peers.has_bwrap()) {
      auto t = Clock::now();
      peers.bwrap_run();
      bwrap = ms_since(t);
    }
    if (keep) {
      result.dsec_ready.add(ready);
      result.dsec_destroy.add(destroy);
      result.dsec_lifecycle.add(lifecycle);
      if (options.null_backend) result.dsec_null.add(null_create);
      if (peers.has_crun()) result.crun.add(crun);
      if (peers.has_bwrap()) result.bwrap.add(bwrap);
    }
    if ((i + 1) % 50 == 0 || i + 1 == total) fmt::print(stderr, "  create: {}/{} iterations\n", i + 1, total);
  }
  result.cpu = cpu.stop();
  return result;
}

}  // namespace dsec::bench
