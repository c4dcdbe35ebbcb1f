#include "agent/init/command_start.hpp"

#include <fcntl.h>
#include <linux/capability.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
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
  // volatile: read in the vfork child, which shares this frame.
  const char* volatile path = kDefaultPath;
  for (auto& e : req.env) {
    envp.push_back(e.data());
    if (e.rfind("PATH=", 0) == 0) path = e.c_str() + 5;
  }
  envp.push_back(nullptr);

  volatile int child_err = 0;
  volatile int child_stage = 0;
  pid_t pid = vfork();
  if (pid == 0) {
    setsid();
    for (std::size_t i = 3; i < req.fds.size(); ++i) {
      if (write(req.fds[i], "0", 1) != 1) {
        child_err = errno;
        child_stage = static_cast<int>(FailStage::kCgroup);
        _exit(127);
      }
    }
    // dsec-init is shielded from the OOM killer; its commands are not.
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom >= 0) {
      (void)write(oom, "0", 1);
      close(oom);
    }
    if (dup2(req.fds[0], 0) < 0 || dup2(req.fds[1], 1) < 0 || dup2(req.fds[2], 2) < 0) {
      child_err = errno;
      child_stage = static_cast<int>(FailStage::kRequest);
      _exit(127);
    }
    if (req.controlling_tty && ioctl(0, TIOCSCTTY, 0) != 0) {
      child_err = errno;
      child_stage = static_cast<int>(FailStage::kRequest);
      _exit(127);
    }
    close_range(3, ~0u, 0);
    for (int sig = 1; sig < NSIG; ++sig) signal(sig, SIG_DFL);
    sigprocmask(SIG_SETMASK, &original_mask, nullptr);
    if (!become_user(req)) {
      child_err = errno;
      child_stage = static_cast<int>(FailStage::kUser);
      _exit(127);
    }
    // As the user: a directory it may not enter fails here, as it would for a login.
    if (chdir(req.cwd.c_str()) != 0) {
      child_err = errno;
      child_stage = static_cast<int>(FailStage::kChdir);
      _exit(127);
    }
    exec_search(argv[0], argv.data(), envp.data(), path);
    child_err = errno;
    child_stage = static_cast<int>(FailStage::kExec);
    _exit(127);
  }
  if (pid < 0) {
    err = errno;
    stage = FailStage::kFork;
    return -1;
  }
  if (child_stage != 0) {
    // The child failed before exec and has exited; reap it here so no kExited is reported for it.
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    err = child_err;
    stage = static_cast<FailStage>(child_stage);
    return -1;
  }
  return pid;
}

}  // namespace dsec::init
