// dsec-bench sleep: sandboxes holding 64, 256 and 1024 MiB of anonymous memory (memhold: pseudo-random pages and a
// checksum) sleep in place and wake. For each: the memory charged to the sandbox before and after the sleep and how
// much of it went to swap, the sleep's and the wake's time, the latency from calling wake() to the first exec's
// result (target <= 200 ms: pages come back lazily, nothing is faulted in ahead), and an exec that has memhold read
// and rewrite all of its memory, next to the same exec while everything was resident: the price of faulting it back.
//
// The embedded agent this starts sets up its own swap file under the home (dsecd --swap-file, --swap-size) and
// turns it off at shutdown; the bench then removes the file. With --endpoint, the node's own swap is used as it is.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "agent/node/swap.hpp"
#include "bench.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"

namespace dsec::bench {
namespace {

namespace fs = std::filesystem;
constexpr double kMiB = 1024.0 * 1024.0;
constexpr auto kAsleepFor = std::chrono::seconds(1);
constexpr const char* kHoldDir = "/tmp/h";

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

ExecResult run_shell(const Sandbox& sb, const std::string& command, double timeout_seconds = 600) {
  ExecRequest request;
  request.shell = command;
  request.timeout_seconds = timeout_seconds;
  ExecResult r = sb.exec(request);
  if (r.exit_code != 0 || r.timed_out)
    throw Error(Code::kInternal, fmt::format("`{}` in sandbox {} ended with exit code {}{}: {}", command, sb.id(),
                                             r.exit_code, r.timed_out ? " (timed out)" : "", r.stderr_data));
  return r;
}

std::string wait_for_file(const Sandbox& sb, const std::string& path, std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    try {
      return sb.read_file(path);
    } catch (const Error& e) {
      if (e.code() != Code::kNotFound || Clock::now() > deadline) throw;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

struct Touch {
  double exec_ms = 0, self_ms = 0;
  bool intact = false;
};

// One exec: memhold reads and rewrites all of its memory (SIGUSR1) and the exec waits for its verdict.
Touch touch_all(const Sandbox& sb, int pid, const std::string& sum) {
  auto t0 = Clock::now();
  ExecResult r = run_shell(sb, fmt::format("rm -f {0}/check; kill -USR1 {1}; while [ ! -s {0}/check ]; do usleep 1000; "
                                           "done; cat {0}/check",
                                           kHoldDir, pid));
  Touch t;
  t.exec_ms = ms_since(t0);
  // "ok <sum> <ms>"
  std::istringstream in(r.stdout_data);
  std::string verdict, got;
  in >> verdict >> got >> t.self_ms;
  t.intact = verdict == "ok" && got == sum;
  return t;
}

double charged_bytes(const std::string& sandbox_id) {
  SandboxProcesses found = find_sandbox_processes({sandbox_id});
  auto it = found.memory_cgroup.find(sandbox_id);
  if (it == found.memory_cgroup.end()) return std::nan("");
  return static_cast<double>(cgroup_memory_bytes(it->second));
}

SleepSize run_size(const Options& o, Client& client, const std::string& memhold, std::size_t mib) {
  SleepSize sz;
  sz.mib = mib;
  sz.memory_limit = (static_cast<std::uint64_t>(mib) + 128) << 20;
  SandboxSpec spec = bench_spec(o);
  spec.resources.cpu = 1;
  spec.resources.memory_bytes = sz.memory_limit;
  spec.labels["dsec-bench-sleep"] = std::to_string(mib);
  Sandbox sb = client.create(spec);
  fmt::print(stderr, "dsec-bench sleep: {} MiB in sandbox {}\n", mib, sb.id());

  sb.write_file("/usr/local/bin/memhold", memhold, 0755);
  run_shell(sb, fmt::format("mkdir -p {0} && memhold {1} {0} >/dev/null 2>&1 &", kHoldDir, mib));
  std::istringstream ready(wait_for_file(sb, fmt::format("{}/ready", kHoldDir), std::chrono::seconds(600)));
  std::size_t ready_mib = 0;
  ready >> ready_mib >> sz.fill_ms;
  const std::string sum = trim(sb.read_file(fmt::format("{}/sum", kHoldDir)));
  const int pid = std::stoi(sb.read_file(fmt::format("{}/pid", kHoldDir)));

  ExecRequest true_request;
  true_request.argv = {"true"};
  true_request.timeout_seconds = 60;
  Latency awake;
  for (int i = 0; i < 10; ++i) {
    auto t0 = Clock::now();
    sb.exec(true_request);
    awake.add(ms_since(t0));
  }
  sz.awake_exec_ms = awake.percentile(50);
  Touch floor = touch_all(sb, pid, sum);
  if (!floor.intact) throw Error(Code::kInternal, fmt::format("memhold {} MiB: checksum wrong before any sleep", mib));
  sz.awake_touch_ms = floor.exec_ms;
  sz.awake_touch_self_ms = floor.self_ms;

  for (std::size_t round = 0; round < o.sleep_rounds; ++round) {
    SleepRound r;
    auto t0 = Clock::now();
    SleepResult s = sb.sleep();
    r.sleep_call_ms = ms_since(t0);
    r.before_bytes = static_cast<double>(s.memory_before_bytes);
    r.after_bytes = static_cast<double>(s.memory_after_bytes);
    r.swap_bytes = static_cast<double>(s.swap_bytes);
    r.sleep_ms = s.seconds * 1000;
    std::this_thread::sleep_for(kAsleepFor);

    auto t1 = Clock::now();
    SleepResult w = sb.wake();
    r.wake_call_ms = ms_since(t1);
    r.wake_ms = w.seconds * 1000;
    auto t2 = Clock::now();
    ExecResult first = sb.exec(true_request);
    r.first_exec_ms = ms_since(t2);
    r.wake_to_exec_ms = ms_since(t1);
    if (first.exit_code != 0)
      throw Error(Code::kInternal, fmt::format("the first exec after the wake: exit {}", first.exit_code));

    Touch t = touch_all(sb, pid, sum);
    r.touch_ms = t.exec_ms;
    r.touch_self_ms = t.self_ms;
    r.intact = t.intact;
    r.after_touch_bytes = charged_bytes(sb.id());
    fmt::print(stderr,
               "  round {}: {:.1f} -> {:.1f} MiB charged ({:.1f} MiB in swap), sleep {:.0f} ms, wake {:.1f} ms, "
               "wake to first exec {:.1f} ms, touch all {:.0f} ms, {}\n",
               round + 1, r.before_bytes / kMiB, r.after_bytes / kMiB, r.swap_bytes / kMiB, r.sleep_ms, r.wake_ms,
               r.wake_to_exec_ms, r.touch_ms, r.intact ? "intact" : "CHECKSUM WRONG");
    sz.rounds.push_back(r);
  }
  sb.destroy();
  return sz;
}

double released_ratio(const SleepRound& r) {
  return r.before_bytes > 0 ? (r.before_bytes - r.after_bytes) / r.before_bytes : 0;
}

std::string mib_text(double bytes) {
  if (std::isnan(bytes)) return "n/a";
  double m = bytes / kMiB;
  return m < 10 ? fmt::format("{:.2f} MiB", m) : fmt::format("{:.0f} MiB", m);
}

}  // namespace

SleepBenchResult run_sleep(const Options& o, const std::string& home) {
  SleepBenchResult result;
  result.cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  const fs::path memhold_path = beside_self("dsec-memhold");
  std::ifstream in(memhold_path, std::ios::binary);
  if (!in)
    throw Error(Code::kFailedPrecondition, fmt::format("{} is missing: build the dsec-memhold target (it is uploaded "
                                                       "into the sandboxes)",
                                                       memhold_path.string()));
  const std::string memhold((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::size_t max_mib = *std::max_element(o.sleep_sizes_mib.begin(), o.sleep_sizes_mib.end());

  SwapDir swap_dir;  // destroyed after the client, so after the agent stopped
  swap_dir.notes = &result.notes;
  ClientOptions copts;
  if (o.endpoints.empty()) {
    const std::uint64_t swap_bytes =
        o.sleep_swap_bytes ? o.sleep_swap_bytes : (static_cast<std::uint64_t>(max_mib) + 512) << 20;
    swap_dir.dir = fs::path(home) / fmt::format("bench-swap-{}", ::getpid());
    swap_dir.file = swap_dir.dir / "swapfile";
    fs::create_directories(swap_dir.dir);
    copts.home = home;
    copts.agent_binary = o.agent_binary;
    copts.agent_args = {"--backends",           "container",   "--swap-file",
                        swap_dir.file.string(), "--swap-size", std::to_string(swap_bytes)};
    copts.agent_args.insert(copts.agent_args.end(), o.agent_args.begin(), o.agent_args.end());
    result.swap = fmt::format(
        "a {} MiB swap file on {} ({}), made by the embedded agent (dsecd --swap-file) and "
        "removed after",
        swap_bytes >> 20, agent::swap_filesystem(swap_dir.dir).name, swap_dir.file.string());
  } else {
    copts.endpoints = o.endpoints;
  }
  copts.call_deadline = std::chrono::minutes(10);
  copts.request_timeout = std::chrono::minutes(5);  // a sleep of 1 GiB writes it all to swap first
  fmt::print(stderr, "dsec-bench: starting the client{}\n",
             o.endpoints.empty() ? " and an embedded agent with swap" : "");
  {
    Client client(copts);
    NodeInfo node = client.nodes().front();
    result.node_swap_bytes = node.swap_bytes;
    result.cgroup = node.cgroup_version;
    result.agent = o.endpoints.empty() ? fmt::format("embedded dsecd {} (home {})", node.version, home)
                                       : fmt::format("dsecd {} at {}", node.version, client.endpoint());
    if (!o.endpoints.empty())
      result.swap = node.swap_bytes ? fmt::format("the node's own: {} MiB", node.swap_bytes >> 20)
                                    : "none on the node: anonymous memory cannot be released";
    CpuMeter cpu({agent_pid_for(client)});
    for (std::size_t mib : o.sleep_sizes_mib) result.sizes.push_back(run_size(o, client, memhold, mib));
    result.cpu = cpu.stop();
    client.close();  // the agent stops and turns its swap off
  }
  for (const auto& sz : result.sizes)
    for (const auto& r : sz.rounds) {
      if (!r.intact) result.notes.push_back(fmt::format("{} MiB: memhold's checksum came back wrong", sz.mib));
      if (std::isnan(r.after_touch_bytes))
        result.notes.push_back("the sandboxes' cgroups are not on this host: charged memory after the touch is n/a");
    }
  std::sort(result.notes.begin(), result.notes.end());
  result.notes.erase(std::unique(result.notes.begin(), result.notes.end()), result.notes.end());
  return result;
}

void print_sleep(const SleepBenchResult& r) {
  fmt::print("\n== sleep: sandboxes holding anonymous memory sleep in place and wake ==\n");
  fmt::print("  swap: {}\n  agent: {}, cgroup {}\n", r.swap, r.agent, r.cgroup);
  fmt::print("  {:>5} {:>3}  {:>24} {:>9} {:>9} {:>9} {:>19} {:>10} {:>22} {:>8}\n", "MiB", "#",
             "charged before -> after", "released", "in swap", "sleep", "wake (agent/call)", "wake->exec",
             "touch all (awake)", "intact");
  for (const auto& sz : r.sizes) {
    for (std::size_t i = 0; i < sz.rounds.size(); ++i) {
      const SleepRound& x = sz.rounds[i];
      fmt::print(
          "  {:>5} {:>3}  {:>24} {:>8.1f}% {:>9} {:>7.2f} s {:>19} {:>7.1f} ms {:>10.0f} ms ({:>5.0f} ms) "
          "{:>8}\n",
          sz.mib, i + 1, mib_text(x.before_bytes) + " -> " + mib_text(x.after_bytes), released_ratio(x) * 100,
          mib_text(x.swap_bytes), x.sleep_ms / 1000, fmt::format("{:.1f} / {:.1f} ms", x.wake_ms, x.wake_call_ms),
          x.wake_to_exec_ms, x.touch_ms, sz.awake_touch_ms, x.intact ? "yes" : "NO");
    }
    fmt::print(
        "        memhold filled {} MiB in {:.0f} ms; exec `true` awake {:.2f} ms (p50 of 10); first exec after "
        "the wake {}\n",
        sz.mib, sz.fill_ms, sz.awake_exec_ms, [&] {
          std::string s;
          for (const auto& x : sz.rounds) s += fmt::format("{}{:.2f} ms", s.empty() ? "" : ", ", x.first_exec_ms);
          return s;
        }());
  }
  print_cpu(r.cpu, r.cores, "  load: ");
  for (const auto& n : r.notes) fmt::print("  note: {}\n", n);
}

std::string markdown_sleep(const SleepBenchResult& r) {
  std::string md = "### Sleep and wake of sandboxes holding anonymous memory\n\n";
  md += fmt::format(
      "Swap: {}. Agent: {}, cgroup {}. Each sandbox runs memhold (pseudo-random anonymous pages and "
      "their checksum); it sleeps for {} s per round.\n\n",
      r.swap, r.agent, r.cgroup, std::chrono::duration<double>(kAsleepFor).count());
  md +=
      "| held | round | charged before → after sleep | released | in swap | sleep | wake: agent / call | wake → "
      "first exec result | first exec | exec touching all memory (same, awake) | intact |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  double worst_release = 1, worst_wake_exec = 0;
  for (const auto& sz : r.sizes)
    for (std::size_t i = 0; i < sz.rounds.size(); ++i) {
      const SleepRound& x = sz.rounds[i];
      worst_release = std::min(worst_release, released_ratio(x));
      worst_wake_exec = std::max(worst_wake_exec, x.wake_to_exec_ms);
      md += fmt::format(
          "| {} MiB | {} | {} → {} | {:.1f}% | {} | {:.2f} s | {:.1f} / {:.1f} ms | {:.1f} ms | {:.1f} ms "
          "| {:.0f} ms ({:.0f} ms) | {} |\n",
          sz.mib, i + 1, mib_text(x.before_bytes), mib_text(x.after_bytes), released_ratio(x) * 100,
          mib_text(x.swap_bytes), x.sleep_ms / 1000, x.wake_ms, x.wake_call_ms, x.wake_to_exec_ms, x.first_exec_ms,
          x.touch_ms, sz.awake_touch_ms, x.intact ? "yes" : "**no**");
    }
  md += fmt::format(
      "\n| target | measured (worst of all rounds) | verdict |\n| --- | --- | --- |\n"
      "| sleep releases >= 90% of the memory charged | {:.1f}% | {} |\n"
      "| wake to first exec <= 200 ms | {:.1f} ms | {} |\n",
      worst_release * 100, worst_release >= 0.9 ? "**met**" : "**not met**", worst_wake_exec,
      worst_wake_exec <= 200 ? "**met**" : "**not met**");
  md += fmt::format("\nLoad: {}.\n", cpu_text(r.cpu, r.cores));
  for (const auto& n : r.notes) md += fmt::format("- {}\n", n);
  return md;
}

}  // namespace dsec::bench
