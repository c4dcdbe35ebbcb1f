#include "agent/backends/container/init_socket.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "common/syscall.hpp"
#include "dsec/error.hpp"

namespace dsec::agent {

UniqueFd connect_init(const std::string& path, const std::string& sandbox_id) {
  UniqueFd conn(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!conn) throw_errno(errno, "socket");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  if (retry_eintr([&] { return ::connect(conn.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr); }) != 0)
    throw_errno(errno, fmt::format("connect to the init of sandbox {}", sandbox_id));
  return conn;
}

void send_init_request(int conn, const std::string& message, const std::vector<int>& fds) {
  ssize_t sent = send_with_fds(conn, message, fds);
  if (sent < 0) throw_errno(errno, "send a request to the sandbox's init");
  std::string_view rest(message);
  rest.remove_prefix(static_cast<std::size_t>(sent));
  while (!rest.empty()) {
    ssize_t n = retry_eintr([&] { return ::send(conn, rest.data(), rest.size(), MSG_NOSIGNAL); });
    if (n < 0) throw_errno(errno, "send a request to the sandbox's init");
    rest.remove_prefix(static_cast<std::size_t>(n));
  }
}

bool read_init_reply(int conn, void* into, std::size_t n, std::chrono::steady_clock::time_point deadline,
                     const std::function<bool()>& give_up) {
  char* p = static_cast<char*>(into);
  std::size_t got = 0;
  while (got < n) {
    auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (ms <= 0) return false;
    pollfd pfd{conn, POLLIN, 0};
    int rc = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(ms, give_up ? 200 : 1000)));
    if (rc < 0 && errno != EINTR) return false;
    if (rc <= 0) {
      if (give_up && give_up()) return false;
      continue;
    }
    ssize_t r = ::recv(conn, p + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    got += static_cast<std::size_t>(r);
  }
  return true;
}

std::string exchange_process_request(const std::string& socket_path, const std::string& sandbox_id,
                                     process_protocol::Op op, const std::string& payload, const std::vector<int>& fds,
                                     std::chrono::steady_clock::time_point deadline,
                                     const std::function<bool()>& give_up) {
  UniqueFd conn = connect_init(socket_path, sandbox_id);
  std::string message;
  std::uint32_t head[3] = {process_protocol::kMagic, static_cast<std::uint32_t>(op),
                           static_cast<std::uint32_t>(payload.size())};
  message.append(reinterpret_cast<const char*>(head), sizeof head);
  message += payload;
  send_init_request(conn.get(), message, fds);
  std::uint32_t len = 0;
  if (!read_init_reply(conn.get(), &len, sizeof len, deadline, give_up) || len > process_protocol::kMaxPayloadBytes)
    throw Error(Code::kUnavailable, fmt::format("sandbox {}: its init did not answer a process request", sandbox_id));
  std::string reply(len, '\0');
  if (!read_init_reply(conn.get(), reply.data(), len, deadline, give_up))
    throw Error(Code::kUnavailable, fmt::format("sandbox {}: its init did not answer a process request", sandbox_id));
  return reply;
}

}  // namespace dsec::agent
