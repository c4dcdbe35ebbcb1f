#include "agent/host.hpp"

#include <sched.h>
#include <sys/statvfs.h>
#include <sys/sysinfo.h>

#include "common/syscall.hpp"

namespace dsec::agent {

HostCapacity probe_host() {
  HostCapacity cap;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (::sched_getaffinity(0, sizeof(set), &set) == 0) cap.cores = static_cast<std::uint32_t>(CPU_COUNT(&set));
  else throw_errno(errno, "sched_getaffinity");
  struct sysinfo si{};
  if (::sysinfo(&si) != 0) throw_errno(errno, "sysinfo");
  cap.memory_bytes = static_cast<std::uint64_t>(si.totalram) * si.mem_unit;
  return cap;
}

DiskUsage probe_disk(const std::filesystem::path& dir) {
  struct statvfs st{};
  if (::statvfs(dir.c_str(), &st) != 0) throw_errno_fmt(errno, "statvfs {}", dir.string());
  return DiskUsage{static_cast<std::uint64_t>(st.f_blocks) * st.f_frsize,
                   static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize};
}

double load_average_1m() {
  struct sysinfo si{};
  if (::sysinfo(&si) != 0) return 0;
  return static_cast<double>(si.loads[0]) / static_cast<double>(1 << SI_LOAD_SHIFT);
}

}  // namespace dsec::agent
