// Starting a container sandbox's first process, dsec-init, in one clone().
//
// The agent clones with CLONE_VM | CLONE_VFORK into new mount, pid, ipc and uts namespaces; the child joins the
// sandbox's cgroups, a cgroup namespace and a pre-made network namespace, builds the root filesystem (a private tmpfs
// holding the overlay's upper and work dirs, the overlay of the image layers, /proc with sensitive paths masked and
// /proc/sys read-only, a minimal /dev, read-only /sys), pivots into it, sets rlimits, drops every capability (but the
// three dsec-init keeps to start commands as users), sets no_new_privs, loads the seccomp filter and execs dsec-init.
// The agent thread is suspended only until that exec.
//
// The child shares the agent's memory, so it may not allocate: RootfsPlan prepares every path, option string and
// step beforehand, and the child walks it with plain syscalls.
#pragma once

#include <linux/filter.h>
#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/unique_fd.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent::container {

// One step of building the sandbox's root, run in the child.
struct RootfsStep {
  // kIdmapBind: source's mount copied, idmapped with the sandbox's user namespace and attached at target.
  // kSetFsIds: the file-system uid and gid become `dev` (root inside a user namespace), capabilities kept.
  enum class Kind { kMount, kMkdir, kMknod, kSymlink, kBindReadOnly, kIdmapBind, kSetFsIds };
  Kind kind;
  const char* source = nullptr;  // mount source / symlink target
  const char* target = nullptr;
  const char* fstype = nullptr;
  unsigned long flags = 0;
  const char* data = nullptr;
  unsigned mode = 0;           // mkdir / mknod mode
  unsigned long long dev = 0;  // mknod device
  bool optional = false;       // a missing target (ENOENT) is fine: e.g. a /proc file this kernel lacks
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
// With `options.read_only_root` the root is the image layers alone, mounted read-only (an overlay without an upper
// layer; the fncall backend's fork servers): rw/ is then a small tmpfs for the plan's own use, and the image must have
// the /proc, /dev, /sys and /tmp directories, as a read-only root cannot get them.
// What a sandbox sees masked in /proc and /sys: files that expose the host's physical memory and its page state
// (kcore, kpage*, iomem, vmallocinfo, page and slab statistics), kernel keys and symbols, timers and scheduler
// internals, the kernel log, energy counters (powercap: a side channel), and directories of firmware, debugging,
// tracing and memory management (DAMON, page_idle). A masked file reads as empty (/dev/null bound over it), a masked
// directory is empty; paths this kernel lacks are skipped.
inline constexpr std::string_view kMaskedFiles[] = {
    "/proc/kcore",       "/proc/kpagecgroup",     "/proc/kpageflags",    "/proc/kpagecount",
    "/proc/iomem",       "/proc/ioports",         "/proc/vmallocinfo",   "/proc/pagetypeinfo",
    "/proc/zoneinfo",    "/proc/buddyinfo",       "/proc/slabinfo",      "/proc/keys",
    "/proc/key-users",   "/proc/kallsyms",        "/proc/kmsg",          "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug",     "/proc/latency_stats", "/proc/config.gz",
    "/proc/mtrr",        "/sys/kernel/vmcoreinfo"};
inline constexpr std::string_view kMaskedDirectories[] = {"/proc/acpi",
                                                          "/proc/scsi",
                                                          "/proc/asound",
                                                          "/proc/driver",
                                                          "/sys/firmware",
                                                          "/sys/kernel/debug",
                                                          "/sys/kernel/tracing",
                                                          "/sys/kernel/security",
                                                          "/sys/kernel/mm",
                                                          "/sys/kernel/btf",
                                                          "/sys/kernel/slab",
                                                          "/sys/kernel/config",
                                                          "/sys/devices/virtual/powercap",
                                                          "/sys/fs/bpf",
                                                          "/sys/fs/pstore"};

struct RootfsOptions {
  bool read_only_root = false;
  // The sandbox runs in a user namespace whose block of host ids starts here: layers and the writable layer are
  // idmapped (SpawnRequest::userns_fd must then be that namespace).
  std::optional<std::uint32_t> userns_first;
  const char* proc_options = nullptr;  // mount options of /proc, e.g. "hidepid=invisible"
};

RootfsPlan plan_rootfs(const std::string& run_dir, const std::vector<std::string>& layers_top_first,
                       const Resources& resources, const RootfsOptions& options = {});

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
  // A batch sandbox (Priority::kBatch): its init runs SCHED_IDLE, which every process it starts inherits and none
  // can leave (RLIMIT_NICE 0, no CAP_SYS_NICE on the host).
  bool sched_idle = false;
  // A latency sandbox on a kernel with core scheduling: its init takes a core cookie of its own (PR_SCHED_CORE),
  // which its processes inherit, so no other sandbox's task runs on the SMT sibling of a core it runs on.
  bool core_cookie = false;
  // KSM asked for (spec "ksm"): its init marks its memory mergeable (PR_SET_MEMORY_MERGE), inherited by every
  // process it starts, across exec.
  bool memory_merge = false;
  // Another program to start instead of dsec-init (the fncall backend's fork servers): a path inside the new root,
  // executed with these argv and envp (null-terminated arrays). Its fds are then 0-2 /dev/null, 3 listen_fd, 4 the
  // scratch tmpfs; init_binary_fd is not used.
  const char* exec_path = nullptr;
  const char* const* exec_argv = nullptr;
  const char* const* exec_envp = nullptr;
  // Capabilities the started program keeps (bit n is capability n) in its bounding, permitted and effective sets;
  // uid 0 then keeps exactly these across the exec. 0: uid 0 gains none on exec, and the program keeps none but
  // dsec-init, which keeps CAP_SETUID, CAP_SETGID and CAP_SETPCAP to start commands as users (none of its commands
  // keeps any).
  std::uint64_t keep_capabilities = 0;
  // The sandbox's user namespace (UserNamespaces::take), joined after pivot_root; -1: host ids.
  int userns_fd = -1;
};

struct SpawnedInit {
  pid_t pid = -1;  // host pid of dsec-init
  UniqueFd pidfd;  // refers to exactly that process, whatever happens to the pid number
};

// Throws dsec::Error naming the step that failed (e.g. "mount overlay on /run/dsec/x/root: Invalid argument").
SpawnedInit spawn_init(const SpawnRequest& request);

}  // namespace dsec::agent::container
