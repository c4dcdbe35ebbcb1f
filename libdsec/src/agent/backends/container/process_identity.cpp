#include "agent/backends/container/process_identity.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "common/wire/init_protocol.hpp"

namespace dsec::agent::container {

std::string boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(in, id);
  return id;
}

std::optional<std::uint64_t> process_start_time(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so fields are counted after the last ')'.
  auto paren = stat.rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  std::istringstream fields(stat.substr(paren + 1));
  std::string field;
  for (int i = 3; i <= 22; ++i) {
    if (!(fields >> field)) return std::nullopt;
    // A process that has exited and waits to be reaped (a killed agent whose parent has not waited for it yet)
    // holds nothing any more: as good as gone.
    if (i == 3 && (field == "Z" || field == "X" || field == "x")) return std::nullopt;
  }
  try {
    return std::stoull(field);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

bool process_in_cgroup(pid_t pid, const std::string& path, const std::string& version) {
  std::ifstream in(fmt::format("/proc/{}/cgroup", pid));
  std::string line;
  while (std::getline(in, line)) {
    auto first = line.find(':');
    auto second = line.find(':', first + 1);
    if (first == std::string::npos || second == std::string::npos) continue;
    std::string controllers = line.substr(first + 1, second - first - 1);
    bool wanted = false;
    if (version == "v2") {
      wanted = line.compare(0, first, "0") == 0 && controllers.empty();
    } else {
      std::istringstream cs(controllers);
      for (std::string c; std::getline(cs, c, ',');) wanted |= c == "pids";
    }
    // Its own group or one below it (init sits in an exec group of its sandbox between execs on cgroup v1).
    if (wanted) {
      const std::string at = line.substr(second + 1);
      return at == path || at.starts_with(path + "/");
    }
  }
  return false;
}

std::uint64_t netns_inode_of_pid(pid_t pid) {
  struct stat st {};
  if (::stat(fmt::format("/proc/{}/ns/net", pid).c_str(), &st) != 0) return 0;
  return st.st_ino;
}

std::uint64_t netns_inode_of_fd(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return 0;
  return st.st_ino;
}

bool probe_init(const std::string& socket_path, bool expect_answer, std::chrono::milliseconds timeout,
                std::string* why) {
  UniqueFd conn(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!conn) {
    *why = fmt::format("socket: {}", std::strerror(errno));
    return false;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket_path.size() >= sizeof addr.sun_path) {
    *why = fmt::format("{} is too long for a unix socket path", socket_path);
    return false;
  }
  std::strncpy(addr.sun_path, socket_path.c_str(), sizeof addr.sun_path - 1);
  if (retry_eintr([&] { return ::connect(conn.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr); }) != 0) {
    *why = fmt::format("connect to {}: {}", socket_path, std::strerror(errno));
    return false;
  }
  if (!expect_answer) return true;
  const std::uint32_t empty = 0;
  if (retry_eintr([&] { return ::send(conn.get(), &empty, sizeof empty, MSG_NOSIGNAL); }) != sizeof empty) {
    *why = fmt::format("send to {}: {}", socket_path, std::strerror(errno));
    return false;
  }
  init_protocol::Reply reply{};
  std::size_t got = 0;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (got < sizeof reply) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      *why = fmt::format("no answer on {} within {} ms", socket_path, timeout.count());
      return false;
    }
    pollfd p{conn.get(), POLLIN, 0};
    int rc = ::poll(&p, 1, static_cast<int>(left.count()));
    if (rc < 0 && errno != EINTR) {
      *why = fmt::format("poll {}: {}", socket_path, std::strerror(errno));
      return false;
    }
    if (rc <= 0) continue;
    ssize_t n = ::recv(conn.get(), reinterpret_cast<char*>(&reply) + got, sizeof reply - got, 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) {
      *why = fmt::format("{} closed without an answer", socket_path);
      return false;
    }
    got += static_cast<std::size_t>(n);
  }
  if (reply.type != init_protocol::ReplyType::kFailed ||
      reply.b != static_cast<std::int32_t>(init_protocol::FailStage::kRequest)) {
    *why =
        fmt::format("unexpected answer on {} (type {}, stage {})", socket_path, static_cast<int>(reply.type), reply.b);
    return false;
  }
  return true;
}

}  // namespace dsec::agent::container
