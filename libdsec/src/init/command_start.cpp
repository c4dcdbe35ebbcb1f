#include "init/command_start.hpp"

#include <fcntl.h>
#include <linux/capability.h>
#include <linux/magic.h>
#include <linux/sched.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

namespace dsec::init {
namespace {

using init_protocol::FailStage;

// execve with a PATH search that uses the command's own PATH (execvpe would use dsec-init's). Runs in the vfork
// child, so it allocates nothing.
void exec_search(const char* file, char* const argv[], char* const envp[], const char* path) {
  if (std::strchr(file, '/')) {
    execve(file, argv, envp);
    return;
  }
  int first_error = ENOENT;
  char candidate[4096];
  std::size_t flen = std::strlen(file);
  const char* p = path;
  while (true) {
    const char* end = std::strchr(p, ':');
    std::size_t dlen = end ? static_cast<std::size_t>(end - p) : std::strlen(p);
    if (dlen + 1 + flen + 1 <= sizeof candidate) {
      std::size_t n = 0;
      if (dlen == 0) {
        candidate[n++] = '.';
      } else {
        // NOLINTNEXTLINE(bugprone-not-null-terminated-result): the file name copied below ends the string
        std::memcpy(candidate, p, dlen);
        n = dlen;
      }
      candidate[n++] = '/';
      std::memcpy(candidate + n, file, flen + 1);
      execve(candidate, argv, envp);
      // Keep looking past "not here"; remember the first more telling error (EACCES: exists but not executable).
      if (errno != ENOENT && errno != ENOTDIR && first_error == ENOENT) first_error = errno;
    }
    if (!end) break;
    p = end + 1;
  }
  errno = first_error;
}

// The command's capabilities and ids, in the vfork child. Raw system calls only: glibc's setuid family changes the
// ids of every thread of the process by signalling them, which must never run in a child that shares dsec-init's
// memory; the kernel calls change this task alone. False with errno set when a step fails.
bool become_user(const StartRequest& req) {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[2]{};
  if (req.drop_capabilities) {
    // dsec-init keeps its capabilities permitted only; raise them for the steps below.
    if (syscall(SYS_capget, &hdr, caps) != 0) return false;
    for (auto& c : caps) {
      c.effective = c.permitted;
      c.inheritable = 0;
    }
    if (syscall(SYS_capset, &hdr, caps) != 0) return false;
    for (int cap = 0; cap < 64; ++cap)
      if (prctl(PR_CAPBSET_READ, cap, 0, 0, 0) == 1 && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) return false;
  }
  if (req.set_user) {
    if (syscall(SYS_setgroups, req.groups.size(), req.groups.data()) != 0) return false;
    if (syscall(SYS_setresgid, req.gid, req.gid, req.gid) != 0) return false;
    if (syscall(SYS_setresuid, req.uid, req.uid, req.uid) != 0) return false;
    // The id change made the memory this child shares with dsec-init dumpable again (per fs.suid_dumpable); it
    // must stay closed to the sandbox's processes. The exec sets the command's own.
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (req.uid != 0 && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  }
  if (req.drop_capabilities) {
    __user_cap_data_struct none[2]{};
    if (syscall(SYS_capset, &hdr, none) != 0) return false;
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL) return false;
  }
  return true;
}

// Whether the kernel takes clone3 with CLONE_INTO_CGROUP (Linux 5.7+); cleared at the first ENOSYS or E2BIG.
bool clone_into_cgroup_works = true;

bool is_cgroup2_dir(int fd) {
  struct stat st;
  struct statfs fs;
  return fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) && fstatfs(fd, &fs) == 0 && fs.f_type == CGROUP2_SUPER_MAGIC;
}

#if defined(__x86_64__)
// The child's stack for clone_vfork_into: dsec-init starts one command at a time, and waits while the child runs.
alignas(64) char child_stack[128 * 1024];

// clone3(CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP): what vfork does, with the child born in the cgroup that
// `group_dir` (a cgroup2 directory) names, so the command never moves between groups. A move waits for an RCU
// grace period after an idle spell (milliseconds), which every agent-loop step after think time would pay. The child
// runs fn(arg) on a stack of its own and exits with its value; the parent gets the child's pid, or -errno. glibc
// has no clone3 wrapper, and a child sharing the parent's memory must not return into the parent's frames: so the
// system call is made here, and the child calls fn straight from it.
long clone_vfork_into(int group_dir, int (*fn)(void*), void* arg) {
  clone_args args{};
  args.flags = CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP;
  args.exit_signal = SIGCHLD;
  args.stack = reinterpret_cast<std::uint64_t>(child_stack);
  args.stack_size = sizeof child_stack;
  args.cgroup = static_cast<std::uint64_t>(group_dir);
  long ret;
  // fn and arg ride in callee-saved registers, which the child starts with too; the kernel points the child's rsp
  // at the top of the stack (16-byte aligned, as the call below needs).
  register void* fn_reg asm("r12") = reinterpret_cast<void*>(fn);
  register void* arg_reg asm("r13") = arg;
  asm volatile(
      "syscall\n\t"
      "test %%rax, %%rax\n\t"
      "jnz 1f\n\t"
      "xor %%ebp, %%ebp\n\t"
      "mov %%r13, %%rdi\n\t"
      "call *%%r12\n\t"
      "mov %%eax, %%edi\n\t"
      "mov %[exit], %%eax\n\t"
      "syscall\n\t"
      "hlt\n\t"
      "1:\n\t"
      : "=a"(ret)
      : "0"(SYS_clone3), "D"(&args), "S"(sizeof args), "r"(fn_reg), "r"(arg_reg), [exit] "i"(SYS_exit)
      : "rcx", "r11", "memory");
  return ret;
}
#else
// Elsewhere the child joins its group by writing to cgroup.procs.
long clone_vfork_into(int, int (*)(void*), void*) { return -ENOSYS; }
#endif

// What the child of start_command needs, and what it reports back before it execs (it shares dsec-init's memory,
// and dsec-init waits until it has exec'd or exited: volatile, written by the child, read after).
struct ChildStart {
  const StartRequest& req;
  const sigset_t& original_mask;
  char* const* argv;
  char* const* envp;
  const char* path;
  int group_dir = -1;   // a cgroup2 directory among req.fds: the group the command starts in
  bool joined = false;  // the clone put the child in that group already
  volatile int err = 0;
  volatile int stage = 0;
};

// The child's side of a start, up to the exec. Runs on dsec-init's memory (vfork, or a clone with CLONE_VM), so it
// allocates nothing and never returns.
[[noreturn]] int run_child(void* arg) {
  ChildStart& c = *static_cast<ChildStart*>(arg);
  const StartRequest& req = c.req;
  auto fail = [&](FailStage stage) {
    c.err = errno;
    c.stage = static_cast<int>(stage);
    _exit(127);
  };
  setsid();
  if (!c.joined) {
    for (std::size_t i = 3; i < req.fds.size(); ++i) {
      if (req.fds[i] == c.group_dir) continue;
      if (write(req.fds[i], "0", 1) != 1) fail(FailStage::kCgroup);
    }
  }
  // dsec-init is shielded from the OOM killer; its commands are not.
  int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
  if (oom >= 0) {
    (void)write(oom, "0", 1);
    close(oom);
  }
  if (dup2(req.fds[0], 0) < 0 || dup2(req.fds[1], 1) < 0 || dup2(req.fds[2], 2) < 0) fail(FailStage::kRequest);
  if (req.controlling_tty && ioctl(0, TIOCSCTTY, 0) != 0) fail(FailStage::kRequest);
  close_range(3, ~0u, 0);
  for (int sig = 1; sig < NSIG; ++sig) signal(sig, SIG_DFL);
  sigprocmask(SIG_SETMASK, &c.original_mask, nullptr);
  if (!become_user(req)) fail(FailStage::kUser);
  // As the user: a directory it may not enter fails here, as it would for a login.
  if (chdir(req.cwd.c_str()) != 0) fail(FailStage::kChdir);
  exec_search(c.argv[0], c.argv, c.envp, c.path);
  fail(FailStage::kExec);
  _exit(127);  // not reached: fail() exits, which the compiler cannot see through the lambda
}

}  // namespace

StartRequest start_request_of(init_protocol::StartPayload&& command, bool drop_capabilities) {
  StartRequest req;
  req.argv = std::move(command.argv);
  req.env = std::move(command.env);
  req.cwd = std::move(command.cwd);
  req.set_user = command.has_user;
  req.uid = command.uid;
  req.gid = command.gid;
  req.groups.assign(command.groups.begin(), command.groups.end());
  req.drop_capabilities = drop_capabilities;
  return req;
}

void close_all(std::vector<int>& fds) {
  for (int fd : fds)
    if (fd >= 0) close(fd);
  fds.clear();
}

// Starts the command; returns its pid, or -1 with `err` and `stage` saying why not.
pid_t start_command(StartRequest& req, const sigset_t& original_mask, int& err, FailStage& stage) {
  std::vector<char*> argv, envp;
  for (auto& a : req.argv) argv.push_back(a.data());
  argv.push_back(nullptr);
  ChildStart child{req, original_mask, argv.data(), envp.data(), kDefaultPath};
  for (auto& e : req.env) {
    envp.push_back(e.data());
    if (e.rfind("PATH=", 0) == 0) child.path = e.c_str() + 5;
  }
  envp.push_back(nullptr);
  child.envp = envp.data();

  // The command's cgroup: a cgroup2 directory among the descriptors is joined by the clone itself; where that is
  // refused, or there is none, the child writes "0" to the cgroup.procs descriptors.
  for (std::size_t i = 3; i < req.fds.size(); ++i)
    if (is_cgroup2_dir(req.fds[i])) child.group_dir = req.fds[i];
  pid_t pid = -1;
  bool cloned = false;
  if (child.group_dir >= 0 && clone_into_cgroup_works) {
    child.joined = true;
    long r = clone_vfork_into(child.group_dir, &run_child, &child);
    if (r >= 0) {
      pid = static_cast<pid_t>(r);
      cloned = true;
    } else {
      child.joined = false;
      // An old kernel (ENOSYS, E2BIG) never will; a refusal (EACCES: a user namespace's root may not write the
      // group's cgroup.procs) is this sandbox's, so the next command tries again.
      if (r == -ENOSYS || r == -E2BIG) clone_into_cgroup_works = false;
    }
  }
  if (!cloned) {
    pid = vfork();
    if (pid == 0) run_child(&child);
  }
  if (pid < 0) {
    err = errno;
    stage = FailStage::kFork;
    return -1;
  }
  if (child.stage != 0) {
    // The child failed before exec and has exited; reap it here so no kExited is reported for it.
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    err = child.err;
    stage = static_cast<FailStage>(child.stage);
    return -1;
  }
  return pid;
}

}  // namespace dsec::init
