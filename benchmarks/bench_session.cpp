// dsec-bench session: a shell session's run of `true` next to an exec of `true` in the same sandbox (alternating,
// back to back and after 1 s of think time), then a 40-step SWE-style episode (look around a small repository,
// edit files, run its tests) through one session and through execs that each set up the directory and
// environment the session keeps, alternating episode by episode.
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "dsec/session.hpp"

namespace dsec::bench {
namespace {

void check(const ExecResult& r, std::string_view what, const std::string& command) {
  if (r.exit_code != 0 || r.timed_out)
    throw Error(Code::kInternal, fmt::format("{} `{}` ended with exit code {} (signal {}): {}", what, command,
                                             r.exit_code, r.signal, r.stderr_data));
}

// The episode's steps, as an agent would type them into a shell once it is in the repository.
std::vector<std::string> episode_steps() {
  std::vector<std::string> steps = {"ls", "cat README", "ls src tests", "grep -rn 'add' src"};
  for (int i = 0; i < 6; ++i) {
    steps.push_back(fmt::format("cat src/mod{}.sh", i));
    steps.push_back(fmt::format("grep -n 'echo' src/mod{}.sh | head -3", i));
    steps.push_back(fmt::format("sed -i 's/VALUE={}/VALUE={}/' src/mod{}.sh", i, i + 1, i));
    steps.push_back("sh tests/run.sh");
    steps.push_back("echo \"step $STEP\"; STEP=$((STEP + 1))");
    steps.push_back("wc -l src/*.sh | tail -1");
  }
  return steps;  // 40
}

}  // namespace

void run_session(const Options& options, Client& client) {
  Sandbox sb = client.create(bench_spec(options));
  Session sess = sb.shell();

  ExecRequest exec_true;
  exec_true.argv = {"true"};
  exec_true.timeout_seconds = 30;
  Latency run_lat, exec_lat, run_agent, exec_agent;
  for (std::size_t i = 0; i < options.warmup + options.n; ++i) {
    auto t0 = Clock::now();
    ExecResult e = sb.exec(exec_true);
    double exec_ms = ms_since(t0);
    check(e, "exec", "true");
    auto t1 = Clock::now();
    ExecResult r = sess.run("true", 30);
    double run_ms = ms_since(t1);
    check(r, "session run", "true");
    if (i < options.warmup) continue;
    exec_lat.add(exec_ms);
    run_lat.add(run_ms);
    exec_agent.add(e.duration_seconds * 1000);
    run_agent.add(r.duration_seconds * 1000);
  }
  Latency run_gap, exec_gap;
  const std::size_t gaps = std::max<std::size_t>(10, options.n / 10);
  for (std::size_t i = 0; i < gaps; ++i) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    auto t0 = Clock::now();
    check(sb.exec(exec_true), "exec", "true");
    exec_gap.add(ms_since(t0));
    std::this_thread::sleep_for(std::chrono::seconds(1));
    auto t1 = Clock::now();
    check(sess.run("true", 30), "session run", "true");
    run_gap.add(ms_since(t1));
  }

  // The repository: six small modules and a test script that sources them all.
  std::string setup = "mkdir -p /work/repo/src /work/repo/tests && cd /work/repo && echo 'a small project' > README";
  for (int i = 0; i < 6; ++i)
    setup += fmt::format(" && printf 'VALUE={}\\nadd() {{ echo $(($1 + $2)); }}\\necho module {}\\n' > src/mod{}.sh", i,
                         i, i);
  setup +=
      " && printf 'for f in src/*.sh; do . ./$f >/dev/null; done; [ $(add 2 3) = 5 ] && echo ok\\n' > tests/run.sh";
  check(sb.exec(setup, 30), "exec", "setup");

  const std::vector<std::string> steps = episode_steps();
  const std::size_t episodes = std::max<std::size_t>(3, std::min<std::size_t>(10, options.n / 20));
  Latency ep_session, ep_exec, step_session, step_exec;
  for (std::size_t e = 0; e < episodes; ++e) {
    // Through a session: one `cd` and one `export`, then the steps as typed.
    Session ep = sb.shell();
    auto t0 = Clock::now();
    check(ep.run("cd /work/repo && export STEP=0", 30), "session run", "cd");
    for (const auto& step : steps) {
      auto s0 = Clock::now();
      check(ep.run(step, 30), "session run", step);
      step_session.add(ms_since(s0));
    }
    ep_session.add(ms_since(t0));
    ep.close();
    // Through execs: each step carries what the session kept (the directory; the counter in a file).
    auto t1 = Clock::now();
    check(sb.exec("echo 0 > /tmp/step", 30), "exec", "counter");
    for (const auto& step : steps) {
      std::string command = "cd /work/repo && STEP=$(cat /tmp/step) && { " + step + "; } && echo $STEP > /tmp/step";
      auto s0 = Clock::now();
      check(sb.exec(command, 30), "exec", step);
      step_exec.add(ms_since(s0));
    }
    ep_exec.add(ms_since(t1));
  }
  sess.close();
  sb.destroy();

  fmt::print("\n== shell sessions: run(\"true\") next to exec of `true`, n={} (after {} warm-up), alternating ==\n",
             options.n, options.warmup);
  print_header();
  print_row("exec round trip (client)", exec_lat);
  print_row("  of which in the agent", exec_agent);
  print_row("session run round trip (client)", run_lat);
  print_row("  of which in the agent", run_agent);
  print_row("after 1 s idle: exec round trip", exec_gap);
  print_row("after 1 s idle: session run round trip", run_gap);
  fmt::print("\n== a {}-step SWE-style episode, {} episodes each way, alternating ==\n", steps.size(), episodes);
  print_header();
  print_row("episode through one session", ep_session);
  print_row("episode through execs", ep_exec);
  print_row("  one step, session", step_session);
  print_row("  one step, exec", step_exec);
}

}  // namespace dsec::bench
