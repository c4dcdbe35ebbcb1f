// HTTP plumbing shared by the agent's server and router: the message types, and a blocking stream over a socket
// file descriptor that Beast's synchronous read/write drive. The stream reports the socket's SO_RCVTIMEO/SO_SNDTIMEO
// expiry as an error (asio's own sockets would wait again), which is what bounds an idle or stuck client.
#pragma once

#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <string>
#include <string_view>

#include <boost/asio/buffer.hpp>
#include <boost/asio/error.hpp>
#include <boost/beast/http/message.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/system/error_code.hpp>
#include <boost/system/system_error.hpp>

typedef struct ssl_st SSL;

namespace dsec::agent {

using HttpRequest = boost::beast::http::request<boost::beast::http::string_body>;
using HttpResponse = boost::beast::http::response<boost::beast::http::string_body>;

// Lets a handler answer with a body it produces while it runs: the status line and headers first, then pieces sent
// as chunks (chunked transfer encoding) as soon as they are written. The server ends the body when the handler
// returns; a handler that began a stream has its returned response ignored.
class ResponseStream {
 public:
  virtual ~ResponseStream() = default;
  // Sends `head`'s status line and headers (its body is ignored). At most once per request.
  virtual void begin(HttpResponse head) = 0;
  virtual bool begun() const noexcept = 0;
  // Sends one chunk now. False once the client is gone, or stopped reading for the idle timeout or until
  // `give_up_at` (whichever comes first): the rest is dropped, never an exception, so the handler can finish.
  virtual bool write(std::string_view data, std::chrono::steady_clock::time_point give_up_at =
                                                std::chrono::steady_clock::time_point::max()) = 0;
  // Whether the client has closed its side of the connection (it can no longer read an answer), looked at now.
  virtual bool client_gone() const { return false; }
};

// Beast (Boost 1.74) speaks boost::string_view; the agent speaks std::string_view.
inline std::string_view std_view(boost::beast::string_view s) noexcept { return {s.data(), s.size()}; }
inline boost::beast::string_view beast_view(std::string_view s) noexcept { return {s.data(), s.size()}; }

// Where a request came from: the unix socket (access by the socket file's mode) or TCP, through TLS or not, and the
// client certificate's subject when the client presented one.
struct Peer {
  bool tcp = false;
  bool tls = false;
  std::string address;         // "10.0.0.7:51234" for TCP, "unix" for the socket
  std::string client_subject;  // "/CN=trainer-3/O=lab" with mutual TLS, else empty
};

// Reading and writing through a TLS session over a blocking socket (http/tls.cpp): bytes moved, with `ec`
// set as for the plain socket (eof once the peer closed, ETIMEDOUT when the socket's timeout passed).
std::size_t tls_read(SSL* ssl, void* data, std::size_t size, boost::system::error_code& ec);
std::size_t tls_write(SSL* ssl, const void* data, std::size_t size, boost::system::error_code& ec);

// A connected socket as a Beast SyncReadStream and SyncWriteStream, plain or through a TLS session. Owns neither.
class FdStream {
 public:
  explicit FdStream(int fd, SSL* tls = nullptr) noexcept : fd_(fd), tls_(tls) {}
  int fd() const noexcept { return fd_; }

  template <typename MutableBufferSequence>
  std::size_t read_some(const MutableBufferSequence& buffers, boost::system::error_code& ec) {
    iovec iov[kMaxIov];
    int n = 0;
    for (auto it = boost::asio::buffer_sequence_begin(buffers);
         it != boost::asio::buffer_sequence_end(buffers) && n < kMaxIov; ++it) {
      boost::asio::mutable_buffer b(*it);
      if (b.size() == 0) continue;
      iov[n++] = iovec{b.data(), b.size()};
    }
    ec = {};
    if (n == 0) return 0;
    if (tls_) return tls_read(tls_, iov[0].iov_base, iov[0].iov_len, ec);
    ssize_t r;
    do {
      r = ::readv(fd_, iov, n);
    } while (r < 0 && errno == EINTR);
    if (r < 0) {
      ec = error_from_errno(errno);
      return 0;
    }
    if (r == 0) {
      ec = boost::asio::error::eof;
      return 0;
    }
    return static_cast<std::size_t>(r);
  }

  template <typename MutableBufferSequence>
  std::size_t read_some(const MutableBufferSequence& buffers) {
    boost::system::error_code ec;
    std::size_t n = read_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

  template <typename ConstBufferSequence>
  std::size_t write_some(const ConstBufferSequence& buffers, boost::system::error_code& ec) {
    iovec iov[kMaxIov];
    int n = 0;
    for (auto it = boost::asio::buffer_sequence_begin(buffers);
         it != boost::asio::buffer_sequence_end(buffers) && n < kMaxIov; ++it) {
      boost::asio::const_buffer b(*it);
      if (b.size() == 0) continue;
      iov[n++] = iovec{const_cast<void*>(b.data()), b.size()};
    }
    ec = {};
    if (n == 0) return 0;
    if (tls_) return tls_write(tls_, iov[0].iov_base, iov[0].iov_len, ec);
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<std::size_t>(n);
    ssize_t r;
    do {
      r = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    } while (r < 0 && errno == EINTR);
    if (r < 0) {
      ec = error_from_errno(errno);
      return 0;
    }
    return static_cast<std::size_t>(r);
  }

  template <typename ConstBufferSequence>
  std::size_t write_some(const ConstBufferSequence& buffers) {
    boost::system::error_code ec;
    std::size_t n = write_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

 private:
  static constexpr int kMaxIov = 16;

  // A blocking socket whose timeout expired reports EAGAIN; call it what it is.
  static boost::system::error_code error_from_errno(int err) {
    if (err == EAGAIN || err == EWOULDBLOCK) err = ETIMEDOUT;
    return {err, boost::system::system_category()};
  }

  int fd_;
  SSL* tls_;
};

}  // namespace dsec::agent
