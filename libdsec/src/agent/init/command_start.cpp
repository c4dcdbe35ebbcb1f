#include "agent/init/command_start.hpp"

#include <fcntl.h>
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

}  // namespace

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
    close_range(3, ~0u, 0);
    for (int sig = 1; sig < NSIG; ++sig) signal(sig, SIG_DFL);
    sigprocmask(SIG_SETMASK, &original_mask, nullptr);
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
