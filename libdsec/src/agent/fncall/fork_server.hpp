// One fork server of a warm pool: the zygote (zygote.py) as pid 1 of its own sandbox, and the children it arms for
// future calls.
//
// The sandbox is the container runtime's (container/spawn): new mount, pid, ipc, uts and cgroup namespaces, an
// empty network namespace, the image's layers as a read-only root, masked /proc, a minimal /dev, read-only /sys,
// its own cgroup. Unlike a container's init, the zygote keeps CAP_SYS_ADMIN, CAP_SETUID and CAP_SETGID (each call's
// child needs them to make its namespaces and mounts before it drops to an unprivileged uid with none) and runs under
// a seccomp filter that still allows mount; every call's child loads the container's strict filter on top.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "agent/backends/container/cgroup.hpp"
#include "agent/backends/container/netns_pool.hpp"
#include "agent/backends/container/seccomp.hpp"
#include "agent/backends/container/user_namespace.hpp"
#include "agent/config.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::fncall {

// A GPU device node of the host that fork servers carry (hidden until a call is given it).
struct DeviceNode {
  std::string name;  // "nvidia0", "nvidiactl"
  dev_t dev = 0;
};

// What every fork server of the node shares; made once, on first use.
struct Runtime {
  FnCallConfig config;
  std::string node_id;
  std::filesystem::path run_dir;  // <agent run dir>/fncall
  unsigned cores = 1;
  int cap_last_cap = 40;
  std::unique_ptr<container::CgroupDriver> cgroups;  // servers' and calls' groups, with cpu accounting
  std::unique_ptr<container::NetnsPool> netns;
  container::SeccompProgram server_filter;            // the zygote's: the container filter with mount allowed
  std::string call_filter_base64;                     // the container's strict filter, loaded by every call's child
  std::vector<DeviceNode> gpu_nodes;                  // /dev/nvidia* of the host
  std::shared_ptr<container::UserNamespaces> userns;  // null or disabled: servers run with host ids
  std::atomic<std::uint64_t> next_id{0};
};

// The limits a call's group has: a call that asks for these needs no write to the group. And what was charged to
// the group before its child joined it: page cache an earlier call of the server read (reclaimable, and not this
// call's, so not in its peak).
struct GroupLimits {
  std::uint64_t memory_bytes = 0;
  std::uint32_t pids = 0;
  std::uint64_t charged_before = 0;
};

// A call's child, forked and waiting for its request.
struct Slot {
  UniqueFd sock;   // to the child (and to its parent, which reports the exit)
  UniqueFd pidfd;  // the child: pid 1 of the call's pid namespace
  // The child's mount namespace: held here, so that the child's exit does not wait for its mounts to be taken
  // down (that happens when the slot is released, off the call's path).
  UniqueFd mount_ns;
  std::unique_ptr<container::SandboxCgroup> cgroup;  // the call's group, which the child joined
  // C and C++: the program's own group, which the child joins after the compile, so that the program's CPU time,
  // peak memory and OOM kills are its own and not the compiler's.
  std::unique_ptr<container::SandboxCgroup> run_cgroup;
  GroupLimits limits, run_limits;
};

struct ForkServerParams {
  std::string id;                             // unique on the node: names its cgroup and run dir
  std::string language;                       // python, shell, c, cpp
  std::string image;                          // for messages
  std::vector<std::filesystem::path> layers;  // lowest first
};

class ForkServer {
 public:
  // Starts the zygote and waits until it has imported its modules (throws dsec::Error naming what failed; an image
  // without python3 is FAILED_PRECONDITION).
  static std::unique_ptr<ForkServer> start(Runtime& runtime, const ForkServerParams& params);
  ~ForkServer();
  ForkServer(const ForkServer&) = delete;
  ForkServer& operator=(const ForkServer&) = delete;

  // Forks a child for one call in a cgroup of its own (and, with `run_group`, gives it a second one for the program
  // a compile builds) and returns once it is ready (UNAVAILABLE when the zygote is gone or does not answer). The
  // groups are ones earlier calls of this server left empty (see recycle), or new.
  Slot arm(bool run_group);
  // Takes back a used slot: its child is ended, its mount namespace released, and its groups, once empty, are kept
  // (their peak restarted, their limits reset) for the server's next calls; a group that still holds a process, or
  // more than a few, is removed. Reusing groups spares the kernel a memory cgroup's making and removal per call.
  void recycle(Slot slot);
  bool alive() const;
  // Kills the zygote and everything in its sandbox (armed and running children too), and removes its cgroup and run
  // directory. Idempotent.
  void kill();

  const std::string& id() const noexcept { return id_; }
  const std::vector<std::string>& preload_failures() const noexcept { return preload_failures_; }

 private:
  ForkServer(Runtime& runtime, std::string id) : runtime_(runtime), id_(std::move(id)) {}
  // start()'s first exchange with the zygote: its settings for the language, then its hello (or why it failed).
  void greet(const ForkServerParams& params);

  Runtime& runtime_;
  std::string id_;
  std::filesystem::path run_dir_;
  pid_t pid_ = -1;
  UniqueFd pidfd_;
  UniqueFd ctl_;
  std::mutex ctl_mu_;
  std::unique_ptr<container::SandboxCgroup> cgroup_;
  UniqueFd netns_;
  std::optional<std::uint32_t> userns_first_;  // its user namespace's block, given back when it is gone
  std::vector<std::string> preload_failures_;
  std::mutex kill_mu_;
  bool killed_ = false;
  // Emptied groups of earlier calls, for the next ones: of calls, and of C and C++ programs.
  struct SpareGroup {
    std::unique_ptr<container::SandboxCgroup> group;
    GroupLimits limits;
  };
  std::unique_ptr<container::SandboxCgroup> take_group(bool run, bool compiles, GroupLimits& limits);
  void keep_group(std::unique_ptr<container::SandboxCgroup> group, GroupLimits limits, bool run, bool compiles);
  std::mutex spare_mu_;
  std::vector<SpareGroup> spare_, spare_run_;
  bool spares_closed_ = false;  // the server was killed: groups given back now are removed
};

// The script the zygote runs (zygote.py, compiled in).
std::string_view zygote_script();

}  // namespace dsec::agent::fncall
