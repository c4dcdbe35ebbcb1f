#include "agent/backends/container/spawn.hpp"

#include <fcntl.h>
#include <linux/capability.h>
#include <linux/seccomp.h>
#include <linux/securebits.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "common/syscall.hpp"
#include "common/wire/init_protocol.hpp"

namespace dsec::agent::container {
namespace {

// prctl options newer than some C libraries' headers (Linux 5.14 and 6.4).
constexpr int kPrSchedCore = 62;
constexpr int kPrSchedCoreCreate = 1;
constexpr int kPrSetMemoryMerge = 67;

using Kind = RootfsStep::Kind;

// What the child reports back through shared memory when a step fails.
struct ChildFailure {
  volatile int err = 0;
  const char* volatile what = nullptr;    // the step ("mount", "pivot_root", ...)
  const char* volatile target = nullptr;  // its object, if any
};

struct ChildArgs {
  const SpawnRequest* req;
  sigset_t original_mask;
  ChildFailure failure;
};

[[noreturn]] void fail(ChildArgs* a, const char* what, const char* target) {
  a->failure.err = errno ? errno : EINVAL;
  a->failure.target = target;
  a->failure.what = what;
  _exit(127);
}

int run_step(const RootfsStep& s, int userns_fd) {
  switch (s.kind) {
    case Kind::kMount:
      return mount(s.source, s.target, s.fstype, s.flags, s.data);
    case Kind::kMkdir:
      if (mkdir(s.target, s.mode) == 0 || errno == EEXIST) return 0;
      return -1;
    case Kind::kMknod:
      return mknod(s.target, S_IFCHR | s.mode, static_cast<dev_t>(s.dev));
    case Kind::kSymlink:
      if (symlink(s.source, s.target) == 0 || errno == EEXIST) return 0;
      return -1;
    case Kind::kBindReadOnly:
      if (mount(s.source ? s.source : s.target, s.target, nullptr, MS_BIND | MS_REC, nullptr) != 0) return -1;
      return mount(nullptr, s.target, nullptr, MS_BIND | MS_REMOUNT | MS_RDONLY | s.flags, nullptr);
    case Kind::kIdmapBind: {
      // A copy of source's mount, idmapped with the sandbox's user namespace, attached at target.
      int tree = static_cast<int>(syscall(SYS_open_tree, AT_FDCWD, s.source, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
      if (tree < 0) return -1;
      mount_attr attr{};
      attr.attr_set = MOUNT_ATTR_IDMAP;
      attr.userns_fd = static_cast<std::uint64_t>(userns_fd);
      int rc = static_cast<int>(syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH, &attr, sizeof attr));
      if (rc == 0)
        rc = static_cast<int>(syscall(SYS_move_mount, tree, "", AT_FDCWD, s.target, MOVE_MOUNT_F_EMPTY_PATH));
      int err = errno;
      close(tree);
      errno = err;
      return rc;
    }
    case Kind::kSetFsIds: {
      // What is made from here on is root's inside (see RootfsStep::kSetFsIds), with the capabilities that leaving
      // fsuid 0 took from the effective set raised again.
      syscall(SYS_setfsgid, static_cast<unsigned>(s.dev));
      syscall(SYS_setfsuid, static_cast<unsigned>(s.dev));
      __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
      __user_cap_data_struct data[2]{};
      if (syscall(SYS_capget, &hdr, data) != 0) return -1;
      data[0].effective = data[0].permitted;
      data[1].effective = data[1].permitted;
      return static_cast<int>(syscall(SYS_capset, &hdr, data));
    }
  }
  return -1;
}

const char* step_name(Kind k) {
  switch (k) {
    case Kind::kMount:
      return "mount";
    case Kind::kMkdir:
      return "mkdir";
    case Kind::kMknod:
      return "mknod";
    case Kind::kSymlink:
      return "symlink";
    case Kind::kBindReadOnly:
      return "bind read-only";
    case Kind::kIdmapBind:
      return "idmapped bind";
    case Kind::kSetFsIds:
      return "set file-system ids";
  }
  return "step";
}

// child_main's steps, in the order it takes them (it runs on its own stack, sharing the agent's memory: syscalls
// only, no allocation). A step that fails ends the child (fail).

// Handlers are the agent's code: never run them here.
void reset_signal_handlers() {
  for (int sig = 1; sig < NSIG; ++sig) {
    struct sigaction sa;
    if (sigaction(sig, nullptr, &sa) == 0 && sa.sa_handler != SIG_DFL && sa.sa_handler != SIG_IGN) {
      sa.sa_handler = SIG_DFL;
      sa.sa_flags = 0;
      sigaction(sig, &sa, nullptr);
    }
  }
}

// Joins the sandbox's cgroups first, so that the cgroup namespace made next is rooted there; then its network
// namespace, and names the host.
void join_sandbox(ChildArgs* a) {
  const SpawnRequest& r = *a->req;
  for (int fd : r.cgroup_procs_fds)
    if (write(fd, "0", 1) != 1) fail(a, "join cgroup", nullptr);
  if (unshare(CLONE_NEWCGROUP) != 0) fail(a, "unshare cgroup namespace", nullptr);
  if (setns(r.netns_fd, CLONE_NEWNET) != 0) fail(a, "setns network namespace", nullptr);
  if (sethostname(r.hostname.data(), r.hostname.size()) != 0) fail(a, "sethostname", nullptr);
}

// Runs the plan's steps and makes its root the child's; returns the scratch tmpfs, opened on the way.
int enter_root(ChildArgs* a) {
  const SpawnRequest& r = *a->req;
  // Nothing mounted from here on may reach the host's mount table.
  if (mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) fail(a, "make mounts private", "/");
  for (const RootfsStep& s : r.rootfs->steps) {
    if (run_step(s, r.userns_fd) != 0) {
      if (s.optional && (errno == ENOENT || errno == ENOTDIR)) continue;
      fail(a, step_name(s.kind), s.target);
    }
  }
  int scratch = open(r.rootfs->scratch.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (scratch < 0) fail(a, "open", r.rootfs->scratch.c_str());

  if (chdir(r.rootfs->root.c_str()) != 0) fail(a, "chdir", r.rootfs->root.c_str());
  if (syscall(SYS_pivot_root, ".", ".") != 0) fail(a, "pivot_root", r.rootfs->root.c_str());
  if (umount2(".", MNT_DETACH) != 0) fail(a, "detach the host root", nullptr);
  if (chdir("/") != 0) fail(a, "chdir", "/");
  return scratch;
}

// The OOM score, resource limits and scheduling every process of the sandbox inherits. Limits come before the user
// namespace: raising a hard limit needs the host's CAP_SYS_RESOURCE.
void set_limits(ChildArgs* a) {
  const SpawnRequest& r = *a->req;
  // dsec-init should survive the sandbox's own OOM kills; the commands it starts reset this to 0. This needs
  // CAP_SYS_RESOURCE, which some hosts withhold even from root: then init stays at 0 and, as the smallest process in
  // the sandbox, is the OOM killer's last choice anyway.
  int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
  if (oom >= 0) {
    (void)!write(oom, "-1000", 5);
    close(oom);
  }

  rlimit files{r.open_files, r.open_files};
  if (setrlimit(RLIMIT_NOFILE, &files) != 0) fail(a, "setrlimit NOFILE", nullptr);
  rlimit core{0, 0};
  setrlimit(RLIMIT_CORE, &core);
  // No process inside may raise its scheduling priority (a batch sandbox's SCHED_IDLE stays).
  rlimit nice{0, 0};
  setrlimit(RLIMIT_NICE, &nice);
  if (r.sched_idle) {
    sched_param idle{};
    if (sched_setscheduler(0, SCHED_IDLE, &idle) != 0) fail(a, "sched_setscheduler SCHED_IDLE", nullptr);
  }
  // PIDTYPE_TGID (1): the cookie covers this process; children inherit it.
  if (r.core_cookie && prctl(kPrSchedCore, kPrSchedCoreCreate, 0, 1, 0) != 0) fail(a, "prctl PR_SCHED_CORE", nullptr);
  if (r.memory_merge && prctl(kPrSetMemoryMerge, 1, 0, 0, 0) != 0) fail(a, "prctl PR_SET_MEMORY_MERGE", nullptr);
}

// The sandbox's own user namespace, last of all: its root is then root inside only (the mount, pid, network and
// other namespaces stay the host's, so nothing inside has any power over them). Raw syscalls: glibc's set*id
// would signal the agent's other threads.
void enter_user_namespace(ChildArgs* a) {
  const SpawnRequest& r = *a->req;
  if (r.userns_fd < 0) return;
  if (setns(r.userns_fd, CLONE_NEWUSER) != 0) fail(a, "setns user namespace", nullptr);
  if (syscall(SYS_setgroups, 0, nullptr) != 0) fail(a, "setgroups", nullptr);
  if (syscall(SYS_setresgid, 0, 0, 0) != 0) fail(a, "setresgid", nullptr);
  if (syscall(SYS_setresuid, 0, 0, 0) != 0) fail(a, "setresuid", nullptr);
}

// Descriptors: 0-2 /dev/null, 3 init.sock, 4 the scratch tmpfs, 5 the dsec-init binary; nothing else survives.
// Another program (exec_path) gets 0-4 alike and no 5.
void arrange_descriptors(ChildArgs* a, int scratch, bool own_program) {
  const SpawnRequest& r = *a->req;
  int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
  if (devnull < 0) fail(a, "open", "/dev/null");
  int listen_hi = fcntl(r.listen_fd, F_DUPFD_CLOEXEC, 10);
  int scratch_hi = fcntl(scratch, F_DUPFD_CLOEXEC, 10);
  int init_hi = own_program ? -1 : fcntl(r.init_binary_fd, F_DUPFD_CLOEXEC, 10);
  if (listen_hi < 0 || scratch_hi < 0 || (!own_program && init_hi < 0)) fail(a, "dup", nullptr);
  if (dup2(devnull, 0) < 0 || dup2(devnull, 1) < 0 || dup2(devnull, 2) < 0 ||
      dup2(listen_hi, init_protocol::kListenFd) < 0 || dup2(scratch_hi, init_protocol::kScratchFd) < 0 ||
      (!own_program && dup3(init_hi, 5, O_CLOEXEC) < 0))
    fail(a, "dup2", nullptr);
  if (close_range(own_program ? 5 : 6, ~0u, 0) != 0) fail(a, "close_range", nullptr);
}

// The capabilities the started program holds (see SpawnRequest::keep_capabilities), locked so that none can come
// back; then no new privileges and the seccomp filter.
void confine(ChildArgs* a, bool own_program) {
  const SpawnRequest& r = *a->req;
  const std::uint64_t keep = r.keep_capabilities;
  // dsec-init (keep 0) holds exactly CAP_SETUID, CAP_SETGID and CAP_SETPCAP, to start each command as the user it
  // names; every command gives all three up (and the whole bounding set) before it execs (command_start.cpp), so
  // nothing that runs in the sandbox has a capability. They reach dsec-init as ambient capabilities, the only kind
  // an exec keeps under NOROOT; dsec-init makes them permitted only at once (container_init.cpp).
  const std::uint64_t init_caps =
      keep == 0 && !own_program ? (1ull << CAP_SETUID) | (1ull << CAP_SETGID) | (1ull << CAP_SETPCAP) : 0;
  constexpr unsigned long kNoRoot = SECBIT_KEEP_CAPS_LOCKED | SECBIT_NO_SETUID_FIXUP | SECBIT_NO_SETUID_FIXUP_LOCKED |
                                    SECBIT_NOROOT | SECBIT_NOROOT_LOCKED;
  constexpr unsigned long kNoAmbient = SECBIT_NO_CAP_AMBIENT_RAISE | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
  if (keep == 0) {
    // Every other capability goes for good: uid 0 inside gains none on exec (NOROOT), none can come back. Raising
    // ambient capabilities is locked once dsec-init's are raised (below).
    if (prctl(PR_SET_SECUREBITS, init_caps ? kNoRoot : kNoRoot | kNoAmbient, 0, 0, 0) != 0)
      fail(a, "set securebits", nullptr);
  } else {
    // Keep some: uid 0 keeps exactly those across the exec (bounding set); a later change to another uid drops
    // them all (the setuid fixup stays on), and none can be raised as ambient.
    if (prctl(PR_SET_SECUREBITS,
              SECBIT_KEEP_CAPS_LOCKED | SECBIT_NO_CAP_AMBIENT_RAISE | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED, 0, 0, 0) != 0)
      fail(a, "set securebits", nullptr);
  }
  const std::uint64_t held = keep | init_caps;
  for (int cap = 0; cap <= r.cap_last_cap; ++cap) {
    if (cap < 64 && (held >> cap) & 1) continue;
    if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL) fail(a, "drop bounding capability", nullptr);
  }
  prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  data[0].permitted = data[0].effective = static_cast<std::uint32_t>(held);
  data[1].permitted = data[1].effective = static_cast<std::uint32_t>(held >> 32);
  data[0].inheritable = static_cast<std::uint32_t>(init_caps);  // an ambient capability must be inheritable too
  data[1].inheritable = static_cast<std::uint32_t>(init_caps >> 32);
  if (syscall(SYS_capset, &hdr, data) != 0) fail(a, "capset", nullptr);
  if (init_caps) {
    for (int cap : {CAP_SETUID, CAP_SETGID, CAP_SETPCAP})
      if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0) != 0) fail(a, "raise ambient capability", nullptr);
    if (prctl(PR_SET_SECUREBITS, kNoRoot | kNoAmbient, 0, 0, 0) != 0) fail(a, "lock securebits", nullptr);
  }
  if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail(a, "no_new_privs", nullptr);
  if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, r.seccomp) != 0) fail(a, "load seccomp filter", nullptr);
}

// Runs in the cloned child, on its own stack, sharing the agent's memory: syscalls only, no allocation.
int child_main(void* arg) {
  auto* a = static_cast<ChildArgs*>(arg);
  const SpawnRequest& r = *a->req;
  errno = 0;

  reset_signal_handlers();
  // Directory modes in the plan are meant exactly (/tmp and /dev/shm are 1777).
  umask(0);
  join_sandbox(a);
  const int scratch = enter_root(a);
  set_limits(a);
  enter_user_namespace(a);
  const bool own_program = r.exec_path != nullptr;
  arrange_descriptors(a, scratch, own_program);
  confine(a, own_program);

  // The agent's threads block signals they wait for (SIGTERM, SIGINT); nothing of that may reach the sandbox.
  umask(022);
  sigset_t empty;
  sigemptyset(&empty);
  sigprocmask(SIG_SETMASK, &empty, nullptr);
  if (own_program) {
    execve(r.exec_path, const_cast<char* const*>(r.exec_argv), const_cast<char* const*>(r.exec_envp));
    fail(a, "exec", r.exec_path);
  }
  static char init_name[] = "dsec-init";
  char* argv[] = {init_name, nullptr};
  char* envp[] = {nullptr};
  syscall(SYS_execveat, 5, "", argv, envp, AT_EMPTY_PATH);
  fail(a, "exec dsec-init", nullptr);
}

// Appends a plan's steps, one method per kind; strings the plan keeps (RootfsPlan::keep).
class PlanSteps {
 public:
  explicit PlanSteps(RootfsPlan& plan) : p_(plan) {}

  const char* keep(std::string s) { return p_.keep(std::move(s)); }
  // A path under the new root.
  const char* at(std::string_view rel) { return p_.keep(p_.root + std::string(rel)); }
  void mount_step(const char* src, const char* target, const char* type, unsigned long flags, const char* data,
                  bool optional = false) {
    p_.steps.push_back({Kind::kMount, src, target, type, flags, data, 0, 0, optional});
  }
  void mkdir_step(const char* target, unsigned mode) {
    p_.steps.push_back({Kind::kMkdir, nullptr, target, nullptr, 0, nullptr, mode, 0, false});
  }
  void idmap_step(const char* source, const char* target) {
    p_.steps.push_back({Kind::kIdmapBind, source, target, nullptr, 0, nullptr, 0, 0, false});
  }
  void add(const RootfsStep& step) { p_.steps.push_back(step); }
  const RootfsPlan& plan() const { return p_; }

 private:
  RootfsPlan& p_;
};

// The overlay's lowerdir: the layers, top first. With a user namespace, every layer is stacked through an idmapped
// copy of its mount under <run>/lower: on disk, files keep the ids the sandbox sees.
std::string stack_layers(PlanSteps& steps, const std::string& run_dir, const std::vector<std::string>& layers_top_first,
                         bool idmapped) {
  std::string lower;
  for (std::size_t i = 0; i < layers_top_first.size(); ++i) {
    std::string layer = layers_top_first[i];
    if (idmapped) {
      if (i == 0) steps.mkdir_step(steps.keep(run_dir + "/lower"), 0700);
      const char* staged = steps.keep(fmt::format("{}/lower/{}", run_dir, i));
      steps.mkdir_step(staged, 0700);
      steps.idmap_step(steps.keep(layer), staged);
      layer = staged;
    }
    lower += (lower.empty() ? "" : ":") + layer;
  }
  return lower;
}

// The scratch tmpfs and the overlay of the layers (`lower`) under it, mounted at the root. With a user namespace
// the writable layer is stacked through an idmapped copy of the scratch tmpfs at <run>/rwmap.
void mount_overlay(PlanSteps& steps, const std::string& run_dir, std::string lower, std::size_t layer_count,
                   const Resources& resources, const RootfsOptions& options, const char* empty_dir) {
  const RootfsPlan& p = steps.plan();
  const bool idmapped = options.userns_first.has_value();
  // Where the overlay finds the scratch tmpfs's directories: idmapped, or the tmpfs itself.
  const std::string writable = idmapped ? run_dir + "/rwmap" : p.scratch;
  auto stack_writable = [&] {
    if (!idmapped) return;
    steps.mkdir_step(steps.keep(writable), 0700);
    steps.idmap_step(steps.keep(p.scratch), steps.keep(writable));
    // The overlay records its mounter's credentials and works on its upper layer with them: root inside, seen
    // through the idmapped mount as on-disk 0. What the steps after it make is root's inside too.
    steps.add({Kind::kSetFsIds, nullptr, nullptr, nullptr, 0, nullptr, 0, *options.userns_first, false});
  };
  if (options.read_only_root) {
    // No writable layer: the scratch tmpfs only holds the empty directory, and the overlay has lower layers alone
    // (the kernel wants two of them then: an image of one layer gets the empty directory as its second).
    steps.mount_step("dsec-rw", steps.keep(p.scratch), "tmpfs", MS_NOSUID | MS_NODEV,
                     "size=64k,nr_inodes=64,mode=0755");
    steps.mkdir_step(empty_dir, 0555);
    stack_writable();
    if (layer_count == 1) lower += ":" + writable + "/empty";
    steps.mount_step("dsec-root", steps.keep(p.root), "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV,
                     steps.keep(fmt::format("lowerdir={}", lower)));
    return;
  }
  // The writable layer: a tmpfs as large as the disk limit, so the kernel enforces it (ENOSPC past it).
  std::uint64_t inodes = std::max<std::uint64_t>(16384, resources.disk_bytes / 8192);
  steps.mount_step("dsec-rw", steps.keep(p.scratch), "tmpfs", MS_NOSUID | MS_NODEV,
                   steps.keep(fmt::format("size={},nr_inodes={},mode=0755", resources.disk_bytes, inodes)));
  steps.mkdir_step(steps.keep(p.scratch + "/upper"), 0755);
  steps.mkdir_step(steps.keep(p.scratch + "/work"), 0755);
  steps.mkdir_step(empty_dir, 0555);
  stack_writable();
  // metacopy and redirect_dir off (the kernel's defaults, said here whatever the host's module options): every
  // file the sandbox changes is then whole in the upper directory, which a snapshot takes as a layer of its own.
  steps.mount_step("dsec-root", steps.keep(p.root), "overlay", MS_NOSUID | MS_NODEV,
                   steps.keep(fmt::format("lowerdir={},upperdir={}/upper,workdir={}/work,volatile,metacopy=off,"
                                          "redirect_dir=off",
                                          lower, writable, writable)));
}

// /proc, /dev (its devices, pts, shm and links) and /sys, and /tmp. On a read-only root the directories are the
// image's own (EEXIST); a missing one fails the start.
void mount_system(PlanSteps& steps, const Resources& resources, const RootfsOptions& options) {
  for (const char* d : {"/proc", "/dev", "/sys"}) steps.mkdir_step(steps.at(d), 0755);
  steps.mkdir_step(steps.at("/tmp"), 01777);
  steps.mount_step("proc", steps.at("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC,
                   options.proc_options ? steps.keep(options.proc_options) : nullptr);
  // Each superblock a sandbox mounts costs kernel memory in every memory cgroup on the host (per-cgroup shrinker and
  // LRU bookkeeping), so a sandbox mounts as few as it can: /dev/shm is a directory of the /dev tmpfs, and every
  // masked directory is a read-only bind of one empty directory on the scratch tmpfs.
  steps.mount_step("dsec-dev", steps.at("/dev"), "tmpfs", MS_NOSUID | MS_NOEXEC,
                   steps.keep(fmt::format("mode=0755,size={},nr_inodes=4096",
                                          std::min<std::uint64_t>(resources.memory_bytes, 1ull << 30))));
  struct Device {
    const char* name;
    unsigned major, minor;
  };
  for (const Device& d : {Device{"/dev/null", 1, 3},
                          {"/dev/zero", 1, 5},
                          {"/dev/full", 1, 7},
                          {"/dev/random", 1, 8},
                          {"/dev/urandom", 1, 9},
                          {"/dev/tty", 5, 0}})
    steps.add({Kind::kMknod, nullptr, steps.at(d.name), nullptr, 0, nullptr, 0666, makedev(d.major, d.minor), false});
  steps.mkdir_step(steps.at("/dev/pts"), 0755);
  steps.mkdir_step(steps.at("/dev/shm"), 01777);
  steps.mount_step("devpts", steps.at("/dev/pts"), "devpts", MS_NOSUID | MS_NOEXEC,
                   "newinstance,ptmxmode=0666,mode=0620");
  for (auto [target, link] : {std::pair{"/dev/ptmx", "pts/ptmx"},
                              {"/dev/fd", "/proc/self/fd"},
                              {"/dev/stdin", "/proc/self/fd/0"},
                              {"/dev/stdout", "/proc/self/fd/1"},
                              {"/dev/stderr", "/proc/self/fd/2"}})
    steps.add({Kind::kSymlink, link, steps.at(target), nullptr, 0, nullptr, 0, 0, false});
  steps.mount_step("sysfs", steps.at("/sys"), "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr);
}

// Masked (docs/security.md has the list and why): files read as empty, directories are empty. Read-only: kernel
// tunables and triggers.
void mask_kernel_files(PlanSteps& steps, const char* empty_dir) {
  for (std::string_view f : kMaskedFiles)
    steps.mount_step(steps.at("/dev/null"), steps.at(f), nullptr, MS_BIND, nullptr, true);
  for (std::string_view d : kMaskedDirectories)
    steps.add(
        {Kind::kBindReadOnly, empty_dir, steps.at(d), nullptr, MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr, 0, 0, true});
  for (const char* d : {"/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs"})
    steps.add(
        {Kind::kBindReadOnly, nullptr, steps.at(d), nullptr, MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr, 0, 0, true});
}

}  // namespace

RootfsPlan plan_rootfs(const std::string& run_dir, const std::vector<std::string>& layers_top_first,
                       const Resources& resources, const RootfsOptions& options) {
  RootfsPlan p;
  p.scratch = run_dir + "/rw";
  p.root = run_dir + "/root";
  PlanSteps steps(p);
  std::string lower = stack_layers(steps, run_dir, layers_top_first, options.userns_first.has_value());
  const char* empty_dir = p.keep(p.scratch + "/empty");
  mount_overlay(steps, run_dir, std::move(lower), layers_top_first.size(), resources, options, empty_dir);
  mount_system(steps, resources, options);
  mask_kernel_files(steps, empty_dir);
  return p;
}

SpawnedInit spawn_init(const SpawnRequest& request) {
  constexpr std::size_t kStackSize = 256 << 10;
  void* stack = mmap(nullptr, kStackSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) throw_errno(errno, "mmap stack for sandbox init");

  ChildArgs args{&request, {}, {}};
  sigset_t all;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &args.original_mask);
  pid_t pid = clone(child_main, static_cast<char*>(stack) + kStackSize,
                    CLONE_VM | CLONE_VFORK | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | SIGCHLD, &args);
  int clone_errno = errno;
  pthread_sigmask(SIG_SETMASK, &args.original_mask, nullptr);
  munmap(stack, kStackSize);
  if (pid < 0) throw_errno(clone_errno, "clone sandbox init");

  if (args.failure.what != nullptr) {
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    const char* target = args.failure.target;
    throw_errno(args.failure.err, target ? fmt::format("start sandbox: {} {}", args.failure.what, target)
                                         : fmt::format("start sandbox: {}", args.failure.what));
  }
  SpawnedInit out;
  out.pid = pid;
  out.pidfd.reset(static_cast<int>(syscall(SYS_pidfd_open, pid, 0)));
  if (!out.pidfd) {
    int err = errno;
    kill(pid, SIGKILL);
    int status;
    waitpid(pid, &status, 0);
    throw_errno(err, "pidfd_open sandbox init");
  }
  return out;
}

}  // namespace dsec::agent::container
