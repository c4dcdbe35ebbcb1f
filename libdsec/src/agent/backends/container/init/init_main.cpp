// dsec-init: pid 1 of every container sandbox.
//
// It does two things: reaps every process that ends inside the sandbox (orphans re-parent to pid 1), and starts a
// command each time the agent asks over init.sock, so an exec costs one message and one fork+exec instead of a
// namespace entry. It is linked statically so that it needs nothing from the sandbox's image, and it is entered
// already confined: no capabilities, no_new_privs, the seccomp filter. See init_protocol.hpp for the wire.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "agent/backends/container/init/init_protocol.hpp"

namespace {

using dsec::init_protocol::FailStage;
using dsec::init_protocol::Reply;
using dsec::init_protocol::ReplyType;

constexpr const char* kDefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

struct StartRequest {
  std::vector<std::string> argv;
  std::vector<std::string> env;
  std::string cwd;
  std::vector<int> fds;  // stdin, stdout, stderr, cgroup.procs...
};

void close_all(std::vector<int>& fds) {
  for (int fd : fds)
    if (fd >= 0) close(fd);
  fds.clear();
}

void send_reply(int conn, ReplyType type, std::int32_t a, std::int32_t b) {
  Reply r{type, a, b};
  // The agent may be gone (restarted): never let that signal or block pid 1.
  (void)send(conn, &r, sizeof r, MSG_NOSIGNAL | MSG_DONTWAIT);
}

bool read_exact(int fd, char* out, std::size_t n) {
  while (n > 0) {
    ssize_t got = read(fd, out, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    out += got;
    n -= static_cast<std::size_t>(got);
  }
  return true;
}

// Reads one StartRequest; false on a malformed or truncated one.
bool read_request(int conn, StartRequest& req) {
  std::uint32_t len = 0;
  char cbuf[CMSG_SPACE(sizeof(int) * dsec::init_protocol::kMaxPassedFds)];
  iovec iov{&len, sizeof len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = cbuf;
  msg.msg_controllen = sizeof cbuf;
  ssize_t got;
  do {
    got = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  } while (got < 0 && errno == EINTR);
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      std::size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < n; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        req.fds.push_back(fd);
      }
    }
  }
  if (got != sizeof len || (msg.msg_flags & MSG_CTRUNC) || len > dsec::init_protocol::kMaxRequestBytes ||
      req.fds.size() < 3)
    return false;
  std::string payload(len, '\0');
  if (!read_exact(conn, payload.data(), len)) return false;

  std::size_t pos = 0;
  auto u32 = [&](std::uint32_t& v) {
    if (payload.size() - pos < 4) return false;
    std::memcpy(&v, payload.data() + pos, 4);
    pos += 4;
    return true;
  };
  auto str = [&](std::string& s) {
    std::uint32_t n;
    if (!u32(n) || payload.size() - pos < n) return false;
    s.assign(payload.data() + pos, n);
    pos += n;
    return s.find('\0') == std::string::npos;
  };
  std::uint32_t argc = 0, envc = 0;
  if (!u32(argc) || argc == 0 || argc > len) return false;
  req.argv.resize(argc);
  for (auto& a : req.argv)
    if (!str(a)) return false;
  if (!u32(envc) || envc > len) return false;
  req.env.resize(envc);
  for (auto& e : req.env)
    if (!str(e)) return false;
  return str(req.cwd) && pos == payload.size();
}

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

}  // namespace

int main() {
  using namespace dsec::init_protocol;
  // Nothing inside the sandbox may open our descriptors through /proc/1/fd.
  prctl(PR_SET_DUMPABLE, 0);

  sigset_t original_mask, mask;
  sigprocmask(SIG_SETMASK, nullptr, &original_mask);
  sigemptyset(&mask);
  sigaddset(&mask, SIGCHLD);
  sigprocmask(SIG_BLOCK, &mask, nullptr);
  sigdelset(&original_mask, SIGCHLD);
  int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  if (sfd < 0) return 111;
  fcntl(kListenFd, F_SETFD, FD_CLOEXEC);
  fcntl(kScratchFd, F_SETFD, FD_CLOEXEC);

  std::unordered_map<pid_t, int> waiting;  // command pid -> the agent connection awaiting its exit
  pollfd fds[2] = {{kListenFd, POLLIN, 0}, {sfd, POLLIN, 0}};
  for (;;) {
    int n = poll(fds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      return 112;
    }
    if (fds[1].revents & POLLIN) {
      signalfd_siginfo info;
      while (read(sfd, &info, sizeof info) == sizeof info) {
      }
      int status;
      pid_t pid;
      while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        auto it = waiting.find(pid);
        if (it == waiting.end()) continue;  // an orphan, or a background process: reaped, nobody to tell
        send_reply(it->second, ReplyType::kExited, status, 0);
        close(it->second);
        waiting.erase(it);
      }
    }
    if (fds[0].revents & POLLIN) {
      int conn = accept4(kListenFd, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      timeval tv{10, 0};  // the agent sends its request at once; a stalled peer must not hold pid 1
      setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
      StartRequest req;
      if (!read_request(conn, req)) {
        send_reply(conn, ReplyType::kFailed, EINVAL, static_cast<std::int32_t>(FailStage::kRequest));
        close_all(req.fds);
        close(conn);
        continue;
      }
      int err = 0;
      FailStage stage = FailStage::kRequest;
      pid_t pid = start_command(req, original_mask, err, stage);
      close_all(req.fds);
      if (pid < 0) {
        send_reply(conn, ReplyType::kFailed, err, static_cast<std::int32_t>(stage));
        close(conn);
        continue;
      }
      send_reply(conn, ReplyType::kStarted, pid, 0);
      waiting.emplace(pid, conn);
    }
  }
}
