// dsec-bench reclaim: what the node's cold-memory reclaimer (docs/qos.md) takes back from idle sandboxes, and what
// the first step after it costs. K sandboxes each run a Python process that imported numpy (when the image has it)
// and a test suite's worth of standard modules, then idles, as an RL environment waits for the trainer's next step;
// a few more run the same with reclaim=false, the control. The bench keeps every sandbox in use (a file read each)
// until all workers idle, reads the host's memory and the sandboxes' cgroup charges, then leaves them alone until
// the reclaimer has taken each one once (SandboxInfo::cold_memory; reading a sandbox's info is not a use) and reads
// them again. Last, the first step on reclaimed sandboxes next to the control's: an exec that signals the worker,
// which walks all of its objects, touches the memory it holds and runs a numpy operation.
//
// The embedded agent gets a swap file of its own under the home (dsecd --swap-file, removed after) and a short
// --reclaim-age; with --endpoint the node's own swap and age are used, and a node without swap is skipped.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <set>
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
constexpr const char* kWorkDir = "/tmp/w";
constexpr const char* kFallbackImage = "bookworm-python";
constexpr std::size_t kThreads = 8;  // concurrent calls while starting, touching and destroying the sandboxes
constexpr auto kReadyTimeout = std::chrono::minutes(15);

// The worker: imports what a test run of a Python project would (numpy when present), holds `hold` MiB of random
// bytes (-1: none with numpy, 48 without), tells the bench it is ready, and idles. On SIGUSR1 it takes one step:
// walks every object (a collection), touches every page it holds, runs a numpy operation, and writes
// "ok <ms> <objects>" into the FIFO `step`, which the bench's exec reads.
constexpr const char* kWorker = R"PY(import gc, os, signal, sys, time
t0 = time.monotonic()
d, hold = sys.argv[1], int(sys.argv[2])
MODULES = """unittest unittest.mock doctest json re collections itertools functools typing dataclasses enum pathlib
tempfile shutil subprocess argparse logging logging.handlers configparser csv sqlite3 decimal fractions statistics
random datetime calendar zoneinfo email email.mime.text email.parser http.client http.server urllib.request
urllib.parse xml.etree.ElementTree xml.dom.minidom html.parser hashlib hmac secrets base64 binascii struct pickle copy
pprint textwrap difflib string io gzip bz2 lzma zipfile tarfile threading concurrent.futures multiprocessing asyncio
socket ssl select selectors queue heapq bisect weakref contextlib inspect ast dis tokenize traceback warnings platform
locale gettext uuid glob fnmatch filecmp timeit trace pdb cProfile pstats ctypes sysconfig importlib.metadata
""".split()
loaded = 0
for name in MODULES:
    try:
        __import__(name)
        loaded += 1
    except Exception:
        pass
try:
    import numpy
    import numpy.linalg, numpy.random, numpy.testing
    numpy.linalg.inv(numpy.eye(16) * 2.0)
except ImportError:
    numpy = None
if hold < 0:
    hold = 0 if numpy is not None else 48
held = os.urandom(hold << 20) if hold else b""

def put(name, text):
    tmp = os.path.join(d, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, os.path.join(d, name))

def step(signum, frame):
    t = time.monotonic()
    objects = len(gc.get_objects())
    gc.collect()
    touched = sum(memoryview(held)[::4096]) if held else 0
    if numpy is not None:
        a = numpy.arange(4096, dtype=numpy.float64)
        float(a @ a)
    with open(os.path.join(d, "step"), "w") as f:
        f.write("ok %.3f %d\n" % ((time.monotonic() - t) * 1000, objects))

fifo = os.path.join(d, "step")
if not os.path.exists(fifo):
    os.mkfifo(fifo)
signal.signal(signal.SIGUSR1, step)
put("pid", str(os.getpid()))
put("ready", "%d %d %d %.0f" % (loaded, numpy is not None, hold, (time.monotonic() - t0) * 1000))
while True:
    signal.pause()
)PY";

// Calls fn(i) for i in [0, n) on kThreads threads; the first error is thrown once all have stopped.
void for_each_parallel(std::size_t n, const std::function<void(std::size_t)>& fn) {
  std::atomic<std::size_t> next{0};
  std::exception_ptr first;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (std::size_t t = 0; t < std::min(kThreads, n); ++t)
    threads.emplace_back([&] {
      for (std::size_t i = next++; i < n; i = next++) {
        try {
          fn(i);
        } catch (...) {
          std::lock_guard lock(mu);
          if (!first) first = std::current_exception();
          next = n;
        }
      }
    });
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

struct Worker {
  Worker(Sandbox sb, bool is_control) : sandbox(std::move(sb)), control(is_control) {}
  Sandbox sandbox;
  bool control = false;
  std::atomic<double> started_at{0};  // unix seconds: its worker was started (0: not yet)
  std::atomic<bool> ready{false};     // its worker said so
};

// Keeps every sandbox in use until stop(): a thread reads each one's ready file in passes (a file call is a use, so
// the reclaimer leaves them alone), marking the workers that are ready and failing on one whose log shows it died.
class KeepInUse {
 public:
  explicit KeepInUse(std::deque<Worker>& workers) : workers_(workers), thread_([this] { run(); }) {}
  ~KeepInUse() { stop(); }
  void stop() {
    stopping_ = true;
    if (thread_.joinable()) thread_.join();
  }
  std::size_t ready() const {
    return static_cast<std::size_t>(
        std::count_if(workers_.begin(), workers_.end(), [](const Worker& w) { return w.ready.load(); }));
  }
  void rethrow_failure() {
    std::lock_guard lock(mu_);
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  void run() {
    while (!stopping_) {
      try {
        for_each_parallel(workers_.size(), [&](std::size_t i) { touch(workers_[i]); });
      } catch (...) {
        std::lock_guard lock(mu_);
        failure_ = std::current_exception();
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
  }
  static void touch(Worker& w) {
    try {
      w.sandbox.read_file(fmt::format("{}/ready", kWorkDir));
      w.ready = true;
      return;
    } catch (const Error& e) {
      if (e.code() != Code::kNotFound) throw;
    }
    if (w.started_at == 0) return;
    std::string log;
    try {
      log = w.sandbox.read_file(fmt::format("{}/log", kWorkDir));
    } catch (const Error& e) {
      if (e.code() != Code::kNotFound) throw;
    }
    if (log.find("Error") != std::string::npos || log.find("not found") != std::string::npos)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("the Python worker in sandbox {} failed: {}", w.sandbox.id(), log));
  }

  std::deque<Worker>& workers_;
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::exception_ptr failure_;
  std::thread thread_;  // last: started once the rest is set
};

struct MemoryView {
  double mem_available = 0, swap_used = 0;
  double charge = 0, control_charge = 0, rss = 0;
};

MemoryView read_memory(const std::deque<Worker>& workers) {
  MemoryView v;
  std::map<std::string, double> meminfo = meminfo_settled();
  v.mem_available = meminfo["MemAvailable"];
  v.swap_used = meminfo["SwapTotal"] - meminfo["SwapFree"];
  std::set<std::string> ids;
  std::set<std::string> control;
  for (const auto& w : workers) {
    ids.insert(w.sandbox.id());
    if (w.control) control.insert(w.sandbox.id());
  }
  SandboxProcesses found = find_sandbox_processes(ids);
  for (const auto& [id, dir] : found.memory_cgroup)
    (control.count(id) ? v.control_charge : v.charge) += static_cast<double>(cgroup_memory_bytes(dir));
  for (const auto& [id, pids] : found.pids)
    if (!control.count(id))
      for (int pid : pids) v.rss += static_cast<double>(rss_bytes(pid));
  return v;
}

struct StepTime {
  double round_trip_ms = 0, inside_ms = 0;
};

StepTime take_step(const Sandbox& sb) {
  auto t0 = Clock::now();
  ExecResult r = sb.exec(fmt::format("kill -USR1 $(cat {0}/pid) && cat {0}/step", kWorkDir), 120);
  StepTime s;
  s.round_trip_ms = ms_since(t0);
  std::istringstream in(r.stdout_data);
  std::string verdict;
  in >> verdict >> s.inside_ms;
  if (r.exit_code != 0 || verdict != "ok")
    throw Error(Code::kInternal, fmt::format("the step in sandbox {} failed (exit code {}): {}{}", sb.id(), r.exit_code,
                                             r.stdout_data, r.stderr_data));
  return s;
}

// The first step after the idle time and the next one, back to back: round trips and the worker's own times.
void two_steps(const Sandbox& sb, Latency& first, Latency& first_inside, Latency& second, Latency& second_inside) {
  StepTime a = take_step(sb);
  StepTime b = take_step(sb);
  first.add(a.round_trip_ms);
  first_inside.add(a.inside_ms);
  second.add(b.round_trip_ms);
  second_inside.add(b.inside_ms);
}

bool has_image(Client& client, const std::string& name) {
  const std::string wanted = name.find(':') == std::string::npos ? name + ":latest" : name;
  for (const auto& image : client.images())
    if (image.reference == wanted) return true;
  return false;
}

std::string mib(double bytes) { return std::isnan(bytes) ? "n/a" : fmt::format("{:.0f} MiB", bytes / kMiB); }

// The probes' rows, as both the text and the Markdown show them.
std::vector<std::pair<std::string, const Latency*>> step_rows(const ReclaimBenchResult& r) {
  return {{"reclaimed: first step, exec round trip", &r.first_reclaimed},
          {"reclaimed: first step, the worker's own time", &r.first_reclaimed_inside},
          {"reclaimed: second step, exec round trip", &r.second_reclaimed},
          {"reclaimed: second step, the worker's own time", &r.second_reclaimed_inside},
          {"control: first step, exec round trip", &r.first_control},
          {"control: first step, the worker's own time", &r.first_control_inside},
          {"control: second step, exec round trip", &r.second_control},
          {"control: second step, the worker's own time", &r.second_control_inside}};
}

double less_pct(double before, double after) { return before > 0 ? (before - after) / before * 100 : std::nan(""); }

}  // namespace

ReclaimBenchResult run_reclaim(const Options& o, const std::string& home) {
  ReclaimBenchResult result;
  result.cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  result.count = o.given.count("-k") || o.given.count("--count") ? o.density_count : 200;
  result.control = o.reclaim_control;
  result.age_seconds = o.reclaim_age_seconds;
  const std::size_t hold_guess = o.reclaim_hold_mib.value_or(48);
  result.memory_limit = (hold_guess + 256) << 20;
  const std::size_t total = result.count + result.control;

  SwapDir swap_dir;  // destroyed after the client, so after the agent stopped
  swap_dir.notes = &result.notes;
  ClientOptions copts;
  if (o.endpoints.empty()) {
    swap_dir.dir = fs::path(home) / fmt::format("bench-reclaim-swap-{}", ::getpid());
    fs::create_directories(swap_dir.dir);
    agent::SwapFilesystem fs_kind = agent::swap_filesystem(swap_dir.dir);
    if (!fs_kind.can_hold_swap) {
      result.skipped = fmt::format(
          "no swap possible: {} is on {}, which cannot hold a swap file (give --home on a "
          "disk filesystem, or --endpoint of a node with swap)",
          swap_dir.dir.string(), fs_kind.name);
      return result;
    }
    const std::uint64_t swap_bytes =
        o.sleep_swap_bytes ? o.sleep_swap_bytes
                           : static_cast<std::uint64_t>(total) * (hold_guess + 32) * (1 << 20) + (1ull << 30);
    swap_dir.file = swap_dir.dir / "swapfile";
    const double mem_total = static_cast<double>(meminfo_bytes("MemTotal"));
    const double mem_ratio = std::max(
        2.0, (static_cast<double>(total) * static_cast<double>(result.memory_limit) + (1 << 30)) / mem_total * 1.2);
    copts.home = home;
    copts.agent_binary = o.agent_binary;
    copts.agent_args = {"--backends",          "container",
                        "--swap-file",         swap_dir.file.string(),
                        "--swap-size",         std::to_string(swap_bytes),
                        "--reclaim-age",       std::to_string(o.reclaim_age_seconds),
                        "--memory-overcommit", fmt::format("{:.2f}", mem_ratio)};
    copts.agent_args.insert(copts.agent_args.end(), o.agent_args.begin(), o.agent_args.end());
    result.swap = fmt::format("a {:.1f} GiB swap file on {} ({}), made by the embedded agent and removed after",
                              static_cast<double>(swap_bytes) / (1ull << 30), fs_kind.name, swap_dir.file.string());
  } else {
    copts.endpoints = o.endpoints;
  }
  copts.call_deadline = std::chrono::minutes(5);
  copts.request_timeout = std::chrono::minutes(2);

  fmt::print(stderr, "dsec-bench: starting the client{}\n",
             o.endpoints.empty() ? " and an embedded agent with swap" : "");
  Client client(copts);
  NodeInfo node = client.nodes().front();
  result.cgroup = node.cgroup_version;
  result.reclaim_mode = node.qos.reclaim;
  result.reclaim_reason = node.qos.reclaim_reason;
  result.agent = o.endpoints.empty() ? fmt::format("embedded dsecd {} (home {})", node.version, home)
                                     : fmt::format("dsecd {} at {}", node.version, client.endpoint());
  if (!o.endpoints.empty()) {
    result.swap = fmt::format("the node's own: {} MiB", node.swap_bytes >> 20);
    result.age_seconds = 0;  // the node's, not known to the client
    if (node.swap_bytes == 0) result.skipped = "no swap on the node: the reclaimer can release page cache only";
  }
  if (node.qos.reclaim == "off")
    result.skipped = fmt::format("the node's reclaimer is off: {}", node.qos.reclaim_reason);
  if (!result.skipped.empty()) return result;

  result.image = o.reclaim_image;
  if (!has_image(client, result.image)) {
    if (o.given.count("--reclaim-image") || !has_image(client, kFallbackImage))
      throw Error(Code::kNotFound,
                  fmt::format("image {} is not in the store (build it: dsec image build bookworm-numpy --from "
                              "debootstrap:bookworm --include python3,python3-numpy; or {} with --include python3)",
                              result.image, kFallbackImage));
    result.notes.push_back(
        fmt::format("{} is not in the store: {} (python3 without numpy) is used", result.image, kFallbackImage));
    result.image = kFallbackImage;
  }

  SandboxSpec spec = bench_spec(o);
  spec.image = result.image;
  spec.resources.cpu = 0.25;
  spec.resources.memory_bytes = result.memory_limit;
  spec.ttl = std::chrono::seconds(7200);
  spec.labels["dsec-bench-reclaim"] = std::to_string(::getpid());
  SandboxSpec control_spec = spec;
  control_spec.resources.reclaim = false;

  CpuMeter cpu({agent_pid_for(client)}, /*descendants=*/true);  // the sandboxes' processes count as the agent's
  result.mem_available_start = static_cast<double>(mem_available_settled());
  fmt::print(stderr, "dsec-bench reclaim: creating {} sandboxes of {} and {} with reclaim=false\n", result.count,
             result.image, result.control);
  const auto t0 = Clock::now();
  std::deque<Worker> workers;
  for (auto& sb : client.create_many(result.count, spec)) workers.emplace_back(std::move(sb), false);
  if (result.control)
    for (auto& sb : client.create_many(result.control, control_spec)) workers.emplace_back(std::move(sb), true);
  result.create_seconds = ms_since(t0) / 1000;

  // In use from now until the first reading, so that no worker's memory is reclaimed before it is read.
  KeepInUse keep(workers);
  const std::string hold_arg = o.reclaim_hold_mib ? std::to_string(*o.reclaim_hold_mib) : "-1";
  for_each_parallel(workers.size(), [&](std::size_t i) {
    Worker& w = workers[i];
    w.sandbox.write_file(fmt::format("{}/worker.py", kWorkDir), kWorker);
    w.started_at = unix_now();
    ExecResult r = w.sandbox.exec(fmt::format("python3 {0}/worker.py {0} {1} >{0}/log 2>&1 &", kWorkDir, hold_arg), 60);
    if (r.exit_code != 0)
      throw Error(Code::kInternal, fmt::format("starting the worker in {}: exit code {}: {}", w.sandbox.id(),
                                               r.exit_code, r.stderr_data));
  });
  for (std::size_t ready = keep.ready(); ready < workers.size(); ready = keep.ready()) {
    keep.rethrow_failure();
    if (Clock::now() - t0 > kReadyTimeout)
      throw Error(Code::kDeadlineExceeded, fmt::format("only {} of {} workers were ready after {:.0f} s", ready,
                                                       workers.size(), ms_since(t0) / 1000));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  result.ready_seconds = ms_since(t0) / 1000;
  {
    std::istringstream ready(workers.front().sandbox.read_file(fmt::format("{}/ready", kWorkDir)));
    int numpy = 0, hold = 0;
    ready >> result.modules >> numpy >> hold;
    result.workload = fmt::format("python3 that imported {} standard modules{}{}, then idles in signal.pause()",
                                  result.modules, numpy ? " and numpy" : " (no numpy in the image)",
                                  hold ? fmt::format(" and holds {} MiB of random bytes", hold) : "");
  }
  fmt::print(stderr, "dsec-bench reclaim: all {} workers idle after {:.1f} s; settling\n", workers.size(),
             result.ready_seconds);
  std::this_thread::sleep_for(std::chrono::seconds(3));  // still in use: page cache and allocators settle
  keep.rethrow_failure();

  const auto labels = Labels{{"dsec-bench-reclaim", std::to_string(::getpid())}};
  MemoryView before = read_memory(workers);
  keep.stop();
  const double before_at = unix_now();
  std::map<std::string, double> started;
  for (const auto& w : workers) started[w.sandbox.id()] = w.started_at;
  for (const auto& info : client.list(labels))
    result.reclaimed_early += info.cold_memory.last_reclaim_at > started[info.id];
  result.mem_available_before = before.mem_available;
  result.swap_used_before = before.swap_used;
  result.charge_before = before.charge;
  result.control_charge_before = before.control_charge;
  result.rss_before = before.rss;

  // Nobody touches them now; the reclaimer takes each one after its age.
  std::set<std::string> control_ids;
  for (const auto& w : workers)
    if (w.control) control_ids.insert(w.sandbox.id());
  const auto t1 = Clock::now();
  const double timeout_s =
      static_cast<double>(std::max<std::size_t>(result.age_seconds, 120)) * 2 + 2.0 * static_cast<double>(result.count);
  fmt::print(stderr, "dsec-bench reclaim: waiting for the reclaimer (up to {:.0f} s)\n", timeout_s);
  double last_print = 0;
  for (;;) {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    result.reclaimed_once = 0;
    for (const auto& info : client.list(labels))
      if (!control_ids.count(info.id) && info.cold_memory.last_reclaim_at > before_at) ++result.reclaimed_once;
    const double waited = ms_since(t1) / 1000;
    if (result.reclaimed_once >= result.count) break;
    if (waited > timeout_s) {
      result.notes.push_back(fmt::format("only {} of {} sandboxes were reclaimed within {:.0f} s",
                                         result.reclaimed_once, result.count, timeout_s));
      break;
    }
    if (waited - last_print >= 10) {
      fmt::print(stderr, "  {:.0f} s: {} of {} reclaimed\n", waited, result.reclaimed_once, result.count);
      last_print = waited;
    }
  }
  result.reclaim_seconds = ms_since(t1) / 1000;
  std::this_thread::sleep_for(std::chrono::seconds(2));
  MemoryView after = read_memory(workers);
  result.mem_available_after = after.mem_available;
  result.swap_used_after = after.swap_used;
  result.charge_after = after.charge;
  result.control_charge_after = after.control_charge;
  result.rss_after = after.rss;
  std::vector<std::size_t> reclaimed, control;
  for (std::size_t i = 0; i < workers.size(); ++i) {
    if (workers[i].control) {
      control.push_back(i);
      continue;
    }
    SandboxInfo info = workers[i].sandbox.info();
    result.reclaimed_bytes += info.cold_memory.reclaimed_bytes;
    result.reclaims += info.cold_memory.reclaims;
    result.refaults += info.cold_memory.refaults;
    if (info.cold_memory.last_reclaim_at > before_at) reclaimed.push_back(i);
  }
  for (const auto& info : client.list(labels))
    if (control_ids.count(info.id) && info.cold_memory.reclaims > 0)
      result.notes.push_back(fmt::format("control sandbox {} (reclaim=false) was reclaimed", info.id));
  result.node_reclaimed_bytes = client.nodes().front().qos.reclaimed_bytes;

  // The first step on reclaimed sandboxes (spread over the order they were made) and on the control, alternating.
  const std::size_t probes = std::min(reclaimed.size(), std::max<std::size_t>(control.size(), 1));
  for (std::size_t p = 0; p < probes; ++p) {
    const Sandbox& r = workers[reclaimed[p * reclaimed.size() / probes]].sandbox;
    const std::uint64_t refaults = r.info().cold_memory.refaults;
    two_steps(r, result.first_reclaimed, result.first_reclaimed_inside, result.second_reclaimed,
              result.second_reclaimed_inside);
    result.probe_refaults += r.info().cold_memory.refaults - refaults;
    if (p < control.size())
      two_steps(workers[control[p]].sandbox, result.first_control, result.first_control_inside, result.second_control,
                result.second_control_inside);
  }
  result.cpu = cpu.stop();

  fmt::print(stderr, "dsec-bench reclaim: destroying {} sandboxes\n", workers.size());
  for_each_parallel(workers.size(), [&](std::size_t i) { workers[i].sandbox.destroy(); });
  client.close();  // the agent stops and turns its swap off
  return result;
}

void print_reclaim(const ReclaimBenchResult& r) {
  fmt::print("\n== reclaim: idle Python sandboxes before and after the cold-memory reclaimer ==\n");
  if (!r.skipped.empty()) {
    fmt::print("  skipped: {}\n", r.skipped);
    return;
  }
  const double k = static_cast<double>(r.count);
  fmt::print("  agent: {}, cgroup {}; reclaimer {}: {}\n  swap: {}\n", r.agent, r.cgroup, r.reclaim_mode,
             r.reclaim_reason, r.swap);
  fmt::print("  {} sandboxes of {} ({} with reclaim=false), each: {}; memory limit {}\n", r.count + r.control, r.image,
             r.control, r.workload, mib(static_cast<double>(r.memory_limit)));
  fmt::print(
      "  created in {:.1f} s; every worker idle after {:.1f} s; {} reclaimed after their worker started and "
      "before the first reading\n",
      r.create_seconds, r.ready_seconds, r.reclaimed_early);
  fmt::print(
      "  reclaimer: {} of {} taken at least once in {:.0f} s (age {} s); {} reclaims, {} reclaimed, {} "
      "refaults (pages)\n",
      r.reclaimed_once, r.count, r.reclaim_seconds, r.age_seconds, r.reclaims,
      mib(static_cast<double>(r.reclaimed_bytes)), r.refaults);
  fmt::print("  {:<46} {:>12} {:>12} {:>9} {:>14} {:>14}\n", "", "before", "after", "less", "before/sandbox",
             "after/sandbox");
  auto row = [&](const std::string& name, double b, double a) {
    fmt::print("  {:<46} {:>12} {:>12} {:>8.1f}% {:>14} {:>14}\n", name, mib(b), mib(a), less_pct(b, a),
               fmt::format("{:.1f} MiB", b / k / kMiB), fmt::format("{:.1f} MiB", a / k / kMiB));
  };
  row("cgroup charges of the reclaimable sandboxes", r.charge_before, r.charge_after);
  row("RSS of their processes", r.rss_before, r.rss_after);
  row("host memory in use by them (MemAvailable drop)", r.mem_available_start - r.mem_available_before,
      r.mem_available_start - r.mem_available_after);
  fmt::print("  control ({}): charges {} -> {}; host swap in use {} -> {}\n", r.control, mib(r.control_charge_before),
             mib(r.control_charge_after), mib(r.swap_used_before), mib(r.swap_used_after));
  print_header();
  for (const auto& [name, latency] : step_rows(r)) print_row(name, *latency);
  fmt::print("  pages read back by the probed reclaimed sandboxes over their two steps: {}\n", r.probe_refaults);
  print_cpu(r.cpu, r.cores, "  load: ");
  for (const auto& n : r.notes) fmt::print("  note: {}\n", n);
}

std::string markdown_reclaim(const ReclaimBenchResult& r) {
  std::string md = "### Cold-memory reclaim of idle sandboxes\n\n";
  if (!r.skipped.empty()) return md + fmt::format("Skipped: {}.\n", r.skipped);
  const double k = static_cast<double>(r.count);
  md += fmt::format(
      "Agent: {}, cgroup {}; reclaimer `{}` ({}). Swap: {}. {} sandboxes of `{}` (cpu 0.25, memory limit {}), each "
      "running a {}; {} more with `reclaim=false` as the control. `create_many` of all: {:.1f} s; every worker idle "
      "{:.1f} s after the first create. The bench read a file of every sandbox in passes from its create until the "
      "first reading (a use each): {} were reclaimed after their worker started and before that reading.\n\n",
      r.agent, r.cgroup, r.reclaim_mode, r.reclaim_reason, r.swap, r.count, r.image,
      mib(static_cast<double>(r.memory_limit)), r.workload, r.control, r.create_seconds, r.ready_seconds,
      r.reclaimed_early);
  md +=
      "| measure | before | after the reclaimer | less | per sandbox before → after |\n"
      "| --- | --- | --- | --- | --- |\n";
  auto row = [&](const std::string& name, double b, double a) {
    md += fmt::format("| {} | {} | {} | {:.1f}% | {:.1f} → {:.1f} MiB |\n", name, mib(b), mib(a), less_pct(b, a),
                      b / k / kMiB, a / k / kMiB);
  };
  row(fmt::format("charged to the {} reclaimable sandboxes' memory cgroups", r.count), r.charge_before, r.charge_after);
  row("RSS of their processes", r.rss_before, r.rss_after);
  row("host memory they hold (MemAvailable at the start less now)", r.mem_available_start - r.mem_available_before,
      r.mem_available_start - r.mem_available_after);
  md += fmt::format(
      "\nThe reclaimer took {} of {} sandboxes at least once within {:.0f} s of the first reading (age {} s): {} "
      "reclaims, {} in all, {} pages read back since. Host swap in use {} → {}; the control's charges {} → {}.\n\n",
      r.reclaimed_once, r.count, r.reclaim_seconds, r.age_seconds, r.reclaims,
      mib(static_cast<double>(r.reclaimed_bytes)), r.refaults, mib(r.swap_used_before), mib(r.swap_used_after),
      mib(r.control_charge_before), mib(r.control_charge_after));
  md +=
      "| the first step after the idle time (exec: signal the worker, which walks its objects, touches its memory, "
      "runs numpy) | p50 | p90 | p99 | max |\n| --- | --- | --- | --- | --- |\n";
  auto lat = [&](const std::string& name, const Latency& l) {
    md += fmt::format("| {} (n = {}) | {:.1f} ms | {:.1f} ms | {:.1f} ms | {:.1f} ms |\n", name, l.count(),
                      l.percentile(50), l.percentile(90), l.percentile(99), l.max());
  };
  for (const auto& [name, latency] : step_rows(r)) lat(name, *latency);
  md += fmt::format("\nPages the probed reclaimed sandboxes read back over their two steps: {}.\n\n", r.probe_refaults);
  const double charge_less = less_pct(r.charge_before, r.charge_after);
  const double host_less =
      less_pct(r.mem_available_start - r.mem_available_before, r.mem_available_start - r.mem_available_after);
  md += fmt::format(
      "| target | measured | verdict |\n| --- | --- | --- |\n"
      "| idle sandboxes hold >= 30% less memory after reclaim (DSec: 21.2%) | cgroup charges {:.1f}% "
      "less, host {:.1f}% less | {} |\n",
      charge_less, host_less, charge_less >= 30 && host_less >= 30 ? "**met**" : "**not met**");
  md += fmt::format("\nLoad: {} (the sandboxes' processes count as the agent's).\n", cpu_text(r.cpu, r.cores));
  for (const auto& n : r.notes) md += fmt::format("- {}\n", n);
  return md;
}

}  // namespace dsec::bench
