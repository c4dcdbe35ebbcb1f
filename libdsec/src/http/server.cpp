#include "http/server.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/chunk_encode.hpp>
#include <boost/beast/http/empty_body.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/serializer.hpp>
#include <boost/beast/http/write.hpp>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"
#include "dsec/version.hpp"

namespace dsec::agent {
namespace http = boost::beast::http;

namespace {

constexpr int kBacklog = 1024;

void set_timeouts(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

HttpResponse error_response(const Error& error, int status) {
  HttpResponse res{static_cast<http::status>(status), 11};
  res.set(http::field::content_type, "application/json");
  res.body() = protocol::encode_error(error).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return res;
}

// After an error answer the request's remaining bytes are unread; closing now would make the kernel reset the
// connection and the client could lose the answer. Half-close, then read and drop what still comes, briefly.
void linger_close(int fd) {
  ::shutdown(fd, SHUT_WR);
  set_timeouts(fd, std::chrono::milliseconds{500});
  char buf[16384];
  std::size_t total = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{2};
  while (total < (16u << 20) && std::chrono::steady_clock::now() < deadline) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0 && !(n < 0 && errno == EINTR)) break;
    if (n > 0) total += static_cast<std::size_t>(n);
  }
}

std::string endpoint_string(const sockaddr_storage& addr) {
  char host[INET6_ADDRSTRLEN] = {};
  if (addr.ss_family == AF_INET6) {
    const auto& a = reinterpret_cast<const sockaddr_in6&>(addr);
    ::inet_ntop(AF_INET6, &a.sin6_addr, host, sizeof host);
    return fmt::format("[{}]:{}", host, ntohs(a.sin6_port));
  }
  const auto& a = reinterpret_cast<const sockaddr_in&>(addr);
  ::inet_ntop(AF_INET, &a.sin_addr, host, sizeof host);
  return fmt::format("{}:{}", host, ntohs(a.sin_port));
}

// A response body written while the handler runs, as chunks on the connection's socket. After a failed write
// (the client went away, or stopped reading for the idle timeout) every later write is dropped at once.
class ChunkedStream final : public ResponseStream {
 public:
  ChunkedStream(FdStream& stream, unsigned version, std::chrono::milliseconds idle_timeout,
                std::function<bool()> keep_alive)
      : stream_(stream), version_(version), idle_timeout_(idle_timeout), keep_alive_(std::move(keep_alive)) {}

  void begin(HttpResponse head) override {
    if (begun_) throw Error(Code::kInternal, "a streamed response began twice");
    begun_ = true;
    keep_ = keep_alive_();
    http::response<http::empty_body> res;
    static_cast<http::response_header<>&>(res) = std::move(head.base());
    res.version(version_);
    res.keep_alive(keep_);
    res.set(http::field::server, fmt::format("dsecd/{}", kVersion));
    res.chunked(true);
    http::response_serializer<http::empty_body> serializer(res);
    boost::system::error_code ec;
    http::write_header(stream_, serializer, ec);
    ok_ = !ec;
  }

  bool begun() const noexcept override { return begun_; }

  bool client_gone() const override {
    pollfd p{stream_.fd(), POLLRDHUP, 0};
    return ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
  }

  bool write(std::string_view data, std::chrono::steady_clock::time_point give_up_at) override {
    if (!begun_) throw Error(Code::kInternal, "a streamed response wrote a chunk before its head");
    if (!ok_ || data.empty()) return ok_;
    std::string frame = fmt::format("{:x}\r\n", data.size());
    frame.append(data);
    frame += "\r\n";
    // A client that stops reading must not hold the handler past give_up_at (an exec's deadline): each send's
    // timeout is what is left until then when that is shorter than the idle timeout.
    const bool limited = give_up_at != std::chrono::steady_clock::time_point::max();
    bool shortened = false;
    std::string_view left = frame;
    while (!left.empty()) {
      if (limited) {
        // Past the limit a client still gets what its socket takes at once (a reading client always does).
        auto remaining = std::max(
            std::chrono::duration_cast<std::chrono::milliseconds>(give_up_at - std::chrono::steady_clock::now()),
            std::chrono::milliseconds{10});
        if (remaining < idle_timeout_) {
          set_send_timeout(remaining);
          shortened = true;
        }
      }
      boost::system::error_code ec;
      std::size_t n = stream_.write_some(boost::asio::const_buffer(left.data(), left.size()), ec);
      if (ec) {
        ok_ = false;
        break;
      }
      left.remove_prefix(n);
    }
    if (shortened) set_send_timeout(idle_timeout_);
    return ok_;
  }

  // Ends the body. True when the connection is still good for another request.
  bool finish() {
    if (!ok_) return false;
    boost::system::error_code ec;
    boost::asio::write(stream_, http::make_chunk_last(), ec);
    return !ec && keep_;
  }

 private:
  void set_send_timeout(std::chrono::milliseconds timeout) {
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((timeout.count() % 1000) * 1000);
    ::setsockopt(stream_.fd(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  }

  FdStream& stream_;
  unsigned version_;
  std::chrono::milliseconds idle_timeout_;
  std::function<bool()> keep_alive_;
  bool begun_ = false;
  bool ok_ = true;
  bool keep_ = false;
};

// Writes a whole (not streamed) answer with the server's name; true when it went out.
bool write_answer(FdStream& stream, HttpResponse& res, bool keep_alive) {
  res.keep_alive(keep_alive);
  res.set(http::field::server, fmt::format("dsecd/{}", kVersion));
  res.prepare_payload();
  boost::system::error_code ec;
  http::write(stream, res, ec);
  return !ec;
}

}  // namespace

Server::Server(ServerOptions options, HttpHandler handler, ServerEvents& events)
    : options_(std::move(options)), handler_(std::move(handler)), events_(events) {}

Server::~Server() {
  if (started_) stop();
}

std::size_t Server::connections() const {
  std::lock_guard lock(mutex_);
  return open_.size();
}

void Server::start() {
  if (options_.unix_socket.empty() && options_.tcp_listen.empty())
    throw Error(Code::kInvalidArgument, "the agent needs a unix socket or a TCP address to listen on");
  wake_.reset(::eventfd(0, EFD_CLOEXEC));
  if (!wake_) throw_errno(errno, "eventfd");
  try {
    if (!options_.unix_socket.empty()) listen_unix();
    if (!options_.tcp_listen.empty()) listen_tcp();
  } catch (...) {
    listeners_.clear();
    remove_socket_file();
    throw;
  }
  started_ = true;
  accept_thread_ = std::thread([this] { accept_loop(); });
}

void Server::listen_unix() {
  const std::string path = options_.unix_socket.string();
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path)
    throw Error(Code::kInvalidArgument,
                fmt::format("unix socket path {} is longer than {} bytes", path, sizeof addr.sun_path - 1));
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);

  if (options_.unix_socket.has_parent_path()) {
    std::error_code ec;
    std::filesystem::create_directories(options_.unix_socket.parent_path(), ec);
    if (ec)
      throw Error(code_for_errno(ec.value()),
                  fmt::format("create {}: {}", options_.unix_socket.parent_path().string(), ec.message()));
  }
  // A socket file left by an agent that died is replaced; one that still answers belongs to a live agent.
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) throw Error(Code::kAlreadyExists, fmt::format("{} exists and is not a socket", path));
    UniqueFd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (probe && ::connect(probe.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0)
      throw Error(Code::kAlreadyExists, fmt::format("another agent is listening on {}", path));
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) throw_errno_fmt(errno, "remove stale socket {}", path);
  }

  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw_errno(errno, "socket(AF_UNIX)");
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    throw_errno_fmt(errno, "bind unix socket {}", path);
  if (::listen(fd.get(), kBacklog) != 0) throw_errno_fmt(errno, "listen on {}", path);
  if (::stat(path.c_str(), &st) == 0) {
    socket_dev_ = st.st_dev;
    socket_ino_ = st.st_ino;
  }
  listeners_.push_back(std::move(fd));
  listener_tcp_.push_back(false);
}

void Server::listen_tcp() {
  const std::string& spec = options_.tcp_listen;
  std::string host, port;
  if (!spec.empty() && spec.front() == '[') {
    auto close = spec.find(']');
    if (close == std::string::npos || close + 1 >= spec.size() || spec[close + 1] != ':')
      throw Error(Code::kInvalidArgument, fmt::format("listen address '{}' is not [IPV6]:PORT", spec));
    host = spec.substr(1, close - 1);
    port = spec.substr(close + 2);
  } else {
    auto colon = spec.rfind(':');
    if (colon == std::string::npos)
      throw Error(Code::kInvalidArgument, fmt::format("listen address '{}' is not HOST:PORT", spec));
    host = spec.substr(0, colon);
    port = spec.substr(colon + 1);
  }
  if (port.empty() || port.find_first_not_of("0123456789") != std::string::npos || std::stoul(port) > 65535)
    throw Error(Code::kInvalidArgument, fmt::format("listen address '{}': '{}' is not a port", spec, port));

  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* result = nullptr;
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &result);
  if (rc != 0) throw Error(Code::kInvalidArgument, fmt::format("listen address '{}': {}", spec, ::gai_strerror(rc)));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(result, ::freeaddrinfo);

  int last_errno = 0;
  for (addrinfo* ai = result; ai; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), kBacklog) != 0) {
      last_errno = errno;
      continue;
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) == 0) tcp_endpoint_ = endpoint_string(bound);
    listeners_.push_back(std::move(fd));
    listener_tcp_.push_back(true);
    return;
  }
  throw_errno_fmt(last_errno ? last_errno : EADDRNOTAVAIL, "listen on {}", spec);
}

void Server::accept_loop() {
  std::vector<pollfd> fds;
  for (const auto& l : listeners_) fds.push_back(pollfd{l.get(), POLLIN, 0});
  fds.push_back(pollfd{wake_.get(), POLLIN, 0});
  for (;;) {
    int n = ::poll(fds.data(), fds.size(), -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      log_warn("poll on listeners: {}", std::strerror(errno));
      return;
    }
    if (fds.back().revents) return;
    for (std::size_t i = 0; i + 1 < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      sockaddr_storage from{};
      socklen_t from_len = sizeof from;
      UniqueFd conn(::accept4(fds[i].fd, reinterpret_cast<sockaddr*>(&from), &from_len, SOCK_CLOEXEC));
      if (!conn) {
        if (errno == EMFILE || errno == ENFILE) {
          log_warn("accept: {}; waiting for connections to close", std::strerror(errno));
          std::this_thread::sleep_for(std::chrono::milliseconds{100});
        }
        continue;
      }
      int fd = conn.get();
      Peer peer;
      peer.tcp = listener_tcp_[i];
      peer.tls = peer.tcp && options_.tls != nullptr;
      peer.address = peer.tcp ? endpoint_string(from) : "unix";
      // Answers go out as they are written (a stream's pieces, a head before its body): without this the kernel holds
      // a small write back until the client's delayed ACK, 40 ms on Linux.
      if (peer.tcp) {
        const int one = 1;
        ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      }
      {
        std::lock_guard lock(mutex_);
        if (stopping_) return;
        if (open_.size() >= options_.max_connections) {
          events_.connection_refused();
          refuse(std::move(conn), peer.tls);
          continue;
        }
        open_.insert(fd);
      }
      events_.connection_opened();
      try {
        std::thread([this, fd, peer] { serve(fd, peer); }).detach();
        conn.release();  // the connection thread closes it
      } catch (const std::system_error& e) {
        log_warn("cannot start a connection thread: {}", e.what());
        {
          std::lock_guard lock(mutex_);
          open_.erase(fd);
        }
        events_.connection_closed();
        refuse(std::move(conn), peer.tls);
      }
    }
  }
}

// Beyond max_connections: one short answer from the accept thread, which must not block on a slow client.
void Server::refuse(UniqueFd fd, bool tls) {
  // A TLS client would read a plain answer as a broken handshake; it gets the connection closed instead.
  if (tls) return;
  set_timeouts(fd.get(), std::chrono::milliseconds{100});
  Error error(Code::kUnavailable,
              fmt::format("the agent is serving its maximum of {} connections; retry later", options_.max_connections));
  HttpResponse res = error_response(error, http_status(error.code()));
  FdStream stream(fd.get());
  write_answer(stream, res, false);
  char buf[4096];
  while (::recv(fd.get(), buf, sizeof buf, MSG_DONTWAIT) > 0) {
  }
  events_.count_request("unrouted", "-", res.result_int());
}

// A TCP connection's TLS handshake, on the connection's own thread. Null with `serving` false when it failed.
std::unique_ptr<auth::TlsSession> Server::start_tls(int fd, Peer& peer, bool& serving) {
  std::unique_ptr<auth::TlsSession> tls;
  try {
    tls = std::make_unique<auth::TlsSession>(*options_.tls, fd);
    std::string why;
    if (tls->accept(why)) {
      peer.client_subject = tls->peer_subject();
    } else {
      events_.tls_handshake_failed();
      serving = false;
    }
  } catch (const std::exception& e) {
    log_warn("TLS connection from {}: {}", peer.address, e.what());
    serving = false;
  }
  return tls;
}

// Reads one request: its header, a 100 Continue where the client waits for one, then its body.
void Server::read_request(FdStream& stream, boost::beast::flat_buffer& buffer,
                          http::request_parser<http::string_body>& parser, const Peer& peer,
                          std::optional<HttpResponse>& refused, boost::system::error_code& ec) {
  parser.header_limit(static_cast<std::uint32_t>(std::min<std::size_t>(options_.max_header_bytes, UINT32_MAX)));
  parser.body_limit(static_cast<std::uint64_t>(options_.max_body_bytes));
  http::read_header(stream, buffer, parser, ec);
  if (ec) return;
  if (options_.admit) {
    refused = options_.admit(parser.get(), peer);
    if (refused) return;
  }
  if (parser.is_done()) return;
  if (boost::beast::iequals(parser.get()[http::field::expect], "100-continue")) {
    static constexpr std::string_view kContinue = "HTTP/1.1 100 Continue\r\n\r\n";
    boost::asio::const_buffer b(kContinue.data(), kContinue.size());
    while (b.size() > 0 && !ec) b += stream.write_some(b, ec);
  }
  if (!ec) http::read(stream, buffer, parser, ec);
}

// A request the parser refused gets an answer (431, 413, 400) and the connection closes after it; between requests,
// end of stream and timeouts simply end the connection, and mid-request so does a client that went away. True when
// an answer was sent (the connection then lingers, so the client reads it).
bool Server::answer_unreadable(FdStream& stream, const boost::system::error_code& ec) {
  std::optional<std::pair<int, Error>> answer;
  if (ec == http::error::header_limit) {
    answer.emplace(431, Error(Code::kResourceExhausted,
                              fmt::format("request header larger than {} bytes", options_.max_header_bytes), false));
  } else if (ec == http::error::body_limit) {
    answer.emplace(413, Error(Code::kResourceExhausted,
                              fmt::format("request body larger than {} bytes (the agent's max body size)",
                                          options_.max_body_bytes),
                              false));
  } else if (ec.category() == http::make_error_code(http::error::bad_target).category() &&
             ec != http::error::end_of_stream && ec != http::error::partial_message) {
    answer.emplace(400, Error(Code::kInvalidArgument, fmt::format("malformed HTTP request: {}", ec.message())));
  }
  if (!answer) return false;
  HttpResponse res = error_response(answer->second, answer->first);
  write_answer(stream, res, false);
  events_.count_request("unrouted", "-", answer->first);
  return true;
}

// Hands one request to the handler and writes its answer (or finishes the stream it began). False when the
// connection ends here.
bool Server::answer(FdStream& stream, HttpRequest& request, const Peer& peer) {
  auto keep_alive = [&] {
    std::lock_guard lock(mutex_);
    return request.keep_alive() && !stopping_;
  };
  ChunkedStream streamed(stream, request.version(),
                         std::chrono::duration_cast<std::chrono::milliseconds>(options_.idle_timeout), keep_alive);
  HttpResponse res;
  try {
    res = handler_(request, streamed, peer);
  } catch (const std::exception& e) {
    if (streamed.begun()) {
      // Too late for an error status: cut the body short, which the client sees as a broken response.
      log_warn("streamed response to {} ended by an error: {}", std_view(request.target()), e.what());
      return false;
    }
    res = error_response(Error(Code::kInternal, e.what()), 500);
  }
  if (streamed.begun()) return streamed.finish();
  const bool keep = keep_alive();
  res.version(request.version());
  return write_answer(stream, res, keep) && keep;
}

void Server::serve(int fd, Peer peer) {
  set_timeouts(fd, std::chrono::duration_cast<std::chrono::milliseconds>(options_.idle_timeout));
  std::unique_ptr<auth::TlsSession> tls;
  bool serving = true;
  if (peer.tls) tls = start_tls(fd, peer, serving);
  FdStream stream(fd, tls ? tls->get() : nullptr);
  boost::beast::flat_buffer buffer;
  bool linger = false;
  while (serving) {
    http::request_parser<http::string_body> parser;
    boost::system::error_code ec;
    std::optional<HttpResponse> refused;
    read_request(stream, buffer, parser, peer, refused, ec);
    if (ec) {
      linger = answer_unreadable(stream, ec);
      break;
    }
    if (refused) {
      // The answer admit gave from the header; the connection ends, its body never read.
      refused->version(parser.get().version());
      write_answer(stream, *refused, false);
      linger = true;  // the unread body is drained and dropped while the client reads the answer
      break;
    }
    HttpRequest request = parser.release();
    if (!answer(stream, request, peer)) break;
  }
  if (tls && serving) tls->shutdown();
  if (linger) linger_close(fd);
  tls.reset();
  // Counted before the connection leaves open_: once open_ is empty, stop() may return and the server go, so this
  // thread touches no member after the block below.
  events_.connection_closed();
  {
    std::lock_guard lock(mutex_);
    open_.erase(fd);
    ::close(fd);  // under the lock, so stop_accepting never shuts down a reused descriptor number
    if (open_.empty()) idle_.notify_all();
  }
}

void Server::stop_accepting() {
  {
    std::lock_guard lock(mutex_);
    if (stopping_) return;
    stopping_ = true;
    // Readers blocked between requests see end of stream; handlers running now still write their answer.
    for (int fd : open_) ::shutdown(fd, SHUT_RD);
  }
  if (wake_) {
    std::uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(wake_.get(), &one, sizeof one);
  }
  if (accept_thread_.joinable()) accept_thread_.join();
  listeners_.clear();
  remove_socket_file();
}

void Server::remove_socket_file() {
  if (socket_ino_ == 0) return;
  struct stat st {};
  const std::string path = options_.unix_socket.string();
  if (::lstat(path.c_str(), &st) == 0 && st.st_dev == socket_dev_ && st.st_ino == socket_ino_) ::unlink(path.c_str());
  socket_ino_ = 0;
}

void Server::wait_connections() {
  std::unique_lock lock(mutex_);
  idle_.wait(lock, [&] { return open_.empty(); });
  started_ = false;
}

}  // namespace dsec::agent
