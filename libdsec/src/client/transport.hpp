// HTTP to one node agent over libcurl. A Transport keeps a pool of curl easy handles; each handle keeps its
// connection alive between calls, so a trainer's steady stream of calls reuses a few connections instead of
// reconnecting, from any number of threads.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "client/endpoint.hpp"
#include "dsec/error.hpp"

namespace dsec::http::curl {
class HandlePool;
}

namespace dsec::detail {

using SteadyClock = std::chrono::steady_clock;

struct HttpRequest {
  std::string_view method = "GET";  // GET, POST, PUT, DELETE
  std::string target;               // "/v1/sandboxes/x?path=..." (already escaped)
  std::string_view body;            // not copied: must outlive the call
  std::string_view content_type;    // for a body
  // When set, the body of a 2xx answer is handed here piece by piece as it arrives instead of being collected
  // (other answers are still collected, to read their error). What it throws aborts the exchange and is rethrown
  // by send() as it was.
  std::function<void(std::string_view)> on_body;
};

inline HttpRequest http_request(std::string_view method, std::string target, std::string_view body = {},
                                std::string_view content_type = {}) {
  HttpRequest r;
  r.method = method;
  r.target = std::move(target);
  r.body = body;
  r.content_type = content_type;
  return r;
}

struct HttpResponse {
  long status = 0;
  std::string body;
  std::string content_type;
};

// A failure below HTTP: the agent could not be reached, the connection broke, or the deadline passed.
// maybe_sent tells whether the request could have reached the agent (curl got as far as sending it); a call that
// is not idempotent (exec) may only be retried when it is false.
class TransportError : public Error {
 public:
  TransportError(Code code, const std::string& message, bool retryable, bool maybe_sent)
      : Error(code, message, retryable), maybe_sent_(maybe_sent) {}
  bool maybe_sent() const noexcept { return maybe_sent_; }

 private:
  bool maybe_sent_;
};

struct TransportStats {
  std::uint64_t requests = 0;    // HTTP exchanges attempted
  std::uint64_t connects = 0;    // new connections opened for them (a reused connection counts 0)
  std::size_t idle_handles = 0;  // handles in the pool now
};

// Who the client is to the agents and whom it trusts: a bearer token sent on every request, the CA bundle that
// verifies an https:// agent's certificate (empty: the system's), a client certificate and key for agents that ask
// for one (mutual TLS).
struct Credentials {
  std::string token;
  std::string ca_file;
  std::string client_cert;
  std::string client_key;
};

class Transport {
 public:
  explicit Transport(Endpoint endpoint, std::shared_ptr<const Credentials> credentials = nullptr,
                     std::size_t max_idle_handles = 64);
  ~Transport();
  Transport(const Transport&) = delete;
  Transport& operator=(const Transport&) = delete;

  // One HTTP exchange. Returns any HTTP status (the caller decides what is an error); throws TransportError when
  // no response came back before `deadline` or the connection failed.
  HttpResponse send(const HttpRequest& request, SteadyClock::time_point deadline);

  const Endpoint& endpoint() const noexcept { return endpoint_; }
  const std::shared_ptr<const Credentials>& credentials() const noexcept { return credentials_; }
  TransportStats stats() const;

 private:
  Endpoint endpoint_;
  std::shared_ptr<const Credentials> credentials_;
  std::unique_ptr<http::curl::HandlePool> handles_;  // easy handles, each with its live connection
  std::atomic<std::uint64_t> requests_{0};
  std::atomic<std::uint64_t> connects_{0};
};

}  // namespace dsec::detail
