// dsec-bench microvm: QEMU microVMs (kind "microvm"), measured in one run, every figure naming the accelerator the
// node chose (GET /v1/node: microvm.accelerator).
//
//  1. create to the first exec's result (`true`), sequential: from a template (the first create of the shape makes
//     it and is reported apart), from a pre-booted pool (a third agent with --microvm-pool 2), cold boots (a second
//     agent with --microvm-templates off), next to a plain qemu-system-x86_64 boot of the same guest kernel with the
//     same machine options and a minimal initramfs (busybox as /init: mount /proc, print a marker, poweroff -f) timed
//     to the marker on its console, and a container of the same image. The four take turns within every iteration, so a
//     change in the machine's load reaches all of them alike.
//  2. exec round trip of `true` in a warm VM, back to back and after 1 s of think time, next to a container's.
//  3. host memory per idle VM: K clones, then a few cold boots, settled: PSS of each QEMU (anon / file / shmem, and
//     the guest-RAM memfd mapping: the template's share), the VM's cgroup charge, MemAvailable per VM.
//  4. density: clones in batches up to a target (or until a create fails, or MemAvailable < 2 GiB): memory, CPU of
//     the idle VMs, an exec in every one, teardown, and nothing of them left behind.
//  5. sleep and wake of VMs whose memhold holds 64 and 192 MiB: memory before and after, the state file, wake to the
//     first exec, the checksum.
//  6. fork(8) of a VM running a background counter: until all copies answer, and each copy's counter runs on.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "agent/backends/qemu/initramfs.hpp"
#include "agent/backends/qemu/microvm/guest_kernel.hpp"
#include "agent/backends/qemu/qemu_command.hpp"
#include "bench.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/manifest.hpp"
#include "qemu_tier.hpp"

extern char** environ;

namespace dsec::bench {
namespace {

namespace fs = std::filesystem;
constexpr std::uint64_t kVmMemory = 128ull << 20;  // the backend's smallest guest
constexpr const char* kPeerMarker = "DSEC-BENCH-PEER-UP";
constexpr auto kSettle = std::chrono::seconds(10);
constexpr auto kCpuWindow = std::chrono::seconds(10);
constexpr double kDensityMemoryFloor = 2 * kGiB;
constexpr auto kThink = std::chrono::seconds(1);
constexpr const char* kHoldDir = "/tmp/h";

// utime + stime of one process (not its children), in clock ticks; 0 when it is gone.
std::uint64_t own_ticks(int pid) {
  std::string text = read_text_file(fmt::format("/proc/{}/stat", pid));
  auto close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream in(text.substr(close + 2));
  std::string field;
  std::uint64_t total = 0;
  for (int i = 3; i <= 15 && in >> field; ++i)
    if (i >= 14) total += std::strtoull(field.c_str(), nullptr, 10);
  return total;
}

// Busy ticks of all CPUs (/proc/stat: user nice system irq softirq steal).
std::uint64_t node_busy_ticks() {
  std::ifstream in("/proc/stat");
  std::string label;
  in >> label;
  std::uint64_t v[8] = {};
  for (auto& x : v) in >> x;
  return v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
}

double ticks_per_second() { return static_cast<double>(::sysconf(_SC_CLK_TCK)); }

// The guest RAM mapping of a QEMU (a memfd "dsec-ram-..."), from /proc/<pid>/smaps.
struct RamMapping {
  bool found = false;
  double rss = 0, pss = 0, anonymous = 0, private_bytes = 0;
};

RamMapping ram_mapping(int pid) {
  RamMapping r;
  std::ifstream in(fmt::format("/proc/{}/smaps", pid));
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string first;
    ls >> first;
    if (first.empty()) continue;
    if (first.back() != ':') {  // a mapping's header: "start-end perms offset dev inode [path]"
      inside = line.find("memfd:dsec-ram-") != std::string::npos;
      r.found |= inside;
      continue;
    }
    if (!inside) continue;
    double kb = 0;
    ls >> kb;
    double bytes = kb * 1024;
    if (first == "Rss:") r.rss += bytes;
    else if (first == "Pss:") r.pss += bytes;
    else if (first == "Anonymous:") r.anonymous += bytes;
    else if (first == "Private_Clean:" || first == "Private_Dirty:") r.private_bytes += bytes;
  }
  return r;
}

// The cgroup directories named `cgroup_name` directly under the hierarchies' roots (an agent's subtree).
std::vector<fs::path> subtree_dirs(const std::string& cgroup_name) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& h : fs::directory_iterator("/sys/fs/cgroup", ec)) {
    fs::path d = h.path() / cgroup_name;
    std::error_code e2;
    if (fs::is_directory(d, e2)) out.push_back(d);
  }
  if (fs::is_directory(fs::path("/sys/fs/cgroup") / cgroup_name, ec))
    out.push_back(fs::path("/sys/fs/cgroup") / cgroup_name);
  return out;
}

std::string wait_for_file(const Sandbox& sb, const std::string& path, std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    try {
      std::string s = sb.read_file(path);
      if (!s.empty()) return s;
    } catch (const Error& e) {
      if (e.code() != Code::kNotFound || Clock::now() > deadline) throw;
    }
    if (Clock::now() > deadline) throw Error(Code::kDeadlineExceeded, fmt::format("{} stayed empty", path));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

SandboxSpec vm_spec(const Options& o, std::uint64_t memory = kVmMemory) {
  SandboxSpec spec = bench_spec(o);
  spec.kind = "microvm";
  spec.resources.cpu = 1;
  spec.resources.memory_bytes = memory;
  spec.ttl = std::chrono::seconds(3600);
  spec.labels["dsec-bench-microvm"] = "1";
  return spec;
}

void ensure_image(const Options& o, const std::string& home, std::vector<std::string>& notes) {
  auto store = image::open_directory_store(fs::path(home) / "store");
  try {
    image::fetch_manifest(*store, image::parse_reference(o.image));
    return;
  } catch (const Error& e) {
    if (e.code() != Code::kNotFound) throw;
  }
  if (o.image != "busybox")
    throw Error(Code::kNotFound,
                fmt::format("image {} is not in {}/store (this benchmark builds only busybox)", o.image, home));
  const std::string cli = o.dsec_cli.empty() ? beside_self("dsec").string() : o.dsec_cli;
  std::vector<std::string> argv{cli, "--home", home, "image", "build", "busybox", "--from", "busybox-static", "-q"};
  std::string line;
  for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
  fmt::print(stderr, "dsec-bench: {}\n", line);
  run_command(argv);
  notes.push_back(fmt::format("built: `{}`", line));
}

// ---------------------------------------------------------------------------------------------- the QEMU peer

void cpio_entry(std::string& out, unsigned ino, const std::string& name, unsigned mode, const std::string& data,
                unsigned rdev_major = 0, unsigned rdev_minor = 0) {
  auto pad = [&out] {
    while (out.size() % 4) out.push_back('\0');
  };
  const bool dir = (mode & 0170000) == 0040000;
  out += fmt::format("070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}", ino, mode,
                     0, 0, dir ? 2 : 1, 0, data.size(), 0, 0, rdev_major, rdev_minor, name.size() + 1, 0);
  out += name;
  out.push_back('\0');
  pad();
  out += data;
  pad();
}

// A plain qemu-system-x86_64 of the same guest kernel and machine options as dsec's VMs (qemu_command.cpp), with an
// initramfs of busybox whose /init prints a marker on the console and powers off.
class QemuPeer {
 public:
  QemuPeer(const fs::path& dir, bool kvm, std::uint32_t tsc_khz, const fs::path& kernel) : dir_(dir) {
    fs::create_directories(dir);
    std::ifstream bb("/bin/busybox", std::ios::binary);
    if (!bb) throw Error(Code::kFailedPrecondition, "the QEMU peer needs /bin/busybox (busybox-static)");
    const std::string busybox((std::istreambuf_iterator<char>(bb)), std::istreambuf_iterator<char>());
    std::string cpio;
    unsigned ino = 1;
    cpio_entry(cpio, ino++, "dev", 0040755, "");
    cpio_entry(cpio, ino++, "dev/console", 0020600, "", 5, 1);
    cpio_entry(cpio, ino++, "proc", 0040755, "");
    cpio_entry(cpio, ino++, "bin", 0040755, "");
    cpio_entry(cpio, ino++, "bin/busybox", 0100755, busybox);
    cpio_entry(cpio, ino++, "init", 0100755,
               fmt::format("#!/bin/busybox sh\n/bin/busybox mount -t proc proc /proc\necho {}\n"
                           "/bin/busybox poweroff -f\n",
                           kPeerMarker));
    cpio_entry(cpio, ino++, "TRAILER!!!", 0, "");
    initrd_ = dir / "peer-initramfs.cpio";
    std::ofstream out(initrd_, std::ios::binary | std::ios::trunc);
    out << cpio;
    if (!out) throw Error(Code::kInternal, fmt::format("cannot write {}", initrd_.string()));
    out.close();
    log_ = dir / "peer-qemu.log";

    agent::qemu::CmdlineOptions co;
    co.guest_mode = "1";  // the microvm tier's line, as dsec boots its guests
    co.accelerator = kvm ? agent::qemu::Accelerator::kKvm : agent::qemu::Accelerator::kTcg;
    co.tsc_khz = tsc_khz;
    const std::string append = agent::qemu::kernel_cmdline(co);
    argv_ = {"/usr/bin/qemu-system-x86_64",
             "-name",
             "dsec-bench-peer,debug-threads=on",
             "-nodefaults",
             "-no-user-config",
             "-nographic",
             "-display",
             "none",
             "-no-reboot",
             "-sandbox",
             "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
             "-machine",
             "microvm,x-option-roms=off,pic=off,isa-serial=on,rtc=on,acpi=on,memory-backend=ram",
             "-accel",
             kvm ? "kvm" : "tcg,tb-size=32",
             "-cpu",
             kvm ? "host" : "max",
             "-smp",
             "1",
             "-m",
             "128M",
             "-object",
             "memory-backend-memfd,id=ram,size=128M,share=on",
             "-kernel",
             kernel.string(),
             "-initrd",
             initrd_.string(),
             "-append",
             append,
             "-chardev",
             "stdio,id=console,signal=off",
             "-serial",
             "chardev:console"};
  }

  std::string command() const {
    std::string s;
    for (const auto& a : argv_) s += (s.empty() ? "" : " ") + (a.find(' ') != std::string::npos ? "'" + a + "'" : a);
    return s;
  }

  struct Run {
    double marker_ms = std::nan("");
    double exit_ms = std::nan("");
  };

  // Spawn to the marker on the console, and to QEMU's exit (the guest's poweroff).
  Run run() {
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw_errno(errno, "pipe");
    UniqueFd rd(p[0]), wr(p[1]);
    UniqueFd log(::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_adddup2(&fa, wr.get(), 1);
    posix_spawn_file_actions_adddup2(&fa, log ? log.get() : wr.get(), 2);
    std::vector<char*> args;
    for (auto& a : argv_) args.push_back(a.data());
    args.push_back(nullptr);
    Run r;
    const auto t0 = Clock::now();
    pid_t pid = -1;
    int err = ::posix_spawn(&pid, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (err != 0) throw_errno(err, "spawn qemu-system-x86_64");
    wr.reset();
    std::string seen;
    const auto deadline = t0 + std::chrono::seconds(60);
    bool eof = false;
    while (!eof && Clock::now() < deadline) {
      pollfd pfd{rd.get(), POLLIN, 0};
      int left =
          static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      int n = ::poll(&pfd, 1, std::max(1, left));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      char buf[4096];
      ssize_t got = ::read(rd.get(), buf, sizeof buf);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        eof = true;
        break;
      }
      seen.append(buf, static_cast<std::size_t>(got));
      if (std::isnan(r.marker_ms) && seen.find(kPeerMarker) != std::string::npos) r.marker_ms = ms_since(t0);
    }
    int status = 0;
    const auto exit_deadline = Clock::now() + std::chrono::seconds(10);
    for (;;) {
      pid_t w = ::waitpid(pid, &status, WNOHANG);
      if (w == pid) {
        if (eof) r.exit_ms = ms_since(t0);
        break;
      }
      if (Clock::now() > exit_deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    if (std::isnan(r.marker_ms))
      throw Error(Code::kInternal, fmt::format("the QEMU peer printed no marker in 60 s; console: {}; log {}",
                                               seen.substr(seen.size() > 400 ? seen.size() - 400 : 0), log_.string()));
    return r;
  }

 private:
  fs::path dir_, initrd_, log_;
  std::vector<std::string> argv_;
};

// ---------------------------------------------------------------------------------------------- measures

struct Lifecycle {
  double create_ms = 0, exec_ms = 0, total_ms = 0, second_exec_ms = 0;
};

Lifecycle create_exec_destroy(Client& client, const SandboxSpec& spec) {
  Lifecycle l;
  auto t0 = Clock::now();
  Sandbox sb = client.create(spec);
  auto t1 = Clock::now();
  check_ok(sb.exec(true_request()), fmt::format("the first exec in {}", sb.id()));
  auto t2 = Clock::now();
  l.create_ms = ms_between(t0, t1);
  l.exec_ms = ms_between(t1, t2);
  l.total_ms = ms_between(t0, t2);
  // The second exec (not part of the total): what the first one pays beyond a warm exec.
  check_ok(sb.exec(true_request()), fmt::format("the second exec in {}", sb.id()));
  l.second_exec_ms = ms_since(t2);
  sb.destroy();
  return l;
}

// How many of the VMs' QEMU logs report a failed ram_block_discard_range (the balloon's free page reporting could
// not give guest pages back), and one such line.
std::size_t discard_failures(const Agent& agent, const std::vector<Sandbox>& vms, std::string& example) {
  std::size_t n = 0;
  for (const auto& v : vms) {
    std::string log = read_text_file((agent.run_dir / v.id() / "qemu.log").string());
    auto pos = log.find("ram_block_discard_range");
    if (pos == std::string::npos) continue;
    ++n;
    if (example.empty()) {
      auto start = log.rfind('\n', pos);
      auto end = log.find('\n', pos);
      example =
          log.substr(start == std::string::npos ? 0 : start + 1,
                     end == std::string::npos ? std::string::npos : end - (start == std::string::npos ? 0 : start + 1));
    }
  }
  return n;
}

// The figures of K idle VMs (their QEMUs found by sandbox id in the agent's cgroup).
void measure_vms(const Agent& agent, const std::vector<Sandbox>& vms, MicroVmIdleMemory& m) {
  std::set<std::string> ids;
  for (const auto& v : vms) ids.insert(v.id());
  auto qemus = agent_qemus(agent.cgroup_name);
  std::vector<double> pss;
  for (const auto& [id, pid] : qemus) {
    if (!ids.count(id)) continue;
    auto f = kb_fields(fmt::format("/proc/{}/smaps_rollup", pid));
    m.rss += f["Rss"];
    m.pss += f["Pss"];
    m.pss_anon += f["Pss_Anon"];
    m.pss_file += f["Pss_File"];
    m.pss_shmem += f["Pss_Shmem"];
    pss.push_back(f["Pss"]);
    RamMapping ram = ram_mapping(pid);
    m.ram_pss += ram.pss;
    m.ram_rss += ram.rss;
    // A clone's RAM is a private mapping of the template: its own pages are the ones copied on write (Anonymous). A
    // VM of its own maps its memfd shared: every page in it is its own.
    m.ram_private += ram.anonymous > 0 ? ram.anonymous : ram.private_bytes;
  }
  m.found = pss.size();
  const double k = m.found ? static_cast<double>(m.found) : std::nan("");
  for (double* v : {&m.rss, &m.pss, &m.pss_anon, &m.pss_file, &m.pss_shmem, &m.ram_pss, &m.ram_rss, &m.ram_private})
    *v /= k;
  if (!pss.empty()) {
    m.pss_min = *std::min_element(pss.begin(), pss.end());
    m.pss_max = *std::max_element(pss.begin(), pss.end());
  }
  SandboxProcesses found = find_sandbox_processes(ids);
  double charge = 0;
  for (const auto& [id, dir] : found.memory_cgroup) charge += static_cast<double>(cgroup_memory_bytes(dir));
  m.cgroup_charge =
      found.memory_cgroup.empty() ? std::nan("") : charge / static_cast<double>(found.memory_cgroup.size());
  if (agent.pid > 0) m.template_resident = template_resident_bytes(agent.pid);
}

// CPU of the agent's QEMUs over `window`: % of one core per VM.
double idle_cpu_pct(const Agent& agent, std::chrono::seconds window, std::size_t* vms_seen = nullptr,
                    double* agent_cores = nullptr, double* node_cores = nullptr) {
  auto before = agent_qemus(agent.cgroup_name);
  std::map<int, std::uint64_t> t0;
  for (const auto& [id, pid] : before) t0[pid] = own_ticks(pid);
  std::uint64_t a0 = agent.pid > 0 ? own_ticks(agent.pid) : 0;
  std::uint64_t n0 = node_busy_ticks();
  auto start = Clock::now();
  std::this_thread::sleep_for(window);
  double secs = std::chrono::duration<double>(Clock::now() - start).count();
  std::uint64_t total = 0;
  for (const auto& [pid, t] : t0) {
    std::uint64_t now = own_ticks(pid);
    if (now >= t) total += now - t;
  }
  const double hz = ticks_per_second();
  if (vms_seen) *vms_seen = t0.size();
  if (agent_cores && agent.pid > 0) *agent_cores = static_cast<double>(own_ticks(agent.pid) - a0) / hz / secs;
  if (node_cores) *node_cores = static_cast<double>(node_busy_ticks() - n0) / hz / secs;
  if (t0.empty()) return std::nan("");
  return static_cast<double>(total) / hz / secs / static_cast<double>(t0.size()) * 100;
}

// Memory of K idle VMs made by `make`.
MicroVmIdleMemory idle_memory(const Agent& agent, const std::string& what, std::size_t k,
                              const std::function<std::vector<Sandbox>()>& make) {
  MicroVmIdleMemory m;
  m.what = what;
  fmt::print(stderr, "dsec-bench microvm: memory of {} idle {} ({} agent)\n", k, what, agent.label);
  const double before = static_cast<double>(mem_available_settled());
  const double agent_before = agent.pid > 0 ? static_cast<double>(rss_bytes(agent.pid)) : 0;
  const int self = static_cast<int>(::getpid());
  auto others_now = [&] {
    std::set<int> exclude{self, agent.pid};
    for (const auto& [id, pid] : agent_qemus(agent.cgroup_name)) exclude.insert(pid);
    return static_cast<double>(rss_of_all_but(exclude));
  };
  const double others_before = others_now();
  auto t0 = Clock::now();
  std::vector<Sandbox> vms = make();
  m.create_seconds = ms_since(t0) / 1000;
  m.count = vms.size();
  // Settling: the CPU the idle VMs use is measured meanwhile.
  auto s0 = Clock::now();
  m.vm_cpu_pct = idle_cpu_pct(agent, kSettle);
  m.settle_seconds = ms_since(s0) / 1000;
  m.load1 = load1_now();
  const double after = static_cast<double>(mem_available_settled());
  m.others_rss_delta = others_now() - others_before;
  measure_vms(agent, vms, m);
  m.discard_failures = discard_failures(agent, vms, m.discard_example);
  m.mem_available_per_vm = (before - after) / static_cast<double>(std::max<std::size_t>(1, m.count));
  m.agent_rss_delta = agent.pid > 0 ? static_cast<double>(rss_bytes(agent.pid)) - agent_before : std::nan("");
  destroy_all(vms, 8);
  return m;
}

// ---------------------------------------------------------------------------------------------- density

MicroVmDensityRun density_run(const Options& o, Agent& agent, std::vector<std::string>& problems) {
  MicroVmDensityRun d;
  d.target = o.microvm_density;
  const SandboxSpec spec = vm_spec(o);
  d.mem_available_start = static_cast<double>(mem_available_settled(3));
  const int self = static_cast<int>(::getpid());
  auto others_now = [&] {
    std::set<int> exclude{self, agent.pid};
    for (const auto& [id, pid] : agent_qemus(agent.cgroup_name)) exclude.insert(pid);
    return static_cast<double>(rss_of_all_but(exclude));
  };
  const double others_before = others_now();
  std::vector<Sandbox> vms;
  auto t0 = Clock::now();
  while (vms.size() < d.target) {
    const double avail = static_cast<double>(meminfo_bytes("MemAvailable"));
    if (avail < kDensityMemoryFloor) {
      d.stop_reason = fmt::format("MemAvailable {:.2f} GiB fell below 2 GiB", avail / kGiB);
      break;
    }
    const std::size_t batch = std::min(o.microvm_batch, d.target - vms.size());
    auto b0 = Clock::now();
    try {
      std::vector<Sandbox> made = agent.client->create_many(batch, spec);
      d.batch_per_vm.add(ms_since(b0) / static_cast<double>(batch));
      for (auto& s : made) vms.push_back(std::move(s));
    } catch (const std::exception& e) {
      d.stop_reason = fmt::format("a create failed at {} VMs: {}", vms.size(), e.what());
      problems.push_back(fmt::format("density: a create_many of {} failed with {} VMs running (load {}): {}", batch,
                                     vms.size(), load_text(), e.what()));
      break;
    }
    fmt::print(stderr, "  density: {}/{} VMs, MemAvailable {:.2f} GiB, load {}, last batch {:.0f} ms per VM\n",
               vms.size(), d.target, static_cast<double>(meminfo_bytes("MemAvailable")) / kGiB, load_text(),
               ms_since(b0) / static_cast<double>(batch));
  }
  if (d.stop_reason.empty()) d.stop_reason = "reached the target";
  d.create_seconds = ms_since(t0) / 1000;
  d.ran = vms.size();
  if (vms.empty()) return d;

  fmt::print(stderr, "  density: {} VMs up; settling {} s, then CPU over {} s\n", vms.size(), kSettle.count(),
             kCpuWindow.count());
  std::this_thread::sleep_for(kSettle);
  d.cpu_window = static_cast<double>(kCpuWindow.count());
  d.vm_cpu_pct = idle_cpu_pct(agent, kCpuWindow, &d.qemu_found, &d.agent_cores, &d.node_busy_cores);
  d.vms_cores = d.vm_cpu_pct * static_cast<double>(d.qemu_found) / 100;
  read_loadavg(d.load1, d.load5, d.load15);
  d.mem_available_end = static_cast<double>(mem_available_settled(3));
  d.others_rss_delta = others_now() - others_before;
  MicroVmIdleMemory m;
  measure_vms(agent, vms, m);
  d.pss_per_vm = m.pss;
  d.rss_per_vm = m.rss;
  d.cgroup_per_vm = m.cgroup_charge;
  d.mem_available_per_vm = (d.mem_available_start - d.mem_available_end) / static_cast<double>(d.ran);

  // An exec in every one.
  fmt::print(stderr, "  density: an exec of `true` in each of the {} VMs\n", vms.size());
  std::atomic<std::size_t> next{0};
  std::mutex mu;
  auto e0 = Clock::now();
  std::vector<std::thread> pool;
  pool.reserve(4);
  for (int t = 0; t < 4; ++t)
    pool.emplace_back([&] {
      for (std::size_t i = next++; i < vms.size(); i = next++) {
        auto s = Clock::now();
        std::string err;
        try {
          ExecResult r = vms[i].exec(true_request(60));
          if (r.exit_code != 0 || r.timed_out)
            err = fmt::format("exit {} signal {}{}", r.exit_code, r.signal, r.timed_out ? " (timed out)" : "");
        } catch (const std::exception& e) {
          err = e.what();
        }
        double took = ms_since(s);
        std::lock_guard lock(mu);
        d.exec_check.add(took);
        if (err.empty()) {
          ++d.exec_ok;
        } else {
          ++d.exec_failed;
          if (d.exec_errors.size() < 10) d.exec_errors.push_back(fmt::format("{}: {}", vms[i].id(), err));
        }
      }
    });
  for (auto& t : pool) t.join();
  d.exec_check_seconds = ms_since(e0) / 1000;
  if (d.exec_failed)
    problems.push_back(fmt::format("density: {} of {} idle VMs did not answer an exec of `true` (first: {})",
                                   d.exec_failed, d.ran, d.exec_errors.front()));

  fmt::print(stderr, "  density: destroying {} VMs\n", vms.size());
  std::vector<std::string> destroy_errors;
  auto x0 = Clock::now();
  destroy_all(vms, 8, &destroy_errors);
  d.destroy_seconds = ms_since(x0) / 1000;
  if (!destroy_errors.empty())
    problems.push_back(
        fmt::format("density: {} destroys failed (first: {})", destroy_errors.size(), destroy_errors.front()));
  // Nothing left: no QEMU of the agent's cgroup, no VM the node counts, no sandbox of the run listed.
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  for (;;) {
    d.qemu_left = agent_qemus(agent.cgroup_name).size();
    d.vms_reported_left = agent.client->nodes().front().microvm.vms;
    if ((d.qemu_left == 0 && d.vms_reported_left == 0) || Clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  d.sandboxes_listed_left = agent.client->list({{"dsec-bench-microvm", "1"}}).size();
  if (d.qemu_left || d.vms_reported_left || d.sandboxes_listed_left)
    problems.push_back(
        fmt::format("density: after the teardown {} QEMU processes of the agent's cgroup, {} VMs in "
                    "GET /v1/node and {} sandboxes listed remain",
                    d.qemu_left, d.vms_reported_left, d.sandboxes_listed_left));
  return d;
}

// ---------------------------------------------------------------------------------------------- sleep

struct Touch {
  double ms = 0;
  bool intact = false;
};

Touch touch_all(const Sandbox& sb, int pid, const std::string& sum) {
  auto t0 = Clock::now();
  ExecResult r = run_shell(sb,
                           fmt::format("rm -f {0}/check; kill -USR1 {1}; while [ ! -s {0}/check ]; do usleep 2000; "
                                       "done; cat {0}/check",
                                       kHoldDir, pid),
                           600);
  Touch t;
  t.ms = ms_since(t0);
  std::istringstream in(r.stdout_data);
  std::string verdict, got;
  in >> verdict >> got;
  t.intact = verdict == "ok" && got == sum;
  return t;
}

MicroVmSleepRun sleep_run(const Options& o, Agent& agent, const std::string& memhold, std::size_t held) {
  MicroVmSleepRun r;
  r.mib = held;
  r.guest_memory = (static_cast<std::uint64_t>(held) + 128) << 20;
  Sandbox sb = agent.client->create(vm_spec(o, r.guest_memory));
  // From here (its shape's template made) to its destroy: what this VM adds to the templates' RAM.
  const double templates_before = agent.pid > 0 ? template_resident_bytes(agent.pid) : std::nan("");
  fmt::print(stderr, "dsec-bench microvm: sleep of a VM holding {} MiB ({} MiB guest): {}\n", held,
             r.guest_memory >> 20, sb.id());
  sb.write_file("/usr/local/bin/memhold", memhold, 0755);
  run_shell(sb, fmt::format("mkdir -p {0} && memhold {1} {0} >/dev/null 2>&1 &", kHoldDir, held));
  std::istringstream ready(wait_for_file(sb, fmt::format("{}/ready", kHoldDir), std::chrono::seconds(600)));
  std::size_t ready_mib = 0;
  ready >> ready_mib >> r.fill_ms;
  const std::string sum = trim(sb.read_file(fmt::format("{}/sum", kHoldDir)));
  const int pid = std::stoi(sb.read_file(fmt::format("{}/pid", kHoldDir)));
  Touch before = touch_all(sb, pid, sum);
  r.intact_before = before.intact;
  r.awake_touch_ms = before.ms;
  std::string cgroup_dir;
  {
    SandboxProcesses found = find_sandbox_processes({sb.id()});
    if (auto it = found.memory_cgroup.find(sb.id()); it != found.memory_cgroup.end()) cgroup_dir = it->second;
  }
  if (!cgroup_dir.empty()) r.shmem_before_sleep = memory_stat(cgroup_dir, "shmem");

  auto t0 = Clock::now();
  SleepResult s = sb.sleep();
  r.sleep_call_ms = ms_since(t0);
  r.before_bytes = static_cast<double>(s.memory_before_bytes);
  r.after_bytes = static_cast<double>(s.memory_after_bytes);
  r.sleep_seconds = s.seconds;
  if (!cgroup_dir.empty()) r.shmem_after_sleep = memory_stat(cgroup_dir, "shmem");
  std::error_code ec;
  fs::path state = agent.run_dir / sb.id() / "sleep.state";
  auto size = fs::file_size(state, ec);
  if (!ec) {
    struct stat st {};
    r.state_file_bytes = static_cast<double>(size);
    if (::stat(state.c_str(), &st) == 0 && static_cast<double>(st.st_blocks) * 512 < r.state_file_bytes)
      r.state_file_bytes = static_cast<double>(st.st_blocks) * 512;  // sparse: what it takes on disk
  }
  std::this_thread::sleep_for(kThink);
  auto t1 = Clock::now();
  SleepResult w;
  try {
    w = sb.wake();
  } catch (const Error& e) {
    // Why: the VM's memory cgroup, and whether a second wake does any better.
    std::string why = e.what();
    if (!cgroup_dir.empty()) {
      std::string oom = read_text_file(cgroup_dir + "/memory.oom_control");
      auto pos = oom.find("oom_kill ");
      why += fmt::format(" [its memory cgroup: {} charged of a {} limit, shmem {}, oom_kill {}]",
                         mib(static_cast<double>(cgroup_memory_bytes(cgroup_dir))),
                         mib(std::strtod(read_text_file(cgroup_dir + "/memory.limit_in_bytes").c_str(), nullptr)),
                         mib(memory_stat(cgroup_dir, "shmem")),
                         pos == std::string::npos ? "n/a" : trim(oom.substr(pos + 9, oom.find('\n', pos) - pos - 9)));
    }
    std::this_thread::sleep_for(std::chrono::seconds(2));
    try {
      sb.wake();
      why += "; a second wake 2 s later worked";
    } catch (const std::exception& e2) {
      why += fmt::format("; a second wake 2 s later failed too: {}", e2.what());
    }
    throw Error(e.code(), why);
  }
  r.wake_call_ms = ms_since(t1);
  r.wake_seconds = w.seconds;
  auto t2 = Clock::now();
  check_ok(sb.exec(true_request()), "the first exec after the wake");
  r.first_exec_ms = ms_since(t2);
  r.wake_to_exec_ms = ms_since(t1);
  Touch after = touch_all(sb, pid, sum);
  r.intact_after = after.intact;
  r.touch_ms = after.ms;
  r.charged_after_wake = vm_charged(sb.id());
  sb.destroy();
  if (agent.pid > 0) r.template_growth = template_resident_bytes(agent.pid) - templates_before;
  return r;
}

// ---------------------------------------------------------------------------------------------- fork

long read_count(const Sandbox& sb) {
  ExecRequest r;
  r.argv = {"cat", "/tmp/count"};
  r.timeout_seconds = 60;
  ExecResult out = sb.exec(r);
  check_ok(out, fmt::format("cat /tmp/count in {}", sb.id()));
  return std::stol(trim(out.stdout_data));
}

MicroVmForkRun fork_run(const Options& o, Agent& agent, std::size_t count, std::vector<std::string>& problems) {
  MicroVmForkRun f;
  f.count = count;
  Sandbox sb = agent.client->create(vm_spec(o));
  fmt::print(stderr, "dsec-bench microvm: fork({}) of {}, which runs a counter in the background\n", count, sb.id());
  run_shell(sb,
            "sh -c 'i=0; while true; do i=$((i+1)); echo $i > /tmp/count.t && mv /tmp/count.t /tmp/count; "
            "usleep 100000; done' </dev/null >/dev/null 2>&1 &");
  wait_for_file(sb, "/tmp/count", std::chrono::seconds(60));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const long c0 = read_count(sb);

  auto t0 = Clock::now();
  std::vector<Sandbox> forks = sb.fork(count);
  f.call_ms = ms_since(t0);
  std::vector<long> first(forks.size(), -1);
  std::vector<std::string> errs(forks.size());
  {
    std::vector<std::thread> pool;
    for (std::size_t i = 0; i < forks.size(); ++i)
      pool.emplace_back([&, i] {
        try {
          first[i] = read_count(forks[i]);
        } catch (const std::exception& e) {
          errs[i] = e.what();
        }
      });
    for (auto& t : pool) t.join();
  }
  f.all_answered_ms = ms_since(t0);
  std::this_thread::sleep_for(kThink);
  for (std::size_t i = 0; i < forks.size(); ++i) {
    if (first[i] < 0) {
      f.details.push_back(fmt::format("{}: no answer: {}", forks[i].id(), errs[i]));
      continue;
    }
    ++f.answered;
    long again = -1;
    try {
      again = read_count(forks[i]);
    } catch (const std::exception& e) {
      f.details.push_back(fmt::format("{}: second read failed: {}", forks[i].id(), e.what()));
    }
    if (again > first[i]) ++f.alive;
    if (first[i] >= c0) ++f.inherited;
    f.details.push_back(fmt::format("{}: counter {} -> {} a second later", forks[i].id(), first[i], again));
  }
  try {
    long p1 = read_count(sb);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    long p2 = read_count(sb);
    f.parent_alive = p2 > p1;
    f.details.push_back(fmt::format("parent {}: counter {} at the fork, {} -> {} after", sb.id(), c0, p1, p2));
  } catch (const std::exception& e) {
    f.details.push_back(fmt::format("parent {}: {}", sb.id(), e.what()));
  }
  if (f.answered < count || f.alive < count || !f.parent_alive)
    problems.push_back(fmt::format("fork({}): {} copies answered, {} with their background process alive; parent {}",
                                   count, f.answered, f.alive, f.parent_alive ? "alive" : "NOT alive"));
  destroy_all(forks, 8);
  sb.destroy();
  return f;
}

}  // namespace

MicroVmBenchResult run_microvm(const Options& o, const std::string& home) {
  MicroVmBenchResult r;
  r.cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  const Sections sections{"microvm", r.cores, r.section_load, r.problems};
  r.n = o.given.count("-n") ? o.n : 20;
  r.warmup = o.given.count("--warmup") ? o.warmup : 1;
  const std::vector<std::size_t> sleep_sizes =
      o.given.count("--sleep-sizes") ? o.sleep_sizes_mib : std::vector<std::size_t>{64, 192};
  const std::size_t fork_count = o.given.count("--forks") ? o.fork_count : 8;
  if (!o.endpoints.empty())
    r.notes.push_back(
        "--endpoint is ignored: this benchmark starts agents of its own (one with templates, one without)");

  ensure_image(o, home, r.notes);
  const fs::path memhold_path = beside_self("dsec-memhold");
  std::string memhold;
  {
    std::ifstream in(memhold_path, std::ios::binary);
    if (in) memhold.assign((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }

  const ScratchDir work("dsec-bench-microvm");

  // Admission: the density run's VMs (1 core, 128 MiB each) must be let in.
  const double cpu_ratio = std::max(32.0, static_cast<double>(o.microvm_density + o.microvm_idle + 16) / r.cores * 1.5);
  auto tmpl_agent = start_agent(o, home, "templates", "microvm",
                                {"--backends", "container,microvm", "--microvm-templates", "on", "--cpu-overcommit",
                                 fmt::format("{:.0f}", cpu_ratio), "--memory-overcommit", "4"});
  std::unique_ptr<Agent> cold_agent;
  try {
    cold_agent = start_agent(o, home, "cold", "microvm", {"--backends", "microvm", "--microvm-templates", "off"});
  } catch (const std::exception& e) {
    r.problems.push_back(fmt::format("the agent with --microvm-templates off did not start: {}", e.what()));
  }
  constexpr std::uint32_t kPoolSize = 2;
  std::unique_ptr<Agent> pool_agent;
  try {
    pool_agent =
        start_agent(o, home, "pool", "microvm", {"--backends", "microvm", "--microvm-pool", std::to_string(kPoolSize)});
    r.pool_size = kPoolSize;
  } catch (const std::exception& e) {
    r.problems.push_back(fmt::format("the agent with --microvm-pool {} did not start: {}", kPoolSize, e.what()));
  }
  Agent& A = *tmpl_agent;
  const NodeInfo& node = A.node;
  r.accelerator = node.microvm.accelerator;
  r.accelerator_reason = node.microvm.accelerator_reason;
  r.kernel_release = node.microvm.kernel;
  r.agent_version = node.version;
  r.qemu_version = qemu_version();
  const std::string acc = r.accelerator;
  const bool kvm = acc == "kvm";
  std::vector<int> pids{A.pid};
  if (cold_agent) pids.push_back(cold_agent->pid);
  if (pool_agent) pids.push_back(pool_agent->pid);

  // 1. create to the first exec's result.
  sections.run(fmt::format("create to first exec [{}]", acc), pids, [&] {
    std::unique_ptr<QemuPeer> peer;
    try {
      agent::microvm::GuestKernel k = agent::microvm::find_guest_kernel({});
      r.kernel_path = k.kernel.string();
      r.tsc_khz = kvm ? 0 : agent::qemu::host_tsc_khz();
      peer =
          std::make_unique<QemuPeer>(fs::path(work.dir) / "peer", kvm, static_cast<std::uint32_t>(r.tsc_khz), k.kernel);
      r.peer_command = peer->command();
    } catch (const std::exception& e) {
      r.problems.push_back(fmt::format("the QEMU peer cannot run: {}", e.what()));
    }
    const SandboxSpec vspec = vm_spec(o);
    const SandboxSpec cspec = bench_spec(o);
    fmt::print(stderr, "dsec-bench microvm: the first create of the shape (it makes the template)\n");
    Lifecycle first = create_exec_destroy(*A.client, vspec);
    r.first_create_ms = first.create_ms;
    r.first_exec_ms = first.exec_ms;
    r.template_resident.emplace_back("after the first create (the template frozen)", template_resident_bytes(A.pid));
    // The pool agent's first create makes its template and starts the shape's pool: wait until it is full.
    auto wait_pool_full = [&](std::chrono::seconds limit) {
      const auto until = Clock::now() + limit;
      while (Clock::now() < until) {
        NodeInfo n = pool_agent->client->nodes().front();
        if (n.microvm.pool_ready >= kPoolSize) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      return false;
    };
    if (pool_agent) {
      try {
        (void)create_exec_destroy(*pool_agent->client, vspec);
        if (!wait_pool_full(std::chrono::seconds(120))) r.problems.push_back("the pool did not fill within 120 s");
      } catch (const std::exception& e) {
        r.problems.push_back(fmt::format("the pool agent's first create failed: {}", e.what()));
        pool_agent.reset();
      }
    }
    const std::size_t total = r.warmup + r.n;
    bool cold_ok = cold_agent != nullptr;
    for (std::size_t i = 0; i < total; ++i) {
      const bool keep = i >= r.warmup;
      Lifecycle t = create_exec_destroy(*A.client, vspec);
      if (keep) {
        r.tmpl_total.add(t.total_ms);
        r.tmpl_create.add(t.create_ms);
        r.tmpl_exec.add(t.exec_ms);
        r.tmpl_second_exec.add(t.second_exec_ms);
      }
      if (pool_agent) {
        try {
          Lifecycle p = create_exec_destroy(*pool_agent->client, vspec);
          if (keep) {
            r.pool_total.add(p.total_ms);
            r.pool_create.add(p.create_ms);
            r.pool_exec.add(p.exec_ms);
            r.pool_second_exec.add(p.second_exec_ms);
          }
        } catch (const std::exception& e) {
          r.problems.push_back(fmt::format("a create from the pool failed (iteration {}): {}", i, e.what()));
        }
      }
      if (cold_ok) {
        try {
          Lifecycle c = create_exec_destroy(*cold_agent->client, vspec);
          if (keep) {
            r.cold_total.add(c.total_ms);
            r.cold_create.add(c.create_ms);
            r.cold_exec.add(c.exec_ms);
          }
        } catch (const std::exception& e) {
          r.problems.push_back(fmt::format("a cold boot failed (iteration {}, load {}): {}", i, load_text(), e.what()));
        }
      }
      if (peer) {
        try {
          QemuPeer::Run p = peer->run();
          if (keep) {
            r.peer_marker.add(p.marker_ms);
            if (!std::isnan(p.exit_ms)) r.peer_exit.add(p.exit_ms);
          }
        } catch (const std::exception& e) {
          r.problems.push_back(fmt::format("the QEMU peer failed: {}", e.what()));
          peer.reset();
        }
      }
      Lifecycle c = create_exec_destroy(*A.client, cspec);
      if (keep) {
        r.ct_total.add(c.total_ms);
        r.ct_create.add(c.create_ms);
        r.ct_exec.add(c.exec_ms);
      }
      if ((i + 1) % 5 == 0 || i + 1 == total)
        fmt::print(stderr, "  create: {}/{} iterations (load {})\n", i + 1, total, load_text());
    }
    r.template_resident.emplace_back(fmt::format("after {} clones made, exec'd and destroyed", total),
                                     template_resident_bytes(A.pid));
    if (pool_agent) {
      NodeInfo n = pool_agent->client->nodes().front();
      r.pool_claims = n.microvm.pool_claims;
      r.pool_misses = n.microvm.pool_misses;
    }
  });
  if (pool_agent) {
    pool_agent.reset();  // its pooled VMs must not sit in the memory and density figures
    pids.pop_back();
  }

  // 2. exec round trips.
  sections.run(fmt::format("exec round trip [{}]", acc), pids, [&] {
    struct Log {
      MicroVmBenchResult& r;
      int pid;
      ~Log() { r.template_resident.emplace_back("after the exec round trips", template_resident_bytes(pid)); }
    } log{r, A.pid};
    Sandbox vm = A.client->create(vm_spec(o));
    Sandbox ct = A.client->create(bench_spec(o));
    const ExecRequest req = true_request();
    for (int i = 0; i < 5; ++i) {
      check_ok(vm.exec(req), "warm-up exec in the VM");
      check_ok(ct.exec(req), "warm-up exec in the container");
    }
    r.exec_n = r.n * 10;
    r.think_n = r.n;
    for (std::size_t i = 0; i < r.exec_n; ++i) {
      auto t0 = Clock::now();
      ExecResult x = vm.exec(req);
      r.vm_exec.add(ms_since(t0));
      r.vm_exec_agent.add(x.duration_seconds * 1000);
      check_ok(x, "exec in the VM");
      auto t1 = Clock::now();
      check_ok(ct.exec(req), "exec in the container");
      r.ct_exec_b2b.add(ms_since(t1));
    }
    fmt::print(stderr, "  exec: {} back to back each; now {} after {} s of think time\n", r.exec_n, r.think_n,
               std::chrono::duration<double>(kThink).count());
    for (std::size_t i = 0; i < r.think_n; ++i) {
      std::this_thread::sleep_for(kThink);
      auto vm_call = [&] {
        auto t0 = Clock::now();
        ExecResult x = vm.exec(req);
        r.vm_think.add(ms_since(t0));
        r.vm_think_agent.add(x.duration_seconds * 1000);
        check_ok(x, "exec in the VM");
      };
      auto ct_call = [&] {
        auto t0 = Clock::now();
        check_ok(ct.exec(req), "exec in the container");
        r.ct_think.add(ms_since(t0));
      };
      if (i % 2 == 0) {
        vm_call();
        ct_call();
      } else {
        ct_call();
        vm_call();
      }
    }
    vm.destroy();
    ct.destroy();
  });

  // 3. memory per idle VM.
  if (o.microvm_idle > 0)
    sections.run(fmt::format("memory per idle VM, template clones [{}]", acc), pids, [&] {
      r.memory.push_back(idle_memory(A, "template clones", o.microvm_idle,
                                     [&] { return A.client->create_many(o.microvm_idle, vm_spec(o)); }));
      r.template_resident.emplace_back(fmt::format("after {} idle clones", o.microvm_idle),
                                       template_resident_bytes(A.pid));
    });
  if (o.microvm_idle_cold > 0 && cold_agent)
    sections.run(fmt::format("memory per idle VM, cold boots [{}]", acc), pids, [&] {
      r.memory.push_back(idle_memory(*cold_agent, "cold boots", o.microvm_idle_cold, [&] {
        std::vector<Sandbox> v;
        for (std::size_t i = 0; i < o.microvm_idle_cold; ++i) v.push_back(cold_agent->client->create(vm_spec(o)));
        return v;
      }));
    });
  auto check_subtree_gone = [&](const std::string& label, const std::string& name) {
    if (name.empty()) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    auto left = subtree_dirs(name);
    if (left.empty()) return;
    std::string list;
    for (const auto& d : left) {
      list += (list.empty() ? "" : ", ") + d.string();
      ::rmdir(d.c_str());  // empty groups of this run's own agent
    }
    r.problems.push_back(
        fmt::format("the {} agent left its cgroup subtree behind after a clean shutdown: {} "
                    "(dsec-bench removed them)",
                    label, list));
  };
  if (cold_agent) {
    const std::string name = cold_agent->cgroup_name;
    cold_agent.reset();  // its VMs are gone; it stops
    pids = {A.pid};
    check_subtree_gone("cold (--backends microvm)", name);
  }

  // 4. density.
  if (o.microvm_density > 0)
    sections.run(fmt::format("density [{}]", acc), pids, [&] {
      r.density = density_run(o, A, r.problems);
      r.template_resident.emplace_back("after the density run", template_resident_bytes(A.pid));
      r.subtree_charge.emplace_back("after the density run's teardown", subtree_charge(A.cgroup_name));
    });

  // 5. sleep and wake.
  if (!sleep_sizes.empty())
    sections.run(fmt::format("sleep and wake [{}]", acc), pids, [&] {
      if (memhold.empty())
        throw Error(Code::kFailedPrecondition,
                    fmt::format("{} is missing: build the dsec-memhold target", memhold_path.string()));
      for (std::size_t held : sleep_sizes) {
        try {
          r.sleeps.push_back(sleep_run(o, A, memhold, held));
          const auto& s = r.sleeps.back();
          if (!s.intact_after || !s.intact_before)
            r.problems.push_back(
                fmt::format("sleep {} MiB: memhold's checksum came back wrong ({} before the sleep, {} "
                            "after the wake)",
                            held, s.intact_before ? "right" : "wrong", s.intact_after ? "right" : "wrong"));
        } catch (const std::exception& e) {
          MicroVmSleepRun failed;
          failed.mib = held;
          failed.error = e.what();
          r.sleeps.push_back(failed);
          r.problems.push_back(fmt::format("sleep {} MiB failed (load {}): {}", held, load_text(), e.what()));
        }
        r.subtree_charge.emplace_back(fmt::format("after the {} MiB sleep VM was destroyed", held),
                                      subtree_charge(A.cgroup_name));
      }
    });

  // 6. fork.
  if (fork_count > 0)
    sections.run(fmt::format("fork({}) [{}]", fork_count, acc), pids,
                 [&] { r.fork = fork_run(o, A, fork_count, r.problems); });
  r.template_resident.emplace_back("at the end (templates of every shape used)", template_resident_bytes(A.pid));
  r.subtree_charge.emplace_back("at the end, no VM running", subtree_charge(A.cgroup_name));

  const std::string tmpl_cgroup = A.cgroup_name;
  tmpl_agent.reset();
  check_subtree_gone("templates (--backends container,microvm)", tmpl_cgroup);
  return r;
}

// ---------------------------------------------------------------------------------------------- output

namespace {

std::string lat(const Latency& l, double p) { return l.empty() ? "n/a" : ms(l.percentile(p)); }

std::string verdict(bool met) { return met ? "**met**" : "**not met**"; }

struct TargetRow {
  std::string target, measured, verdict;
};

std::vector<TargetRow> targets(const MicroVmBenchResult& r) {
  std::vector<TargetRow> t;
  const std::string& a = r.accelerator;
  const bool kvm = a == "kvm";
  auto lat_pair = [](const Latency& l) { return fmt::format("p50 {}, p99 {}", lat(l, 50), lat(l, 99)); };
  auto pass_pair = [](const Latency& l, double limit) {
    if (l.empty()) return std::string("not measured");
    return fmt::format("p50 {}, p99 {}", l.percentile(50) <= limit ? "met" : "NOT met",
                       l.percentile(99) <= limit ? "met" : "NOT met");
  };
  if (!kvm) {
    t.push_back({fmt::format("[{}] create to first exec from a pool <= 150 ms", a), lat_pair(r.pool_total),
                 pass_pair(r.pool_total, 150)});
    t.push_back({fmt::format("[{}] create to first exec from a template (snapshot) <= 150 ms", a),
                 lat_pair(r.tmpl_total), pass_pair(r.tmpl_total, 150)});
    t.push_back(
        {fmt::format("[{}] cold create to first exec: measured, no target", a), lat_pair(r.cold_total), "reported"});
    t.push_back(
        {"[kvm] cold <= 125 ms; from a snapshot <= 50 ms", fmt::format("not measurable: accelerator is {}", a), "n/a"});
  } else {
    t.push_back({"[kvm] cold create to first exec <= 125 ms", lat_pair(r.cold_total), pass_pair(r.cold_total, 125)});
    t.push_back(
        {"[kvm] create to first exec from a pool <= 50 ms", lat_pair(r.pool_total), pass_pair(r.pool_total, 50)});
    t.push_back({"[kvm] create to first exec from a template (snapshot) <= 50 ms", lat_pair(r.tmpl_total),
                 pass_pair(r.tmpl_total, 50)});
  }
  const double mem_limit = kvm ? 30 : 60;
  for (const auto& m : r.memory) {
    if (m.what != "template clones") continue;
    t.push_back({fmt::format("[{}] host memory per idle microVM (PSS, {} clones) <= {:.0f} MiB", a, m.count, mem_limit),
                 fmt::format("{} PSS; node MemAvailable drop {} per VM", mib(m.pss), mib(m.mem_available_per_vm)),
                 m.found ? (m.pss <= mem_limit * kMiB ? "**met** (PSS)" : "**not met** (PSS)") +
                               std::string(m.mem_available_per_vm <= mem_limit * kMiB ? "; met by MemAvailable"
                                                                                      : "; not met by MemAvailable")
                         : "not measured"});
  }
  for (const auto& s : r.sleeps) {
    if (!s.error.empty() || s.before_bytes <= 0) continue;
    double released = (s.before_bytes - s.after_bytes) / s.before_bytes * 100;
    t.push_back({fmt::format("[{}] sleep of a VM holding {} MiB gives its memory back (protocol.md: nothing of QEMU's "
                             "stays charged)",
                             a, s.mib),
                 fmt::format("{:.1f}% released, {} left charged", released, mib(s.after_bytes)),
                 verdict(released >= 90)});
  }
  if (r.density)
    t.push_back({fmt::format("[{}] idle microVMs on this node >= 200", a),
                 fmt::format("{} ran (target {}; {}); {} answered an exec", r.density->ran, r.density->target,
                             r.density->stop_reason, r.density->exec_ok),
                 verdict(r.density->ran >= 200 && r.density->exec_failed == 0)});
  return t;
}

}  // namespace

void print_microvm(const MicroVmBenchResult& r) {
  const std::string& a = r.accelerator;
  fmt::print("\n== microvm [{}]: QEMU microVMs; accelerator {} ({}) ==\n", a, a, r.accelerator_reason);
  fmt::print("  [{}] guest kernel {} ({}); {}; dsecd {}; tsc {} kHz\n", a, r.kernel_release, r.kernel_path,
             r.qemu_version, r.agent_version, r.tsc_khz);
  fmt::print("\n  -- [{}] create to first exec of `true`, sequential, n={} (after {} warm-up), taking turns --\n", a,
             r.n, r.warmup);
  fmt::print("  {:<62} {:>9} {:>9} {:>9} {:>9}\n", "", "p50", "p90", "p99", "max");
  auto row = [&](const std::string& name, const Latency& l) {
    if (l.empty()) {
      fmt::print("  {:<62} {:>9}\n", name, "n/a");
      return;
    }
    fmt::print("  {:<62} {:>9} {:>9} {:>9} {:>9}\n", name, ms(l.percentile(50)), ms(l.percentile(90)),
               ms(l.percentile(99)), ms(l.max()));
  };
  fmt::print("  [{}] first create of the shape (boots and freezes the template): create {}, first exec {}\n", a,
             ms(r.first_create_ms), ms(r.first_exec_ms));
  row(fmt::format("[{}] microVM from a template: create + first exec", a), r.tmpl_total);
  row(fmt::format("[{}]   of which create", a), r.tmpl_create);
  row(fmt::format("[{}]   of which the first exec", a), r.tmpl_exec);
  row(fmt::format("[{}]   the second exec, for comparison (not in the total)", a), r.tmpl_second_exec);
  row(fmt::format("[{}] microVM from a pool of {}: create + first exec", a, r.pool_size), r.pool_total);
  row(fmt::format("[{}]   of which create (the claim)", a), r.pool_create);
  row(fmt::format("[{}]   of which the first exec", a), r.pool_exec);
  row(fmt::format("[{}]   the second exec, for comparison (not in the total)", a), r.pool_second_exec);
  if (r.pool_size)
    fmt::print("  [{}] pool: {} creates claimed a pooled VM, {} found the pool empty\n", a, r.pool_claims,
               r.pool_misses);
  row(fmt::format("[{}] microVM cold boot: create + first exec", a), r.cold_total);
  row(fmt::format("[{}]   of which create", a), r.cold_create);
  row(fmt::format("[{}]   of which the first exec", a), r.cold_exec);
  row(fmt::format("[{}] plain QEMU, same kernel: spawn to console marker", a), r.peer_marker);
  row(fmt::format("[{}] plain QEMU: spawn to exit (poweroff -f)", a), r.peer_exit);
  row(fmt::format("[{}] container (same agent): create + first exec", a), r.ct_total);
  row(fmt::format("[{}]   of which create", a), r.ct_create);
  if (!r.peer_command.empty()) fmt::print("  [{}] plain QEMU: {}\n", a, r.peer_command);

  fmt::print("\n  -- [{}] exec round trip of `true` in a warm sandbox --\n", a);
  fmt::print("  {:<62} {:>9} {:>9} {:>9} {:>9}\n", "", "p50", "p90", "p99", "max");
  row(fmt::format("[{}] microVM, back to back (n={})", a, r.vm_exec.count()), r.vm_exec);
  row(fmt::format("[{}]   of which in the agent (ExecResult.duration)", a), r.vm_exec_agent);
  row(fmt::format("[{}] container, back to back (n={})", a, r.ct_exec_b2b.count()), r.ct_exec_b2b);
  row(fmt::format("[{}] microVM, after 1 s of think time (n={})", a, r.vm_think.count()), r.vm_think);
  row(fmt::format("[{}]   of which in the agent", a), r.vm_think_agent);
  row(fmt::format("[{}] container, after 1 s of think time (n={})", a, r.ct_think.count()), r.ct_think);

  for (const auto& m : r.memory) {
    fmt::print("\n  -- [{}] host memory per idle microVM: {} {} (made in {:.1f} s, settled {:.0f} s) --\n", a, m.count,
               m.what, m.create_seconds, m.settle_seconds);
    fmt::print("  [{}] QEMU processes found: {}; PSS per VM {} (min {}, max {}); RSS {}\n", a, m.found, mib(m.pss),
               mib(m.pss_min), mib(m.pss_max), mib(m.rss));
    fmt::print("  [{}]   Pss_Anon {}, Pss_File {}, Pss_Shmem {}\n", a, mib(m.pss_anon), mib(m.pss_file),
               mib(m.pss_shmem));
    fmt::print(
        "  [{}]   guest RAM mapping (memfd): RSS {}, PSS {}, the VM's own pages {}; templates' memfds resident "
        "on the node {} (counted once)\n",
        a, mib(m.ram_rss), mib(m.ram_pss), mib(m.ram_private), mib(m.template_resident));
    fmt::print(
        "  [{}]   memory cgroup charge per VM {}; node MemAvailable drop per VM {} (other processes' RSS changed "
        "by {} meanwhile: noise); agent RSS growth {}\n",
        a, mib(m.cgroup_charge), mib(m.mem_available_per_vm), mib(m.others_rss_delta), mib(m.agent_rss_delta));
    fmt::print("  [{}]   idle CPU per VM {:.2f}% of a core; load average (1 min) {:.2f}\n", a, m.vm_cpu_pct, m.load1);
    if (m.discard_failures)
      fmt::print("  [{}]   {} of {} QEMU logs report a failed discard (free page reporting gave nothing back): {}\n", a,
                 m.discard_failures, m.count, m.discard_example);
  }

  if (r.density) {
    const auto& d = *r.density;
    fmt::print("\n  -- [{}] density: idle template clones (128 MiB, 1 vCPU) in batches of create_many --\n", a);
    fmt::print("  [{}] ran {} of {} ({}); creates took {:.1f} s, {} per VM per batch (p50), {} (max)\n", a, d.ran,
               d.target, d.stop_reason, d.create_seconds, lat(d.batch_per_vm, 50),
               d.batch_per_vm.empty() ? "n/a" : ms(d.batch_per_vm.max()));
    fmt::print(
        "  [{}] at the end: PSS per VM {}, RSS {}, cgroup charge {}, node MemAvailable drop per VM {} "
        "(MemAvailable {:.2f} -> {:.2f} GiB; other processes' RSS changed by {} meanwhile)\n",
        a, mib(d.pss_per_vm), mib(d.rss_per_vm), mib(d.cgroup_per_vm), mib(d.mem_available_per_vm),
        d.mem_available_start / kGiB, d.mem_available_end / kGiB, mib(d.others_rss_delta));
    fmt::print(
        "  [{}] idle CPU over {:.0f} s: {} QEMUs use {:.2f} cores ({:.2f}% of a core per VM), the agent {:.3f}, "
        "the node {:.2f} of {}; load average {:.2f} {:.2f} {:.2f}\n",
        a, d.cpu_window, d.qemu_found, d.vms_cores, d.vm_cpu_pct, d.agent_cores, d.node_busy_cores, r.cores, d.load1,
        d.load5, d.load15);
    fmt::print(
        "  [{}] exec of `true` in every one: {} answered, {} failed, in {:.1f} s (4 at a time; p50 {}, p99 {}, "
        "max {})\n",
        a, d.exec_ok, d.exec_failed, d.exec_check_seconds, lat(d.exec_check, 50), lat(d.exec_check, 99),
        d.exec_check.empty() ? "n/a" : ms(d.exec_check.max()));
    for (const auto& e : d.exec_errors) fmt::print("  [{}]   failed: {}\n", a, e);
    fmt::print(
        "  [{}] destroyed in {:.1f} s; left: {} QEMU processes in the agent's cgroup, {} VMs in GET /v1/node, "
        "{} sandboxes listed\n",
        a, d.destroy_seconds, d.qemu_left, d.vms_reported_left, d.sandboxes_listed_left);
  }

  if (!r.sleeps.empty()) {
    fmt::print("\n  -- [{}] sleep (RAM and device state to disk, QEMU ends) and wake of a VM holding memory --\n", a);
    fmt::print("  {:>6} {:>6} {:>24} {:>9} {:>8} {:>11} {:>11} {:>17} {:>12} {:>9} {:>8}\n", "held", "guest",
               "charged before -> after", "released", "sleep", "state file", "wake", "wake->1st exec", "charged now",
               "touch", "intact");
    for (const auto& s : r.sleeps) {
      if (!s.error.empty()) {
        fmt::print("  [{}] {:>3} MiB: failed: {}\n", a, s.mib, s.error);
        continue;
      }
      double released = s.before_bytes > 0 ? (s.before_bytes - s.after_bytes) / s.before_bytes * 100 : 0;
      fmt::print("  {:>6} {:>6} {:>24} {:>8.1f}% {:>6.2f} s {:>11} {:>9.2f} s {:>14} {:>12} {:>9} {:>8}  [{}]\n",
                 fmt::format("{}M", s.mib), fmt::format("{}M", s.guest_memory >> 20),
                 mib(s.before_bytes) + " -> " + mib(s.after_bytes), released, s.sleep_seconds,
                 s.state_file_bytes < 0 ? "n/a" : mib(s.state_file_bytes), s.wake_seconds, ms(s.wake_to_exec_ms),
                 mib(s.charged_after_wake), ms(s.touch_ms), s.intact_after && s.intact_before ? "yes" : "NO", a);
      fmt::print(
          "  [{}]   memhold filled {} MiB in {:.0f} ms; sleep call {}, wake call {}, first exec after the wake "
          "{}; touching all the memory awake before: {}\n",
          a, s.mib, s.fill_ms, ms(s.sleep_call_ms), ms(s.wake_call_ms), ms(s.first_exec_ms), ms(s.awake_touch_ms));
      fmt::print(
          "  [{}]   shmem in the VM's charge: {} before the sleep, {} after it (QEMU gone); the templates' "
          "memfds grew by {} from this VM's create (its shape's template made) to its destroy\n",
          a, mib(s.shmem_before_sleep), mib(s.shmem_after_sleep), mib(s.template_growth));
    }
  }

  if (r.fork) {
    const auto& f = *r.fork;
    fmt::print("\n  -- [{}] fork({}) of a VM running a background counter --\n", a, f.count);
    fmt::print("  [{}] fork() returned after {}; all {} copies answered an exec after {}\n", a, ms(f.call_ms), f.count,
               ms(f.all_answered_ms));
    fmt::print(
        "  [{}] copies answering {}, background process alive in {}, counter inherited in {}; parent alive: {}\n", a,
        f.answered, f.alive, f.inherited, f.parent_alive ? "yes" : "NO");
    for (const auto& d : f.details) fmt::print("  [{}]   {}\n", a, d);
  }

  if (!r.template_resident.empty()) {
    fmt::print("\n  -- [{}] the templates' RAM (sealed memfds held by the agent), resident pages --\n", a);
    for (const auto& [when, bytes] : r.template_resident) fmt::print("  [{}] {}: {}\n", a, when, mib(bytes));
    for (const auto& [when, bytes] : r.subtree_charge)
      fmt::print("  [{}] charged to the agent's cgroup subtree {}: {}\n", a, when, mib(bytes));
  }
  fmt::print("\n  -- [{}] targets --\n", a);
  for (const auto& t : targets(r)) fmt::print("  {:<70} {:<56} {}\n", t.target, t.measured, t.verdict);
  print_run_log(a, r.section_load, r.notes, r.problems);
}

std::string markdown_microvm(const MicroVmBenchResult& r) {
  const std::string& a = r.accelerator;
  std::string md = fmt::format("### microVMs [{}]\n\n", a);
  md += fmt::format(
      "Accelerator **{}** ({}). Guest kernel {}, {}, dsecd {}. VMs of 128 MiB and 1 vCPU unless said; "
      "image busybox.\n\n",
      a, r.accelerator_reason, r.kernel_release, r.qemu_version, r.agent_version);
  md += fmt::format("#### [{}] Create to the first exec of `true` (sequential, n = {}, {} warm-up, taking turns)\n\n",
                    a, r.n, r.warmup);
  md += "| system | p50 | p90 | p99 | max |\n| --- | --- | --- | --- | --- |\n";
  auto row = [&](const std::string& name, const Latency& l) {
    if (l.empty()) return fmt::format("| {} | n/a | | | |\n", name);
    return fmt::format("| {} | {} | {} | {} | {} |\n", name, ms(l.percentile(50)), ms(l.percentile(90)),
                       ms(l.percentile(99)), ms(l.max()));
  };
  md += fmt::format(
      "| [{}] first create of the shape (boots and freezes the template) | {} (create {}, exec {}) | | | |\n", a,
      ms(r.first_create_ms + r.first_exec_ms), ms(r.first_create_ms), ms(r.first_exec_ms));
  md += row(fmt::format("[{}] microVM from a template: create + first exec", a), r.tmpl_total);
  md += row(fmt::format("[{}] … of which create", a), r.tmpl_create);
  md += row(fmt::format("[{}] … of which the first exec", a), r.tmpl_exec);
  md += row(fmt::format("[{}] the second exec in the same clone (not in the total)", a), r.tmpl_second_exec);
  md += row(fmt::format("[{}] microVM from a pool (`--microvm-pool {}`; {} claims, {} misses): create + first exec", a,
                        r.pool_size, r.pool_claims, r.pool_misses),
            r.pool_total);
  md += row(fmt::format("[{}] … of which create (the claim)", a), r.pool_create);
  md += row(fmt::format("[{}] … of which the first exec", a), r.pool_exec);
  md += row(fmt::format("[{}] the second exec in the same pooled VM (not in the total)", a), r.pool_second_exec);
  md += row(fmt::format("[{}] microVM cold boot (`--microvm-templates off`): create + first exec", a), r.cold_total);
  md += row(fmt::format("[{}] … of which create", a), r.cold_create);
  md += row(fmt::format("[{}] plain `qemu-system-x86_64`, same kernel and machine: spawn to console marker", a),
            r.peer_marker);
  md += row(fmt::format("[{}] plain `qemu-system-x86_64`: spawn to exit (`poweroff -f`)", a), r.peer_exit);
  md += row(fmt::format("[{}] container of the same image: create + first exec", a), r.ct_total);

  md += fmt::format("\n#### [{}] Exec round trip of `true` in a warm sandbox\n\n", a);
  md += "| system | p50 | p90 | p99 | max |\n| --- | --- | --- | --- | --- |\n";
  md += row(fmt::format("[{}] microVM, back to back (n = {})", a, r.vm_exec.count()), r.vm_exec);
  md += row(fmt::format("[{}] … of which in the agent", a), r.vm_exec_agent);
  md += row(fmt::format("[{}] container, back to back (n = {})", a, r.ct_exec_b2b.count()), r.ct_exec_b2b);
  md += row(fmt::format("[{}] microVM, after 1 s of think time (n = {})", a, r.vm_think.count()), r.vm_think);
  md += row(fmt::format("[{}] container, after 1 s of think time (n = {})", a, r.ct_think.count()), r.ct_think);

  if (!r.memory.empty()) {
    md += fmt::format("\n#### [{}] Host memory per idle microVM (settled {:.0f} s)\n\n", a,
                      std::chrono::duration<double>(kSettle).count());
    md +=
        "| VMs | PSS (min–max) | Pss_Anon | Pss_File | Pss_Shmem | guest RAM memfd: PSS / own pages | template "
        "memfd on the node | cgroup charge | MemAvailable drop | idle CPU |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
    for (const auto& m : r.memory)
      md += fmt::format("| [{}] {} {} | {} ({}–{}) | {} | {} | {} | {} / {} | {} | {} | {} | {:.2f}% |\n", a, m.count,
                        m.what, mib(m.pss), mib(m.pss_min), mib(m.pss_max), mib(m.pss_anon), mib(m.pss_file),
                        mib(m.pss_shmem), mib(m.ram_pss), mib(m.ram_private), mib(m.template_resident),
                        mib(m.cgroup_charge), mib(m.mem_available_per_vm), m.vm_cpu_pct);
  }
  if (r.density) {
    const auto& d = *r.density;
    md += fmt::format("\n#### [{}] Density: idle template clones\n\n", a);
    md += fmt::format("- [{}] ran **{}** of {} ({}); creates {:.1f} s in all, {} per VM per batch (p50)\n", a, d.ran,
                      d.target, d.stop_reason, d.create_seconds, lat(d.batch_per_vm, 50));
    md += fmt::format(
        "- [{}] per VM at the end: PSS {}, cgroup charge {}, node MemAvailable drop {} ({:.2f} → {:.2f} "
        "GiB available)\n",
        a, mib(d.pss_per_vm), mib(d.cgroup_per_vm), mib(d.mem_available_per_vm), d.mem_available_start / kGiB,
        d.mem_available_end / kGiB);
    md += fmt::format(
        "- [{}] idle over {:.0f} s: the QEMUs {:.2f} cores ({:.2f}% of a core per VM), the agent {:.3f}, "
        "the node {:.2f} of {}; load average {:.2f} {:.2f} {:.2f}\n",
        a, d.cpu_window, d.vms_cores, d.vm_cpu_pct, d.agent_cores, d.node_busy_cores, r.cores, d.load1, d.load5,
        d.load15);
    md += fmt::format("- [{}] exec in every one: {} answered, {} failed ({:.1f} s, p50 {}, p99 {})\n", a, d.exec_ok,
                      d.exec_failed, d.exec_check_seconds, lat(d.exec_check, 50), lat(d.exec_check, 99));
    md += fmt::format(
        "- [{}] teardown {:.1f} s; left after it: {} QEMU processes, {} VMs in GET /v1/node, {} sandboxes\n", a,
        d.destroy_seconds, d.qemu_left, d.vms_reported_left, d.sandboxes_listed_left);
  }
  if (!r.sleeps.empty()) {
    md += fmt::format("\n#### [{}] Sleep and wake (RAM and device state to a file, QEMU ends; wake restores)\n\n", a);
    md +=
        "| held | guest | charged before → after | released | sleep | state file | wake | wake → first exec result "
        "| intact |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
    for (const auto& s : r.sleeps) {
      if (!s.error.empty()) {
        md += fmt::format("| [{}] {} MiB | failed: {} | | | | | | | |\n", a, s.mib, s.error);
        continue;
      }
      double released = s.before_bytes > 0 ? (s.before_bytes - s.after_bytes) / s.before_bytes * 100 : 0;
      md += fmt::format(
          "| [{}] {} MiB | {} MiB | {} → {} (shmem {} → {}) | {:.1f}% | {:.2f} s | {} | {:.2f} s | {} | "
          "{} |\n",
          a, s.mib, s.guest_memory >> 20, mib(s.before_bytes), mib(s.after_bytes), mib(s.shmem_before_sleep),
          mib(s.shmem_after_sleep), released, s.sleep_seconds, s.state_file_bytes < 0 ? "n/a" : mib(s.state_file_bytes),
          s.wake_seconds, ms(s.wake_to_exec_ms), s.intact_after && s.intact_before ? "yes" : "**no**");
    }
  }
  if (r.fork) {
    const auto& f = *r.fork;
    md += fmt::format(
        "\n#### [{}] Fork\n\n`fork({})` of a VM running a background counter: `fork()` returned after "
        "{}, all {} copies answered an exec after {}; {} copies with the counter still running, {} "
        "carrying the parent's count; parent still running: {}.\n",
        a, f.count, ms(f.call_ms), f.count, ms(f.all_answered_ms), f.alive, f.inherited,
        f.parent_alive ? "yes" : "**no**");
  }
  if (!r.template_resident.empty()) {
    md += fmt::format("\n#### [{}] Templates' RAM (sealed memfds held by the agent), resident\n\n", a);
    for (const auto& [when, bytes] : r.template_resident) md += fmt::format("- [{}] {}: {}\n", a, when, mib(bytes));
    for (const auto& [when, bytes] : r.subtree_charge)
      md += fmt::format("- [{}] charged to the agent's cgroup subtree {}: {}\n", a, when, mib(bytes));
  }
  md += fmt::format("\n#### [{}] Targets\n\n| target | measured | verdict |\n| --- | --- | --- |\n", a);
  for (const auto& t : targets(r)) md += fmt::format("| {} | {} | {} |\n", t.target, t.measured, t.verdict);
  return md + markdown_run_log(a, r.section_load, r.notes, r.problems);
}

}  // namespace dsec::bench
