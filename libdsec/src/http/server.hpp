// dsecd's HTTP/1.1 server: a unix socket and/or a TCP listener, one thread per connection with Beast's synchronous
// parser (an exec blocks its connection for as long as it runs; Linux threads are cheap), keep-alive.
//
// Limits: at most max_connections at once (beyond: 503 UNAVAILABLE and close), headers up to max_header_bytes
// (beyond: 431), bodies up to max_body_bytes (beyond: 413), and a connection silent for idle_timeout while the agent
// waits to read from it or write to it is closed. A request Beast cannot parse gets 400 INVALID_ARGUMENT and its
// connection is closed; the server goes on serving the others. Every error body is the dsec error JSON.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/parser.hpp>

#include "common/unique_fd.hpp"
#include "http/http.hpp"
#include "http/server_events.hpp"
#include "http/tls.hpp"

namespace dsec::agent {

struct ServerOptions {
  std::filesystem::path unix_socket;  // empty: none
  std::string tcp_listen;             // "HOST:PORT", "[::1]:PORT", ":PORT" (all addresses); empty: none
  std::size_t max_connections = 4096;
  std::size_t max_header_bytes = 16u << 10;
  std::size_t max_body_bytes = 256u << 20;
  std::chrono::seconds idle_timeout{120};
  // TLS on the TCP listener (null: plain HTTP there, which dsecd allows only with --insecure-no-tls).
  std::shared_ptr<auth::TlsServerContext> tls;
  // Called with each request's header before its body is read (optional). An answer here (401 for a missing or
  // unknown token) is sent at once and the connection closed, its body never buffered: a caller that may not call
  // costs the server no body's memory.
  std::function<std::optional<HttpResponse>(const HttpRequest& header, const Peer& peer)> admit;
};

// Answers one request, with a returned response or through the stream. The server catches what escapes it
// (INTERNAL, or the end of the connection once a stream began), but the router answers its own errors.
using HttpHandler = std::function<HttpResponse(HttpRequest&, ResponseStream&, const Peer&)>;

class Server {
 public:
  Server(ServerOptions options, HttpHandler handler, ServerEvents& events);
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  ~Server();

  // Binds the listeners and starts accepting. Throws dsec::Error naming the address (in use, permission, ...).
  void start();
  // Stops accepting, removes the unix socket, and ends idle connections; requests being served run on and their
  // connections close after answering.
  void stop_accepting();
  // Waits until every connection thread has ended.
  void wait_connections();
  void stop() {
    stop_accepting();
    wait_connections();
  }

  // "127.0.0.1:43215" once listening on TCP (a port 0 in tcp_listen is resolved here); empty otherwise.
  const std::string& tcp_endpoint() const noexcept { return tcp_endpoint_; }
  std::size_t connections() const;

 private:
  void listen_unix();
  void listen_tcp();
  void accept_loop();
  void refuse(UniqueFd fd, bool tls);
  void remove_socket_file();  // only if the path is still the socket this server bound
  // One connection, request after request, on its own thread; and its steps.
  void serve(int fd, Peer peer);
  std::unique_ptr<auth::TlsSession> start_tls(int fd, Peer& peer, bool& serving);
  // Reads one request; `refused` is set instead when options_.admit answered its header.
  void read_request(FdStream& stream, boost::beast::flat_buffer& buffer,
                    boost::beast::http::request_parser<boost::beast::http::string_body>& parser, const Peer& peer,
                    std::optional<HttpResponse>& refused, boost::system::error_code& ec);
  bool answer_unreadable(FdStream& stream, const boost::system::error_code& ec);
  bool answer(FdStream& stream, HttpRequest& request, const Peer& peer);

  ServerOptions options_;
  HttpHandler handler_;
  ServerEvents& events_;

  std::vector<UniqueFd> listeners_;
  std::vector<bool> listener_tcp_;  // per listener: TCP (else the unix socket)
  UniqueFd wake_;                   // eventfd: wakes the accept loop to stop
  std::thread accept_thread_;
  std::string tcp_endpoint_;
  dev_t socket_dev_ = 0;  // the unix socket we bound, removed at stop only if still ours
  ino_t socket_ino_ = 0;

  mutable std::mutex mutex_;
  std::condition_variable idle_;
  std::unordered_set<int> open_;  // connection fds being served
  bool stopping_ = false;
  std::atomic<bool> started_{false};
};

}  // namespace dsec::agent
