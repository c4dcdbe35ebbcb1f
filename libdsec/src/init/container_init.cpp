// dsec-init in a container sandbox: pid 1 of its pid namespace, entered already confined (no_new_privs, the seccomp
// filter, and of all capabilities only CAP_SETUID, CAP_SETGID and CAP_SETPCAP, which it keeps permitted but not
// effective, to start commands as other users; every command gives them up before it execs). It reaps every process
// that ends inside the sandbox (orphans re-parent to it) and starts a command each time the agent asks over
// init.sock, so an exec costs one message and one fork+exec instead of a namespace entry. See init_protocol.hpp for
// the wire, and process_table.hpp for the processes it keeps (spawned commands and shell sessions).
#include <fcntl.h>
#include <linux/capability.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/wire/init_protocol.hpp"
#include "init/command_start.hpp"
#include "init/init_main.hpp"
#include "init/process_table.hpp"

namespace dsec::init {
namespace {

using init_protocol::FailStage;
using init_protocol::Reply;
using init_protocol::ReplyType;

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

// Reads a request's first u32 and the descriptors sent with it; false when the connection broke or sent too many.
bool read_head(int conn, std::uint32_t& first, std::vector<int>& fds) {
  char cbuf[CMSG_SPACE(sizeof(int) * dsec::init_protocol::kMaxPassedFds)];
  iovec iov{&first, sizeof first};
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
        fds.push_back(fd);
      }
    }
  }
  return got == sizeof first && !(msg.msg_flags & MSG_CTRUNC);
}

// Reads the rest of one StartRequest whose length came first; false on a malformed or truncated one.
bool read_request(int conn, std::uint32_t len, StartRequest& req) {
  if (len > dsec::init_protocol::kMaxRequestBytes || req.fds.size() < 3) return false;
  std::string payload(len, '\0');
  if (!read_exact(conn, payload.data(), len)) return false;

  dsec::init_protocol::StartPayload command;
  if (!dsec::init_protocol::decode_start_payload(payload, command)) return false;
  std::vector<int> fds = std::move(req.fds);
  req = start_request_of(std::move(command), /*drop_capabilities=*/true);
  req.fds = std::move(fds);
  return true;
}

// Reads the rest of a process request (process_protocol.hpp) and has the table serve it.
void serve_process_request(int conn, ProcessTable& table, std::vector<int>& fds) {
  std::uint32_t head[2];
  if (!read_exact(conn, reinterpret_cast<char*>(head), sizeof head) ||
      head[1] > dsec::process_protocol::kMaxPayloadBytes) {
    close_all(fds);
    close(conn);
    return;
  }
  std::string payload(head[1], '\0');
  if (!read_exact(conn, payload.data(), payload.size())) {
    close_all(fds);
    close(conn);
    return;
  }
  table.serve(static_cast<std::uint64_t>(conn), static_cast<dsec::process_protocol::Op>(head[0]), payload, fds);
}

// The capabilities dsec-init was started with (spawn.cpp: CAP_SETUID, CAP_SETGID, CAP_SETPCAP, ambient so that they
// survived its exec) stay permitted only: none is effective while it serves, and none is ambient or inheritable,
// so nothing it starts inherits one. A command's child raises them for its own switch to its user and then drops
// them all (command_start.cpp).
void hold_capabilities_permitted_only() {
  prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct caps[2]{};
  if (syscall(SYS_capget, &hdr, caps) != 0) return;
  for (auto& c : caps) c.effective = c.inheritable = 0;
  syscall(SYS_capset, &hdr, caps);
}

// Drains the signalfd `sfd` and reaps every child that ended: the table's own, and commands whose connection waits
// for their exit (told, then closed).
void reap_children(int sfd, ProcessTable& table, std::unordered_map<pid_t, int>& waiting) {
  signalfd_siginfo info;
  while (read(sfd, &info, sizeof info) == sizeof info) {
  }
  int status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    if (table.reaped(pid, status)) continue;
    auto it = waiting.find(pid);
    if (it == waiting.end()) continue;  // an orphan, or a background process: reaped, nobody to tell
    send_reply(it->second, ReplyType::kExited, status, 0);
    close(it->second);
    waiting.erase(it);
  }
}

// One connection of the agent: a process request for the table, or a command to start (its connection then waits
// in `waiting` for its exit).
void serve_connection(int conn, ProcessTable& table, const sigset_t& original_mask,
                      std::unordered_map<pid_t, int>& waiting) {
  timeval tv{10, 0};  // the agent sends its request at once; a stalled peer must not hold pid 1
  setsockopt(conn, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  StartRequest req;
  std::uint32_t first = 0;
  bool head = read_head(conn, first, req.fds);
  if (head && first == dsec::process_protocol::kMagic) {
    serve_process_request(conn, table, req.fds);
    return;
  }
  if (!head || !read_request(conn, first, req)) {
    send_reply(conn, ReplyType::kFailed, EINVAL, static_cast<std::int32_t>(FailStage::kRequest));
    close_all(req.fds);
    close(conn);
    return;
  }
  int err = 0;
  FailStage stage = FailStage::kRequest;
  pid_t pid = start_command(req, original_mask, err, stage);
  // A child that changed its ids made the memory it shared with us dumpable again, also one that failed
  // halfway (become_user resets it only once all ids are set).
  if (req.set_user) prctl(PR_SET_DUMPABLE, 0);
  close_all(req.fds);
  if (pid < 0) {
    send_reply(conn, ReplyType::kFailed, err, static_cast<std::int32_t>(stage));
    close(conn);
    return;
  }
  send_reply(conn, ReplyType::kStarted, pid, 0);
  waiting.emplace(pid, conn);
}

}  // namespace

int run_container_init() {
  using namespace dsec::init_protocol;
  hold_capabilities_permitted_only();
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
  ProcessTable table(
      original_mask, /*drop_capabilities=*/true,
      [](std::uint64_t conn, const std::string& reply) { send_process_reply(static_cast<int>(conn), reply); },
      /*tickets_are_fds=*/true);
  std::vector<pollfd> fds;
  for (;;) {
    fds.assign({{kListenFd, POLLIN, 0}, {sfd, POLLIN, 0}});
    table.poll_fds(fds);
    int n = poll(fds.data(), fds.size(), table.next_timeout_ms());
    if (n < 0) {
      if (errno == EINTR) continue;
      return 112;
    }
    table.poll_done(fds, 2);
    table.expire();
    if (fds[1].revents & POLLIN) {
      reap_children(sfd, table, waiting);
    }
    if (fds[0].revents & POLLIN) {
      int conn = accept4(kListenFd, nullptr, nullptr, SOCK_CLOEXEC);
      if (conn < 0) continue;
      serve_connection(conn, table, original_mask, waiting);
    }
  }
}

}  // namespace dsec::init
