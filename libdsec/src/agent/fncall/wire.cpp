#include "agent/fncall/wire.hpp"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::fncall {
namespace {

constexpr std::size_t kMaxFds = 16;

void put_u32(char* out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
}

std::uint32_t get_u32(const char* in) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(static_cast<unsigned char>(in[i])) << (8 * i);
  return v;
}

void send_all(int sock, std::string_view data) {
  while (!data.empty()) {
    ssize_t n = retry_eintr([&] { return ::send(sock, data.data(), data.size(), MSG_NOSIGNAL); });
    if (n < 0) {
      if (errno == EPIPE || errno == ECONNRESET) throw Error(Code::kUnavailable, "fork server: the peer is gone");
      throw_errno(errno, "send to fork server");
    }
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

// Waits until the socket is readable or the deadline passes; false on the deadline (a deadline already past still
// looks once).
bool wait_readable(int sock, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    pollfd p{sock, POLLIN, 0};
    int rc = ::poll(&p, 1, ms <= 0 ? 0 : static_cast<int>(std::min<long long>(ms + 1, 1000)));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) throw_errno(errno, "poll fork server socket");
    if (ms <= 0 && rc == 0) return false;
  }
}

// Reads exactly `size` bytes into `out`; false when the deadline passes first.
bool read_exact(int sock, char* out, std::size_t size, std::chrono::steady_clock::time_point deadline) {
  std::size_t got = 0;
  while (got < size) {
    if (!wait_readable(sock, deadline)) return false;
    ssize_t n = retry_eintr([&] { return ::recv(sock, out + got, size - got, MSG_DONTWAIT); });
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n < 0) throw_errno(errno, "read from fork server");
    if (n == 0) throw Error(Code::kUnavailable, "fork server: the peer closed its socket mid-message");
    got += static_cast<std::size_t>(n);
  }
  return true;
}

}  // namespace

std::string Frame::text(const char* key, std::string fallback) const {
  if (!header.is_object()) return fallback;
  auto it = header.find(key);
  return it != header.end() && it->is_string() ? it->get<std::string>() : fallback;
}

std::optional<int> Frame::integer(const char* key) const {
  if (!header.is_object()) return std::nullopt;
  auto it = header.find(key);
  if (it == header.end()) return std::nullopt;
  if (it->is_number_unsigned()) {
    std::uint64_t v = it->get<std::uint64_t>();
    if (v <= static_cast<std::uint64_t>(INT_MAX)) return static_cast<int>(v);
  } else if (it->is_number_integer()) {
    std::int64_t v = it->get<std::int64_t>();
    if (v >= INT_MIN && v <= INT_MAX) return static_cast<int>(v);
  }
  return std::nullopt;
}

double Frame::number(const char* key, double fallback) const {
  if (!header.is_object()) return fallback;
  auto it = header.find(key);
  return it != header.end() && it->is_number() ? it->get<double>() : fallback;
}

void send_frame(int sock, const json& header, std::string_view blob, const std::vector<int>& fds) {
  if (fds.size() > kMaxFds) throw Error(Code::kInternal, "fork server frame: too many descriptors");
  std::string head = header.dump();
  std::string data(8, '\0');
  put_u32(data.data(), static_cast<std::uint32_t>(head.size()));
  put_u32(data.data() + 4, static_cast<std::uint32_t>(blob.size()));
  data += head;
  std::string_view rest(data);
  if (!fds.empty()) {
    ssize_t sent = send_with_fds(sock, data, fds);
    if (sent < 0) {
      if (errno == EPIPE || errno == ECONNRESET) throw Error(Code::kUnavailable, "fork server: the peer is gone");
      throw_errno(errno, "send to fork server");
    }
    rest.remove_prefix(static_cast<std::size_t>(sent));
  }
  send_all(sock, rest);
  send_all(sock, blob);
}

bool recv_frame(int sock, Frame& out, std::chrono::steady_clock::time_point deadline, bool* timed_out) {
  if (timed_out) *timed_out = false;
  out = Frame{};
  char prefix[8];
  std::size_t got = 0;
  while (got < sizeof prefix) {
    if (!wait_readable(sock, deadline)) {
      if (got != 0) throw Error(Code::kUnavailable, "fork server: a message stopped midway");
      if (timed_out) *timed_out = true;
      return false;
    }
    char cbuf[CMSG_SPACE(sizeof(int) * kMaxFds)]{};
    iovec iov{prefix + got, sizeof prefix - got};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf;
    msg.msg_controllen = sizeof cbuf;
    ssize_t n = retry_eintr([&] { return ::recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC); });
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) continue;
    if (n < 0) {
      if (errno == ECONNRESET && got == 0) return false;
      throw_errno(errno, "read from fork server");
    }
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
      std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (std::size_t i = 0; i < count; ++i) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
        out.fds.emplace_back(fd);
      }
    }
    if (n == 0) {
      if (got == 0) return false;
      throw Error(Code::kUnavailable, "fork server: the peer closed its socket mid-message");
    }
    got += static_cast<std::size_t>(n);
  }
  std::uint32_t head_len = get_u32(prefix), blob_len = get_u32(prefix + 4);
  if (head_len > kMaxFrameHeader || blob_len > kMaxFrameBlob)
    throw Error(Code::kInternal,
                fmt::format("fork server: a message of {} + {} bytes is too large", head_len, blob_len));
  std::string head(head_len, '\0');
  if (!read_exact(sock, head.data(), head.size(), deadline))
    throw Error(Code::kUnavailable, "fork server: a message stopped midway");
  // The blob grows as its bytes arrive: a length the peer (a process in the sandbox) only claims costs the agent at
  // most one step of memory, not kMaxFrameBlob.
  constexpr std::size_t kBlobStep = 1u << 20;
  while (out.blob.size() < blob_len) {
    std::size_t at = out.blob.size();
    std::size_t n = std::min<std::size_t>(blob_len - at, kBlobStep);
    out.blob.resize(at + n);
    if (!read_exact(sock, out.blob.data() + at, n, deadline))
      throw Error(Code::kUnavailable, "fork server: a message stopped midway");
  }
  try {
    out.header = json::parse(head);
  } catch (const json::exception& e) {
    throw Error(Code::kInternal, fmt::format("fork server: a message that is not JSON: {}", e.what()));
  }
  return true;
}

}  // namespace dsec::agent::fncall
