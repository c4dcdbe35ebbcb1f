#include "http/curl.hpp"

#include <cctype>

namespace dsec::http::curl {

void global_init(std::string_view client) {
  static std::once_flag once;
  std::call_once(once, [client] {
    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
      throw Error(Code::kInternal, fmt::format("curl_global_init failed: {} cannot start", client));
  });
}

HeaderList::~HeaderList() { curl_slist_free_all(list_); }

void HeaderList::add(const char* line) {
  curl_slist* next = curl_slist_append(list_, line);
  if (!next) throw Error(Code::kResourceExhausted, "out of memory building HTTP headers");
  list_ = next;
}

HandlePool::~HandlePool() {
  for (CURL* h : idle_) curl_easy_cleanup(h);
}

CURL* HandlePool::take() {
  {
    std::lock_guard lock(mu_);
    if (!idle_.empty()) {
      CURL* h = idle_.back();
      idle_.pop_back();
      return h;
    }
  }
  CURL* h = curl_easy_init();
  if (!h) throw Error(Code::kResourceExhausted, "curl_easy_init failed (out of memory?)");
  return h;
}

void HandlePool::give_back(CURL* handle) {
  curl_easy_reset(handle);  // no pointers into the finished transfer's state stay behind
  {
    std::lock_guard lock(mu_);
    if (idle_.size() < max_idle_) {
      idle_.push_back(handle);
      return;
    }
  }
  curl_easy_cleanup(handle);
}

std::size_t HandlePool::idle() const {
  std::lock_guard lock(mu_);
  return idle_.size();
}

HandlePool::Lease::~Lease() {
  if (keep_) pool_.give_back(handle_);
  else curl_easy_cleanup(handle_);
}

void start_transfer(CURL* h, const TransferOptions& o) {
  curl_easy_reset(h);  // options only: live connections stay in the handle
  auto given = [](const char* s) { return s != nullptr && *s != '\0'; };
  set(h, CURLOPT_URL, o.url);  // curl copies string options
  if (given(o.unix_socket)) set(h, CURLOPT_UNIX_SOCKET_PATH, o.unix_socket);
  if (given(o.ca_file)) set(h, CURLOPT_CAINFO, o.ca_file);
  if (given(o.client_cert)) set(h, CURLOPT_SSLCERT, o.client_cert);
  if (given(o.client_key)) set(h, CURLOPT_SSLKEY, o.client_key);
  set(h, CURLOPT_PROTOCOLS_STR, "http,https");
  set(h, CURLOPT_NOSIGNAL, 1L);  // no SIGALRM in a multi-threaded program
  set(h, CURLOPT_HTTP_VERSION, static_cast<long>(CURL_HTTP_VERSION_1_1));
  set(h, CURLOPT_TCP_KEEPALIVE, 1L);
  set(h, CURLOPT_TCP_NODELAY, 1L);
  set(h, CURLOPT_FOLLOWLOCATION, 0L);
  set(h, CURLOPT_USERAGENT, o.user_agent);
  if (o.headers) set(h, CURLOPT_HTTPHEADER, o.headers->list());
  if (o.error_buffer) {
    o.error_buffer[0] = '\0';
    set(h, CURLOPT_ERRORBUFFER, o.error_buffer);
  }
}

std::string url_escape(std::string_view text) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size() * 3);
  for (unsigned char c : text) {
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

Failure classify(CURLcode rc) {
  switch (rc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_SSL_CONNECT_ERROR:
      return Failure::kUnreachable;
    case CURLE_OPERATION_TIMEDOUT:
      return Failure::kTimedOut;
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
      return Failure::kBroken;
    case CURLE_OUT_OF_MEMORY:
      return Failure::kOutOfMemory;
    case CURLE_WEIRD_SERVER_REPLY:
      return Failure::kNotHttp;
    case CURLE_UNSUPPORTED_PROTOCOL:
      return Failure::kUnsupportedProtocol;
    case CURLE_URL_MALFORMAT:
      return Failure::kMalformedUrl;
    case CURLE_PEER_FAILED_VERIFICATION:
      return Failure::kUntrustedCertificate;
    case CURLE_SSL_CACERT_BADFILE:
      return Failure::kBadCaFile;
    default:
      return Failure::kOther;
  }
}

std::string describe(CURLcode rc, const char* error_buffer) {
  return error_buffer && *error_buffer ? std::string(error_buffer) : std::string(curl_easy_strerror(rc));
}

bool may_have_sent(CURL* h) {
  curl_off_t pretransfer_us = 0;
  long request_bytes = 0;
  curl_easy_getinfo(h, CURLINFO_PRETRANSFER_TIME_T, &pretransfer_us);
  curl_easy_getinfo(h, CURLINFO_REQUEST_SIZE, &request_bytes);
  return pretransfer_us > 0 || request_bytes > 0;
}

long response_code(CURL* h) {
  long status = 0;
  curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
  return status;
}

}  // namespace dsec::http::curl
