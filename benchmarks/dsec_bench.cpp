// dsec-bench: measures dsec's container sandboxes against their peers on this machine, in one run.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bench.hpp"
#include "common/syscall.hpp"
#include "dsec/error.hpp"
#include "dsec/version.hpp"
#include "host.hpp"
#include "peers.hpp"

namespace dsec::bench {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kUsage = R"(usage: dsec-bench COMMAND [flags]

Measures dsec container sandboxes side by side with crun and bubblewrap (and a host fork+exec) on this machine,
in one run, and prints the machine and its load with the figures.

Commands:
  create       sequential create-to-ready latency (p50/p90/p99/max) of a sandbox, each destroyed after outside the
               timed part; next to `crun run` of an OCI bundle of the same root (whole lifecycle of `true`) and
               `bwrap --unshare-all --ro-bind ROOT / --proc /proc --dev /dev true`
  throughput   completed creates per second at each concurrency (create then destroy in a closed loop), next to
               `crun run` and `bwrap` run in parallel
  exec         round trip of `true` in a live sandbox, next to posix_spawn + wait of the same static binary
  density      K idle sandboxes: host memory per sandbox, then the time to destroy them all
  cgroup-join  kernel floor under every create: a fresh process joining fresh cgroups (the hierarchies dsec's
               runtime uses here) after idle gaps of 0, 10 and 50 ms; needs no agent
  image        cold starts of a >1 GiB image (Debian + python3, a compiler toolchain, a Python project with tests:
               bench/base, bench/toolchain, bench/task in <home>/store, built with the dsec CLI when missing): time
               from create to the first exec result and bytes fetched, with the agent streaming layers lazily and
               with it pulling and extracting them whole; then concurrent cold starts of each (wall time, bytes
               written). Not part of `all`
  pulse        a pulse over many nodes: a private etcd and --agents agents on this machine (tmpfs homes), a
               Client that finds them through etcd only, and one create_group (or create_many) of --sandboxes
               sandboxes of the null backend (a control-plane simulation: admitted and recorded, nothing started);
               then --real-sandboxes busybox containers over --real-agents agents the same way. Time until all are
               acknowledged, creates/s, the client's CPU and peak memory, the agents' CPU, sandboxes per agent,
               destroy time. Not part of `all`
  sleep        sandboxes holding --sleep-sizes MiB of anonymous memory (dsec-memhold: pseudo-random pages and a
               checksum) sleep in place and wake, --sleep-rounds times each: memory charged before and after the
               sleep and how much went to swap, sleep and wake times, wake to the first exec's result, and an exec
               that touches all the memory again (next to the same exec while it was resident). The embedded agent
               sets up a swap file of its own under the home (dsecd --swap-file) and turns it off at the end; the
               file is removed. Then everything `snapshot` measures. Not part of `all`
  snapshot     Sandbox::snapshot of a sandbox that wrote --sizes MiB of random files: the time its processes
               stood still and the whole snapshot, --repeat times per size; a create from the largest snapshot
               to its first exec; then fork(--forks): the time until all forks answered an exec. Snapshots go to
               a store of their own under the work directory, emptied as the run goes. Not part of `all`
  fncall       function calls: python `print(1+1)` through Client::run_code (the fncall backend's warm pools over
               --fncall-image) next to a cold `/usr/bin/python3 -c` per call on the host and an exec of `python3 -c`
               in a container sandbox of the same image: sequential p50/p90/p99 with the three alternating, then
               calls per second at each --concurrency. Not part of `all`
  microvm      QEMU microVMs (kind "microvm"), every figure naming the accelerator (GET /v1/node): create to the
               first exec of `true` (-n sequential each; default 20) from a template, cold (a second agent with
               --microvm-templates off), next to a plain qemu-system-x86_64 boot of the same guest kernel to a marker
               on its console and a container; exec round trips back to back and after 1 s of think time; host
               memory per idle VM (--idle clones, --idle-cold cold boots: PSS with its anon/file/shmem breakdown and
               the template's share, MemAvailable per VM); density (clones in batches up to --density, stopping when
               MemAvailable < 2 GiB or creates fail: memory, CPU of the idle VMs, an exec in every one, teardown);
               sleep and wake of VMs holding 64 and 192 MiB (dsec-memhold; --sleep-sizes); fork(8) of a VM running a
               background process (--forks). Starts its own agents; builds the image with the dsec CLI when missing.
               Not part of `all`
  vm           full VMs (kind "vm": q35 booting the image's own kernel and systemd, with a screen) of the desktop
               image (scripts/desktop-image.sh builds it), 2 vCPUs, 1 GiB, 1024x768, every figure naming the
               accelerator (GET /v1/node) and the load: create to ready of the shape's first VM (a boot of the whole
               system, frozen as the template) and of the next ones (its clones; --vm-n creates in all, default 3);
               screenshot latency (-n, default 20); one key typed into the focused terminal until a screenshot
               differs (half as many samples); memory of the idle VMs (cgroup charge, QEMU PSS, the template's RAM);
               sleep and wake of one VM; snapshots of it (into a store of the run's own). Starts its own agent
               (--backends container,vm). Not part of `all`
  network      create-to-ready with network "egress" (3 rules) against "none", alternating; the latency of a rule
               change (set_network) on a live sandbox; both again with -k sandboxes holding rules on the node. No
               traffic is sent. Not part of `all`
  session      shell sessions: run("true") next to an exec of `true` (alternating, back to back and after 1 s
               idle), then a 40-step SWE-style episode through one session and through execs. Not part of `all`
  qos          classes of service: a latency-class sandbox answers a fixed step (an exec of a 3000-iteration
               shell loop, a few ms, timed by the client, the agent and inside the sandbox) every --think ms, on an
               idle node, beside -k spinner sandboxes (default 2 per core, a core each) with priorities on (the
               stepper latency, the spinners batch) and off (all standard): p50/p99 and p99 inflation over idle (-n
               steps per row, default 500, the rows taking turns --rounds times, default 5); then the same on an
               agent started with --latency-cpus (default: the last CPU). Starts its own agents. Not part of `all`
  reclaim      cold-memory reclaim: -k idle sandboxes (default 200) of --reclaim-image each running python3 that
               imported numpy and ~90 standard modules, plus --control more with reclaim=false; host memory and
               their cgroup charges before and after the reclaimer took every one (an agent of its own with a swap
               file under the home, --reclaim-age); the first step on a reclaimed sandbox next to the control's;
               the time to create them all. Not part of `all`
  pulse-node   a pulse on one node: --pulse-n creates (default 1000, 0.01 cores and 16 MiB each) at once from
               --pulse-threads threads (default 32), on an agent without a pool and then on one keeping a warm pool
               of --pulse-n (dsecd --warm-pool): time until all are ready, per-create latency, the pool's claims and
               misses; then, on the pooled agent, creates/s in a closed loop against `crun run` and `bwrap` (the
               throughput benchmark's loop, --concurrency levels). Starts its own agents. Not part of `all`
  registry     an image of an OCI registry (Debian + python3, build-essential, git, python3-dev, cmake; 3 gzip
               layers; cached under <home>/cache) pushed into a private docker-registry on loopback: dsec's import
               next to skopeo copy + umoci unpack, a second image sharing its layers, a create of it on a fresh
               agent that must import it, and a create of it on a cold node; prints as it goes. Not part of `all`
  all          all of the above but image, pulse, sleep, snapshot, fncall, microvm, vm, network, qos, reclaim,
               registry and pulse-node, then a
               Markdown summary for docs/benchmarks.md

Flags:
  --endpoint URL         use a running agent ("unix:/run/dsec/dsecd.sock", "http://host:7070"); repeatable
  --home DIR             image store (DIR/images) for the peers' root and, without --endpoint, the home of the
                         embedded agent this starts (default $DSEC_HOME, then /var/lib/dsec)
  --agent PATH           the dsecd binary of the embedded agent (default: the library's search)
  --agent-arg ARG        one more flag for the embedded agent of create, throughput, exec, density, fncall,
                         snapshot, sleep, qos and reclaim (repeatable: --agent-arg --userns --agent-arg off)
  --image NAME           image to create (default busybox); its root is also the peers' root
  --rootfs DIR           the peers' root instead of the image's directory in the store
  --work-dir DIR         where the OCI bundle, crun's state and the peers' logs go (default: a new /tmp dir)
  --peers LIST           crun,bwrap (default); "none" for dsec alone. Explicit peers that cannot run are an error
  -n N                   samples per latency measure (default 200; microvm, vm: 20)
  --warmup N             discarded iterations before measuring (default 10; microvm: 1)
  --concurrency LIST     throughput levels (default 1,2,4,8,16)
  --duration SECONDS     throughput: measured time per system and level (default 5)
  --rounds N             throughput: the systems take turns in N windows of SECONDS/N each (default 5); qos: the rows
                         take turns N times, n/N steps each (default 5)
  -k, --count K          density: idle sandboxes (default 500); qos: spinners (default 2 per core); reclaim: idle
                         sandboxes (default 200)
  --density-cpu CORES    density: cpu per sandbox (default 0.01)
  --density-memory SIZE  density: memory limit per sandbox (default 16Mi)
  --teardown-concurrency N   density: threads destroying (default 8)
  --cold N               image: single cold starts per layer mode (default 3)
  --starts N             image: concurrent cold starts per layer mode (default 32; 0 skips them)
  --layer-modes LIST     image: the agent's --layer-mode values to compare (default lazy,extract)
  --dsec PATH            image, pulse: the dsec CLI that builds images (default: the one beside dsec-bench)
  --sandboxes N          pulse: null-backend sandboxes in the pulse (default 32000; 0 skips it)
  --agents N             pulse: agents serving them (default 16)
  --real-sandboxes N     pulse: container sandboxes in the real pulse (default 500; 0 skips it)
  --real-agents N        pulse: agents serving them (default 4)
  --pulse-api API        pulse: group (Client::create_group, default) or many (Client::create_many)
  --pulse-dir DIR        pulse: a new directory under DIR holds the agents' homes, sandbox records and run
                         directories (default: under /dev/shm, a tmpfs, so that disk writes do not decide the
                         figures; give a disk's directory to measure with them)
  --sleep-sizes LIST     sleep: MiB each sandbox holds (default 64,256,1024; microvm: 64,192)
  --sleep-rounds N       sleep: sleep/wake cycles per size (default 2)
  --swap-size SIZE       sleep, reclaim: the embedded agent's swap file (default: sleep the largest size + 512Mi;
                         reclaim (hold + 32 MiB) per sandbox + 1Gi)
  --sizes LIST           snapshot: MiB written before the snapshots (default 1,16,64,256)
  --repeat N             snapshot: snapshots per size and fork rounds (default 3; 256 MiB and more at most 2)
  --forks N              snapshot, microvm: sandboxes per fork (default 16, microvm 8; 0 skips the fork)
  --fncall-image NAME    fncall: the image of the calls and of the sandbox (default bookworm-python; needs python3)
  --idle K               microvm: idle template clones measured for memory (default 16; 0 skips)
  --idle-cold K          microvm: idle cold-booted VMs measured for memory (default 4; 0 skips)
  --density N            microvm: idle clones to reach in the density run (default 200; 0 skips it)
  --density-batch N      microvm: creates per batch in the density run (default 10)
  --think MS             qos: think time between two steps (default 20)
  --latency-cpus LIST    qos: the reserved-CPU rows' agent's --latency-cpus (default: the last CPU; none skips them)
  --reclaim-image NAME   reclaim: the workers' image (default bookworm-numpy, falling back to bookworm-python; needs
                         python3; build: dsec image build bookworm-numpy --from debootstrap:bookworm --include
                         python3,python3-numpy)
  --control K            reclaim: sandboxes with reclaim=false, the never-reclaimed control (default 8)
  --reclaim-age SECS     reclaim: the embedded agent's --reclaim-age (default 10)
  --pulse-n N            pulse-node: creates in the pulse, and the warm pool's size (default 1000)
  --pulse-threads N      pulse-node: threads issuing them (default 32)
  --hold MIB             reclaim: random bytes each worker holds (default 0 with numpy, else 48)
  --vm-n N               vm: full VMs created, kept up until their memory is measured (default 3; the first boots)
  --markdown             also print the Markdown summary after a single benchmark
  --help
)";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::size_t parse_count(std::string_view flag, std::string_view text, std::size_t min) {
  std::size_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty() || v < min)
    throw UsageError(fmt::format("{}: '{}' is not an integer >= {}", flag, text, min));
  return v;
}

double parse_positive(std::string_view flag, std::string_view text) {
  try {
    std::size_t used = 0;
    double v = std::stod(std::string(text), &used);
    if (used == text.size() && v > 0 && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  throw UsageError(fmt::format("{}: '{}' is not a positive number", flag, text));
}

std::vector<std::string> split_commas(std::string_view text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t end = text.find(',', start);
    if (end == std::string_view::npos) end = text.size();
    if (end > start) out.emplace_back(text.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

Options parse_options(int argc, char** argv) {
  Options o;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    std::string flag = a, value;
    if (!a.empty() && a[0] == '-') o.given.insert(a.substr(0, a.find('=')));
    bool inline_value = false;
    if (a.rfind("--", 0) == 0) {
      if (auto eq = a.find('='); eq != std::string::npos) {
        flag = a.substr(0, eq);
        value = a.substr(eq + 1);
        inline_value = true;
      }
    }
    auto take = [&]() -> std::string {
      if (inline_value) return value;
      if (i + 1 >= args.size()) throw UsageError(fmt::format("{} needs a value", flag));
      return args[++i];
    };
    if (flag == "--help" || flag == "-h") {
      o.command = "help";
      return o;
    } else if (flag == "--endpoint") {
      o.endpoints.push_back(take());
    } else if (flag == "--home") {
      o.home = take();
    } else if (flag == "--agent") {
      o.agent_binary = take();
    } else if (flag == "--agent-arg") {
      o.agent_args.push_back(take());
    } else if (flag == "--image") {
      o.image = take();
    } else if (flag == "--rootfs") {
      o.rootfs = take();
    } else if (flag == "--work-dir") {
      o.work_dir = take();
    } else if (flag == "--peers") {
      std::string v = take();
      o.peers = v == "none" ? std::vector<std::string>{} : split_commas(v);
      for (const auto& p : o.peers)
        if (p != "crun" && p != "bwrap") throw UsageError(fmt::format("--peers: unknown peer '{}' (crun, bwrap)", p));
      o.peers_explicit = true;
    } else if (flag == "-n") {
      o.n = parse_count(flag, take(), 1);
    } else if (flag == "--warmup") {
      o.warmup = parse_count(flag, take(), 0);
    } else if (flag == "--concurrency") {
      o.concurrency.clear();
      for (const auto& c : split_commas(take()))
        o.concurrency.push_back(static_cast<int>(parse_count("--concurrency", c, 1)));
      if (o.concurrency.empty()) throw UsageError("--concurrency needs at least one level");
      for (int c : o.concurrency)
        if (c > 1024) throw UsageError(fmt::format("--concurrency: {} threads is too many (max 1024)", c));
    } else if (flag == "--duration") {
      o.duration_seconds = parse_positive(flag, take());
    } else if (flag == "--rounds") {
      o.rounds = parse_count(flag, take(), 1);
    } else if (flag == "-k" || flag == "--count") {
      o.density_count = parse_count(flag, take(), 1);
    } else if (flag == "--density-cpu") {
      o.density_cpu = parse_positive(flag, take());
    } else if (flag == "--density-memory") {
      std::string v = take();
      auto bytes = parse_size(v);
      if (!bytes || *bytes == 0) throw UsageError(fmt::format("--density-memory: '{}' is not a size like 16Mi", v));
      o.density_memory = *bytes;
    } else if (flag == "--teardown-concurrency") {
      o.teardown_concurrency = parse_count(flag, take(), 1);
    } else if (flag == "--cold") {
      o.cold_runs = parse_count(flag, take(), 0);
    } else if (flag == "--starts") {
      o.starts = parse_count(flag, take(), 0);
      if (o.starts > 1024) throw UsageError("--starts: at most 1024");
    } else if (flag == "--layer-modes") {
      o.layer_modes = split_commas(take());
      if (o.layer_modes.empty()) throw UsageError("--layer-modes needs at least one mode");
      for (const auto& m : o.layer_modes)
        if (m != "lazy" && m != "extract" && m != "auto")
          throw UsageError(fmt::format("--layer-modes: unknown mode '{}' (lazy, extract, auto)", m));
    } else if (flag == "--dsec") {
      o.dsec_cli = take();
    } else if (flag == "--sandboxes") {
      o.pulse_sandboxes = parse_count(flag, take(), 0);
    } else if (flag == "--agents") {
      o.pulse_agents = parse_count(flag, take(), 1);
      if (o.pulse_agents > 256) throw UsageError("--agents: at most 256");
    } else if (flag == "--real-sandboxes") {
      o.real_sandboxes = parse_count(flag, take(), 0);
    } else if (flag == "--real-agents") {
      o.real_agents = parse_count(flag, take(), 1);
      if (o.real_agents > 256) throw UsageError("--real-agents: at most 256");
    } else if (flag == "--pulse-api") {
      o.pulse_api = take();
      if (o.pulse_api != "group" && o.pulse_api != "many")
        throw UsageError(fmt::format("--pulse-api: '{}' is not group or many", o.pulse_api));
    } else if (flag == "--pulse-dir") {
      o.pulse_dir = take();
    } else if (flag == "--sleep-sizes") {
      o.sleep_sizes_mib.clear();
      for (const auto& v : split_commas(take())) o.sleep_sizes_mib.push_back(parse_count("--sleep-sizes", v, 1));
      if (o.sleep_sizes_mib.empty()) throw UsageError("--sleep-sizes needs at least one size in MiB");
      for (auto m : o.sleep_sizes_mib)
        if (m > (1u << 20)) throw UsageError(fmt::format("--sleep-sizes: {} MiB is more than a TiB", m));
    } else if (flag == "--sleep-rounds") {
      o.sleep_rounds = parse_count(flag, take(), 1);
    } else if (flag == "--swap-size") {
      std::string v = take();
      auto bytes = parse_size(v);
      if (!bytes || *bytes < (16u << 20))
        throw UsageError(fmt::format("--swap-size: '{}' is not a size of at least 16Mi", v));
      o.sleep_swap_bytes = *bytes;
    } else if (flag == "--sizes") {
      o.snapshot_sizes.clear();
      for (const auto& v : split_commas(take())) o.snapshot_sizes.push_back(parse_count("--sizes", v, 1));
      if (o.snapshot_sizes.empty()) throw UsageError("--sizes needs at least one size in MiB");
      for (std::size_t v : o.snapshot_sizes)
        if (v > 4096) throw UsageError(fmt::format("--sizes: {} MiB is more than this benchmark writes (4096)", v));
    } else if (flag == "--repeat") {
      o.snapshot_repeat = parse_count(flag, take(), 1);
    } else if (flag == "--forks") {
      o.fork_count = parse_count(flag, take(), 0);
      if (o.fork_count > 1024) throw UsageError("--forks: at most 1024");
    } else if (flag == "--fncall-image") {
      o.fncall_image = take();
      if (o.fncall_image.empty()) throw UsageError("--fncall-image needs an image name");
    } else if (flag == "--idle") {
      o.microvm_idle = parse_count(flag, take(), 0);
    } else if (flag == "--idle-cold") {
      o.microvm_idle_cold = parse_count(flag, take(), 0);
    } else if (flag == "--density") {
      o.microvm_density = parse_count(flag, take(), 0);
    } else if (flag == "--density-batch") {
      o.microvm_batch = parse_count(flag, take(), 1);
    } else if (flag == "--vm-n") {
      o.vm_creates = parse_count(flag, take(), 1);
      if (o.vm_creates > 16) throw UsageError("--vm-n: at most 16 (each VM holds 1 GiB of guest RAM)");
    } else if (flag == "--think") {
      o.qos_think_ms = parse_positive(flag, take());
    } else if (flag == "--latency-cpus") {
      o.qos_latency_cpus = take();
      if (o.qos_latency_cpus.empty()) throw UsageError("--latency-cpus needs a cpu list or none");
    } else if (flag == "--reclaim-image") {
      o.reclaim_image = take();
      if (o.reclaim_image.empty()) throw UsageError("--reclaim-image needs an image name");
    } else if (flag == "--control") {
      o.reclaim_control = parse_count(flag, take(), 0);
    } else if (flag == "--pulse-n") {
      o.pulse_node_n = parse_count(flag, take(), 1);
    } else if (flag == "--pulse-threads") {
      o.pulse_node_threads = parse_count(flag, take(), 1);
    } else if (flag == "--reclaim-age") {
      o.reclaim_age_seconds = parse_count(flag, take(), 1);
      if (o.reclaim_age_seconds > 86400) throw UsageError("--reclaim-age: at most 86400 seconds");
    } else if (flag == "--hold") {
      o.reclaim_hold_mib = parse_count(flag, take(), 0);
      if (*o.reclaim_hold_mib > 4096) throw UsageError("--hold: at most 4096 MiB per sandbox");
    } else if (flag == "--markdown") {
      o.markdown = true;
    } else if (!a.empty() && a[0] == '-') {
      throw UsageError(fmt::format("unknown flag {}", a));
    } else if (o.command.empty()) {
      o.command = a;
    } else {
      throw UsageError(fmt::format("unexpected argument '{}'", a));
    }
  }
  if (o.command.empty()) throw UsageError("no command given");
  for (const char* c :
       {"create", "throughput", "exec", "density", "cgroup-join", "image", "pulse", "sleep", "snapshot", "fncall",
        "microvm", "vm", "network", "session", "qos", "reclaim", "pulse-node", "registry", "all"})
    if (o.command == c) return o;
  throw UsageError(fmt::format("unknown command '{}'", o.command));
}

std::string resolved_home(const Options& o) {
  if (!o.home.empty()) return o.home;
  if (const char* env = std::getenv("DSEC_HOME"); env && *env) return env;
  return "/var/lib/dsec";
}

std::string shell_quote(const std::string& s) {
  if (!s.empty() &&
      s.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:=,") == std::string::npos)
    return s;
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

int run(int argc, char** argv) {
  Options o = parse_options(argc, argv);
  if (o.command == "help") {
    fmt::print("{}", kUsage);
    return 0;
  }
  const bool all = o.command == "all";
  const bool needs_peers =
      all || o.command == "create" || o.command == "throughput" || o.command == "exec" || o.command == "pulse-node";
  auto wants_peer = [&](const char* name) { return std::find(o.peers.begin(), o.peers.end(), name) != o.peers.end(); };

  Report report;
  for (int i = 0; i < argc; ++i) report.command_line += (i ? " " : "") + shell_quote(argv[i]);

  // The peers' root: --rootfs, else the image's layers from the store, mounted read-only as one merged view in a
  // scratch directory of its own. Mounted before crun's private mount namespace is made, so crun sees it too.
  fs::path rootfs;
  struct RemoveDir {
    fs::path dir;
    ~RemoveDir() {
      std::error_code ec;
      if (!dir.empty()) fs::remove(dir, ec);  // empty once peer_root unmounted and removed its scratch
    }
  } remove_peer_dir;
  std::unique_ptr<PeerRoot> peer_root;  // destroyed before remove_peer_dir
  if (needs_peers) {
    if (o.rootfs.empty()) {
      std::string templ = "/tmp/dsec-bench-root-XXXXXX";
      if (::mkdtemp(templ.data()) == nullptr) throw_errno(errno, "mkdtemp /tmp/dsec-bench-root-XXXXXX");
      remove_peer_dir.dir = templ;
      peer_root = mount_image_rootfs(resolved_home(o), o.image, remove_peer_dir.dir / "root");
      rootfs = peer_root->root();
    } else {
      rootfs = o.rootfs;
    }
  }

  // Before any thread exists (the client's and the agent's come next).
  std::string crun_note;
  UniqueFd crun_ns;
  if (needs_peers && wants_peer("crun")) crun_ns = make_crun_mount_namespace(crun_note);
  if (!crun_note.empty()) report.notes.push_back(crun_note);

  MachineInfo& m = report.machine;
  m = read_machine();
  {
    CpuMeter idle({});
    std::this_thread::sleep_for(std::chrono::seconds(1));
    m.before = idle.stop();
  }

  const std::string home = resolved_home(o);
  fs::path work_dir = o.work_dir;
  bool own_work_dir = false;
  if (work_dir.empty()) {
    std::string templ = "/tmp/dsec-bench-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw_errno(errno, "mkdtemp /tmp/dsec-bench-XXXXXX");
    work_dir = templ;
    own_work_dir = true;
  }
  struct RemoveWorkDir {
    fs::path dir;
    bool armed;
    ~RemoveWorkDir() {
      std::error_code ec;
      if (armed) fs::remove_all(dir, ec);
    }
  } remove_work_dir{work_dir, own_work_dir};

  std::optional<Client> client;
  // snapshot: the embedded agent commits snapshots to a store of their own, which the run empties and removes.
  std::string snapshot_store;
  const bool snapshots = o.command == "snapshot" || o.command == "sleep";
  if (snapshots && o.endpoints.empty()) snapshot_store = (work_dir / "snapshots").string();
  // The image benchmark starts an agent of its own for every cold start; the pulse starts its own cluster.
  const bool own_agents = o.command == "cgroup-join" || o.command == "image" || o.command == "pulse" ||
                          o.command == "microvm" || o.command == "vm" || o.command == "qos" || o.command == "reclaim" ||
                          o.command == "pulse-node" || o.command == "registry";
  if (!own_agents) {
    ClientOptions copts;
    copts.endpoints = o.endpoints;
    if (o.endpoints.empty()) {
      copts.home = home;
      copts.agent_binary = o.agent_binary;
      // Admission must let the density run in: K sandboxes of density_cpu cores and density_memory each, plus the
      // largest throughput level's sandboxes. The null backend gives the control-plane floor in `create`.
      const bool density = all || o.command == "density" || o.command == "network";
      int max_c = *std::max_element(o.concurrency.begin(), o.concurrency.end());
      double cpu_needed = (density ? static_cast<double>(o.density_count) * o.density_cpu : 0) + max_c * 0.5 + 2;
      double mem_needed = (density ? static_cast<double>(o.density_count) * static_cast<double>(o.density_memory) : 0) +
                          max_c * 128.0 * (1 << 20) + (1 << 30);
      double cpu_ratio = std::max(8.0, cpu_needed / m.cores * 1.2);
      double mem_ratio = std::max(1.0, mem_needed / static_cast<double>(m.mem_total) * 1.2);
      copts.agent_args = {"--backends",          o.command == "fncall" ? "container,fncall" : "container,null",
                          "--cpu-overcommit",    fmt::format("{:.2f}", cpu_ratio),
                          "--memory-overcommit", fmt::format("{:.2f}", mem_ratio)};
      copts.agent_args.insert(copts.agent_args.end(), o.agent_args.begin(), o.agent_args.end());
      if (density) {
        // Thousands of creates at once: on a slow kernel (a node of 3,200, every create waiting on RCU grace periods)
        // one create may wait far longer than the default 15 s, and create_many as a whole longer than a minute.
        copts.request_timeout = std::chrono::minutes(5);
        copts.call_deadline = std::chrono::minutes(30);
      }
      if (o.command == "network") {
        auto more = network_agent_args();
        copts.agent_args.insert(copts.agent_args.end(), more.begin(), more.end());
      }
      if (!snapshot_store.empty()) {
        copts.stores = {(fs::path(home) / "store").string(), snapshot_store};
        copts.agent_args.insert(copts.agent_args.end(), {"--snapshot-store", snapshot_store});
      }
      if (cpu_ratio > 8.0 || mem_ratio > 1.0)
        report.notes.push_back(
            fmt::format("the embedded agent runs with --cpu-overcommit {:.2f} --memory-overcommit "
                        "{:.2f} so that the density run's sandboxes are admitted",
                        cpu_ratio, mem_ratio));
    }
    fmt::print(stderr, "dsec-bench: starting the client{}\n", o.endpoints.empty() ? " and an embedded agent" : "");
    client.emplace(copts);
    std::vector<NodeInfo> nodes = client->nodes();
    if (nodes.empty()) throw Error(Code::kUnavailable, "the agent reported no node");
    const NodeInfo& node = nodes.front();
    if (std::find(node.backends.begin(), node.backends.end(), "container") == node.backends.end())
      throw Error(Code::kFailedPrecondition, fmt::format("node {} does not serve the container backend (it serves: {})",
                                                         node.id, fmt::join(node.backends, ", ")));
    if (o.command == "fncall" && std::find(node.backends.begin(), node.backends.end(), "fncall") == node.backends.end())
      throw Error(Code::kFailedPrecondition, fmt::format("node {} does not serve the fncall backend (it serves: {})",
                                                         node.id, fmt::join(node.backends, ", ")));
    m.agent_cgroup = node.cgroup_version;
    m.agent_pid = agent_pid_for(*client);
    o.null_backend = std::find(node.backends.begin(), node.backends.end(), "null") != node.backends.end();
    m.agent = o.endpoints.empty() ? fmt::format("embedded dsecd {} (home {})", node.version, home)
                                  : fmt::format("dsecd {} at {}", node.version, client->endpoint());
  }

  std::vector<std::string> peer_notes;
  std::unique_ptr<Peers> peers;
  if (needs_peers) {
    peers = std::make_unique<Peers>(o, rootfs, work_dir, std::move(crun_ns), peer_notes);
    if (peers->has_crun()) m.crun_version = peers->crun_version();
    if (peers->has_bwrap()) m.bwrap_version = peers->bwrap_version();
  }
  for (auto& n : peer_notes) report.notes.push_back(std::move(n));

  fmt::print("dsec-bench {} ({})\n", kVersion, report.command_line);
  fmt::print("machine: {} cores ({}), {:.1f} GiB, {}\n", m.cores, m.cpu_model,
             static_cast<double>(m.mem_total) / (1ull << 30), m.kernel);
  fmt::print("cgroup: {}{}\n", m.cgroup, client ? fmt::format("; agent driver: {}", m.agent_cgroup) : "");
  if (client) fmt::print("agent: {}{}\n", m.agent, m.agent_pid > 0 ? fmt::format(", pid {}", m.agent_pid) : "");
  if (needs_peers) {
    fmt::print("peers: {}; {}; root {}\n", m.crun_version.empty() ? "crun n/a" : m.crun_version,
               m.bwrap_version.empty() ? "bwrap n/a" : m.bwrap_version, peers->rootfs().string());
  }
  fmt::print("load average: {:.2f} {:.2f} {:.2f}; in the second before the run: ", m.load1, m.load5, m.load15);
  print_cpu(m.before, m.cores, "");
  for (const auto& n : report.notes) fmt::print("note: {}\n", n);
  std::fflush(stdout);

  if (all || o.command == "create") {
    report.create = run_create(o, *client, *peers);
    print_create(*report.create);
    print_cpu(report.create->cpu, m.cores);
    std::fflush(stdout);
  }
  if (all || o.command == "cgroup-join") {
    report.cgroup_join = run_cgroup_join(o);
    print_cgroup_join(*report.cgroup_join);
    std::fflush(stdout);
  }
  if (all || o.command == "throughput") {
    report.throughput = run_throughput(o, *client, *peers);
    print_throughput(*report.throughput);
    print_cpu(report.throughput->cpu, m.cores);
    std::fflush(stdout);
  }
  if (all || o.command == "exec") {
    report.exec = run_exec(o, *client, *peers);
    print_exec(*report.exec);
    print_cpu(report.exec->cpu, m.cores);
    std::fflush(stdout);
  }
  if (all || o.command == "density") {
    report.density = run_density(o, *client);
    print_density(*report.density);
    print_cpu(report.density->cpu, m.cores);
    std::fflush(stdout);
  }
  if (o.command == "image") {
    report.image = run_image(o, home);
    print_image(*report.image);
    std::fflush(stdout);
  }
  if (o.command == "registry") {
    run_registry(o, home);
    std::fflush(stdout);
  }
  if (o.command == "pulse") {
    report.pulse = run_pulse(o);
    print_pulse(*report.pulse);
    std::fflush(stdout);
  }
  if (o.command == "sleep") {
    report.sleep = run_sleep(o, home);
    print_sleep(*report.sleep);
    std::fflush(stdout);
  }
  if (snapshots) {
    report.snapshot = run_snapshot(o, *client, snapshot_store);
    print_snapshot(*report.snapshot);
    print_cpu(report.snapshot->cpu, m.cores);
    std::fflush(stdout);
  }
  if (o.command == "microvm") {
    report.microvm = run_microvm(o, home);
    print_microvm(*report.microvm);
    std::fflush(stdout);
  }
  if (o.command == "vm") {
    report.vm = run_vm(o, home);
    print_vm(*report.vm);
    std::fflush(stdout);
  }
  if (o.command == "qos") {
    report.qos = run_qos(o, home);
    print_qos(*report.qos);
    std::fflush(stdout);
  }
  if (o.command == "reclaim") {
    report.reclaim = run_reclaim(o, home);
    print_reclaim(*report.reclaim);
    std::fflush(stdout);
  }
  if (o.command == "pulse-node") {
    report.pulse_node = run_pulse_node(o, home, *peers);
    print_pulse_node(*report.pulse_node);
    std::fflush(stdout);
  }
  if (o.command == "network") {
    run_network(o, *client);
    std::fflush(stdout);
  }
  if (o.command == "session") {
    run_session(o, *client);
    std::fflush(stdout);
  }
  if (o.command == "fncall") {
    report.fncall = run_fncall(o, *client);
    print_fncall(*report.fncall);
    std::fflush(stdout);
  }
  if (all || o.markdown)
    fmt::print("\n---- Markdown ----\n\n{}{}{}{}{}{}{}{}{}{}", markdown_report(report, o),
               report.pulse ? "\n" + markdown_pulse(*report.pulse) : std::string(),
               report.sleep ? "\n" + markdown_sleep(*report.sleep) : std::string(),
               report.snapshot ? "\n" + markdown_snapshot(*report.snapshot, m.cores) : std::string(),
               report.fncall ? "\n" + markdown_fncall(*report.fncall) : std::string(),
               report.microvm ? "\n" + markdown_microvm(*report.microvm) : std::string(),
               report.vm ? "\n" + markdown_vm(*report.vm) : std::string(),
               report.qos ? "\n" + markdown_qos(*report.qos) : std::string(),
               report.reclaim ? "\n" + markdown_reclaim(*report.reclaim) : std::string(),
               report.pulse_node ? "\n" + markdown_pulse_node(*report.pulse_node, m.cores) : std::string());
  return 0;
}

}  // namespace

int agent_pid_for(const Client& client) {
  std::string endpoint = client.endpoint();
  if (endpoint.rfind("unix:", 0) != 0) return -1;
  return find_pid_with_arg(endpoint.substr(5));
}

}  // namespace dsec::bench

int main(int argc, char** argv) {
  try {
    return dsec::bench::run(argc, argv);
  } catch (const dsec::bench::UsageError& e) {
    fmt::print(stderr, "dsec-bench: {}\n(dsec-bench --help lists the commands and flags)\n", e.what());
    return 2;
  } catch (const dsec::Error& e) {
    fmt::print(stderr, "dsec-bench: {}: {}\n", e.code_name(), e.what());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "dsec-bench: {}\n", e.what());
    return 1;
  }
}
