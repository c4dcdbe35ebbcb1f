// dsec-bench vm: full VMs (kind "vm", docs/vm.md), q35 machines booting the desktop image's own kernel and systemd
// with a screen, measured in one run; every figure names the accelerator the node chose (GET /v1/node:
// vm.accelerator) and the load it ran under.
//
//  1. create to ready, sequential, --vm-n VMs kept up: the shape's first create (a boot of the whole system up to its
//     desktop, frozen as the template, then the sandbox started from it) and the next ones (clones of the template).
//  2. memory of those VMs, idle and settled: each sandbox's memory cgroup charge (and its shmem), its QEMU's RSS and
//     PSS, the templates' RAM the agent holds, the agent's whole cgroup subtree. Then all but the first go.
//  3. screenshot latency (Sandbox::screenshot, PNG) of the idle desktop.
//  4. input to screen: one key typed into the focused terminal, then screenshots back to back until the PNG differs;
//     a BackSpace undoes it before the next sample.
//  5. sleep and wake of that VM (wake to its first screenshot and exec), then two snapshots of it into a store of
//     the run's own (the first copies the image's layers there too).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <set>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "bench.hpp"
#include "common/syscall.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/manifest.hpp"
#include "qemu_tier.hpp"

namespace dsec::bench {
namespace {

namespace fs = std::filesystem;
constexpr const char* kImage = "desktop";
constexpr const char* kDisplay = "1024x768";
constexpr double kCpu = 2;
constexpr std::uint64_t kMemory = 1ull << 30;
constexpr auto kSettle = std::chrono::seconds(10);
constexpr auto kScreenTimeout = std::chrono::seconds(15);  // a typed key that changed nothing by then: unchanged
constexpr std::size_t kScreenshotWarmup = 2;

// The desktop image in <home>/store, pinned to its manifest so that a rebuild during the run changes nothing.
image::ResolvedManifest desktop_image(const std::string& home) {
  auto store = image::open_directory_store(fs::path(home) / "store");
  try {
    return image::fetch_manifest(*store, image::parse_reference(kImage));
  } catch (const Error& e) {
    if (e.code() != Code::kNotFound) throw;
    throw Error(Code::kNotFound,
                fmt::format("image {} is not in {}/store: build it with scripts/desktop-image.sh (`DSEC_HOME={} "
                            "scripts/desktop-image.sh` from the repository's root)",
                            kImage, home, home));
  }
}

SandboxSpec desktop_spec(const std::string& image) {
  SandboxSpec spec;
  spec.image = image;
  spec.kind = "vm";
  spec.resources.cpu = kCpu;
  spec.resources.memory_bytes = kMemory;
  spec.display = kDisplay;
  spec.ttl = std::chrono::seconds(3600);
  spec.labels = {{"dsec-bench", "1"}, {"dsec-bench-vm", "1"}};
  return spec;
}

// A PNG's size from its IHDR chunk; INTERNAL for bytes that are not a PNG.
std::pair<std::uint32_t, std::uint32_t> png_size(const std::string& png) {
  static const std::string kSignature("\x89PNG\r\n\x1a\n", 8);
  if (png.size() < 24 || png.compare(0, 8, kSignature) != 0 || png.compare(12, 4, "IHDR") != 0)
    throw Error(Code::kInternal, fmt::format("a screenshot of {} bytes is not a PNG", png.size()));
  auto be32 = [&](std::size_t at) {
    std::uint32_t v = 0;
    for (std::size_t i = 0; i < 4; ++i) v = (v << 8) | static_cast<unsigned char>(png[at + i]);
    return v;
  };
  return {be32(16), be32(20)};
}

// Screenshots back to back until one's bytes differ from `than` (a PNG encodes the same screen the same way);
// nullopt when none did before `deadline`.
std::optional<std::string> next_different_screen(const Sandbox& sb, const std::string& than,
                                                 Clock::time_point deadline) {
  while (Clock::now() < deadline) {
    std::string png = sb.screenshot();
    if (png != than) return png;
  }
  return std::nullopt;
}

void measure_idle(const Agent& agent, const std::vector<Sandbox>& vms, VmBenchResult& r) {
  std::set<std::string> ids;
  for (const auto& v : vms) ids.insert(v.id());
  const SandboxProcesses found = find_sandbox_processes(ids);
  const auto qemus = agent_qemus(agent.cgroup_name);
  for (const auto& v : vms) {
    VmIdleMemory m;
    m.id = v.id();
    if (auto it = found.memory_cgroup.find(m.id); it != found.memory_cgroup.end()) {
      m.cgroup_charge = static_cast<double>(cgroup_memory_bytes(it->second));
      m.shmem = memory_stat(it->second, "shmem");
    }
    if (auto it = qemus.find(m.id); it != qemus.end()) {
      auto f = kb_fields(fmt::format("/proc/{}/smaps_rollup", it->second));
      m.qemu_rss = f["Rss"];
      m.qemu_pss = f["Pss"];
    }
    r.idle.push_back(m);
  }
  if (agent.pid > 0) r.template_resident = template_resident_bytes(agent.pid);
  const NodeInfo node = agent.client->nodes().front();
  r.node_templates = node.vm.templates;
  r.node_template_bytes = node.vm.template_bytes;
  r.subtree_charge = subtree_charge(agent.cgroup_name);
}

void input_to_screen(const Sandbox& sb, std::size_t samples, VmBenchResult& r) {
  for (std::size_t i = 0; i < samples; ++i) {
    const std::string before = sb.screenshot();
    const auto t0 = Clock::now();
    sb.type_text("x");
    r.input_call.add(ms_since(t0));
    std::optional<std::string> typed = next_different_screen(sb, before, t0 + kScreenTimeout);
    if (typed) r.input_to_screen.add(ms_since(t0));
    else ++r.input_unchanged;
    // Undone before the next sample, and drawn: the screen is back to what it was (or, should the panel's clock have
    // moved meanwhile, at least no longer shows the key).
    sb.key("BackSpace");
    const auto until = Clock::now() + kScreenTimeout;
    while (typed && Clock::now() < until) {
      std::string now = sb.screenshot();
      if (now == before || now != *typed) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
}

void sleep_and_wake(const Sandbox& sb, VmBenchResult& r) {
  auto t0 = Clock::now();
  SleepResult s = sb.sleep();
  r.sleep_call_ms = ms_since(t0);
  r.sleep_seconds = s.seconds;
  r.sleep_before_bytes = static_cast<double>(s.memory_before_bytes);
  r.sleep_after_bytes = static_cast<double>(s.memory_after_bytes);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  auto t1 = Clock::now();
  SleepResult w = sb.wake();
  r.wake_call_ms = ms_since(t1);
  r.wake_seconds = w.seconds;
  png_size(sb.screenshot());
  r.wake_to_screenshot_ms = ms_since(t1);
  check_ok(sb.exec(true_request()), fmt::format("the first exec in {} after its wake", sb.id()));
  r.wake_to_exec_ms = ms_since(t1);
  r.wake_after_bytes = vm_charged(sb.id());
}

VmBenchResult::Snapshot snapshot_of(const Sandbox& sb, const std::string& what, const std::string& name) {
  VmBenchResult::Snapshot s;
  s.what = what;
  const auto t0 = Clock::now();
  try {
    SnapshotResult snap = sb.snapshot(name);
    s.call_ms = ms_since(t0);
    s.seconds = snap.seconds;
    s.frozen_seconds = snap.frozen_seconds;
    s.layer_bytes = snap.layer_bytes;
    s.stored_bytes = snap.stored_bytes;
    s.file_bytes = snap.file_bytes;
    s.entries = snap.entries;
  } catch (const Error& e) {
    s.call_ms = ms_since(t0);
    s.error = fmt::format("{}: {}", e.code_name(), e.what());
  }
  return s;
}

}  // namespace

VmBenchResult run_vm(const Options& o, const std::string& home) {
  VmBenchResult r;
  r.cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  const Sections sections{"vm", r.cores, r.section_load, r.problems};
  r.creates = o.vm_creates;
  const std::size_t screenshots = o.given.count("-n") ? o.n : 20;
  const std::size_t inputs = std::max<std::size_t>(1, screenshots / 2);
  r.display = kDisplay;
  r.cpu = kCpu;
  r.memory_bytes = kMemory;
  if (!o.endpoints.empty()) r.notes.push_back("--endpoint is ignored: this benchmark starts an agent of its own");

  const image::ResolvedManifest desktop = desktop_image(home);
  r.image = desktop.reference.tagged() + "@" + desktop.digest;
  r.notes.push_back(fmt::format("image {}: {} layers, {} as EROFS, {} stored", r.image, desktop.manifest.layers.size(),
                                mib(static_cast<double>(desktop.manifest.size())),
                                mib(static_cast<double>(desktop.manifest.stored_size()))));

  // Snapshots go to a store of the run's own, removed at the end.
  const ScratchDir work("dsec-bench-vm");
  const std::string snapshot_store = (work.dir / "snapshots").string();
  std::vector<std::string> args{"--backends", "container,vm", "--snapshot-store", snapshot_store};
  args.insert(args.end(), o.agent_args.begin(), o.agent_args.end());
  auto agent = start_agent(o, home, "vm", "vm", args, {(fs::path(home) / "store").string(), snapshot_store});
  Agent& A = *agent;
  r.accelerator = A.node.vm.accelerator;
  r.accelerator_reason = A.node.vm.accelerator_reason;
  r.agent_version = A.node.version;
  r.qemu_version = qemu_version();
  const std::vector<int> pids{A.pid};
  const SandboxSpec spec = desktop_spec(r.image);

  // 1. create to ready.
  std::vector<Sandbox> vms;
  sections.run(fmt::format("create to ready [{}]", r.accelerator), pids, [&] {
    fmt::print(stderr, "dsec-bench vm: the first create of the shape (a boot to the desktop, then its template)\n");
    auto t0 = Clock::now();
    vms.push_back(A.client->create(spec));
    r.first_create_ms = ms_since(t0);
    r.first_load = load_text();
    // A KVM boot the guest never answered falls back to TCG: the figures are the accelerator's that ran them.
    r.accelerator = A.client->nodes().front().vm.accelerator;
    fmt::print(stderr, "  first: {} in {:.1f} s (load {})\n", vms.back().id(), r.first_create_ms / 1000, r.first_load);
    while (vms.size() < r.creates) {
      auto t = Clock::now();
      vms.push_back(A.client->create(spec));
      r.next_create.add(ms_since(t));
      fmt::print(stderr, "  next: {} in {:.1f} s (load {})\n", vms.back().id(), ms_since(t) / 1000, load_text());
    }
    r.next_load = load_text();
  });
  if (vms.empty()) {
    r.problems.push_back("no VM was created: nothing else was measured");
    return r;
  }
  const std::string acc = r.accelerator;

  // 2. memory of the idle VMs; then only the first stays.
  sections.run(fmt::format("memory per idle VM [{}]", acc), pids, [&] {
    fmt::print(stderr, "dsec-bench vm: {} VMs settling for {} s\n", vms.size(), kSettle.count());
    std::this_thread::sleep_for(kSettle);
    r.idle_settle_seconds = static_cast<double>(kSettle.count());
    measure_idle(A, vms, r);
    r.idle_load = load_text();
  });
  std::vector<Sandbox> others;
  for (std::size_t i = 1; i < vms.size(); ++i) others.push_back(std::move(vms[i]));
  vms.resize(1);
  std::vector<std::string> destroy_errors;
  destroy_all(others, 4, &destroy_errors);
  for (const auto& e : destroy_errors) r.problems.push_back("a destroy failed: " + e);
  const Sandbox& sb = vms.front();

  // 3. screenshots.
  sections.run(fmt::format("screenshot [{}]", acc), pids, [&] {
    for (std::size_t i = 0; i < kScreenshotWarmup; ++i) (void)sb.screenshot();
    std::string png;
    for (std::size_t i = 0; i < screenshots; ++i) {
      auto t0 = Clock::now();
      png = sb.screenshot();
      r.screenshot.add(ms_since(t0));
    }
    std::tie(r.png_width, r.png_height) = png_size(png);
    r.png_bytes = png.size();
    r.screenshot_load = load_text();
  });

  // 4. input to screen.
  sections.run(fmt::format("input to screen [{}]", acc), pids, [&] {
    input_to_screen(sb, inputs, r);
    r.input_load = load_text();
  });

  // 5. sleep and wake, snapshots.
  sections.run(fmt::format("sleep and wake [{}]", acc), pids, [&] {
    try {
      sleep_and_wake(sb, r);
    } catch (const Error& e) {
      r.sleep_error = fmt::format("{}: {}", e.code_name(), e.what());
      throw;
    }
    r.sleep_load = load_text();
  });
  sections.run(fmt::format("snapshot [{}]", acc), pids, [&] {
    const std::string tag = fmt::format("{:x}", static_cast<unsigned>(::getpid()));
    r.snapshots.push_back(snapshot_of(sb, "first, into an empty store", fmt::format("dsec-bench/vm:{}-1", tag)));
    r.snapshots.push_back(snapshot_of(sb, "second", fmt::format("dsec-bench/vm:{}-2", tag)));
    r.snapshot_load = load_text();
  });
  destroy_all(vms, 1, &destroy_errors);
  return r;
}

// ---------------------------------------------------------------------------------------------- output

namespace {

std::string lat(const Latency& l, double p) { return l.empty() ? "n/a" : ms(l.percentile(p)); }
std::string lat_max(const Latency& l) { return l.empty() ? "n/a" : ms(l.max()); }
std::string seconds(double ms_value) { return std::isnan(ms_value) ? "n/a" : fmt::format("{:.1f} s", ms_value / 1000); }

std::string shape(const VmBenchResult& r) {
  return fmt::format("{} vCPUs, {} MiB, display {}", r.cpu, r.memory_bytes >> 20, r.display);
}

}  // namespace

void print_vm(const VmBenchResult& r) {
  const std::string& a = r.accelerator;
  fmt::print("\n== vm: full VMs of {} ({}) [{}] ==\n", r.image, shape(r), a);
  fmt::print("  accelerator {} ({}); {}; dsecd {}; {} cores\n", a, r.accelerator_reason, r.qemu_version,
             r.agent_version, r.cores);
  if (!std::isnan(r.first_create_ms)) {
    fmt::print("\n  -- [{}] create to ready, sequential --\n", a);
    fmt::print(
        "  [{}] first of the shape (boot to the desktop, template frozen, sandbox started from it): {} (load {})\n", a,
        seconds(r.first_create_ms), r.first_load);
    fmt::print("  [{}] next {} (clones of the template): p50 {}, max {} (load {})\n", a, r.next_create.count(),
               seconds(r.next_create.empty() ? std::nan("") : r.next_create.percentile(50)),
               seconds(r.next_create.empty() ? std::nan("") : r.next_create.max()), r.next_load);
  }
  if (!r.idle.empty()) {
    fmt::print("\n  -- [{}] memory of the {} idle VMs (settled {:.0f} s; load {}) --\n", a, r.idle.size(),
               r.idle_settle_seconds, r.idle_load);
    for (const auto& m : r.idle)
      fmt::print("  [{}] {}: cgroup charge {} (shmem {}); QEMU RSS {}, PSS {}\n", a, m.id, mib(m.cgroup_charge),
                 mib(m.shmem), mib(m.qemu_rss), mib(m.qemu_pss));
    fmt::print(
        "  [{}] templates: {} holding {} of guest RAM (GET /v1/node), {} resident in their memfds; the agent's "
        "cgroup subtree {}\n",
        a, r.node_templates, mib(static_cast<double>(r.node_template_bytes)), mib(r.template_resident),
        mib(r.subtree_charge));
  }
  if (!r.screenshot.empty())
    fmt::print("\n  [{}] screenshot ({} samples, PNG {}x{}, {:.0f} KiB): p50 {}, p99 {}, max {} (load {})\n", a,
               r.screenshot.count(), r.png_width, r.png_height, static_cast<double>(r.png_bytes) / 1024,
               lat(r.screenshot, 50), lat(r.screenshot, 99), lat_max(r.screenshot), r.screenshot_load);
  if (!r.input_call.empty())
    fmt::print(
        "  [{}] input to screen (type_text(\"x\") into the terminal until a screenshot differs; {} samples, {} "
        "unchanged within {} s): p50 {}, max {}; the input call alone p50 {} (load {})\n",
        a, r.input_call.count(), r.input_unchanged, kScreenTimeout.count(), lat(r.input_to_screen, 50),
        lat_max(r.input_to_screen), lat(r.input_call, 50), r.input_load);
  if (!r.sleep_error.empty()) {
    fmt::print("  [{}] sleep and wake failed: {}\n", a, r.sleep_error);
  } else if (r.sleep_call_ms > 0) {
    fmt::print(
        "  [{}] sleep {:.2f} s on the node ({} call), charged {} -> {}; wake {:.2f} s ({} call), to its first "
        "screenshot {}, to its first exec {}; charged after {} (load {})\n",
        a, r.sleep_seconds, ms(r.sleep_call_ms), mib(r.sleep_before_bytes), mib(r.sleep_after_bytes), r.wake_seconds,
        ms(r.wake_call_ms), ms(r.wake_to_screenshot_ms), ms(r.wake_to_exec_ms), mib(r.wake_after_bytes), r.sleep_load);
  }
  for (const auto& s : r.snapshots) {
    if (!s.error.empty()) fmt::print("  [{}] snapshot ({}) failed after {}: {}\n", a, s.what, ms(s.call_ms), s.error);
    else
      fmt::print(
          "  [{}] snapshot ({}): {} (on the node {:.2f} s, frozen {:.2f} s); layer {} ({} stored), {} of files "
          "in {} entries (load {})\n",
          a, s.what, ms(s.call_ms), s.seconds, s.frozen_seconds, mib(static_cast<double>(s.layer_bytes)),
          mib(static_cast<double>(s.stored_bytes)), mib(static_cast<double>(s.file_bytes)), s.entries, r.snapshot_load);
  }
  print_run_log(a, r.section_load, r.notes, r.problems);
}

std::string markdown_vm(const VmBenchResult& r) {
  const std::string& a = r.accelerator;
  std::string md = fmt::format("### Full VMs [{}]\n\n", a);
  md += fmt::format("Accelerator **{}** ({}). {}, dsecd {}, {} cores. Image {}; VMs of {}.\n\n", a,
                    r.accelerator_reason, r.qemu_version, r.agent_version, r.cores, r.image, shape(r));
  md += "| what | figure | load average |\n| --- | --- | --- |\n";
  if (!std::isnan(r.first_create_ms)) {
    md += fmt::format(
        "| [{}] create to ready, the shape's first (boot to the desktop, template, sandbox from it) | {} "
        "| {} |\n",
        a, seconds(r.first_create_ms), r.first_load);
    md +=
        fmt::format("| [{}] create to ready, the next {} (clones of the template) | p50 {}, max {} | {} |\n", a,
                    r.next_create.count(), seconds(r.next_create.empty() ? std::nan("") : r.next_create.percentile(50)),
                    seconds(r.next_create.empty() ? std::nan("") : r.next_create.max()), r.next_load);
  }
  if (!r.screenshot.empty())
    md += fmt::format("| [{}] screenshot, PNG {}x{} ({:.0f} KiB), n = {} | p50 {}, p99 {}, max {} | {} |\n", a,
                      r.png_width, r.png_height, static_cast<double>(r.png_bytes) / 1024, r.screenshot.count(),
                      lat(r.screenshot, 50), lat(r.screenshot, 99), lat_max(r.screenshot), r.screenshot_load);
  if (!r.input_call.empty())
    md += fmt::format(
        "| [{}] input to screen: `type_text(\"x\")` into the terminal until a screenshot differs, n = {} "
        "({} unchanged within {} s) | p50 {}, max {} (the input call alone: p50 {}) | {} |\n",
        a, r.input_call.count(), r.input_unchanged, kScreenTimeout.count(), lat(r.input_to_screen, 50),
        lat_max(r.input_to_screen), lat(r.input_call, 50), r.input_load);
  if (!r.sleep_error.empty()) md += fmt::format("| [{}] sleep and wake | failed: {} | |\n", a, r.sleep_error);
  else if (r.sleep_call_ms > 0)
    md += fmt::format(
        "| [{}] sleep; wake | {:.2f} s, charged {} → {}; {:.2f} s, to the first screenshot {}, to the "
        "first exec {}, charged {} after | {} |\n",
        a, r.sleep_seconds, mib(r.sleep_before_bytes), mib(r.sleep_after_bytes), r.wake_seconds,
        ms(r.wake_to_screenshot_ms), ms(r.wake_to_exec_ms), mib(r.wake_after_bytes), r.sleep_load);
  for (const auto& s : r.snapshots) {
    if (!s.error.empty())
      md += fmt::format("| [{}] snapshot ({}) | failed: {} | {} |\n", a, s.what, s.error, r.snapshot_load);
    else
      md += fmt::format("| [{}] snapshot ({}) | {} (frozen {:.2f} s); layer {}, {} of files | {} |\n", a, s.what,
                        ms(s.call_ms), s.frozen_seconds, mib(static_cast<double>(s.layer_bytes)),
                        mib(static_cast<double>(s.file_bytes)), r.snapshot_load);
  }
  if (!r.idle.empty()) {
    md += fmt::format("\n#### [{}] Memory of the {} idle VMs (settled {:.0f} s; load {})\n\n", a, r.idle.size(),
                      r.idle_settle_seconds, r.idle_load);
    md += "| VM | cgroup charge | of which shmem | QEMU RSS | QEMU PSS |\n| --- | --- | --- | --- | --- |\n";
    for (const auto& m : r.idle)
      md += fmt::format("| [{}] {} | {} | {} | {} | {} |\n", a, m.id, mib(m.cgroup_charge), mib(m.shmem),
                        mib(m.qemu_rss), mib(m.qemu_pss));
    md += fmt::format(
        "\nTemplates: {} holding {} of guest RAM (GET /v1/node), {} of it resident; the agent's cgroup "
        "subtree {} with the VMs up.\n",
        r.node_templates, mib(static_cast<double>(r.node_template_bytes)), mib(r.template_resident),
        mib(r.subtree_charge));
  }
  return md + markdown_run_log(a, r.section_load, r.notes, r.problems);
}

}  // namespace dsec::bench
