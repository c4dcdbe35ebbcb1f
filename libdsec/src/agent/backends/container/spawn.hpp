// Starting a container sandbox's first process, dsec-init, in one clone().
//
// The agent clones with CLONE_VM | CLONE_VFORK into new mount, pid, ipc and uts namespaces; the child joins the
// sandbox's cgroups, a cgroup namespace and a pre-made network namespace, builds the root filesystem (a private tmpfs
// holding the overlay's upper and work dirs, the overlay of the image layers, /proc with sensitive paths masked and
// /proc/sys read-only, a minimal /dev, read-only /sys), pivots into it, sets rlimits, drops every capability, sets
// no_new_privs, loads the seccomp filter and execs dsec-init. The agent thread is suspended only until that exec.
//
// The child shares the agent's memory, so it may not allocate: RootfsPlan prepares every path, option string and
// step beforehand, and the child walks it with plain syscalls.
#pragma once

#include <linux/filter.h>
#include <sys/types.h>

#include <deque>
#include <string>
#include <vector>

#include "common/unique_fd.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent::container {

// One step of building the sandbox's root, run in the child.
struct RootfsStep {
  enum class Kind { kMount, kMkdir, kMknod, kSymlink, kBindReadOnly };
  Kind kind;
  const char* source = nullptr;  // mount source / symlink target
  const char* target = nullptr;
  const char* fstype = nullptr;
  unsigned long flags = 0;
  const char* data = nullptr;
  unsigned mode = 0;             // mkdir / mknod mode
  unsigned long long dev = 0;    // mknod device
  bool optional = false;         // a missing target (ENOENT) is fine: e.g. a /proc file this kernel lacks
};

// Everything the child needs, built in the parent. Strings live in `storage` (a deque: pointers stay valid).
struct RootfsPlan {
  std::string scratch;  // <run>/<id>/rw: private tmpfs with upper/ and work/
  std::string root;     // <run>/<id>/root: the overlay, then pivot_root's new root
  std::vector<RootfsStep> steps;
  std::deque<std::string> storage;
  const char* keep(std::string s) { return storage.emplace_back(std::move(s)).c_str(); }
};

// Lays out the steps for a sandbox whose run directory is `run_dir` (it must exist, with empty rw/ and root/ in it).
RootfsPlan plan_rootfs(const std::string& run_dir, const std::vector<std::string>& layers_top_first,
                       const Resources& resources);

struct SpawnRequest {
  const RootfsPlan* rootfs = nullptr;
  std::string hostname;
  int netns_fd = -1;
  std::vector<int> cgroup_procs_fds;  // the sandbox's cgroup.procs files, joined before anything else
  int listen_fd = -1;                 // init.sock, already listening; becomes fd 3 of dsec-init
  int init_binary_fd = -1;            // dsec-init, opened O_PATH; exec'd through execveat
  const sock_fprog* seccomp = nullptr;
  int cap_last_cap = 40;
  std::uint32_t open_files = 4096;
};

struct SpawnedInit {
  pid_t pid = -1;   // host pid of dsec-init
  UniqueFd pidfd;   // refers to exactly that process, whatever happens to the pid number
};

// Throws dsec::Error naming the step that failed (e.g. "mount overlay on /run/dsec/x/root: Invalid argument").
SpawnedInit spawn_init(const SpawnRequest& request);

}  // namespace dsec::agent::container
