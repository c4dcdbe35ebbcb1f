#include "agent/node/host.hpp"

#include <sched.h>
#include <sys/statvfs.h>
#include <sys/sysinfo.h>

#include <fstream>
#include <sstream>
#include <string>

#include "common/syscall.hpp"

namespace dsec::agent {

HostCapacity probe_host() {
  HostCapacity cap;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) cap.cores = static_cast<std::uint32_t>(CPU_COUNT(&set));
  else throw_errno(errno, "sched_getaffinity");
  struct sysinfo si {};
  if (::sysinfo(&si) != 0) throw_errno(errno, "sysinfo");
  cap.memory_bytes = static_cast<std::uint64_t>(si.totalram) * si.mem_unit;
  return cap;
}

DiskUsage probe_disk(const std::filesystem::path& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) throw_errno_fmt(errno, "statvfs {}", dir.string());
  return DiskUsage{static_cast<std::uint64_t>(st.f_blocks) * st.f_frsize,
                   static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize};
}

double load_average_1m() {
  struct sysinfo si {};
  if (::sysinfo(&si) != 0) return 0;
  return static_cast<double>(si.loads[0]) / static_cast<double>(1 << SI_LOAD_SHIFT);
}

std::uint64_t memory_in_use() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0, total = 0, available = 0;
  bool have_total = false, have_available = false;
  while (in >> key >> kib) {
    if (key == "MemTotal:") total = kib, have_total = true;
    else if (key == "MemAvailable:") available = kib, have_available = true;
    in.ignore(64, '\n');
  }
  if (!have_total || !have_available || available > total) return 0;
  return (total - available) << 10;
}

namespace {

// One line of a pressure file: "some avg10=1.23 avg60=... total=..." -> the avg10 of "some" or "full".
bool read_avg10(const std::filesystem::path& file, double& some, double* full) {
  std::ifstream in(file);
  if (!in) return false;
  std::string line;
  bool any = false;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string kind, avg10;
    if (!(fields >> kind >> avg10) || avg10.rfind("avg10=", 0) != 0) continue;
    double value = 0;
    try {
      value = std::stod(avg10.substr(6));
    } catch (const std::exception&) {
      continue;
    }
    if (kind == "some") some = value, any = true;
    else if (kind == "full" && full) *full = value;
  }
  return any;
}

}  // namespace

NodePressure read_pressure(const std::filesystem::path& dir) {
  NodePressure p;
  p.psi = read_avg10(dir / "cpu", p.cpu_some, nullptr);
  p.psi = read_avg10(dir / "memory", p.memory_some, &p.memory_full) && p.psi;
  p.psi = read_avg10(dir / "io", p.io_some, &p.io_full) && p.psi;
  return p;
}

}  // namespace dsec::agent
