// One QEMU process, started by the agent with no shell in between: its argv, the descriptors it inherits (at the
// numbers its argv names), its own unprivileged uid and gid and no supplementary groups (or only the group that
// owns /dev/kvm), no_new_privs, the sandbox's cgroup joined before it runs, and a session of its own, so it
// outlives the agent (a restarted agent takes it over). Standard output and error go to a log file the caller
// opened; standard input is /dev/null.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/unique_fd.hpp"

namespace dsec::agent::qemu {

struct InheritedFd {
  int source = -1;  // a descriptor of the agent
  int target = -1;  // its number in QEMU (>= 3; the argv refers to it)
};

struct VmLaunch {
  std::vector<std::string> argv;  // argv[0] is the binary's path
  std::vector<InheritedFd> fds;
  uid_t uid = 0;
  gid_t gid = 0;
  std::optional<gid_t> extra_group;  // e.g. the group of /dev/kvm
  std::vector<int> cgroup_procs;     // cgroup.procs files (open for writing) the process joins before exec
  int log_fd = -1;                   // standard output and error; -1: /dev/null
  bool sched_idle = false;           // runs SCHED_IDLE (so does every thread it starts)
};

struct VmProcess {
  pid_t pid = -1;
  UniqueFd pidfd;
};

// Starts QEMU. The child's failure before exec (joining the cgroup, changing uid, exec itself) is reported as a
// dsec::Error naming the step.
VmProcess launch_vm(const VmLaunch& launch);

// Puts every thread of process `pid` under SCHED_IDLE (a QEMU started before its sandbox's class was known: a
// pooled VM). Threads it starts later inherit the policy from their creator. False when a thread could not be
// changed (it may have just ended).
bool set_sched_idle_threads(pid_t pid);

// Whether the process behind `pidfd` has exited (its pidfd is readable).
bool process_exited(int pidfd);
// SIGKILL through the pidfd, then waits up to `wait` for the exit; reaps it when it is this process's child.
// True once it is gone.
bool kill_and_wait(int pidfd, pid_t pid, std::chrono::milliseconds wait);
// Waits up to `wait` for the exit without signalling; reaps a child. True once it is gone.
bool wait_exit(int pidfd, pid_t pid, std::chrono::milliseconds wait);

// The last `lines` lines of a text file (a guest console, a QEMU log), at most `max_bytes` from its end, with
// control characters other than newline and tab dropped; "" when it cannot be read.
std::string file_tail(const std::filesystem::path& path, std::size_t lines, std::size_t max_bytes = 8192);

// Keeps a log another process appends to (QEMU's console and its stderr, opened O_APPEND) from growing without
// bound: once it is over `max_bytes`, it is cut to its last `keep_bytes` (from a line's start), after a line that
// says how much went. What the writer appends during the cut may be lost; a log is all it is. Answers the bytes
// dropped (0: under the limit, or the file is not there).
std::uint64_t bound_log(const std::filesystem::path& path, std::uint64_t max_bytes, std::uint64_t keep_bytes);

}  // namespace dsec::agent::qemu
