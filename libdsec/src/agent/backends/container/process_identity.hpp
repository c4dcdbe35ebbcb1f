// Telling a sandbox's processes apart from whatever later reuses their pids, so that an agent that restarts can take
// its sandboxes over (or clean up after them) without ever acting on a pid alone.
//
// A process is identified by its pid together with its start time (field 22 of /proc/<pid>/stat, in clock ticks
// since boot) and the host's boot id; the agent opens a pidfd first and checks the start time after, so the pidfd
// it keeps refers to exactly that process. The sandbox's cgroup and network namespace confirm it further.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

namespace dsec::agent::container {

// The running kernel's boot id (/proc/sys/kernel/random/boot_id); empty when unreadable.
std::string boot_id();

// The start time of process `pid` in clock ticks since boot, or nullopt when there is no such process or it has
// exited (a zombie not reaped yet: a dead agent or init whose parent has not waited for it).
std::optional<std::uint64_t> process_start_time(pid_t pid);

// Whether process `pid` is in the cgroup at `path` (relative to the hierarchy's root, as /proc/<pid>/cgroup shows it
// to the agent): for "v1" in the pids hierarchy, for "v2" in the unified one.
bool process_in_cgroup(pid_t pid, const std::string& path, const std::string& version);

// The inode number of the network namespace of `pid` (or of the namespace file descriptor `fd`), 0 when unknown.
std::uint64_t netns_inode_of_pid(pid_t pid);
std::uint64_t netns_inode_of_fd(int fd);

// Whether a sandbox's dsec-init listens on `socket_path`, and, with `expect_answer`, answers: the probe sends an
// empty request, which init refuses at once (kFailed, stage kRequest) without starting anything. A frozen init
// cannot answer, so a sleeping sandbox is probed without it. On false, `why` says what went wrong.
bool probe_init(const std::string& socket_path, bool expect_answer, std::chrono::milliseconds timeout,
                std::string* why);

}  // namespace dsec::agent::container
