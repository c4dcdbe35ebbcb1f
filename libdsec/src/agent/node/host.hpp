// What this machine offers to sandboxes: the cores the agent may run on, its memory, its disk, its load.
#pragma once

#include <cstdint>
#include <filesystem>

#include "dsec/sandbox_info.hpp"

namespace dsec::agent {

struct HostCapacity {
  std::uint32_t cores = 0;         // CPUs in the agent's affinity mask (sched_getaffinity)
  std::uint64_t memory_bytes = 0;  // total RAM (sysinfo)
};

struct DiskUsage {
  std::uint64_t total_bytes = 0;
  std::uint64_t free_bytes = 0;  // available to unprivileged writers
};

HostCapacity probe_host();
// statvfs of the filesystem that holds `dir` (the agent's home); throws dsec::Error with errno context.
DiskUsage probe_disk(const std::filesystem::path& dir);
// The 1-minute load average.
double load_average_1m();
// Memory in use on the host: MemTotal - MemAvailable of /proc/meminfo (0 when it cannot be read).
std::uint64_t memory_in_use();
// The node's pressure stall information (avg10 of /proc/pressure/{cpu,memory,io}); psi false without PSI.
NodePressure read_pressure(const std::filesystem::path& dir = "/proc/pressure");

}  // namespace dsec::agent
