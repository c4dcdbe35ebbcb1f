#include "host.hpp"

#include <dirent.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/statfs.h>
#include <sys/swap.h>
#include <sys/un.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "agent/node/swap.hpp"
#include "common/cgroupfs.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

extern char** environ;

namespace dsec::bench {

namespace fs = std::filesystem;
namespace {

// utime + stime + cutime + cstime of a process, in clock ticks (0 when it is gone).
std::uint64_t process_ticks(const std::string& stat_path) {
  std::string text = read_text_file(stat_path);
  auto close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream in(text.substr(close + 2));
  // Fields after the command: state(3) ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
  // utime(14) stime(15) cutime(16) cstime(17).
  std::string field;
  std::uint64_t total = 0;
  for (int i = 3; i <= 17 && in >> field; ++i)
    if (i >= 14) total += std::strtoull(field.c_str(), nullptr, 10);
  return total;
}

// utime + stime of every kernel thread (PF_KTHREAD in the flags field of /proc/<pid>/stat), in clock ticks.
std::uint64_t kthread_ticks() {
  constexpr unsigned long kPfKthread = 0x00200000;
  std::uint64_t total = 0;
  for (int pid : all_pids()) {
    std::string text = read_text_file(fmt::format("/proc/{}/stat", pid));
    auto close = text.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream in(text.substr(close + 2));
    std::string field;
    unsigned long flags = 0;
    std::uint64_t ticks = 0;
    for (int i = 3; i <= 15 && in >> field; ++i) {
      if (i == 9) flags = std::strtoul(field.c_str(), nullptr, 10);
      if (i >= 14) ticks += std::strtoull(field.c_str(), nullptr, 10);
    }
    if (flags & kPfKthread) total += ticks;
  }
  return total;
}

// A "Key:   123 kB" line of a /proc status-like file, in bytes.
std::uint64_t kb_field(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) == 0 && line.size() > key.size() && line[key.size()] == ':')
      return std::strtoull(line.c_str() + key.size() + 1, nullptr, 10) * 1024;
  }
  return 0;
}

std::string first_line_with(const std::string& path, const std::string& prefix) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) return line;
  return {};
}

std::string trim(const std::string& s) {
  auto b = s.find_first_not_of(" \t\n");
  auto e = s.find_last_not_of(" \t\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// Where the v1 memory controller is mounted ("" when there is none).
std::string memory_v1_mount() {
  auto mounts = cgroup_v1_mounts();
  auto it = mounts.find("memory");
  return it == mounts.end() ? std::string() : it->second;
}

std::string cgroup_v2_mount() {
  std::ifstream in("/proc/self/mounts");
  std::string dev, dir, type, rest;
  while (in >> dev >> dir >> type) {
    std::getline(in, rest);
    if (type == "cgroup2") return dir;
  }
  return {};
}

}  // namespace

// Numeric entries of /proc.
std::vector<int> all_pids() {
  std::vector<int> pids;
  DIR* d = ::opendir("/proc");
  if (!d) return pids;
  while (dirent* e = ::readdir(d)) {
    const char* s = e->d_name;
    if (*s < '1' || *s > '9') continue;
    char* end = nullptr;
    long pid = std::strtol(s, &end, 10);
    if (*end == '\0') pids.push_back(static_cast<int>(pid));
  }
  ::closedir(d);
  return pids;
}

fs::path beside_self(const char* name) {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return ec ? fs::path(name) : self.parent_path() / name;
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

void read_loadavg(double& l1, double& l5, double& l15) {
  std::istringstream in(read_text_file("/proc/loadavg"));
  in >> l1 >> l5 >> l15;
}

MachineInfo read_machine() {
  MachineInfo m;
  m.cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));
  std::string model = first_line_with("/proc/cpuinfo", "model name");
  if (auto colon = model.find(':'); colon != std::string::npos) m.cpu_model = trim(model.substr(colon + 1));
  m.mem_total = meminfo_bytes("MemTotal");
  utsname u{};
  if (::uname(&u) == 0) m.kernel = fmt::format("{} {}", u.sysname, u.release);
  struct statfs st {};
  if (::statfs("/sys/fs/cgroup", &st) == 0 && st.f_type == CGROUP2_SUPER_MAGIC) {
    m.cgroup = "v2 (unified)";
  } else {
    struct statfs unified {};
    bool hybrid = ::statfs("/sys/fs/cgroup/unified", &unified) == 0 && unified.f_type == CGROUP2_SUPER_MAGIC;
    if (hybrid) {
      std::string controllers = trim(read_text_file("/sys/fs/cgroup/unified/cgroup.controllers"));
      m.cgroup = fmt::format("v1 controllers + cgroup2 at /sys/fs/cgroup/unified (hybrid; cgroup2 controllers: {})",
                             controllers.empty() ? "none" : controllers);
    } else {
      m.cgroup = "v1";
    }
  }
  read_loadavg(m.load1, m.load5, m.load15);
  std::time_t now = std::time(nullptr);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S %Z", std::localtime(&now));
  m.started_at = buf;
  return m;
}

std::uint64_t meminfo_bytes(const std::string& field) {
  std::uint64_t v = kb_field("/proc/meminfo", field);
  if (v == 0) throw Error(Code::kInternal, fmt::format("/proc/meminfo has no {}", field));
  return v;
}

std::uint64_t mem_available_settled(int samples) {
  std::vector<std::uint64_t> v;
  for (int i = 0; i < samples; ++i) {
    if (i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    v.push_back(meminfo_bytes("MemAvailable"));
  }
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::map<std::string, double> meminfo_settled(int samples) {
  std::map<std::string, std::vector<double>> reads;
  for (int i = 0; i < samples; ++i) {
    if (i) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::ifstream in("/proc/meminfo");
    std::string line;
    while (std::getline(in, line)) {
      auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      double v = std::strtod(line.c_str() + colon + 1, nullptr);
      if (line.find(" kB") != std::string::npos) v *= 1024;
      reads[line.substr(0, colon)].push_back(v);
    }
  }
  std::map<std::string, double> out;
  for (auto& [k, v] : reads) {
    std::sort(v.begin(), v.end());
    out[k] = v[v.size() / 2];
  }
  return out;
}

std::map<std::string, double> slab_bytes() {
  std::map<std::string, double> out;
  std::ifstream in("/proc/slabinfo");
  std::string line;
  const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#' || line.rfind("slabinfo", 0) == 0) continue;
    std::istringstream ls(line);
    std::string name, colon, word;
    double active_objs = 0, num_objs = 0, objsize = 0, objperslab = 0, pagesperslab = 0;
    ls >> name >> active_objs >> num_objs >> objsize >> objperslab >> pagesperslab;
    // ... : tunables <limit> <batchcount> <sharedfactor> : slabdata <active_slabs> <num_slabs> <sharedavail>
    double active_slabs = 0, num_slabs = 0;
    while (ls >> word && word != "slabdata") {
    }
    ls >> active_slabs >> num_slabs;
    if (!ls.fail()) out[name] = num_slabs * pagesperslab * page;
  }
  return out;
}

// utime + stime + cutime + cstime of every live descendant of `pid` (/proc/<pid>/task/<tid>/children), in ticks.
static std::uint64_t descendant_ticks(int pid, int depth = 0) {
  if (depth > 64) return 0;
  std::uint64_t total = 0;
  std::error_code ec;
  for (const auto& task : std::filesystem::directory_iterator(fmt::format("/proc/{}/task", pid), ec)) {
    std::istringstream children(read_text_file((task.path() / "children").string()));
    int child = 0;
    while (children >> child)
      total += process_ticks(fmt::format("/proc/{}/stat", child)) + descendant_ticks(child, depth + 1);
  }
  return total;
}

CpuMeter::CpuMeter(std::vector<int> pids, bool descendants) : pids_(std::move(pids)), descendants_(descendants) {
  start();
}

void CpuMeter::start() { start_ = snapshot(); }

CpuMeter::Snapshot CpuMeter::snapshot() const {
  Snapshot s;
  s.at = Clock::now();
  std::istringstream in(first_line_with("/proc/stat", "cpu "));
  std::string label;
  in >> label;
  // user nice system idle iowait irq softirq steal
  std::uint64_t v[8] = {};
  for (auto& x : v) in >> x;
  s.busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7];
  s.steal = v[7];
  s.kernel = v[5] + v[6] + kthread_ticks();
  s.ours = process_ticks("/proc/self/stat");
  for (int pid : pids_) {
    if (pid <= 0) continue;
    s.ours += process_ticks(fmt::format("/proc/{}/stat", pid));
    if (descendants_) s.ours += descendant_ticks(pid);
  }
  return s;
}

CpuUse CpuMeter::stop() const {
  Snapshot end = snapshot();
  double hz = static_cast<double>(::sysconf(_SC_CLK_TCK));
  CpuUse u;
  u.seconds = std::chrono::duration<double>(end.at - start_.at).count();
  if (u.seconds <= 0) return u;
  double busy = static_cast<double>(end.busy - start_.busy) / hz;
  double ours = end.ours >= start_.ours ? static_cast<double>(end.ours - start_.ours) / hz : 0;
  u.busy_cores = busy / u.seconds;
  u.ours_cores = ours / u.seconds;
  double kernel = static_cast<double>(end.kernel - std::min(end.kernel, start_.kernel)) / hz;
  double steal = static_cast<double>(end.steal - start_.steal) / hz;
  u.kernel_cores = kernel / u.seconds;
  u.steal_cores = steal / u.seconds;
  u.others_cores = std::max(0.0, busy - ours - kernel - steal) / u.seconds;
  return u;
}

SandboxProcesses find_sandbox_processes(const std::set<std::string>& ids) {
  SandboxProcesses out;
  const std::string v1_memory = memory_v1_mount();
  const std::string v2 = cgroup_v2_mount();
  for (int pid : all_pids()) {
    std::ifstream in(fmt::format("/proc/{}/cgroup", pid));
    std::string line;
    std::string found;
    std::string memory_dir;
    while (std::getline(in, line)) {
      auto first = line.find(':');
      auto second = line.find(':', first + 1);
      if (first == std::string::npos || second == std::string::npos) continue;
      std::string controllers = line.substr(first + 1, second - first - 1);
      std::string path = line.substr(second + 1);
      // The path component that is a sandbox id, and the path up to it.
      std::size_t pos = 0;
      while (pos < path.size()) {
        std::size_t slash = path.find('/', pos + 1);
        std::string component = path.substr(pos + 1, slash == std::string::npos ? std::string::npos : slash - pos - 1);
        if (ids.count(component)) {
          found = component;
          std::string prefix = path.substr(0, slash == std::string::npos ? path.size() : slash);
          bool is_memory = false;
          std::istringstream cs(controllers);
          std::string c;
          while (std::getline(cs, c, ',')) is_memory |= c == "memory";
          if (is_memory && !v1_memory.empty()) memory_dir = v1_memory + prefix;
          else if (controllers.empty() && line.rfind("0::", 0) == 0 && !v2.empty() && v1_memory.empty())
            memory_dir = v2 + prefix;
          break;
        }
        if (slash == std::string::npos) break;
        pos = slash;
      }
    }
    if (found.empty()) continue;
    out.pids[found].push_back(pid);
    if (!memory_dir.empty()) out.memory_cgroup[found] = memory_dir;
  }
  return out;
}

std::uint64_t rss_bytes(int pid) { return kb_field(fmt::format("/proc/{}/status", pid), "VmRSS"); }

std::uint64_t pss_bytes(int pid) { return kb_field(fmt::format("/proc/{}/smaps_rollup", pid), "Pss"); }

std::uint64_t cgroup_memory_bytes(const std::string& dir) {
  for (const char* file : {"/memory.usage_in_bytes", "/memory.current"}) {
    std::string text = read_text_file(dir + file);
    if (!text.empty()) return std::strtoull(text.c_str(), nullptr, 10);
  }
  return 0;
}

std::uint64_t rss_of_all_but(const std::set<int>& exclude) {
  std::uint64_t total = 0;
  for (int pid : all_pids())
    if (!exclude.count(pid)) total += rss_bytes(pid);
  return total;
}

SwapDir::~SwapDir() {
  if (dir.empty()) return;
  bool active = false;
  try {
    for (const auto& s : agent::read_proc_swaps()) active |= s.path == file.string();
  } catch (const Error&) {
  }
  if (active) {
    ::swapoff(file.c_str());
    if (notes) notes->push_back(fmt::format("the agent left {} on; dsec-bench turned it off", file.string()));
  }
  std::error_code ec;
  fs::remove_all(dir, ec);
}

int find_pid_with_arg(const std::string& arg) {
  for (int pid : all_pids()) {
    std::string cmdline = read_text_file(fmt::format("/proc/{}/cmdline", pid));
    std::size_t pos = 0;
    while (pos < cmdline.size()) {
      std::size_t end = cmdline.find('\0', pos);
      if (end == std::string::npos) end = cmdline.size();
      if (cmdline.compare(pos, end - pos, arg) == 0) return pid;
      pos = end + 1;
    }
  }
  return -1;
}

// Runs a command with this process's stdout and stderr, and waits for it; an error when it fails.
void run_command(const std::vector<std::string>& argv) {
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  int err = ::posix_spawn(&pid, args[0], nullptr, nullptr, args.data(), environ);
  if (err != 0) throw_errno_fmt(err, "run {}", argv[0]);
  int status = 0;
  if (retry_eintr([&] { return ::waitpid(pid, &status, 0); }) < 0) throw_errno_fmt(errno, "wait for {}", argv[0]);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string line;
    for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
    throw Error(Code::kInternal, fmt::format("`{}` failed ({})", line,
                                             WIFEXITED(status) ? fmt::format("exit status {}", WEXITSTATUS(status))
                                                               : fmt::format("signal {}", WTERMSIG(status))));
  }
}

// GET `path` from an agent on a unix socket ("unix:/run/...sock"), HTTP/1.0; the body of a 200 answer.
std::string agent_get(const std::string& endpoint, const std::string& path) {
  if (endpoint.rfind("unix:", 0) != 0)
    throw Error(Code::kInvalidArgument,
                fmt::format("the benchmarks read an agent's metrics over a unix socket, not {}", endpoint));
  std::string socket_path = endpoint.substr(5);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw_errno(errno, "socket");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof addr.sun_path) throw Error(Code::kInvalidArgument, "socket path too long");
  std::memcpy(addr.sun_path, socket_path.c_str(), socket_path.size() + 1);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    throw_errno_fmt(errno, "connect {}", socket_path);
  std::string request = fmt::format("GET {} HTTP/1.0\r\nHost: dsecd\r\n\r\n", path);
  for (std::size_t done = 0; done < request.size();) {
    ssize_t n = ::write(fd.get(), request.data() + done, request.size() - done);
    if (n < 0) throw_errno_fmt(errno, "write to {}", socket_path);
    done += static_cast<std::size_t>(n);
  }
  std::string response;
  char buf[65536];
  for (;;) {
    ssize_t n = retry_eintr([&] { return ::read(fd.get(), buf, sizeof buf); });
    if (n < 0) throw_errno_fmt(errno, "read from {}", socket_path);
    if (n == 0) break;
    response.append(buf, static_cast<std::size_t>(n));
  }
  auto header_end = response.find("\r\n\r\n");
  if (response.rfind("HTTP/1.", 0) != 0 || header_end == std::string::npos || response.find(" 200 ") > 12)
    throw Error(Code::kInternal, fmt::format("GET {}: unexpected answer: {}", path, response.substr(0, 200)));
  return response.substr(header_end + 4);
}

// A counter from the Prometheus text of GET /metrics (0 when absent).
std::uint64_t metric(const std::string& text, std::string_view name) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(name, 0) != 0 || line.size() <= name.size() || line[name.size()] != ' ') continue;
    return static_cast<std::uint64_t>(std::strtod(line.c_str() + name.size() + 1, nullptr));
  }
  return 0;
}

}  // namespace dsec::bench
