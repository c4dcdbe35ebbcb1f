#include "client/transport.hpp"

#include "client/curl_exchange.hpp"
#include "http/curl.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <cstring>
#include <exception>

#include <fmt/format.h>

namespace dsec::detail {
namespace {

using http::curl::set;
namespace curl = http::curl;

using std::chrono::duration_cast;
using std::chrono::milliseconds;

constexpr long kMaxConnectTimeoutMs = 10'000;

std::size_t append_body(char* data, std::size_t size, std::size_t count, void* user) {
  static_cast<std::string*>(user)->append(data, size * count);
  return size * count;
}

// Where a streamed answer's body goes: the request's sink for a 2xx answer, the response body otherwise.
struct BodySink {
  CURL* handle;
  const std::function<void(std::string_view)>* on_body;
  std::string* collected;
  std::exception_ptr error;  // what the sink threw; curl sees a failed write and stops
};

std::size_t stream_body(char* data, std::size_t size, std::size_t count, void* user) {
  auto* sink = static_cast<BodySink*>(user);
  const std::size_t n = size * count;
  long status = 0;
  curl_easy_getinfo(sink->handle, CURLINFO_RESPONSE_CODE, &status);
  if (status < 200 || status >= 300) {
    sink->collected->append(data, n);
    return n;
  }
  try {
    (*sink->on_body)(std::string_view(data, n));
    return n;
  } catch (...) {
    sink->error = std::current_exception();
    return 0;  // anything but n: curl aborts the transfer (and drops the connection)
  }
}

// How a curl failure reads to a dsec caller. Connection failures before anything was sent are the one case every
// call may retry; a broken connection after sending is retryable only for idempotent calls (the caller decides).
TransportError to_error(CURLcode rc, const char* detail, int os_errno, const Endpoint& ep, const HttpRequest& req,
                        bool sent) {
  std::string why = curl::describe(rc, detail);
  // curl words a unix socket failure as "port 80"; say what happened to the socket.
  if (rc == CURLE_COULDNT_CONNECT && !ep.unix_path.empty() && os_errno != 0)
    why = fmt::format("connect to {}: {}", ep.unix_path, std::strerror(os_errno));
  std::string what = fmt::format("{} {} on {}: {}", req.method, req.target, ep.text, why);
  switch (curl::classify(rc)) {
    case curl::Failure::kUnreachable:
      return TransportError(Code::kUnavailable, "agent unreachable: " + what, true, false);
    case curl::Failure::kTimedOut:
      return TransportError(Code::kDeadlineExceeded, "deadline exceeded: " + what, false, sent);
    case curl::Failure::kBroken:
      return TransportError(Code::kUnavailable, "connection to the agent broke: " + what, true, sent);
    case curl::Failure::kOutOfMemory:
      return TransportError(Code::kResourceExhausted, "out of memory: " + what, false, sent);
    case curl::Failure::kNotHttp:
    case curl::Failure::kUnsupportedProtocol:
      return TransportError(Code::kUnavailable, "the endpoint does not speak HTTP/1.1 like a dsec agent: " + what,
                            false, sent);
    case curl::Failure::kMalformedUrl:
      return TransportError(Code::kInvalidArgument, "malformed URL: " + what, false, false);
    default:
      return TransportError(Code::kUnknown, what, false, sent);
  }
}

}  // namespace

Transport::Transport(Endpoint endpoint, std::shared_ptr<const Credentials> credentials, std::size_t max_idle_handles)
    : endpoint_(std::move(endpoint)),
      credentials_(std::move(credentials)),
      handles_(std::make_unique<curl::HandlePool>(max_idle_handles)) {
  curl::global_init("the HTTP client");
}

Transport::~Transport() = default;

TransportStats Transport::stats() const {
  TransportStats s;
  s.requests = requests_.load();
  s.connects = connects_.load();
  s.idle_handles = handles_->idle();
  return s;
}

HttpResponse Transport::send(const HttpRequest& req, SteadyClock::time_point deadline) {
  auto remaining = duration_cast<milliseconds>(deadline - SteadyClock::now()).count();
  if (remaining <= 0)
    throw TransportError(
        Code::kDeadlineExceeded,
        fmt::format("deadline exceeded before {} {} on {} was sent", req.method, req.target, endpoint_.text), false,
        false);

  // The handle goes back to the pool on every path, keeping its connection for the next call.
  curl::HandlePool::Lease lease(*handles_);
  CURL* h = lease.get();

  CurlExchange exchange(h, endpoint_, credentials_.get(), req, static_cast<long>(remaining));
  requests_.fetch_add(1, std::memory_order_relaxed);
  CURLcode rc = curl_easy_perform(h);
  connects_.fetch_add(exchange.connects(), std::memory_order_relaxed);
  return exchange.finish(rc);
}

struct CurlExchange::State {
  char errbuf[CURL_ERROR_SIZE] = {0};
  std::string url;
  curl::HeaderList headers;
  HttpResponse response;
  BodySink sink{nullptr, nullptr, nullptr, nullptr};
};

CurlExchange::CurlExchange(void* handle, const Endpoint& endpoint, const Credentials* credentials,
                           const HttpRequest& req, long timeout_ms)
    : handle_(handle), endpoint_(endpoint), request_(req), state_(std::make_unique<State>()) {
  curl::global_init("the HTTP client");
  CURL* h = static_cast<CURL*>(handle);
  State& s = *state_;
  s.url = endpoint.base_url + req.target;
  s.headers.add("Expect:");  // no 100-continue round trip before uploads
  s.headers.add("Accept: application/json");
  if (!req.content_type.empty()) s.headers.add(fmt::format("Content-Type: {}", req.content_type));
  if (credentials && !credentials->token.empty()) s.headers.add("Authorization: Bearer " + credentials->token);

  curl::TransferOptions transfer{.url = s.url.c_str(),
                                 .unix_socket = endpoint.unix_path.c_str(),
                                 .user_agent = "dsec-client/0.1.0",
                                 .headers = &s.headers,
                                 .error_buffer = s.errbuf};
  if (credentials) {
    transfer.ca_file = credentials->ca_file.c_str();
    transfer.client_cert = credentials->client_cert.c_str();
    transfer.client_key = credentials->client_key.c_str();
  }
  curl::start_transfer(h, transfer);
  set(h, CURLOPT_TIMEOUT_MS, std::max<long>(timeout_ms, 1));
  set(h, CURLOPT_CONNECTTIMEOUT_MS, std::min<long>(std::max<long>(timeout_ms, 1), kMaxConnectTimeoutMs));
  s.sink = BodySink{h, &req.on_body, &s.response.body, nullptr};
  if (req.on_body) {
    set(h, CURLOPT_WRITEFUNCTION, &stream_body);
    set(h, CURLOPT_WRITEDATA, static_cast<void*>(&s.sink));
  } else {
    set(h, CURLOPT_WRITEFUNCTION, &append_body);
    set(h, CURLOPT_WRITEDATA, static_cast<void*>(&s.response.body));
  }
  if (req.method == "GET") {
    set(h, CURLOPT_HTTPGET, 1L);
  } else if (req.method == "POST" || req.method == "PUT") {
    set(h, CURLOPT_POST, 1L);
    set(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(req.body.size()));
    set(h, CURLOPT_POSTFIELDS, req.body.empty() ? "" : req.body.data());
    if (req.method == "PUT") set(h, CURLOPT_CUSTOMREQUEST, "PUT");
  } else if (req.method == "DELETE") {
    set(h, CURLOPT_CUSTOMREQUEST, "DELETE");
  } else {
    throw Error(Code::kInternal, fmt::format("unsupported HTTP method {}", req.method));
  }
}

CurlExchange::~CurlExchange() = default;

std::uint64_t CurlExchange::connects() const {
  long connects = 0;
  if (curl_easy_getinfo(static_cast<CURL*>(handle_), CURLINFO_NUM_CONNECTS, &connects) == CURLE_OK && connects > 0)
    return static_cast<std::uint64_t>(connects);
  return 0;
}

HttpResponse CurlExchange::finish(int code) {
  CURL* h = static_cast<CURL*>(handle_);
  const auto rc = static_cast<CURLcode>(code);
  State& s = *state_;
  if (s.sink.error) std::rethrow_exception(s.sink.error);
  if (rc != CURLE_OK) {
    // Conservative: the request may have reached the agent once curl was ready to send or sent any byte.
    long os_errno = 0;
    curl_easy_getinfo(h, CURLINFO_OS_ERRNO, &os_errno);
    throw to_error(rc, s.errbuf, static_cast<int>(os_errno), endpoint_, request_, curl::may_have_sent(h));
  }
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &s.response.status);
  char* ct = nullptr;
  if (curl_easy_getinfo(h, CURLINFO_CONTENT_TYPE, &ct) == CURLE_OK && ct) s.response.content_type = ct;
  return std::move(s.response);
}

}  // namespace dsec::detail
