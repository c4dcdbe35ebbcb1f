// What the benchmarks of the QEMU tiers share (qemu_tier.hpp).
#include "qemu_tier.hpp"

#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "dsec/error.hpp"
#include "host.hpp"

namespace dsec::bench {

namespace fs = std::filesystem;

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

std::string mib(double bytes) {
  if (std::isnan(bytes)) return "n/a";
  double m = bytes / kMiB;
  if (std::fabs(m) < 10) return fmt::format("{:.2f} MiB", m);
  return fmt::format("{:.1f} MiB", m);
}

std::string ms(double v) {
  if (std::isnan(v)) return "n/a";
  if (v < 10) return fmt::format("{:.2f} ms", v);
  if (v < 100) return fmt::format("{:.1f} ms", v);
  return fmt::format("{:.0f} ms", v);
}

std::vector<std::string> cmdline_of(int pid) {
  std::string text = read_text_file(fmt::format("/proc/{}/cmdline", pid));
  std::vector<std::string> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find('\0', pos);
    if (end == std::string::npos) end = text.size();
    out.push_back(text.substr(pos, end - pos));
    pos = end + 1;
  }
  return out;
}

std::string arg_after(const std::vector<std::string>& argv, const std::string& flag) {
  for (std::size_t i = 0; i + 1 < argv.size(); ++i)
    if (argv[i] == flag) return argv[i + 1];
  return {};
}

std::string load_text() {
  double l1 = 0, l5 = 0, l15 = 0;
  read_loadavg(l1, l5, l15);
  return fmt::format("{:.2f} {:.2f} {:.2f}", l1, l5, l15);
}

double load1_now() {
  double l1 = 0, l5 = 0, l15 = 0;
  read_loadavg(l1, l5, l15);
  return l1;
}

std::map<std::string, double> kb_fields(const std::string& path) {
  std::map<std::string, double> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::istringstream v(line.substr(colon + 1));
    double kb = 0;
    std::string unit;
    if (v >> kb >> unit && unit == "kB") out[line.substr(0, colon)] = kb * 1024;
  }
  return out;
}

double template_resident_bytes(int agent_pid) {
  double total = 0;
  std::set<ino_t> seen;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fmt::format("/proc/{}/fd", agent_pid), ec)) {
    std::error_code lec;
    std::string target = fs::read_symlink(e.path(), lec).string();
    if (lec || target.find("memfd:dsec-ram-template") == std::string::npos) continue;
    struct stat st {};
    if (::stat(e.path().c_str(), &st) != 0 || !seen.insert(st.st_ino).second) continue;
    total += static_cast<double>(st.st_blocks) * 512;
  }
  return total;
}

double subtree_charge(const std::string& cgroup_name) {
  for (const std::string& dir : {"/sys/fs/cgroup/memory/" + cgroup_name, "/sys/fs/cgroup/" + cgroup_name,
                                 "/sys/fs/cgroup/unified/" + cgroup_name}) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::string text = read_text_file(dir + "/memory.usage_in_bytes");
    if (text.empty()) text = read_text_file(dir + "/memory.current");
    if (!text.empty()) return std::strtod(text.c_str(), nullptr);
  }
  return std::nan("");
}

std::map<std::string, int> agent_qemus(const std::string& cgroup_name) {
  std::map<std::string, int> out;
  const std::string needle = "/" + cgroup_name + "/";
  for (int pid : all_pids()) {
    std::string comm = trim(read_text_file(fmt::format("/proc/{}/comm", pid)));
    if (comm.rfind("qemu-system", 0) != 0) continue;
    std::string cg = read_text_file(fmt::format("/proc/{}/cgroup", pid));
    if (cg.find(needle) == std::string::npos) continue;
    std::string name = arg_after(cmdline_of(pid), "-name");
    name = name.substr(0, name.find(','));
    out[name.empty() ? fmt::format("pid-{}", pid) : name] = pid;
  }
  return out;
}

ExecRequest true_request(double timeout) {
  ExecRequest r;
  r.argv = {"true"};
  r.timeout_seconds = timeout;
  return r;
}

void check_ok(const ExecResult& r, const std::string& what) {
  if (r.exit_code != 0 || r.timed_out)
    throw Error(Code::kInternal, fmt::format("{}: exit code {} (signal {}){}: {}", what, r.exit_code, r.signal,
                                             r.timed_out ? ", timed out" : "", r.stderr_data));
}

ExecResult run_shell(const Sandbox& sb, const std::string& command, double timeout_seconds) {
  ExecRequest request;
  request.shell = command;
  request.timeout_seconds = timeout_seconds;
  ExecResult r = sb.exec(request);
  check_ok(r, fmt::format("`{}` in {}", command, sb.id()));
  return r;
}

double memory_stat(const std::string& dir, const std::string& key) {
  std::ifstream in(dir + "/memory.stat");
  std::string k;
  double v = 0;
  while (in >> k >> v)
    if (k == key) return v;
  return std::nan("");
}

void destroy_all(std::vector<Sandbox>& vms, std::size_t threads, std::vector<std::string>* errors) {
  std::atomic<std::size_t> next{0};
  std::mutex mu;
  std::vector<std::thread> pool;
  for (std::size_t t = 0; t < std::min(threads, vms.size()); ++t)
    pool.emplace_back([&] {
      for (std::size_t i = next++; i < vms.size(); i = next++) {
        try {
          vms[i].destroy();
        } catch (const std::exception& e) {
          std::lock_guard lock(mu);
          if (errors) errors->push_back(e.what());
        }
      }
    });
  for (auto& t : pool) t.join();
  vms.clear();
}

std::string cpu_line(const CpuUse& c, int cores) {
  return fmt::format(
      "{:.1f} s; CPU busy {:.2f} of {} cores (dsec-bench, agents and their QEMUs {:.2f}, kernel {:.2f}, "
      "steal {:.2f}, other processes {:.2f}); load average at the end {}",
      c.seconds, c.busy_cores, cores, c.ours_cores, c.kernel_cores, c.steal_cores, c.others_cores, load_text());
}

double vm_charged(const std::string& id) {
  SandboxProcesses found = find_sandbox_processes({id});
  auto it = found.memory_cgroup.find(id);
  return it == found.memory_cgroup.end() ? std::nan("") : static_cast<double>(cgroup_memory_bytes(it->second));
}

std::string qemu_version() {
  std::string out;
  if (FILE* f = ::popen("/usr/bin/qemu-system-x86_64 --version 2>/dev/null", "r")) {
    char buf[256];
    if (std::fgets(buf, sizeof buf, f)) out = trim(buf);
    ::pclose(f);
  }
  return out;
}

ScratchDir::ScratchDir(const std::string& prefix) {
  std::string templ = "/tmp/" + prefix + "-XXXXXX";
  if (::mkdtemp(templ.data()) == nullptr) throw_errno_fmt(errno, "mkdtemp {}", templ);
  dir = templ;
}

ScratchDir::~ScratchDir() {
  std::error_code ec;
  fs::remove_all(dir, ec);
}

Agent::~Agent() {
  if (client) {
    try {
      client->close();
    } catch (...) {
    }
  }
}

std::unique_ptr<Agent> start_agent(const Options& o, const std::string& home, const std::string& label,
                                   const std::string& kind, std::vector<std::string> args,
                                   std::vector<std::string> stores) {
  auto a = std::make_unique<Agent>();
  a->label = label;
  a->kind = kind;
  ClientOptions c;
  c.home = home;
  c.agent_binary = o.agent_binary;
  c.agent_args = std::move(args);
  c.stores = std::move(stores);
  c.call_deadline = std::chrono::minutes(10);
  // A full VM's first create of a shape boots a whole system under the tier's boot timeout (300 s).
  c.request_timeout = std::chrono::minutes(kind == "vm" ? 6 : 3);
  c.create_concurrency = 8;
  c.agent_start_timeout = std::chrono::seconds(90);
  std::string line;
  for (const auto& w : c.agent_args) line += " " + w;
  fmt::print(stderr, "dsec-bench {}: starting the {} agent (dsecd{})\n", kind, label, line);
  a->client = std::make_unique<Client>(c);
  const auto deadline = Clock::now() + std::chrono::seconds(90);
  for (;;) {
    a->node = a->client->nodes().front();
    if (!a->tier().offered)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("the {} agent does not serve {}: {}", label, kind, a->tier().unavailable));
    if (a->tier().ready) break;
    if (Clock::now() > deadline)
      throw Error(Code::kDeadlineExceeded, fmt::format("the {} agent's accelerator probe did not finish", label));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!a->tier().unavailable.empty())
    throw Error(Code::kFailedPrecondition,
                fmt::format("the {} agent cannot run {} VMs: {}", label, kind, a->tier().unavailable));
  a->pid = agent_pid_for(*a->client);
  if (a->pid > 0) {
    auto argv = cmdline_of(a->pid);
    a->run_dir = arg_after(argv, "--run-dir");
    a->cgroup_name = arg_after(argv, "--cgroup-name");
  }
  return a;
}

void Sections::run(const std::string& name, const std::vector<int>& pids, const std::function<void()>& body) const {
  fmt::print(stderr, "dsec-bench {}: == {} (load {}) ==\n", command, name, load_text());
  CpuMeter cpu(pids, /*descendants=*/true);
  try {
    body();
  } catch (const std::exception& e) {
    problems.push_back(fmt::format("{}: failed (load {}): {}", name, load_text(), e.what()));
    fmt::print(stderr, "dsec-bench {}: {} failed: {}\n", command, name, e.what());
  }
  section_load.emplace_back(name, cpu_line(cpu.stop(), cores));
}

void print_run_log(const std::string& accelerator, const SectionLoads& section_load,
                   const std::vector<std::string>& notes, const std::vector<std::string>& problems) {
  fmt::print("\n  -- [{}] load per section --\n", accelerator);
  for (const auto& [name, text] : section_load) fmt::print("  {}: {}\n", name, text);
  for (const auto& n : notes) fmt::print("  note: {}\n", n);
  for (const auto& p : problems) fmt::print("  PROBLEM [{}]: {}\n", accelerator, p);
}

std::string markdown_run_log(const std::string& accelerator, const SectionLoads& section_load,
                             const std::vector<std::string>& notes, const std::vector<std::string>& problems) {
  std::string md = fmt::format("\n#### [{}] Load per section\n\n", accelerator);
  for (const auto& [name, text] : section_load) md += fmt::format("- {}: {}\n", name, text);
  for (const auto& n : notes) md += fmt::format("- note: {}\n", n);
  if (!problems.empty()) {
    md += "\nProblems seen:\n\n";
    for (const auto& p : problems) md += fmt::format("- [{}] {}\n", accelerator, p);
  }
  return md;
}

}  // namespace dsec::bench
