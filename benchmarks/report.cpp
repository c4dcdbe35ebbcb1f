// dsec-bench output: a text block per benchmark as it finishes, and the Markdown summary for docs/benchmarks.md.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>

#include "bench.hpp"

namespace dsec::bench {

double Latency::percentile(double p) const {
  if (ms_.empty()) return std::nan("");
  std::vector<double> v = ms_;
  std::sort(v.begin(), v.end());
  auto rank = static_cast<std::size_t>(std::ceil(p / 100.0 * static_cast<double>(v.size())));
  rank = std::clamp<std::size_t>(rank, 1, v.size());
  return v[rank - 1];
}

double Latency::max() const { return ms_.empty() ? std::nan("") : *std::max_element(ms_.begin(), ms_.end()); }

double Latency::mean() const {
  return ms_.empty() ? std::nan("") : std::accumulate(ms_.begin(), ms_.end(), 0.0) / static_cast<double>(ms_.size());
}

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string ms(double v) {
  if (std::isnan(v)) return "n/a";
  if (v < 10) return fmt::format("{:.2f} ms", v);
  if (v < 100) return fmt::format("{:.1f} ms", v);
  return fmt::format("{:.0f} ms", v);
}

std::string mib(double bytes) {
  if (std::isnan(bytes)) return "n/a";
  double m = bytes / kMiB;
  if (std::fabs(m) < 10) return fmt::format("{:.2f} MiB", m);
  return fmt::format("{:.0f} MiB", m);
}

std::string kib(double bytes) {
  if (std::isnan(bytes)) return "n/a";
  return fmt::format("{:.0f} KiB", bytes / 1024.0);
}

std::string md_row(const std::string& name, const Latency& l) {
  return fmt::format("| {} | {} | {} | {} | {} |\n", name, ms(l.percentile(50)), ms(l.percentile(90)),
                     ms(l.percentile(99)), ms(l.max()));
}

std::string yes_no(bool met) { return met ? "**met**" : "**not met**"; }

}  // namespace

std::string cpu_text(const CpuUse& c, int cores) {
  return fmt::format(
      "{:.1f} s; CPU busy {:.2f} of {} cores: dsec-bench, its children and the agent {:.2f}, kernel "
      "threads and interrupts {:.2f}, steal {:.2f}, other processes {:.2f}",
      c.seconds, c.busy_cores, cores, c.ours_cores, c.kernel_cores, c.steal_cores, c.others_cores);
}

void print_row(const std::string& name, const Latency& l) {
  if (l.empty()) return;
  fmt::print("  {:<44} {:>10} {:>10} {:>10} {:>10} {:>10}\n", name, ms(l.percentile(50)), ms(l.percentile(90)),
             ms(l.percentile(99)), ms(l.max()), ms(l.mean()));
}

void print_header() {
  fmt::print("  {:<44} {:>10} {:>10} {:>10} {:>10} {:>10}\n", "", "p50", "p90", "p99", "max", "mean");
}

void print_cpu(const CpuUse& cpu, int cores, std::string_view prefix) {
  fmt::print("{}{}\n", prefix, cpu_text(cpu, cores));
}

void print_create(const CreateResult& r) {
  fmt::print("\n== create: sequential, n={} (after {} warm-up), systems take turns each iteration ==\n", r.n, r.warmup);
  print_header();
  print_row("dsec create (to ready for exec)", r.dsec_ready);
  print_row("dsec destroy (not timed in create)", r.dsec_destroy);
  print_row("dsec create + exec true + destroy", r.dsec_lifecycle);
  print_row("dsec create, null backend (control plane)", r.dsec_null);
  print_row("crun run true (create..exit..delete)", r.crun);
  print_row("bwrap --unshare-all ... true", r.bwrap);
}

void print_throughput(const ThroughputResult& r) {
  fmt::print("\n== throughput: completed creates per second, {:.0f} s per cell in {} turns, systems alternating ==\n",
             r.window_seconds, r.rounds);
  fmt::print("  {:>11} {:>14} {:>11} {:>11} {:>12} {:>11} {:>9} {:>24}\n", "concurrency", "dsec create/s", "create p50",
             "create p99", "destroy p50", "crun run/s", "bwrap/s", "CPU ours/kernel/others");
  for (const auto& p : r.points) {
    fmt::print("  {:>11} {:>14.1f} {:>11} {:>11} {:>12} {:>11} {:>9} {:>24}\n", p.concurrency, p.dsec_rate,
               ms(p.dsec_create.percentile(50)), ms(p.dsec_create.percentile(99)), ms(p.dsec_destroy.percentile(50)),
               p.crun_measured ? fmt::format("{:.1f}", p.crun_rate) : "n/a",
               p.bwrap_measured ? fmt::format("{:.1f}", p.bwrap_rate) : "n/a",
               fmt::format("{:.2f}/{:.2f}/{:.2f}", p.cpu.ours_cores, p.cpu.kernel_cores, p.cpu.others_cores));
  }
}

std::string markdown_throughput(const ThroughputResult& r, int cores) {
  std::string md = fmt::format(
      "### Creates per second (closed loop: each of C threads creates then destroys; {:.0f} s per cell, in {} "
      "turns with the systems alternating)\n\n",
      r.window_seconds, r.rounds);
  md +=
      "| concurrency | dsec creates/s | dsec create p50 / p99 | `crun run`/s | `bwrap`/s | CPU (cores): dsec-bench + "
      "children + agent / kernel threads / other processes |\n"
      "| --- | --- | --- | --- | --- | --- |\n";
  for (const auto& p : r.points)
    md += fmt::format("| {} | {:.1f} | {} / {} | {} | {} | {:.2f} / {:.2f} / {:.2f} |\n", p.concurrency, p.dsec_rate,
                      ms(p.dsec_create.percentile(50)), ms(p.dsec_create.percentile(99)),
                      p.crun_measured ? fmt::format("{:.1f}", p.crun_rate) : "n/a",
                      p.bwrap_measured ? fmt::format("{:.1f}", p.bwrap_rate) : "n/a", p.cpu.ours_cores,
                      p.cpu.kernel_cores, p.cpu.others_cores);
  md += fmt::format("\nLoad during this benchmark: {}.\n\n", cpu_text(r.cpu, cores));
  return md;
}

void print_exec(const ExecBenchResult& r) {
  fmt::print("\n== exec of `true`: n={} (after {} warm-up), alternating with the host spawn ==\n", r.n, r.warmup);
  print_header();
  print_row("dsec exec round trip (client)", r.dsec);
  print_row("  of which in the agent (ExecResult.duration)", r.dsec_agent_side);
  print_row("host posix_spawn + wait (same binary)", r.host);
  for (const auto& g : r.after_gaps) {
    print_row(fmt::format("after {:.0f} ms idle: dsec exec round trip", g.gap_ms), g.dsec);
    print_row("  of which in the agent", g.dsec_agent_side);
    print_row(fmt::format("after {:.0f} ms idle: host posix_spawn + wait", g.gap_ms), g.host);
  }
  fmt::print("  host binary: {} as argv[0] \"true\"\n", r.host_binary);
}

void print_density(const DensityResult& r) {
  double k = static_cast<double>(r.count);
  fmt::print("\n== density: {} idle sandboxes (cpu {} cores, memory limit {} each) ==\n", r.count, r.cpu_per_sandbox,
             mib(static_cast<double>(r.memory_limit)));
  fmt::print("  created with create_many in {:.2f} s ({:.0f} creates/s)\n", r.create_seconds, k / r.create_seconds);
  fmt::print("  found in /proc: {} sandboxes, {} processes\n", r.sandboxes_found, r.processes);
  fmt::print("  {:<44} {:>12} {:>14}\n", "", "total", "per sandbox");
  auto row = [&](const char* name, double v) { fmt::print("  {:<44} {:>12} {:>14}\n", name, mib(v), kib(v / k)); };
  row("MemAvailable drop", r.mem_available_delta);
  row("RSS of the sandboxes' processes", r.rss_total);
  row("PSS of the sandboxes' processes", r.pss_total);
  row("memory cgroup charge", r.cgroup_charge_total);
  row("agent RSS growth", r.agent_rss_delta);
  row("other processes' RSS change (noise gauge)", r.others_rss_delta);
  for (const auto& [name, growth] : r.meminfo_growth) row(fmt::format("host {} growth", name).c_str(), growth);
  row("itemised: kernel growth (no AnonPages) + PSS + agent", r.itemised_total);
  if (!r.slab_growth.empty()) {
    std::string top;
    for (const auto& [name, bytes] : r.slab_growth)
      top += fmt::format("{}{} {}", top.empty() ? "" : ", ", name, kib(bytes / k));
    fmt::print("  slab caches that grew most, per sandbox: {}\n", top);
  }
  fmt::print("  teardown: {} sandboxes destroyed in {:.2f} s ({:.0f}/s)\n", r.count, r.teardown_seconds,
             k / r.teardown_seconds);
  fmt::print("  MemAvailable back after teardown: {}\n", mib(r.mem_returned));
}

void print_cgroup_join(const CgroupJoinResult& r) {
  fmt::print("\n== cgroup join: a fresh process writes \"0\" to cgroup.procs of fresh groups ({}), n={} ==\n", r.layout,
             r.samples);
  fmt::print("  {:>14} {:>12} {:>12} {:>12} {:>12}\n", "idle gap", "first p50", "first p99", "all p50", "all p99");
  for (const auto& p : r.points)
    fmt::print("  {:>11} ms {:>12} {:>12} {:>12} {:>12}\n", p.gap_ms, ms(p.first.percentile(50)),
               ms(p.first.percentile(99)), ms(p.all.percentile(50)), ms(p.all.percentile(99)));
}

std::string markdown_report(const Report& report, const Options& o) {
  const MachineInfo& m = report.machine;
  std::string md;
  md += fmt::format("Command: `{}`\n\n", report.command_line);
  md += fmt::format("Machine: {} cores ({}), {:.1f} GiB RAM, {}, cgroup {}.", m.cores, m.cpu_model,
                    static_cast<double>(m.mem_total) / (kMiB * 1024), m.kernel, m.cgroup);
  if (!m.agent.empty()) md += fmt::format(" Agent: {} (cgroup driver {}).", m.agent, m.agent_cgroup);
  if (!m.crun_version.empty() || !m.bwrap_version.empty())
    md += fmt::format(" Peers: {}, {}.", m.crun_version.empty() ? "crun n/a" : m.crun_version,
                      m.bwrap_version.empty() ? "bwrap n/a" : m.bwrap_version);
  md += fmt::format(" Started {}; load average at start {:.2f} {:.2f} {:.2f}; in the second before the run: {}.\n\n",
                    m.started_at, m.load1, m.load5, m.load15, cpu_text(m.before, m.cores));
  for (const auto& note : report.notes) md += fmt::format("- {}\n", note);
  if (!report.notes.empty()) md += "\n";

  if (report.create) {
    const auto& r = *report.create;
    md += fmt::format("### Create to ready, sequential (n = {}, {} warm-up, systems take turns every iteration)\n\n",
                      r.n, r.warmup);
    md += "| system | p50 | p90 | p99 | max |\n| --- | --- | --- | --- | --- |\n";
    md += md_row("dsec `create` (returns when the sandbox is ready for exec)", r.dsec_ready);
    md += md_row("dsec `destroy` (not part of the row above)", r.dsec_destroy);
    md += md_row("dsec create + exec `true` + destroy (whole lifecycle)", r.dsec_lifecycle);
    if (!r.dsec_null.empty())
      md += md_row("dsec `create` of kind `null` (client, HTTP, registry; no sandbox): the control-plane floor",
                   r.dsec_null);
    if (!r.crun.empty()) md += md_row("`crun run` of `true` (create, start, exit, delete)", r.crun);
    if (!r.bwrap.empty()) md += md_row("`bwrap --unshare-all --ro-bind root / --proc /proc --dev /dev true`", r.bwrap);
    md += fmt::format("\nLoad during this benchmark: {}.\n\n", cpu_text(r.cpu, m.cores));
  }
  if (report.image) md += markdown_image(*report.image) + "\n";
  if (report.cgroup_join) {
    const auto& r = *report.cgroup_join;
    md += fmt::format(
        "### Kernel floor: joining a fresh cgroup after an idle gap ({}; n = {} per row)\n\n"
        "A fresh process writes \"0\" to `cgroup.procs` of a fresh group in each hierarchy, as a sandbox's first "
        "process does.\n\n| idle gap before | first write p50 | first write p99 | all writes p50 | all writes p99 |\n"
        "| --- | --- | --- | --- | --- |\n",
        r.layout, r.samples);
    for (const auto& p : r.points)
      md += fmt::format("| {} ms | {} | {} | {} | {} |\n", p.gap_ms, ms(p.first.percentile(50)),
                        ms(p.first.percentile(99)), ms(p.all.percentile(50)), ms(p.all.percentile(99)));
    md += "\n";
  }
  if (report.throughput) md += markdown_throughput(*report.throughput, m.cores);
  if (report.exec) {
    const auto& r = *report.exec;
    md += fmt::format("### Exec round trip of `true` (n = {}, {} warm-up, alternating)\n\n", r.n, r.warmup);
    md += "| what | p50 | p90 | p99 | max |\n| --- | --- | --- | --- | --- |\n";
    md += md_row("dsec `Sandbox::exec({\"true\"})`, client round trip", r.dsec);
    md += md_row("of which inside the agent (`ExecResult::duration_seconds`)", r.dsec_agent_side);
    md += md_row("host `posix_spawn` + `waitpid` of the same static busybox as `true`", r.host);
    for (const auto& g : r.after_gaps) {
      md += md_row(fmt::format("after {:.0f} ms idle: dsec exec, client round trip", g.gap_ms), g.dsec);
      md += md_row(fmt::format("after {:.0f} ms idle: of which inside the agent", g.gap_ms), g.dsec_agent_side);
      md += md_row(fmt::format("after {:.0f} ms idle: host posix_spawn + waitpid", g.gap_ms), g.host);
    }
    md += fmt::format("\nLoad during this benchmark: {}.\n\n", cpu_text(r.cpu, m.cores));
  }
  if (report.density) {
    const auto& r = *report.density;
    double k = static_cast<double>(r.count);
    md += fmt::format("### Density: {} idle sandboxes (cpu {} cores, memory limit {} each)\n\n", r.count,
                      r.cpu_per_sandbox, mib(static_cast<double>(r.memory_limit)));
    md += "| measure | total | per sandbox |\n| --- | --- | --- |\n";
    auto row = [&](const std::string& name, double v) {
      md += fmt::format("| {} | {} | {} |\n", name, mib(v), kib(v / k));
    };
    row("host MemAvailable drop", r.mem_available_delta);
    row(fmt::format("RSS of the sandboxes' {} processes", r.processes), r.rss_total);
    row("PSS of the same processes", r.pss_total);
    row("charged to the sandboxes' memory cgroups", r.cgroup_charge_total);
    row("agent (dsecd) RSS growth", r.agent_rss_delta);
    row("RSS change of every other process (noise gauge for the first row)", r.others_rss_delta);
    for (const auto& [name, growth] : r.meminfo_growth) row(fmt::format("host-wide `{}` growth", name), growth);
    row("itemised: the growth above except AnonPages, + PSS, + agent growth", r.itemised_total);
    if (!r.slab_growth.empty()) {
      std::string top;
      for (const auto& [name, bytes] : r.slab_growth)
        top += fmt::format("{}`{}` {}", top.empty() ? "" : ", ", name, kib(bytes / k));
      md += fmt::format("\nSlab caches that grew most, per sandbox: {}.\n", top);
    }
    md += fmt::format(
        "\n`create_many({})`: {:.2f} s ({:.0f} creates/s). All {} found alive in /proc. Teardown of all {} with {} "
        "threads: {:.2f} s ({:.0f} destroys/s); MemAvailable back afterwards: {}.\n\n",
        r.count, r.create_seconds, k / r.create_seconds, r.sandboxes_found, r.count, o.teardown_concurrency,
        r.teardown_seconds, k / r.teardown_seconds, mib(r.mem_returned));
    md += fmt::format("Load during this benchmark: {}.\n\n", cpu_text(r.cpu, m.cores));
  }

  std::string targets;
  if (report.create) {
    double p50 = report.create->dsec_ready.percentile(50), p99 = report.create->dsec_ready.percentile(99);
    targets += fmt::format("| create p50 <= 5 ms | {} | {} |\n", ms(p50), yes_no(p50 <= 5));
    targets += fmt::format("| create p99 <= 20 ms | {} | {} |\n", ms(p99), yes_no(p99 <= 20));
  }
  if (report.throughput && !report.throughput->points.empty()) {
    const RatePoint* best = &report.throughput->points.front();
    for (const auto& p : report.throughput->points)
      if (p.dsec_rate > best->dsec_rate) best = &p;
    targets += fmt::format("| >= 300 creates/s on this machine | best {:.1f}/s (concurrency {}) | {} |\n",
                           best->dsec_rate, best->concurrency, yes_no(best->dsec_rate >= 300));
  }
  if (report.exec) {
    double d = report.exec->dsec.percentile(50), h = report.exec->host.percentile(50);
    targets += fmt::format("| exec `true` p50 <= host fork+exec p50 + 1 ms | {} vs {} + 1 ms | {} |\n", ms(d), ms(h),
                           yes_no(d <= h + 1));
  }
  if (report.density) {
    const auto& r = *report.density;
    const double k = static_cast<double>(r.count);
    const double per = r.mem_available_delta / k, itemised = r.itemised_total / k;
    // Both views must fit: MemAvailable is the whole truth on a quiet host, the itemised sum the steadier one.
    const bool memory_ok = per <= kMiB && itemised <= kMiB;
    std::string verdict;
    if (r.count < 2000)
      verdict = fmt::format("memory part {}; 2,000 not tried in this run", memory_ok ? "met" : "not met");
    else verdict = yes_no(memory_ok && r.sandboxes_found == r.count);
    targets += fmt::format(
        "| >= 2,000 idle sandboxes at <= 1 MiB host memory each | {} alive at once; {} each by MemAvailable, {} "
        "each itemised | {} |\n",
        r.count, kib(per), kib(itemised), verdict);
  }
  if (!targets.empty())
    md += "### Targets (DESIGN.md, performance targets)\n\n| target | measured | verdict |\n| --- | --- | --- |\n" +
          targets;
  return md;
}

}  // namespace dsec::bench
