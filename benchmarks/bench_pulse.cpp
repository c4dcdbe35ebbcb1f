// dsec-bench pulse: one trainer's pulse of creates over many nodes found through etcd.
//
// The run starts its own cluster on this machine: a private etcd and N agents (dsecd --listen 127.0.0.1:<port>
// --etcd <url> under a private key prefix), each with its home, sandbox records and run directory on tmpfs
// (/dev/shm), so that disk writes do not decide the figures. A Client that is given only the etcd URL (discovery,
// no endpoint list) then creates every sandbox of the pulse with one call (create_group, or create_many), and the
// time until the call returns, when every sandbox has been acknowledged by its node, is the figure.
//
// 32,000 sandboxes do not run on a 2-core machine: the large pulse uses the null backend, a control-plane
// simulation that admits, records and answers for a sandbox without starting anything (client placement, HTTP,
// the agent's registry and its sandbox records are all real). The second pulse is the real-container one that
// fits this machine: container sandboxes of the busybox image over fewer agents.
//
// The client runs in a forked child of dsec-bench, so getrusage and VmHWM of that child are the client's own CPU
// time and memory high water mark (VmHWM is reset through /proc/self/clear_refs when the child starts).
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include "bench.hpp"
#include "cluster/etcd_client.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "dsec/group.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"

namespace dsec::bench {
namespace {

namespace fs = std::filesystem;
using json = protocol::json;

constexpr std::string_view kEtcd = "/usr/bin/etcd";
constexpr std::string_view kAgentLabel = "dsec-bench-agent";  // node label: which agent of the run
constexpr std::string_view kPulseLabel = "dsec-bench-pulse";  // sandbox label: pulse or warm-up
constexpr auto kStartTimeout = std::chrono::seconds(60);

// The benchmark's etcd client: one member on loopback, a short connect timeout.
cluster::EtcdOptions etcd_options(const std::string& url, std::chrono::milliseconds request_timeout) {
  cluster::EtcdOptions o;
  o.endpoints = {url};
  o.request_timeout = request_timeout;
  o.connect_timeout = std::chrono::milliseconds(500);
  return o;
}
constexpr auto kStopGrace = std::chrono::seconds(60);

std::string human_bytes(double bytes) {
  if (bytes >= (1ull << 30)) return fmt::format("{:.2f} GiB", bytes / (1ull << 30));
  return fmt::format("{:.1f} MiB", bytes / (1 << 20));
}

// Free TCP ports on 127.0.0.1: all bound at once (so they differ), then released for the servers to take.
std::vector<int> free_ports(std::size_t n) {
  std::vector<UniqueFd> held;
  std::vector<int> ports;
  for (std::size_t i = 0; i < n; ++i) {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd) throw_errno(errno, "socket");
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) throw_errno(errno, "bind 127.0.0.1:0");
    socklen_t len = sizeof addr;
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0) throw_errno(errno, "getsockname");
    ports.push_back(ntohs(addr.sin_port));
    held.push_back(std::move(fd));
  }
  return ports;
}

// A server this benchmark started: its own process, its log, SIGTERM if dsec-bench dies first.
class Process {
 public:
  Process() = default;
  Process(std::string name, const std::vector<std::string>& argv, const fs::path& log, int ready_fd = -1)
      : name_(std::move(name)), log_(log) {
    std::vector<char*> args;
    args.reserve(argv.size() + 1);
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    UniqueFd out(::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    if (!out) throw_errno_fmt(errno, "open {}", log.string());
    UniqueFd null_in(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (!null_in) throw_errno(errno, "open /dev/null");
    const pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid < 0) throw_errno_fmt(errno, "fork for {}", name_);
    if (pid == 0) {
      // Only async-signal-safe calls from here to exec.
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(127);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      ::dup2(null_in.get(), 0);
      ::dup2(out.get(), 1);
      ::dup2(out.get(), 2);
      if (ready_fd >= 0) ::dup2(ready_fd, 3);
      ::setpgid(0, 0);  // a ^C at the terminal reaches dsec-bench, which stops the servers in order
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    pid_ = pid;
  }
  Process(Process&& o) noexcept { *this = std::move(o); }
  Process& operator=(Process&& o) noexcept {
    std::swap(name_, o.name_);
    std::swap(log_, o.log_);
    std::swap(pid_, o.pid_);
    std::swap(status_, o.status_);
    return *this;
  }
  ~Process() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      retry_eintr([&] { return ::waitpid(pid_, nullptr, 0); });
    }
  }

  pid_t pid() const noexcept { return pid_; }
  const std::string& name() const noexcept { return name_; }
  // Whether it has exited (reaped); its wait status then in status().
  bool exited() {
    if (pid_ <= 0) return true;
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = st;
      pid_ = -1;
      return true;
    }
    return false;
  }
  void terminate() {
    if (pid_ > 0) ::kill(pid_, SIGTERM);
  }
  // Waits for it to exit, SIGKILL past the grace. Returns a description when it did not exit 0 on its own.
  std::optional<std::string> wait(std::chrono::milliseconds grace) {
    auto give_up = Clock::now() + grace;
    while (!exited()) {
      if (Clock::now() > give_up) {
        ::kill(pid_, SIGKILL);
        int st = 0;
        retry_eintr([&] { return ::waitpid(pid_, &st, 0); });
        pid_ = -1;
        return fmt::format("{} did not stop within {} s of SIGTERM and was killed", name_, grace.count() / 1000);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (WIFEXITED(status_) && WEXITSTATUS(status_) == 0) return std::nullopt;
    return fmt::format("{} ended with {}", name_,
                       WIFEXITED(status_) ? fmt::format("exit status {}", WEXITSTATUS(status_))
                                          : fmt::format("signal {}", WTERMSIG(status_)));
  }
  std::string log_tail(std::size_t n = 2000) const {
    std::string text;
    try {
      text = read_text_file(log_.string());
    } catch (const std::exception&) {
      return "(no log)";
    }
    return text.size() > n ? text.substr(text.size() - n) : text;
  }

 private:
  std::string name_;
  fs::path log_;
  pid_t pid_ = -1;
  int status_ = 0;
};

// CPU seconds (user + system) of a process and the children it reaped; 0 when it is gone.
double process_cpu_seconds(int pid) {
  std::string text;
  try {
    text = read_text_file(fmt::format("/proc/{}/stat", pid));
  } catch (const std::exception&) {
    return 0;
  }
  auto close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream in(text.substr(close + 2));
  std::string field;
  // Fields from 3 (state); utime is 14, stime 15, cutime 16, cstime 17.
  std::uint64_t ticks = 0;
  for (int i = 3; i <= 17 && in >> field; ++i)
    if (i >= 14) ticks += std::strtoull(field.c_str(), nullptr, 10);
  return static_cast<double>(ticks) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

// Time a process has run on a CPU, in seconds, from /proc/<pid>/schedstat (nanoseconds: exact where /proc/<pid>/stat
// rounds a process that ran for less than a clock tick down to 0); 0 when it is gone.
double process_run_seconds(int pid) {
  std::string text;
  try {
    text = read_text_file(fmt::format("/proc/{}/schedstat", pid));
  } catch (const std::exception&) {
    return 0;
  }
  return static_cast<double>(std::strtoull(text.c_str(), nullptr, 10)) / 1e9;
}

// A "VmHWM:" / "VmRSS:" line of /proc/<pid>/status in bytes (0 when missing).
std::uint64_t status_bytes(const std::string& pid, std::string_view field) {
  std::ifstream in(fmt::format("/proc/{}/status", pid));
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) return std::strtoull(line.c_str() + field.size(), nullptr, 10) * 1024;
  return 0;
}

double rusage_seconds(const timeval& tv) { return static_cast<double>(tv.tv_sec) + tv.tv_usec / 1e6; }

struct Rusage {
  double user = 0, sys = 0;
  static Rusage now() {
    rusage ru{};
    ::getrusage(RUSAGE_SELF, &ru);
    return {rusage_seconds(ru.ru_utime), rusage_seconds(ru.ru_stime)};
  }
};

struct ClusterRun {
  std::string backend;
  std::size_t agents = 0, sandboxes = 0;
  std::string etcd_url, prefix, store;
  std::vector<int> agent_pids;
  int etcd_pid = -1;
  std::string api;
  double cpu_per_sandbox = 0.01;
  std::uint64_t memory_per_sandbox = 4ull << 20;
};

std::string node_of(const std::string& sandbox_id) {
  auto dash = sandbox_id.rfind('-');
  return dash == std::string::npos ? sandbox_id : sandbox_id.substr(0, dash);
}

// The client's side of a pulse, in the forked child: discovery, a warm-up sandbox on every agent (its image
// layers mounted, as on a node that has served this image before), the timed pulse, the timed destroy.
json client_side(const ClusterRun& run) {
  {
    // Reset VmHWM to the current RSS: from here on it is this child's own high water mark.
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
  }
  json out;
  std::vector<int> servers = run.agent_pids;
  servers.push_back(run.etcd_pid);

  ClientOptions copts;
  copts.etcd_endpoints = {run.etcd_url};
  copts.etcd_prefix = run.prefix;
  copts.stores = {run.store};
  copts.call_deadline = std::chrono::seconds(300);
  const std::size_t share = (run.sandboxes + run.agents - 1) / run.agents;
  const std::size_t batches = run.agents * ((share + 1023) / 1024);
  copts.create_concurrency = std::max<std::size_t>(32, batches);
  out["create_concurrency"] = copts.create_concurrency;

  auto t_discovery = Clock::now();
  Client client(copts);
  for (;;) {
    std::size_t seen = 0;
    try {
      seen = client.nodes().size();
    } catch (const Error&) {
    }
    if (seen == run.agents) break;
    if (seen > run.agents)
      throw Error(Code::kInternal,
                  fmt::format("the client sees {} nodes under {}, not {}", seen, run.prefix, run.agents));
    if (Clock::now() - t_discovery > kStartTimeout)
      throw Error(Code::kDeadlineExceeded, fmt::format("the client saw {} of {} nodes through etcd within {} s", seen,
                                                       run.agents, kStartTimeout.count()));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  out["discovery_seconds"] = ms_since(t_discovery) / 1000;

  SandboxSpec spec;
  spec.image = "busybox";
  spec.kind = run.backend;
  spec.resources.cpu = run.cpu_per_sandbox;
  spec.resources.memory_bytes = run.memory_per_sandbox;
  spec.ttl = std::chrono::seconds(900);
  spec.labels = {{"dsec-bench", "pulse"}, {std::string(kPulseLabel), "pulse"}};

  std::vector<Sandbox> warm;
  for (std::size_t i = 0; i < run.agents; ++i) {
    SandboxSpec w = spec;
    w.labels[std::string(kPulseLabel)] = "warm-up";
    w.node_selector = {{std::string(kAgentLabel), std::to_string(i)}};
    warm.push_back(client.create(w));
  }

  // The pulse.
  Rusage ru0 = Rusage::now();
  std::vector<double> agent0;
  for (int pid : run.agent_pids) agent0.push_back(process_cpu_seconds(pid));
  const double etcd0 = process_cpu_seconds(run.etcd_pid);
  const std::uint64_t rss_before = status_bytes("self", "VmRSS:");
  std::optional<SandboxGroup> group;
  std::vector<Sandbox> many;
  CpuMeter meter(servers);
  auto t0 = Clock::now();
  if (run.api == "create_group") {
    group.emplace(client.create_group(run.sandboxes, spec, std::chrono::seconds(120)));
  } else {
    many = client.create_many(run.sandboxes, spec);
  }
  const double create_seconds = ms_since(t0) / 1000;
  CpuUse cpu_create = meter.stop();
  Rusage ru1 = Rusage::now();
  std::vector<double> agent1;
  for (int pid : run.agent_pids) agent1.push_back(process_cpu_seconds(pid));
  const std::uint64_t hwm_create = status_bytes("self", "VmHWM:");
  std::uint64_t agents_rss = 0, agent_rss_max = 0;
  for (int pid : run.agent_pids) {
    std::uint64_t rss = status_bytes(std::to_string(pid), "VmRSS:");
    agents_rss += rss;
    agent_rss_max = std::max(agent_rss_max, rss);
  }

  std::map<std::string, std::size_t> per_node;
  std::vector<std::string> ids;
  if (group)
    for (auto& sb : *group) ids.push_back(sb.id());
  for (auto& sb : many) ids.push_back(sb.id());
  if (ids.size() != run.sandboxes)
    throw Error(Code::kInternal, fmt::format("asked for {} sandboxes, got {}", run.sandboxes, ids.size()));
  for (const auto& id : ids) ++per_node[node_of(id)];
  // What the agents themselves hold (the warm-up sandboxes included), and for containers, the sandboxes that have a
  // live process on this host.
  std::size_t reported = 0;
  for (const auto& node : client.nodes()) reported += node.sandboxes;
  out["agents_report"] = reported;
  if (run.backend == "container") {
    std::set<std::string> wanted(ids.begin(), ids.end());
    SandboxProcesses found = find_sandbox_processes(wanted);
    out["alive"] = found.pids.size();
    // Their CPU time, all spent since the pulse began: the machine's meter counts it under other processes.
    double sandboxes_cpu = 0;
    for (const auto& [id, pids] : found.pids)
      for (int pid : pids) sandboxes_cpu += process_run_seconds(pid);
    out["sandboxes_cpu"] = sandboxes_cpu;
  }

  // Destroy them all.
  Rusage ru2 = Rusage::now();
  std::vector<double> agent2;
  for (int pid : run.agent_pids) agent2.push_back(process_cpu_seconds(pid));
  CpuMeter destroy_meter(servers);
  auto t1 = Clock::now();
  if (group) {
    group->destroy();
  } else {
    std::atomic<std::size_t> next{0};
    std::vector<std::thread> threads;
    std::atomic<std::size_t> failures{0};
    for (std::size_t w = 0; w < copts.create_concurrency; ++w)
      threads.emplace_back([&] {
        for (std::size_t i = next.fetch_add(1); i < many.size(); i = next.fetch_add(1)) {
          try {
            many[i].destroy();
          } catch (const Error&) {
            ++failures;
          }
        }
      });
    for (auto& t : threads) t.join();
    if (failures > 0) throw Error(Code::kInternal, fmt::format("{} destroys failed", failures.load()));
  }
  const double destroy_seconds = ms_since(t1) / 1000;
  CpuUse cpu_destroy = destroy_meter.stop();
  Rusage ru3 = Rusage::now();
  std::vector<double> agent3;
  for (int pid : run.agent_pids) agent3.push_back(process_cpu_seconds(pid));
  const double etcd1 = process_cpu_seconds(run.etcd_pid);
  const std::uint64_t hwm = status_bytes("self", "VmHWM:");

  std::size_t left = client.list({{std::string(kPulseLabel), "pulse"}}).size();
  for (auto& w : warm) w.destroy();
  left += client.list({{std::string(kPulseLabel), "warm-up"}}).size();
  client.close();

  double agents_create = 0, agents_destroy = 0, agent_max = 0;
  for (std::size_t i = 0; i < run.agent_pids.size(); ++i) {
    agents_create += agent1[i] - agent0[i];
    agent_max = std::max(agent_max, agent1[i] - agent0[i]);
    agents_destroy += agent3[i] - agent2[i];
  }
  std::size_t lo = run.sandboxes, hi = 0;
  for (std::size_t i = 0; i < run.agents; ++i) {
    // Node ids are pulse-<backend>-<i>; an agent that got nothing has no entry.
    auto it = per_node.find(fmt::format("pulse-{}-{}", run.backend, i));
    std::size_t n = it == per_node.end() ? 0 : it->second;
    lo = std::min(lo, n);
    hi = std::max(hi, n);
  }
  auto cpu_json = [](const CpuUse& c) {
    return json{{"seconds", c.seconds},     {"busy", c.busy_cores},   {"ours", c.ours_cores},
                {"kernel", c.kernel_cores}, {"steal", c.steal_cores}, {"others", c.others_cores}};
  };
  out["create_seconds"] = create_seconds;
  out["destroy_seconds"] = destroy_seconds;
  out["client_user_create"] = ru1.user - ru0.user;
  out["client_sys_create"] = ru1.sys - ru0.sys;
  out["client_cpu_destroy"] = (ru3.user - ru2.user) + (ru3.sys - ru2.sys);
  out["client_rss_before"] = rss_before;
  out["client_hwm_create"] = hwm_create;
  out["client_hwm"] = hwm;
  out["agents_cpu_create"] = agents_create;
  out["agent_cpu_create_max"] = agent_max;
  out["agents_cpu_destroy"] = agents_destroy;
  out["etcd_cpu"] = etcd1 - etcd0;
  out["agents_rss_total"] = agents_rss;
  out["agent_rss_max"] = agent_rss_max;
  out["per_agent_min"] = lo;
  out["per_agent_max"] = hi;
  out["agents_used"] = per_node.size();
  out["left_after_destroy"] = left;
  out["cpu_create"] = cpu_json(cpu_create);
  out["cpu_destroy"] = cpu_json(cpu_destroy);
  return out;
}

CpuUse cpu_from(const json& j) {
  CpuUse c;
  c.seconds = j.at("seconds");
  c.busy_cores = j.at("busy");
  c.ours_cores = j.at("ours");
  c.kernel_cores = j.at("kernel");
  c.steal_cores = j.at("steal");
  c.others_cores = j.at("others");
  return c;
}

// Runs client_side in a forked child and returns what it measured. dsec-bench has no other thread here, so the
// child starts from a consistent copy of it.
json run_client_child(const ClusterRun& run) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw_errno(errno, "pipe2");
  UniqueFd rd(fds[0]), wr(fds[1]);
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) throw_errno(errno, "fork the client");
  if (pid == 0) {
    rd.reset();
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    json result;
    int code = 0;
    try {
      result = client_side(run);
    } catch (const Error& e) {
      result = json{{"error", fmt::format("{}: {}", e.code_name(), e.what())}};
      code = 1;
    } catch (const std::exception& e) {
      result = json{{"error", e.what()}};
      code = 1;
    }
    std::string text = result.dump();
    std::string_view left = text;
    while (!left.empty()) {
      ssize_t n = ::write(wr.get(), left.data(), left.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      left.remove_prefix(static_cast<std::size_t>(n));
    }
    std::fflush(nullptr);
    ::_exit(code);
  }
  wr.reset();
  std::string text;
  char buf[65536];
  for (;;) {
    ssize_t n = retry_eintr([&] { return ::read(rd.get(), buf, sizeof buf); });
    if (n < 0) throw_errno(errno, "read from the client child");
    if (n == 0) break;
    text.append(buf, static_cast<std::size_t>(n));
  }
  int status = 0;
  retry_eintr([&] { return ::waitpid(pid, &status, 0); });
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception&) {
    throw Error(Code::kInternal, fmt::format("the client child ended with {} and no result",
                                             WIFEXITED(status) ? fmt::format("exit status {}", WEXITSTATUS(status))
                                                               : fmt::format("signal {}", WTERMSIG(status))));
  }
  if (j.contains("error")) throw Error(Code::kInternal, fmt::format("the client: {}", j["error"].get<std::string>()));
  return j;
}

struct Etcd {
  Process process;
  std::string url;
};

Etcd start_etcd(const fs::path& dir) {
  fs::create_directories(dir);
  auto ports = free_ports(2);
  Etcd e;
  e.url = fmt::format("http://127.0.0.1:{}", ports[0]);
  const std::string peer = fmt::format("http://127.0.0.1:{}", ports[1]);
  e.process = Process("etcd",
                      {std::string(kEtcd), "--name", "dsec-bench", "--data-dir", (dir / "data").string(),
                       "--listen-client-urls", e.url, "--advertise-client-urls", e.url, "--listen-peer-urls", peer,
                       "--initial-advertise-peer-urls", peer, "--initial-cluster", "dsec-bench=" + peer},
                      dir / "etcd.log");
  cluster::EtcdClient etcd(etcd_options(e.url, std::chrono::milliseconds(1000)));
  auto give_up = Clock::now() + kStartTimeout;
  for (;;) {
    if (e.process.exited())
      throw Error(Code::kInternal, fmt::format("etcd exited at start:\n{}", e.process.log_tail()));
    try {
      etcd.range_prefix("/dsec-bench-probe/");
      return e;
    } catch (const Error&) {
    }
    if (Clock::now() > give_up)
      throw Error(Code::kDeadlineExceeded,
                  fmt::format("etcd did not answer within {} s:\n{}", kStartTimeout.count(), e.process.log_tail()));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

PulseRun run_cluster(const Options& o, const fs::path& scratch, const std::string& dsecd, Etcd& etcd,
                     const std::string& store, const std::string& backend, std::size_t agents, std::size_t sandboxes,
                     std::vector<std::string>& notes) {
  ClusterRun run;
  run.backend = backend;
  run.agents = agents;
  run.sandboxes = sandboxes;
  run.etcd_url = etcd.url;
  run.etcd_pid = etcd.process.pid();
  run.prefix = fmt::format("/dsec-bench-pulse-{}/", backend);
  run.store = store;
  run.api = o.pulse_api == "many" ? "create_many" : "create_group";
  if (backend == "container") run.memory_per_sandbox = 16ull << 20;

  PulseRun r;
  r.backend = backend;
  r.api = run.api;
  r.agents = agents;
  r.sandboxes = sandboxes;

  const fs::path dir = scratch / backend;
  fs::create_directories(dir);
  // Admission room for four times an even share on every agent: placement may lean on some of them.
  const int cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  const double share = std::ceil(static_cast<double>(sandboxes) / static_cast<double>(agents)) * 4 + 16;
  const double cpu_ratio = std::max(32.0, share * run.cpu_per_sandbox / cores);
  const double mem_ratio = std::max(
      2.0, share * static_cast<double>(run.memory_per_sandbox) / static_cast<double>(meminfo_bytes("MemTotal")));

  int ready_pipe[2];
  if (::pipe2(ready_pipe, O_CLOEXEC) != 0) throw_errno(errno, "pipe2");
  UniqueFd ready_rd(ready_pipe[0]);
  // Above fd 3, so that the children's dup2 to 3 always makes a fresh (inheritable) descriptor.
  UniqueFd ready_wr(::fcntl(ready_pipe[1], F_DUPFD_CLOEXEC, 10));
  ::close(ready_pipe[1]);
  if (!ready_wr) throw_errno(errno, "fcntl F_DUPFD_CLOEXEC");

  std::vector<Process> procs;
  struct StopAgents {
    std::vector<Process>& procs;
    ~StopAgents() {
      for (auto& p : procs) p.terminate();
      for (auto& p : procs) p.wait(kStopGrace);
    }
  } stop_agents{procs};

  const auto ports = free_ports(agents);
  auto t_start = Clock::now();
  for (std::size_t i = 0; i < agents; ++i) {
    const fs::path home = dir / fmt::format("agent-{}", i);
    fs::create_directories(home);
    std::vector<std::string> argv{dsecd,
                                  "--listen",
                                  fmt::format("127.0.0.1:{}", ports[i]),
                                  "--insecure-no-tls",
                                  "--node-id",
                                  fmt::format("pulse-{}-{}", backend, i),
                                  "--home",
                                  home.string(),
                                  "--state-dir",
                                  (home / "state").string(),
                                  "--run-dir",
                                  (home / "run").string(),
                                  "--store",
                                  store,
                                  "--backends",
                                  backend,
                                  "--etcd",
                                  etcd.url,
                                  "--etcd-prefix",
                                  run.prefix,
                                  "--label",
                                  fmt::format("{}={}", kAgentLabel, i),
                                  "--cpu-overcommit",
                                  fmt::format("{:.1f}", cpu_ratio),
                                  "--memory-overcommit",
                                  fmt::format("{:.2f}", mem_ratio),
                                  "--ready-fd",
                                  "3"};
    if (backend == "container") {
      argv.insert(argv.end(), {"--cgroup-name", fmt::format("dsec-bench-pulse-{}-{}", ::getpid(), i)});
    }
    procs.emplace_back(fmt::format("agent {}", i), argv, home / "dsecd.log", ready_wr.get());
    run.agent_pids.push_back(procs.back().pid());
  }
  ready_wr.reset();
  notes.push_back(
      fmt::format("{} pulse: agents run with --cpu-overcommit {:.1f} --memory-overcommit {:.2f} (room for "
                  "four times an even share each)",
                  backend, cpu_ratio, mem_ratio));

  // Every agent listening ...
  std::size_t ready = 0;
  std::string partial;
  auto give_up = t_start + kStartTimeout;
  while (ready < agents) {
    for (auto& p : procs)
      if (p.exited()) throw Error(Code::kInternal, fmt::format("{} exited at start:\n{}", p.name(), p.log_tail()));
    if (Clock::now() > give_up)
      throw Error(Code::kDeadlineExceeded,
                  fmt::format("{} of {} agents listening after {} s", ready, agents, kStartTimeout.count()));
    pollfd pfd{ready_rd.get(), POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    char buf[256];
    ssize_t n = ::read(ready_rd.get(), buf, sizeof buf);
    if (n <= 0) continue;
    partial.append(buf, static_cast<std::size_t>(n));
    std::size_t nl;
    while ((nl = partial.find('\n')) != std::string::npos) {
      ++ready;
      partial.erase(0, nl + 1);
    }
  }
  // ... and registered in etcd.
  cluster::EtcdClient ec(etcd_options(etcd.url, std::chrono::milliseconds(2000)));
  for (;;) {
    auto listing = ec.range_prefix(run.prefix + "nodes/");
    if (static_cast<std::size_t>(listing.kvs.size()) == agents) break;
    if (Clock::now() > give_up)
      throw Error(Code::kDeadlineExceeded, fmt::format("{} of {} agents registered in etcd after {} s",
                                                       listing.kvs.size(), agents, kStartTimeout.count()));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  r.agents_ready_seconds = ms_since(t_start) / 1000;

  fmt::print(stderr, "  pulse: {} agents ({}) registered in {:.2f} s; {} of {} sandboxes\n", agents, backend,
             r.agents_ready_seconds, run.api, sandboxes);
  json c = run_client_child(run);
  r.discovery_seconds = c.at("discovery_seconds");
  r.create_seconds = c.at("create_seconds");
  r.destroy_seconds = c.at("destroy_seconds");
  r.client_user_create = c.at("client_user_create");
  r.client_sys_create = c.at("client_sys_create");
  r.client_cpu_create = r.client_user_create + r.client_sys_create;
  r.client_cpu_destroy = c.at("client_cpu_destroy");
  r.client_rss_before = c.at("client_rss_before");
  r.client_hwm_create = c.at("client_hwm_create");
  r.client_hwm = c.at("client_hwm");
  r.agents_cpu_create = c.at("agents_cpu_create");
  r.agent_cpu_create_max = c.at("agent_cpu_create_max");
  r.agents_cpu_destroy = c.at("agents_cpu_destroy");
  r.etcd_cpu = c.at("etcd_cpu");
  r.agents_rss_total = c.at("agents_rss_total");
  r.agent_rss_max = c.at("agent_rss_max");
  r.per_agent_min = c.at("per_agent_min");
  r.per_agent_max = c.at("per_agent_max");
  r.agents_used = c.at("agents_used");
  r.left_after_destroy = c.at("left_after_destroy");
  r.agents_report = c.at("agents_report");
  r.alive = c.value("alive", std::size_t{0});
  r.sandboxes_cpu = c.value("sandboxes_cpu", 0.0);
  if (r.agents_report != sandboxes + agents)
    throw Error(Code::kInternal, fmt::format("{} pulse: the agents report {} live sandboxes, not the pulse's {} and {} "
                                             "warm-up sandboxes",
                                             backend, r.agents_report, sandboxes, agents));
  if (backend == "container" && r.alive != sandboxes)
    throw Error(Code::kInternal,
                fmt::format("container pulse: {} of {} sandboxes have a live process", r.alive, sandboxes));
  r.cpu_create = cpu_from(c.at("cpu_create"));
  r.cpu_destroy = cpu_from(c.at("cpu_destroy"));
  // The sandboxes' own processes (all started in the window) are this run's work too, not other processes'.
  if (r.cpu_create.seconds > 0) {
    const double sandboxes = std::min(r.cpu_create.others_cores, r.sandboxes_cpu / r.cpu_create.seconds);
    r.cpu_create.ours_cores += sandboxes;
    r.cpu_create.others_cores -= sandboxes;
  }
  const double others = r.cpu_create.others_cores;
  if (others > 0.1)
    notes.push_back(
        fmt::format("{} pulse: other processes (not dsec-bench, its agents, etcd{}) used {:.2f} cores "
                    "while it created: the machine was not quiet",
                    backend, backend == "container" ? " or the sandboxes" : "", others));
  if (r.left_after_destroy != 0)
    notes.push_back(
        fmt::format("{} pulse: {} sandboxes still listed after the destroy", backend, r.left_after_destroy));

  for (auto& p : procs) p.terminate();
  for (auto& p : procs)
    if (auto why = p.wait(kStopGrace))
      notes.push_back(fmt::format("{} pulse: {}:\n{}", backend, *why, p.log_tail(600)));
  procs.clear();
  // Nothing may stay: no sandbox record, no group lease, no runtime directory.
  for (std::size_t i = 0; i < agents; ++i) {
    const fs::path home = dir / fmt::format("agent-{}", i);
    std::error_code e1;
    for (const char* sub : {"state", "run"}) {
      for (const auto& entry : fs::recursive_directory_iterator(home / sub, e1)) {
        if (entry.is_directory()) continue;
        notes.push_back(fmt::format("{} pulse: agent {} left {}", backend, i, entry.path().string()));
      }
    }
  }
  if (ec.range_prefix(run.prefix).kvs.size() != 0)
    notes.push_back(fmt::format("{} pulse: registrations left in etcd under {}", backend, run.prefix));
  std::error_code rm;
  fs::remove_all(dir, rm);
  return r;
}

void run_command(const std::vector<std::string>& argv, const fs::path& log) {
  std::string line;
  for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
  fmt::print(stderr, "dsec-bench: {}\n", line);
  Process p("`" + line + "`", argv, log);
  if (auto why = p.wait(std::chrono::minutes(10)))
    throw Error(Code::kInternal, fmt::format("{}:\n{}", *why, p.log_tail()));
}

}  // namespace

PulseBenchResult run_pulse(const Options& o) {
  PulseBenchResult result;
  result.cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  const std::string dsecd = o.agent_binary.empty() ? beside_self("dsecd").string() : o.agent_binary;
  const std::string cli = o.dsec_cli.empty() ? beside_self("dsec").string() : o.dsec_cli;
  for (const auto& bin : {dsecd, cli, std::string(kEtcd)})
    if (::access(bin.c_str(), X_OK) != 0)
      throw Error(Code::kFailedPrecondition, fmt::format("{} is not an executable (needed by the pulse)", bin));

  // Scratch space on tmpfs (/dev/shm when it is one) unless --pulse-dir names another place.
  fs::path base = o.pulse_dir.empty() ? fs::path("/dev/shm") : fs::path(o.pulse_dir);
  struct statfs st {};
  if (::statfs(base.c_str(), &st) != 0) {
    if (!o.pulse_dir.empty()) throw_errno_fmt(errno, "--pulse-dir {}", base.string());
    base = fs::temp_directory_path();
  }
  const bool tmpfs = ::statfs(base.c_str(), &st) == 0 && st.f_type == TMPFS_MAGIC;
  result.scratch_fs = tmpfs ? "tmpfs" : "not tmpfs";
  if (!tmpfs) {
    std::string fs_name = fmt::format("file system type {:#x}", static_cast<unsigned long>(st.f_type));
    if (st.f_type == EXT4_SUPER_MAGIC) fs_name = "ext4";
    if (st.f_type == XFS_SUPER_MAGIC) fs_name = "xfs";
    if (st.f_type == BTRFS_SUPER_MAGIC) fs_name = "btrfs";
    if (st.f_type == OVERLAYFS_SUPER_MAGIC) fs_name = "overlayfs";
    result.scratch_fs = fs_name;
    result.notes.push_back(
        fmt::format("the agents' homes, sandbox records and run directories are under {} ({}), not "
                    "on tmpfs: every record write reaches that file system",
                    base.string(), fs_name));
  }
  std::string templ = (base / "dsec-bench-pulse-XXXXXX").string();
  if (::mkdtemp(templ.data()) == nullptr) throw_errno_fmt(errno, "mkdtemp {}", templ);
  const fs::path scratch = templ;
  result.scratch = scratch.string();
  struct RemoveScratch {
    fs::path dir;
    ~RemoveScratch() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } remove_scratch{scratch};

  // The image every sandbox names: busybox, built with the dsec CLI into a store of this run.
  const fs::path images = scratch / "images";
  fs::create_directories(images);
  run_command({cli, "--home", images.string(), "image", "build", "busybox", "--from", "busybox-static", "-q"},
              scratch / "image-build.log");
  const std::string store = (images / "store").string();

  {
    Process v("etcd --version", {std::string(kEtcd), "--version"}, scratch / "etcd-version.log");
    v.wait(std::chrono::seconds(10));
    std::string text = read_text_file((scratch / "etcd-version.log").string());
    result.etcd_version = text.substr(0, text.find('\n'));
  }

  Etcd etcd = start_etcd(scratch / "etcd");
  struct StopEtcd {
    Etcd& e;
    ~StopEtcd() {
      e.process.terminate();
      e.process.wait(std::chrono::seconds(15));
    }
  } stop_etcd{etcd};

  if (o.pulse_sandboxes > 0)
    result.runs.push_back(
        run_cluster(o, scratch, dsecd, etcd, store, "null", o.pulse_agents, o.pulse_sandboxes, result.notes));
  if (o.real_sandboxes > 0)
    result.runs.push_back(
        run_cluster(o, scratch, dsecd, etcd, store, "container", o.real_agents, o.real_sandboxes, result.notes));
  return result;
}

void print_pulse(const PulseBenchResult& r) {
  fmt::print("\n== pulse: one call creates every sandbox over agents found through etcd ({}) ==\n", r.etcd_version);
  for (const auto& p : r.runs) {
    const double n = static_cast<double>(p.sandboxes);
    fmt::print("  {} backend{}: {} sandboxes over {} agents with {}\n", p.backend,
               p.backend == "null" ? " (control-plane simulation: nothing started)" : "", p.sandboxes, p.agents, p.api);
    fmt::print("    agents started and registered in {:.2f} s; client saw all nodes after {:.2f} s\n",
               p.agents_ready_seconds, p.discovery_seconds);
    fmt::print("    create: {:.2f} s until all acknowledged, {:.0f} creates/s\n", p.create_seconds,
               n / p.create_seconds);
    fmt::print(
        "    client: {:.2f} CPU s ({:.2f} user, {:.2f} sys), RSS {} before, peak {} after the create, peak {} "
        "overall\n",
        p.client_cpu_create, p.client_user_create, p.client_sys_create, human_bytes(p.client_rss_before),
        human_bytes(p.client_hwm_create), human_bytes(p.client_hwm));
    fmt::print("    agents: {:.2f} CPU s in all (busiest {:.2f}), RSS {} in all (largest {}); etcd {:.2f} CPU s\n",
               p.agents_cpu_create, p.agent_cpu_create_max, human_bytes(p.agents_rss_total),
               human_bytes(p.agent_rss_max), p.etcd_cpu);
    fmt::print(
        "    per agent: {} to {} sandboxes ({} of {} agents used); the agents report {} live (with {} warm-up)\n",
        p.per_agent_min, p.per_agent_max, p.agents_used, p.agents, p.agents_report, p.agents);
    if (p.backend == "container")
      fmt::print(
          "    {} sandboxes with a live process in /proc; their processes used {:.2f} CPU s (in \"ours\" below)\n",
          p.alive, p.sandboxes_cpu);
    fmt::print("    destroy: {:.2f} s ({:.0f}/s); client {:.2f} CPU s, agents {:.2f} CPU s; {} left\n",
               p.destroy_seconds, n / p.destroy_seconds, p.client_cpu_destroy, p.agents_cpu_destroy,
               p.left_after_destroy);
    print_cpu(p.cpu_create, r.cores, "    load while creating: ");
    print_cpu(p.cpu_destroy, r.cores, "    load while destroying: ");
  }
  for (const auto& n : r.notes) fmt::print("  note: {}\n", n);
}

std::string markdown_pulse(const PulseBenchResult& r) {
  std::string md;
  md +=
      fmt::format("### Pulse: one call creates every sandbox over agents found through etcd ({})\n\n", r.etcd_version);
  md +=
      "| backend | sandboxes / agents | API | create: all acknowledged | creates/s | client CPU | client peak RSS "
      "| agents' CPU (busiest) | per agent min / max | destroy |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  for (const auto& p : r.runs) {
    const double n = static_cast<double>(p.sandboxes);
    md += fmt::format(
        "| {} | {} / {} | `{}` | {:.2f} s | {:.0f} | {:.2f} s ({:.2f} user + {:.2f} sys) | {} | {:.2f} s ({:.2f}) | "
        "{} / {} | {:.2f} s |\n",
        p.backend == "null" ? "`null` (control-plane simulation)" : "`container` (busybox)", p.sandboxes, p.agents,
        p.api, p.create_seconds, n / p.create_seconds, p.client_cpu_create, p.client_user_create, p.client_sys_create,
        human_bytes(static_cast<double>(p.client_hwm)), p.agents_cpu_create, p.agent_cpu_create_max, p.per_agent_min,
        p.per_agent_max, p.destroy_seconds);
  }
  md += "\n";
  for (const auto& p : r.runs) {
    md += fmt::format(
        "- {}: agents started and registered in {:.2f} s, the client saw all of them through etcd after {:.2f} s. "
        "Client RSS {} before the create, high water mark {} after it. Agents' RSS with every sandbox live: {} in "
        "all, {} the largest. etcd: {:.2f} CPU s over create and destroy. Destroy: client {:.2f} CPU s, agents "
        "{:.2f} CPU s; {} sandboxes left afterwards.{}\n",
        p.backend, p.agents_ready_seconds, p.discovery_seconds, human_bytes(static_cast<double>(p.client_rss_before)),
        human_bytes(static_cast<double>(p.client_hwm_create)), human_bytes(static_cast<double>(p.agents_rss_total)),
        human_bytes(static_cast<double>(p.agent_rss_max)), p.etcd_cpu, p.client_cpu_destroy, p.agents_cpu_destroy,
        p.left_after_destroy,
        p.backend == "container"
            ? fmt::format(" All {} have a live process; those processes used {:.2f} CPU s (counted with dsec-bench "
                          "below).",
                          p.alive, p.sandboxes_cpu)
            : std::string());
    md += fmt::format(
        "  Load while creating: {:.1f} s; CPU busy {:.2f} of {} cores: dsec-bench's client, the agents{} "
        "{:.2f}, kernel threads and interrupts {:.2f}, steal {:.2f}, other processes {:.2f}.\n",
        p.cpu_create.seconds, p.cpu_create.busy_cores, r.cores,
        p.backend == "container" ? ", etcd and the sandboxes" : " and etcd", p.cpu_create.ours_cores,
        p.cpu_create.kernel_cores, p.cpu_create.steal_cores, p.cpu_create.others_cores);
  }
  for (const auto& n : r.notes) md += fmt::format("- {}\n", n);
  for (const auto& p : r.runs) {
    if (p.backend != "null" || p.sandboxes < 32000 || p.agents < 16) continue;
    md += fmt::format(
        "\n| target | measured | verdict |\n| --- | --- | --- |\n| 32,000 creates over >= 16 agents "
        "acknowledged within 10 s | {:.2f} s over {} agents | {} |\n",
        p.create_seconds, p.agents, p.create_seconds <= 10 ? "**met**" : "**not met**");
  }
  return md;
}

}  // namespace dsec::bench
