// One HTTP exchange's libcurl state, set up the same way for the blocking Transport (curl_easy_perform) and the
// AsyncTransport (a multi handle driven by one I/O thread). Keeps curl.h out of the header: handles are void*.
#pragma once

#include <cstdint>
#include <exception>
#include <memory>
#include <string>

#include "client/endpoint.hpp"
#include "client/transport.hpp"

namespace dsec::detail {

class CurlExchange {
 public:
  // Sets every option of `handle` (a CURL*, reset first) for `request` to `endpoint`, allowed `timeout_ms`. The
  // request's body, target and on_body must outlive the exchange, which must not move once made.
  CurlExchange(void* handle, const Endpoint& endpoint, const Credentials* credentials, const HttpRequest& request,
               long timeout_ms);
  ~CurlExchange();
  CurlExchange(const CurlExchange&) = delete;
  CurlExchange& operator=(const CurlExchange&) = delete;

  void* handle() const noexcept { return handle_; }
  // After the transfer ended with curl code `rc`: the answer, or the TransportError (or what on_body threw) to raise.
  HttpResponse finish(int rc);
  // New connections the transfer opened.
  std::uint64_t connects() const;

 private:
  struct State;
  void* handle_;
  const Endpoint& endpoint_;
  const HttpRequest& request_;
  std::unique_ptr<State> state_;
};

}  // namespace dsec::detail
