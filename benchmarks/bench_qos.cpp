// dsec-bench qos: does a latency-class sandbox keep its step time while batch work saturates the node? An agent
// loop's step is a fixed CPU-bound task (a shell loop timed inside the sandbox with $EPOCHREALTIME, so the client's
// and the agent's overhead can be told apart from the loop itself) run by exec, with think time between steps. It
// is measured on an idle node, then beside K spinner sandboxes (default 2 per core) each burning a core: once with
// classes of service on (the stepping sandbox latency, the spinners batch: SCHED_IDLE, cpu.shares 2) and once with
// everything standard. The rows take turns (each turn a fresh stepping sandbox and fresh spinners), so that a change
// in the machine's other load reaches them all. Inflation is a loaded row's p99 over its idle row's p99, less 1.
// With 2 CPUs or more, a second agent started with --latency-cpus (the last CPU by default) gives the reserved-CPU
// fallback's rows.
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bench.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"

namespace dsec::bench {
namespace {

// The step's loop: a few milliseconds of busybox ash on this machine's idle vCPUs (3-8 ms: an idle vCPU runs it
// slower than a busy one). Fixed, so that runs compare.
constexpr std::size_t kLoopIterations = 3000;
constexpr auto kSpinUp = std::chrono::seconds(2);  // spinners run this long before the first step

// The step: a loop of `iterations` in the sandbox's shell, bracketed by its clock ("<start> <end>" in seconds;
// empty fields where the shell has no $EPOCHREALTIME: busybox ash and bash have it, dash has not).
ExecRequest step_request(std::size_t iterations) {
  ExecRequest r;
  r.argv = {"sh", "-c",
            fmt::format("s=$EPOCHREALTIME; i=0; while [ $i -lt {} ]; do i=$((i+1)); done; echo \"$s $EPOCHREALTIME\"",
                        iterations)};
  r.timeout_seconds = 120;
  return r;
}

struct Step {
  double round_trip_ms = 0;
  double agent_ms = 0;  // ExecResult::duration_seconds: the command's start to its end and output, in the agent
  double inside_ms = std::nan("");
};

Step run_step(const Sandbox& sb, const ExecRequest& request) {
  auto t0 = Clock::now();
  ExecResult r = sb.exec(request);
  Step s;
  s.round_trip_ms = ms_since(t0);
  s.agent_ms = r.duration_seconds * 1000;
  if (r.exit_code != 0 || r.timed_out)
    throw Error(Code::kInternal, fmt::format("the step in sandbox {} ended with exit code {}{}: {}", sb.id(),
                                             r.exit_code, r.timed_out ? " (timed out)" : "", r.stderr_data));
  std::istringstream in(r.stdout_data);
  double start = 0, end = 0;
  if (in >> start >> end && end >= start) s.inside_ms = (end - start) * 1000;
  return s;
}

// The highest CPU this process may run on: what the reserved-CPU agent sets aside by default.
int last_cpu() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return -1;
  for (int cpu = CPU_SETSIZE - 1; cpu >= 0; --cpu)
    if (CPU_ISSET(cpu, &set)) return cpu;
  return -1;
}

SandboxSpec qos_spec(const Options& o, Priority priority, const std::string& role) {
  SandboxSpec spec = bench_spec(o);
  spec.resources.cpu = 1;
  spec.resources.memory_bytes = 64ull << 20;
  spec.resources.priority = priority;
  spec.labels["dsec-bench-qos"] = role;
  return spec;
}

struct RowPlan {
  std::string name, baseline;
  Priority latency_class = Priority::kLatency;
  std::size_t spinners = 0;
  Priority spinner_class = Priority::kBatch;
};

// Adds one window's CPU split to a row's, weighted by the windows' lengths.
void add_window(CpuUse& total, const CpuUse& w) {
  const double t = total.seconds + w.seconds;
  if (t <= 0) return;
  auto mix = [&](double a, double b) { return (a * total.seconds + b * w.seconds) / t; };
  total.busy_cores = mix(total.busy_cores, w.busy_cores);
  total.ours_cores = mix(total.ours_cores, w.ours_cores);
  total.kernel_cores = mix(total.kernel_cores, w.kernel_cores);
  total.steal_cores = mix(total.steal_cores, w.steal_cores);
  total.others_cores = mix(total.others_cores, w.others_cores);
  total.seconds = t;
}

// One turn of a row: a fresh stepping sandbox (and spinners), `warmup` steps dropped, then `steps` steps added to
// the row.
void measure_turn(const Options& o, std::size_t steps, Client& client, const RowPlan& plan, const ExecRequest& step,
                  int agent_pid, QosRow& row) {
  Sandbox stepper = client.create(qos_spec(o, plan.latency_class, "step"));
  std::vector<Sandbox> spinners;
  if (plan.spinners) {
    spinners = client.create_many(plan.spinners, qos_spec(o, plan.spinner_class, "spin"));
    for (const auto& sb : spinners) {
      ExecResult r = sb.exec("while :; do :; done >/dev/null 2>&1 &", 30);
      if (r.exit_code != 0)
        throw Error(Code::kInternal, fmt::format("starting the spinner in {}: {}", sb.id(), r.stderr_data));
    }
    std::this_thread::sleep_for(kSpinUp);
    SandboxInfo spin = spinners.front().info();
    row.spinner_granted = spin.qos.granted;
    row.spinner_missing = spin.qos.missing;
  }
  SandboxInfo info = stepper.info();
  row.granted = info.qos.granted;
  row.missing = info.qos.missing;

  const auto think = std::chrono::duration<double, std::milli>(o.qos_think_ms);
  CpuMeter cpu({agent_pid}, /*descendants=*/true);
  for (std::size_t i = 0; i < o.warmup + steps; ++i) {
    std::this_thread::sleep_for(think);
    if (i == o.warmup) cpu.start();
    Step s = run_step(stepper, step);
    if (i < o.warmup) continue;
    row.step.add(s.round_trip_ms);
    row.agent.add(s.agent_ms);
    if (!std::isnan(s.inside_ms)) row.inside.add(s.inside_ms);
  }
  add_window(row.cpu, cpu.stop());
  double l5 = 0, l15 = 0;
  read_loadavg(row.load1, l5, l15);
}

ClientOptions agent_options(const Options& o, const std::string& home, const std::string& latency_cpus) {
  ClientOptions copts;
  if (!o.endpoints.empty()) {
    copts.endpoints = o.endpoints;
    return copts;
  }
  copts.home = home;
  copts.agent_binary = o.agent_binary;
  copts.agent_args = {"--backends", "container"};
  if (!latency_cpus.empty()) copts.agent_args.insert(copts.agent_args.end(), {"--latency-cpus", latency_cpus});
  copts.agent_args.insert(copts.agent_args.end(), o.agent_args.begin(), o.agent_args.end());
  return copts;
}

// The rows one agent gives (the idle baselines and the loaded rows against them), taking turns: `rounds` times
// every row in order, each turn a share of the steps, so that a change in the machine's other load reaches all rows.
void run_rows(const Options& o, Client& client, const std::vector<RowPlan>& plans, QosBenchResult& result,
              const ExecRequest& step) {
  const int agent = agent_pid_for(client);
  const std::size_t first = result.rows.size();
  for (const auto& plan : plans) {
    QosRow row;
    row.name = plan.name;
    row.baseline = plan.baseline;
    row.spinners = plan.spinners;
    row.latency_class = std::string(priority_name(plan.latency_class));
    if (plan.spinners) row.spinner_class = std::string(priority_name(plan.spinner_class));
    result.rows.push_back(std::move(row));
  }
  for (std::size_t round = 0; round < result.rounds; ++round) {
    const std::size_t steps = result.steps / result.rounds + (round < result.steps % result.rounds ? 1 : 0);
    for (std::size_t i = 0; i < plans.size(); ++i) {
      QosRow& row = result.rows[first + i];
      fmt::print(stderr, "dsec-bench qos: turn {} of {}: {}\n", round + 1, result.rounds, row.name);
      measure_turn(o, steps, client, plans[i], step, agent, row);
    }
  }
  for (std::size_t i = first; i < result.rows.size(); ++i) {
    const QosRow& row = result.rows[i];
    const std::string no_clock =
        "the image's sh has no $EPOCHREALTIME: the loop is not timed inside the sandbox "
        "(use an image whose sh is busybox ash or bash)";
    if (row.inside.empty() && std::find(result.notes.begin(), result.notes.end(), no_clock) == result.notes.end())
      result.notes.push_back(no_clock);
    fmt::print(stderr,
               "  {}: step p50 {:.2f} ms, p99 {:.2f} ms; inside p50 {:.2f} ms, p99 {:.2f} ms; CPU busy {:.2f}\n",
               row.name, row.step.percentile(50), row.step.percentile(99), row.inside.percentile(50),
               row.inside.percentile(99), row.cpu.busy_cores);
  }
}

std::string priority_row(std::string_view what, std::size_t k) {
  return fmt::format("loaded: {} ({} spinner{})", what, k, k == 1 ? "" : "s");
}

}  // namespace

QosBenchResult run_qos(const Options& o, const std::string& home) {
  QosBenchResult result;
  result.cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  result.think_ms = o.qos_think_ms;
  result.steps = o.given.count("-n") ? o.n : 500;
  result.rounds = std::min(result.steps, o.given.count("--rounds") ? o.rounds : 5);
  result.warmup = o.warmup;
  result.image = o.image;
  const std::size_t k =
      o.given.count("-k") || o.given.count("--count") ? o.density_count : static_cast<std::size_t>(2 * result.cores);

  fmt::print(stderr, "dsec-bench: starting the client{}\n", o.endpoints.empty() ? " and an embedded agent" : "");
  ExecRequest step;
  {
    Client client(agent_options(o, home, ""));
    NodeInfo node = client.nodes().front();
    result.cgroup = node.cgroup_version;
    result.node_qos = node.qos;
    result.agent = o.endpoints.empty() ? fmt::format("embedded dsecd {} (home {})", node.version, home)
                                       : fmt::format("dsecd {} at {}", node.version, client.endpoint());
    result.loop_iterations = kLoopIterations;
    step = step_request(result.loop_iterations);
    const std::string idle_latency = "idle: latency class", idle_standard = "idle: standard class";
    run_rows(
        o, client,
        {{idle_latency, "", Priority::kLatency, 0, Priority::kBatch},
         {idle_standard, "", Priority::kStandard, 0, Priority::kStandard},
         {priority_row("priorities on: latency beside batch", k), idle_latency, Priority::kLatency, k,
          Priority::kBatch},
         {priority_row("priorities off: all standard", k), idle_standard, Priority::kStandard, k, Priority::kStandard}},
        result, step);
  }

  // The reserved-CPU fallback (dsecd --latency-cpus): an agent of its own, when this bench starts agents.
  std::string reserve = o.qos_latency_cpus;
  if (reserve.empty()) reserve = std::to_string(last_cpu());
  if (!o.endpoints.empty()) {
    result.notes.push_back("no reserved-CPU rows: --endpoint's agent runs with its own --latency-cpus");
  } else if (reserve == "none") {
    result.notes.push_back("no reserved-CPU rows (--latency-cpus none)");
  } else if (result.cores < 2) {
    result.notes.push_back("no reserved-CPU rows: one CPU, none to reserve");
  } else {
    result.reserved_agent = reserve;
    fmt::print(stderr, "dsec-bench: starting an embedded agent with --latency-cpus {}\n", reserve);
    Client client(agent_options(o, home, reserve));
    result.reserved_cpus = client.nodes().front().qos.latency_cpus;
    const std::string idle = fmt::format("idle: latency class on reserved CPU {}", result.reserved_cpus);
    run_rows(o, client,
             {{idle, "", Priority::kLatency, 0, Priority::kBatch},
              {priority_row(fmt::format("CPU {} reserved, latency beside batch", result.reserved_cpus), k), idle,
               Priority::kLatency, k, Priority::kBatch}},
             result, step);
  }
  return result;
}

namespace {

const QosRow* find_row(const QosBenchResult& r, const std::string& name) {
  for (const auto& row : r.rows)
    if (row.name == name) return &row;
  return nullptr;
}

// A loaded row's p99 over its idle row's, less 1, in percent; NaN for a baseline row.
double inflation(const QosBenchResult& r, const QosRow& row, bool inside) {
  const QosRow* base = row.baseline.empty() ? nullptr : find_row(r, row.baseline);
  if (!base) return std::nan("");
  const Latency& a = inside ? row.inside : row.step;
  const Latency& b = inside ? base->inside : base->step;
  return (a.percentile(99) / b.percentile(99) - 1) * 100;
}

std::string pct(double v) { return std::isnan(v) ? "" : fmt::format("{:+.1f}%", v); }

std::string ms2(double v) { return std::isnan(v) ? "n/a" : fmt::format("{:.2f} ms", v); }

std::string node_qos_text(const QosBenchResult& r) {
  const QosNodeInfo& q = r.node_qos;
  return fmt::format("core scheduling {}; reserved CPUs by default: {}; cgroup cpu.idle: {}",
                     q.core_scheduling ? "yes" : fmt::format("no ({})", q.core_scheduling_reason),
                     q.latency_cpus.empty() ? "none" : q.latency_cpus, q.cpu_idle ? "yes" : "no");
}

std::string qos_of(const std::vector<std::string>& granted, const std::vector<std::string>& missing) {
  std::string s = fmt::format("{}", fmt::join(granted, ", "));
  if (!missing.empty()) s += fmt::format("; missing: {}", fmt::join(missing, "; "));
  return s;
}

}  // namespace

void print_qos(const QosBenchResult& r) {
  fmt::print(
      "\n== qos: a latency sandbox's step (a {}-iteration shell loop, {:.0f} ms think time, n={} per row in {} "
      "turn{}, {} warm-up steps each) ==\n",
      r.loop_iterations, r.think_ms, r.steps, r.rounds, r.rounds == 1 ? "" : "s", r.warmup);
  fmt::print("  agent: {}, cgroup driver {}; {}\n", r.agent, r.cgroup, node_qos_text(r));
  fmt::print("  {:<62} {:>10} {:>10} {:>9} {:>10} {:>10} {:>10} {:>9} {:>6}\n", "", "step p50", "step p99", "p99 infl",
             "agent p99", "inside p50", "inside p99", "p99 infl", "busy");
  for (const auto& row : r.rows)
    fmt::print("  {:<62} {:>10} {:>10} {:>9} {:>10} {:>10} {:>10} {:>9} {:>6.2f}\n", row.name,
               ms2(row.step.percentile(50)), ms2(row.step.percentile(99)), pct(inflation(r, row, false)),
               ms2(row.agent.percentile(99)), ms2(row.inside.percentile(50)), ms2(row.inside.percentile(99)),
               pct(inflation(r, row, true)), row.cpu.busy_cores);
  for (const auto& row : r.rows) {
    if (!row.spinners) continue;
    fmt::print("  {}:\n    stepping sandbox ({}): {}\n    spinner ({}): {}\n", row.name, row.latency_class,
               qos_of(row.granted, row.missing), row.spinner_class, qos_of(row.spinner_granted, row.spinner_missing));
    print_cpu(row.cpu, r.cores, "    load: ");
  }
  for (const auto& n : r.notes) fmt::print("  note: {}\n", n);
}

std::string markdown_qos(const QosBenchResult& r) {
  std::string md = "### Classes of service: a latency sandbox's step beside CPU spinners\n\n";
  md += fmt::format(
      "Agent: {}, cgroup driver {}; {}. The step: an exec of a {}-iteration loop of the image's shell ({}), timed by "
      "the client (round trip), by the agent (ExecResult::duration_seconds: from asking the sandbox's init to "
      "start the command until its exit and output are in) and inside the sandbox ($EPOCHREALTIME); {:.0f} ms "
      "think time between steps; n = {} "
      "per row, the rows taking turns {} times (each turn a fresh stepping sandbox and spinners, {} warm-up steps "
      "dropped). Spinners: sandboxes of 1 core each running `while :; do :; done`.\n\n",
      r.agent, r.cgroup, node_qos_text(r), r.loop_iterations, r.image, r.think_ms, r.steps, r.rounds, r.warmup);
  md += fmt::format(
      "| condition | step p50 | step p99 | p99 inflation | in the agent p50 / p99 | inside p50 | "
      "inside p99 | inside p99 inflation | CPU busy (of {}) |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
      r.cores);
  for (const auto& row : r.rows)
    md += fmt::format("| {} | {} | {} | {} | {} / {} | {} | {} | {} | {:.2f} |\n", row.name,
                      ms2(row.step.percentile(50)), ms2(row.step.percentile(99)), pct(inflation(r, row, false)),
                      ms2(row.agent.percentile(50)), ms2(row.agent.percentile(99)), ms2(row.inside.percentile(50)),
                      ms2(row.inside.percentile(99)), pct(inflation(r, row, true)), row.cpu.busy_cores);
  md += "\n";
  for (const auto& row : r.rows)
    if (row.spinners)
      md += fmt::format("- {}: the stepping sandbox got {}; a spinner got {}.\n", row.name,
                        qos_of(row.granted, row.missing), qos_of(row.spinner_granted, row.spinner_missing));
  std::string targets;
  for (const auto& row : r.rows) {
    if (!row.spinners || row.latency_class != "latency") continue;
    double step = inflation(r, row, false), inside = inflation(r, row, true);
    targets += fmt::format("| {}: p99 inflation <= 10% | step {}, inside {} | {} |\n", row.name, pct(step), pct(inside),
                           step <= 10     ? "**met**"
                           : inside <= 10 ? "**met inside only**"
                                          : "**not met**");
  }
  if (!targets.empty()) md += "\n| target | measured | verdict |\n| --- | --- | --- |\n" + targets;
  for (const auto& n : r.notes) md += fmt::format("- {}\n", n);
  return md;
}

}  // namespace dsec::bench
