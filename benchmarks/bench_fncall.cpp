// dsec-bench fncall: a trivial Python call ("print(1+1)") served from the fncall backend's warm pools, next to the
// two ways to run the same code without them, in one run: a cold `python3 -c` per call on the host (posix_spawn of
// the interpreter, its output read through a pipe: the peer), and an exec of `python3 -c` in a live container
// sandbox of the same image. First the sequential round trip with the three alternating every iteration, then calls
// per second in closed loops at each concurrency, the three taking turns in short windows so that a change in the
// machine's load reaches all of them alike.
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <cmath>
#include <exception>
#include <functional>
#include <latch>
#include <mutex>
#include <optional>
#include <thread>

#include "bench.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"

extern char** environ;

namespace dsec::bench {
namespace {

constexpr const char* kProgram = "print(1+1)";
constexpr std::string_view kExpected = "2\n";
constexpr const char* kHostPython = "/usr/bin/python3";
constexpr double kFnCallTargetP50Ms = 5;
constexpr double kFnCallTargetRate = 300;

std::string wait_status_text(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("signal {}", WTERMSIG(status));
  return fmt::format("wait status {:#x}", status);
}

// One cold `python3 -c 'print(1+1)'` on the host: spawn, read its stdout to the end, wait. Returns its output.
std::string host_python_run() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw_errno(errno, "pipe2 for the host python3");
  UniqueFd read_end(fds[0]), write_end(fds[1]);
  posix_spawn_file_actions_t actions;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawn_file_actions_adddup2(&actions, write_end.get(), 1);
  ::posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
  char arg0[] = "python3", arg1[] = "-c";
  std::string program = kProgram;
  char* argv[] = {arg0, arg1, program.data(), nullptr};
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, kHostPython, &actions, nullptr, argv, environ);
  ::posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw_errno_fmt(rc, "spawn {}", kHostPython);
  write_end.reset();
  std::string out;
  char buf[256];
  for (;;) {
    ssize_t n = ::read(read_end.get(), buf, sizeof buf);
    if (n > 0) {
      out.append(buf, static_cast<std::size_t>(n));
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) throw_errno_fmt(errno, "wait for {}", kHostPython);
  if (status != 0 || out != kExpected)
    throw Error(Code::kInternal, fmt::format("{} -c '{}' on the host: {}, output '{}'", kHostPython, kProgram,
                                             wait_status_text(status), out));
  return out;
}

std::string first_line_of(const char* command) {
  std::string out;
  if (FILE* f = ::popen(command, "r")) {
    char buf[256];
    if (std::fgets(buf, sizeof buf, f)) out = buf;
    ::pclose(f);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

struct LoopResult {
  std::size_t completed = 0;
  Latency latency;
};

// C threads each run `op` in a loop for `window_seconds` after `warmup` unmeasured runs each; an op counts when it
// completes inside the window.
LoopResult closed_loop(int concurrency, double window_seconds, std::size_t warmup, const std::function<void()>& op) {
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
    LoopResult mine;
    try {
      for (std::size_t i = 0; i < warmup && !failed.load(); ++i) op();
    } catch (...) {
      record_error();
    }
    warmed.count_down();
    go.wait();
    try {
      while (!failed.load() && Clock::now() < window_end) {
        auto t0 = Clock::now();
        op();
        auto t1 = Clock::now();
        if (t1 <= window_end) {
          ++mine.completed;
          mine.latency.add(ms_between(t0, t1));
        }
      }
    } catch (...) {
      record_error();
    }
    std::lock_guard lock(mu);
    out.completed += mine.completed;
    out.latency.merge(mine.latency);
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(concurrency));
  for (int i = 0; i < concurrency; ++i) threads.emplace_back(worker);
  warmed.arrive_and_wait();
  window_end =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(window_seconds));
  go.count_down();
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  return out;
}

std::string ms_text(double v) {
  if (std::isnan(v)) return "n/a";
  if (v < 10) return fmt::format("{:.2f} ms", v);
  if (v < 100) return fmt::format("{:.1f} ms", v);
  return fmt::format("{:.0f} ms", v);
}

std::string cpu_summary(const CpuUse& c, int cores) {
  return fmt::format(
      "{:.1f} s; CPU busy {:.2f} of {} cores: dsec-bench, its children, the agent and its fork servers and sandbox "
      "{:.2f}, kernel threads and interrupts {:.2f}, steal {:.2f}, other processes {:.2f}",
      c.seconds, c.busy_cores, cores, c.ours_cores, c.kernel_cores, c.steal_cores, c.others_cores);
}

double best_fncall_rate(const FnCallBenchResult& r) {
  double best = 0;
  for (const auto& p : r.points) best = std::max(best, p.fncall_rate);
  return best;
}

}  // namespace

FnCallBenchResult run_fncall(const Options& options, Client& client) {
  FnCallBenchResult result;
  result.n = options.n;
  result.warmup = options.warmup;
  result.image = options.fncall_image;
  result.cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  result.window_seconds = options.duration_seconds;
  result.rounds = options.rounds;
  if (::access(kHostPython, X_OK) != 0)
    throw Error(Code::kFailedPrecondition,
                fmt::format("{} is missing: it is the peer (apt-get install python3)", kHostPython));
  result.host_python = first_line_of("/usr/bin/python3 --version 2>&1");

  FnCallRequest call;
  call.language = "python";
  call.code = kProgram;
  call.image = options.fncall_image;
  call.timeout_seconds = 30;
  std::atomic<std::uint64_t> calls_made{0};
  auto fncall_once = [&]() -> FnCallResult {
    FnCallRequest r = call;
    r.request_id = fmt::format("bench-fncall-{}-{}", ::getpid(), calls_made.fetch_add(1));
    FnCallResult res = client.run_code(r);
    if (res.exit_code != 0 || res.stdout_data != kExpected)
      throw Error(Code::kInternal, fmt::format("run_code of '{}' over {}: exit code {} (signal {}{}), stdout '{}', "
                                               "stderr '{}'",
                                               kProgram, options.fncall_image, res.exit_code, res.signal,
                                               res.timed_out ? ", timed out" : "", res.stdout_data, res.stderr_data));
    return res;
  };

  fmt::print(stderr, "dsec-bench: fncall: a container sandbox of {} for the exec comparison\n", options.fncall_image);
  SandboxSpec spec = bench_spec(options);
  spec.image = options.fncall_image;
  spec.resources.cpu = std::max(1, result.cores);
  spec.resources.memory_bytes = 1ull << 30;
  spec.resources.pids = 1024;
  std::optional<Sandbox> made;
  try {
    made.emplace(client.create(spec));
  } catch (const Error& e) {
    if (e.code() != Code::kNotFound) throw;
    throw Error(Code::kNotFound, fmt::format("{} (build it: dsec image build {} --from debootstrap:bookworm --include "
                                             "python3, or give --fncall-image)",
                                             e.what(), options.fncall_image));
  }
  Sandbox& sb = *made;
  ExecRequest exec;
  exec.argv = {"python3", "-c", kProgram};
  exec.timeout_seconds = 30;
  auto exec_once = [&] {
    ExecResult r = sb.exec(exec);
    if (r.exit_code != 0 || r.stdout_data != kExpected)
      throw Error(Code::kInternal, fmt::format("exec of python3 -c '{}' in sandbox {}: exit code {} (signal {}), "
                                               "stdout '{}', stderr '{}'",
                                               kProgram, sb.id(), r.exit_code, r.signal, r.stdout_data, r.stderr_data));
  };

  const int agent = agent_pid_for(client);
  CpuMeter cpu({agent}, /*descendants=*/true);
  fmt::print(stderr, "dsec-bench: fncall: {} sequential rounds (after {} warm-up)\n", options.n, options.warmup);
  for (std::size_t i = 0; i < options.warmup + options.n; ++i) {
    auto t0 = Clock::now();
    FnCallResult r = fncall_once();
    auto t1 = Clock::now();
    host_python_run();
    auto t2 = Clock::now();
    exec_once();
    auto t3 = Clock::now();
    if (i < options.warmup) continue;
    result.fncall.add(ms_between(t0, t1));
    result.fncall_agent.add(r.duration_seconds * 1000);
    result.host.add(ms_between(t1, t2));
    result.exec.add(ms_between(t2, t3));
    if (result.node.empty()) result.node = r.node;
  }
  result.sequential_cpu = cpu.stop();

  const double window = options.duration_seconds / static_cast<double>(options.rounds);
  const std::size_t warmup = std::max<std::size_t>(1, std::min<std::size_t>(options.warmup, 3));
  for (int c : options.concurrency) {
    FnCallRatePoint point;
    point.concurrency = c;
    CpuMeter level_cpu({agent}, /*descendants=*/true);
    std::size_t host_count = 0, exec_count = 0;
    for (std::size_t round = 0; round < options.rounds; ++round) {
      LoopResult f = closed_loop(c, window, warmup, [&] { fncall_once(); });
      point.fncall_count += f.completed;
      point.fncall.merge(f.latency);
      LoopResult h = closed_loop(c, window, warmup, [] { host_python_run(); });
      host_count += h.completed;
      point.host.merge(h.latency);
      LoopResult e = closed_loop(c, window, warmup, exec_once);
      exec_count += e.completed;
      point.exec.merge(e.latency);
    }
    const double measured = window * static_cast<double>(options.rounds);
    point.fncall_rate = static_cast<double>(point.fncall_count) / measured;
    point.host_rate = static_cast<double>(host_count) / measured;
    point.exec_rate = static_cast<double>(exec_count) / measured;
    point.host_count = host_count;
    point.exec_count = exec_count;
    point.cpu = level_cpu.stop();
    fmt::print(stderr, "  fncall: concurrency {:>2}: fncall {:.0f}/s, host python3 -c {:.1f}/s, exec {:.1f}/s\n", c,
               point.fncall_rate, point.host_rate, point.exec_rate);
    result.points.push_back(std::move(point));
  }
  result.cpu = cpu.stop();
  sb.destroy();
  return result;
}

void print_fncall(const FnCallBenchResult& r) {
  fmt::print("\n== fncall: python3 `{}` over {}: n={} (after {} warm-up), the three alternating ==\n", kProgram,
             r.image, r.n, r.warmup);
  fmt::print("  {:<52} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "", "p50", "p90", "p99", "max", "mean");
  auto row = [](const std::string& name, const Latency& l) {
    fmt::print("  {:<52} {:>10} {:>10} {:>10} {:>10} {:>10}\n", name, ms_text(l.percentile(50)),
               ms_text(l.percentile(90)), ms_text(l.percentile(99)), ms_text(l.max()), ms_text(l.mean()));
  };
  row("dsec run_code (client round trip)", r.fncall);
  row("  of which the run in the pool (FnCallResult.duration)", r.fncall_agent);
  row("host: cold python3 -c per call (spawn, read, wait)", r.host);
  row("container sandbox: exec python3 -c", r.exec);
  fmt::print("  host interpreter: {} ({}); node {}\n", kHostPython, r.host_python, r.node);
  fmt::print("\n  calls/s (closed loop, {:.1f} s per system and level in {} turns)\n", r.window_seconds, r.rounds);
  fmt::print("  {:>11} {:>12} {:>20} {:>14} {:>18} {:>14} {:>16}\n", "concurrency", "fncall/s", "fncall p50 / p99",
             "host cold/s", "host p50 / p99", "exec/s", "ours/others CPU");
  for (const auto& p : r.points)
    fmt::print("  {:>11} {:>12.0f} {:>20} {:>14.1f} {:>18} {:>14.1f} {:>16}\n", p.concurrency, p.fncall_rate,
               ms_text(p.fncall.percentile(50)) + " / " + ms_text(p.fncall.percentile(99)), p.host_rate,
               ms_text(p.host.percentile(50)) + " / " + ms_text(p.host.percentile(99)), p.exec_rate,
               fmt::format("{:.2f} / {:.2f}", p.cpu.ours_cores, p.cpu.others_cores));
  const double p50 = r.fncall.percentile(50);
  fmt::print("  targets: p50 <= {:.0f} ms: {} ({}); >= {:.0f} calls/s on {} cores: {} (best {:.0f}/s)\n",
             kFnCallTargetP50Ms, p50 <= kFnCallTargetP50Ms ? "met" : "NOT met", ms_text(p50), kFnCallTargetRate,
             r.cores, best_fncall_rate(r) >= kFnCallTargetRate ? "met" : "NOT met", best_fncall_rate(r));
  fmt::print("  load: {}\n", cpu_summary(r.cpu, r.cores));
}

std::string markdown_fncall(const FnCallBenchResult& r) {
  std::string md;
  md += fmt::format("### Function calls: python `{}` (n = {}, {} warm-up, the three alternating every iteration)\n\n",
                    kProgram, r.n, r.warmup);
  md += "| system | p50 | p90 | p99 | max |\n| --- | --- | --- | --- | --- |\n";
  auto row = [&](const std::string& name, const Latency& l) {
    md += fmt::format("| {} | {} | {} | {} | {} |\n", name, ms_text(l.percentile(50)), ms_text(l.percentile(90)),
                      ms_text(l.percentile(99)), ms_text(l.max()));
  };
  row(fmt::format("dsec `Client::run_code` over `{}` (warm pool; client round trip)", r.image), r.fncall);
  row("of which the call's run in the pool (`FnCallResult::duration_seconds`)", r.fncall_agent);
  row(fmt::format("host: cold `python3 -c` per call (posix_spawn, read stdout, wait; {})", r.host_python), r.host);
  row(fmt::format("container sandbox of `{}`: `exec python3 -c`", r.image), r.exec);
  md += fmt::format("\nLoad during the sequential part: {}.\n\n", cpu_summary(r.sequential_cpu, r.cores));
  md += fmt::format(
      "Calls per second, closed loop (each of C threads calls again as soon as its call returns; {:.1f} s per system "
      "and level, in {} turns with the systems alternating):\n\n",
      r.window_seconds, r.rounds);
  md +=
      "| concurrency | dsec fncall/s | fncall p50 / p99 | cold `python3 -c`/s | its p50 / p99 | container exec/s | "
      "exec p50 / p99 | CPU (cores): this run's processes / other processes |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- |\n";
  for (const auto& p : r.points)
    md += fmt::format("| {} | {:.0f} | {} / {} | {:.1f} | {} / {} | {:.1f} | {} / {} | {:.2f} / {:.2f} |\n",
                      p.concurrency, p.fncall_rate, ms_text(p.fncall.percentile(50)), ms_text(p.fncall.percentile(99)),
                      p.host_rate, ms_text(p.host.percentile(50)), ms_text(p.host.percentile(99)), p.exec_rate,
                      ms_text(p.exec.percentile(50)), ms_text(p.exec.percentile(99)), p.cpu.ours_cores,
                      p.cpu.others_cores);
  const double p50 = r.fncall.percentile(50);
  md +=
      fmt::format("\nTargets: p50 <= {:.0f} ms: **{}** ({}); >= {:.0f} calls/s on {} cores: **{}** (best {:.0f}/s).\n",
                  kFnCallTargetP50Ms, p50 <= kFnCallTargetP50Ms ? "met" : "not met", ms_text(p50), kFnCallTargetRate,
                  r.cores, best_fncall_rate(r) >= kFnCallTargetRate ? "met" : "not met", best_fncall_rate(r));
  md += fmt::format("\nLoad during this benchmark: {}.\n", cpu_summary(r.cpu, r.cores));
  return md;
}

}  // namespace dsec::bench
