#include "client/transport.hpp"

#include <curl/curl.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <mutex>

#include <fmt/format.h>

namespace dsec::detail {
namespace {

using std::chrono::duration_cast;
using std::chrono::milliseconds;

constexpr long kMaxConnectTimeoutMs = 10'000;

void global_init_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
      throw Error(Code::kInternal, "curl_global_init failed: the HTTP client cannot start");
  });
}

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

// Sets an option whose failure means curl itself is unusable (out of memory, a feature compiled out).
template <typename T>
void set(CURL* h, CURLoption option, T value) {
  CURLcode rc = curl_easy_setopt(h, option, value);
  if (rc != CURLE_OK)
    throw Error(Code::kInternal, fmt::format("libcurl refused option {}: {}", static_cast<int>(option),
                                             curl_easy_strerror(rc)));
}

struct HeaderList {
  curl_slist* list = nullptr;
  ~HeaderList() { curl_slist_free_all(list); }
  void add(const std::string& line) {
    curl_slist* next = curl_slist_append(list, line.c_str());
    if (!next) throw Error(Code::kResourceExhausted, "out of memory building HTTP headers");
    list = next;
  }
};

// How a curl failure reads to a dsec caller. Connection failures before anything was sent are the one case every
// call may retry; a broken connection after sending is retryable only for idempotent calls (the caller decides).
TransportError to_error(CURLcode rc, const char* detail, int os_errno, const Endpoint& ep, const HttpRequest& req,
                        bool sent) {
  std::string why = detail && *detail ? detail : curl_easy_strerror(rc);
  // curl words a unix socket failure as "port 80"; say what happened to the socket.
  if (rc == CURLE_COULDNT_CONNECT && !ep.unix_path.empty() && os_errno != 0)
    why = fmt::format("connect to {}: {}", ep.unix_path, std::strerror(os_errno));
  std::string what = fmt::format("{} {} on {}: {}", req.method, req.target, ep.text, why);
  switch (rc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_SSL_CONNECT_ERROR:
      return TransportError(Code::kUnavailable, "agent unreachable: " + what, true, false);
    case CURLE_OPERATION_TIMEDOUT:
      return TransportError(Code::kDeadlineExceeded, "deadline exceeded: " + what, false, sent);
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
      return TransportError(Code::kUnavailable, "connection to the agent broke: " + what, true, sent);
    case CURLE_OUT_OF_MEMORY:
      return TransportError(Code::kResourceExhausted, "out of memory: " + what, false, sent);
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_UNSUPPORTED_PROTOCOL:
      return TransportError(Code::kUnavailable, "the endpoint does not speak HTTP/1.1 like a dsec agent: " + what,
                            false, sent);
    case CURLE_URL_MALFORMAT:
      return TransportError(Code::kInvalidArgument, "malformed URL: " + what, false, false);
    default:
      return TransportError(Code::kUnknown, what, false, sent);
  }
}

}  // namespace

Transport::Transport(Endpoint endpoint, std::shared_ptr<const Credentials> credentials, std::size_t max_idle_handles)
    : endpoint_(std::move(endpoint)), credentials_(std::move(credentials)), max_idle_handles_(max_idle_handles) {
  global_init_once();
}

Transport::~Transport() {
  for (void* h : idle_) curl_easy_cleanup(static_cast<CURL*>(h));
}

void* Transport::acquire() {
  {
    std::lock_guard lock(mu_);
    if (!idle_.empty()) {
      void* h = idle_.back();
      idle_.pop_back();
      return h;
    }
  }
  CURL* h = curl_easy_init();
  if (!h) throw Error(Code::kResourceExhausted, "curl_easy_init failed (out of memory?)");
  return h;
}

void Transport::give_back(void* handle) {
  {
    std::lock_guard lock(mu_);
    if (idle_.size() < max_idle_handles_) {
      idle_.push_back(handle);
      return;
    }
  }
  curl_easy_cleanup(static_cast<CURL*>(handle));
}

TransportStats Transport::stats() const {
  TransportStats s;
  s.requests = requests_.load();
  s.connects = connects_.load();
  std::lock_guard lock(mu_);
  s.idle_handles = idle_.size();
  return s;
}

HttpResponse Transport::send(const HttpRequest& req, SteadyClock::time_point deadline) {
  auto remaining = duration_cast<milliseconds>(deadline - SteadyClock::now()).count();
  if (remaining <= 0)
    throw TransportError(Code::kDeadlineExceeded,
                         fmt::format("deadline exceeded before {} {} on {} was sent", req.method, req.target,
                                     endpoint_.text),
                         false, false);

  // The handle goes back to the pool on every path, keeping its connection for the next call.
  CURL* h = static_cast<CURL*>(acquire());
  struct Return {
    Transport* t;
    CURL* h;
    ~Return() { t->give_back(h); }
  } give_back_on_exit{this, h};

  curl_easy_reset(h);  // options only: live connections stay in the handle
  HttpResponse resp;
  char errbuf[CURL_ERROR_SIZE] = {0};
  std::string url = endpoint_.base_url + req.target;
  HeaderList headers;
  headers.add("Expect:");  // no 100-continue round trip before uploads
  headers.add("Accept: application/json");
  if (!req.content_type.empty()) headers.add(fmt::format("Content-Type: {}", req.content_type));
  if (credentials_ && !credentials_->token.empty()) headers.add("Authorization: Bearer " + credentials_->token);

  set(h, CURLOPT_URL, url.c_str());
  if (!endpoint_.unix_path.empty()) set(h, CURLOPT_UNIX_SOCKET_PATH, endpoint_.unix_path.c_str());
  set(h, CURLOPT_NOSIGNAL, 1L);  // no SIGALRM in a multi-threaded trainer
  set(h, CURLOPT_HTTP_VERSION, static_cast<long>(CURL_HTTP_VERSION_1_1));
  set(h, CURLOPT_TCP_KEEPALIVE, 1L);
  set(h, CURLOPT_TCP_NODELAY, 1L);
  set(h, CURLOPT_TIMEOUT_MS, static_cast<long>(std::max<long long>(remaining, 1)));
  set(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(std::min<long long>(remaining, kMaxConnectTimeoutMs)));
  set(h, CURLOPT_USERAGENT, "dsec-client/0.1.0");
  set(h, CURLOPT_HTTPHEADER, headers.list);
  set(h, CURLOPT_ERRORBUFFER, errbuf);
  BodySink body_sink{h, &req.on_body, &resp.body, nullptr};
  if (req.on_body) {
    set(h, CURLOPT_WRITEFUNCTION, &stream_body);
    set(h, CURLOPT_WRITEDATA, static_cast<void*>(&body_sink));
  } else {
    set(h, CURLOPT_WRITEFUNCTION, &append_body);
    set(h, CURLOPT_WRITEDATA, static_cast<void*>(&resp.body));
  }
  set(h, CURLOPT_PROTOCOLS_STR, "http,https");
  if (credentials_) {
    if (!credentials_->ca_file.empty()) set(h, CURLOPT_CAINFO, credentials_->ca_file.c_str());
    if (!credentials_->client_cert.empty()) set(h, CURLOPT_SSLCERT, credentials_->client_cert.c_str());
    if (!credentials_->client_key.empty()) set(h, CURLOPT_SSLKEY, credentials_->client_key.c_str());
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

  requests_.fetch_add(1, std::memory_order_relaxed);
  CURLcode rc = curl_easy_perform(h);

  long connects = 0;
  if (curl_easy_getinfo(h, CURLINFO_NUM_CONNECTS, &connects) == CURLE_OK && connects > 0)
    connects_.fetch_add(static_cast<std::uint64_t>(connects), std::memory_order_relaxed);

  if (body_sink.error) std::rethrow_exception(body_sink.error);
  if (rc != CURLE_OK) {
    // Conservative: the request may have reached the agent once curl was ready to send or sent any byte.
    curl_off_t pretransfer_us = 0;
    long request_bytes = 0;
    curl_easy_getinfo(h, CURLINFO_PRETRANSFER_TIME_T, &pretransfer_us);
    curl_easy_getinfo(h, CURLINFO_REQUEST_SIZE, &request_bytes);
    long os_errno = 0;
    curl_easy_getinfo(h, CURLINFO_OS_ERRNO, &os_errno);
    throw to_error(rc, errbuf, static_cast<int>(os_errno), endpoint_, req, pretransfer_us > 0 || request_bytes > 0);
  }
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &resp.status);
  char* ct = nullptr;
  if (curl_easy_getinfo(h, CURLINFO_CONTENT_TYPE, &ct) == CURLE_OK && ct) resp.content_type = ct;
  return resp;
}

}  // namespace dsec::detail
