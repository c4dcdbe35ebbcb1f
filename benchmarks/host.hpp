// What dsec-bench reads about the host: the machine, its load and memory, and the processes of sandboxes.
#pragma once

#include <filesystem>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "bench.hpp"

namespace dsec::bench {

MachineInfo read_machine();
// Load averages, "1.23 0.80 0.51".
void read_loadavg(double& l1, double& l5, double& l15);
// A field of /proc/meminfo in bytes ("MemAvailable"); throws when it is missing.
std::uint64_t meminfo_bytes(const std::string& field);
// MemAvailable, the median of `samples` reads taken 100 ms apart (one read is one instant of a noisy machine).
std::uint64_t mem_available_settled(int samples = 5);
// Every field of /proc/meminfo in bytes, each the median of `samples` reads taken 100 ms apart.
std::map<std::string, double> meminfo_settled(int samples = 5);

// Memory held by each slab cache (/proc/slabinfo: slabs x pages per slab), in bytes; empty when unreadable.
std::map<std::string, double> slab_bytes();

// CPU time of the whole machine against the CPU time of dsec-bench (with its reaped children) and of `pids`.
// With `descendants`, the live descendants of `pids` count too: long-lived children of the agent (a sandbox's init,
// a fork server) reap what they run, and their time would otherwise show only once they exit.
class CpuMeter {
 public:
  explicit CpuMeter(std::vector<int> pids, bool descendants = false);
  void start();
  CpuUse stop() const;

 private:
  struct Snapshot {
    std::uint64_t busy = 0;    // ticks, all CPUs
    std::uint64_t ours = 0;    // ticks of self + children + pids
    std::uint64_t kernel = 0;  // ticks of kernel threads, irq and softirq
    std::uint64_t steal = 0;
    Clock::time_point at;
  };
  Snapshot snapshot() const;

  std::vector<int> pids_;
  bool descendants_ = false;
  Snapshot start_;
};

// The processes whose cgroup path names one of `ids` as a path component: the processes of those sandboxes.
struct SandboxProcesses {
  std::map<std::string, std::vector<int>> pids;      // sandbox id -> its processes
  std::map<std::string, std::string> memory_cgroup;  // sandbox id -> its memory cgroup directory
};
SandboxProcesses find_sandbox_processes(const std::set<std::string>& ids);

// Resident and proportional set size of a process in bytes (0 when it is gone).
std::uint64_t rss_bytes(int pid);
std::uint64_t pss_bytes(int pid);
// Memory charged to a cgroup directory (v1 memory.usage_in_bytes, v2 memory.current); 0 when unreadable.
std::uint64_t cgroup_memory_bytes(const std::string& dir);
// Summed RSS of every process on the host except `exclude`.
std::uint64_t rss_of_all_but(const std::set<int>& exclude);
// The pid of a process that has `arg` as one of its command-line arguments (the first found), else -1.
int find_pid_with_arg(const std::string& arg);

std::string read_text_file(const std::string& path);

// Runs a command with this process's stdout and stderr, and waits for it; an error when it fails.
void run_command(const std::vector<std::string>& argv);
// GET `path` from an agent on a unix socket ("unix:/run/...sock"), HTTP/1.0; the body of a 200 answer.
std::string agent_get(const std::string& endpoint, const std::string& path);
// A counter from the Prometheus text of GET /metrics (0 when absent).
std::uint64_t metric(const std::string& text, std::string_view name);

// The directory of a swap file a benchmark's embedded agent makes under the home (dsecd --swap-file). Destroy it
// after the agent stopped: the agent turns the file off at shutdown; should it not have, this does so and adds a
// note saying it. The directory is removed either way.
struct SwapDir {
  std::filesystem::path dir, file;
  std::vector<std::string>* notes = nullptr;
  SwapDir() = default;
  SwapDir(const SwapDir&) = delete;
  SwapDir& operator=(const SwapDir&) = delete;
  ~SwapDir();
};

// The numeric entries of /proc; a file named `name` beside this program (dsec, dsecd, dsec-memhold...).
std::vector<int> all_pids();
std::filesystem::path beside_self(const char* name);

}  // namespace dsec::bench
