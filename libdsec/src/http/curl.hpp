// libcurl, set up one way for every HTTP client dsec has: the client library's transports (blocking and async), the
// HTTP image store and the etcd client. Each keeps what is its own (how it reads a body, how long it waits, what an
// error means to its caller); what they share is here: starting libcurl, setting an option, header lists, a pool of
// easy handles that keep their connections, the options every transfer takes, and what a failed transfer was.
#pragma once

#include <curl/curl.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::http::curl {

// curl_global_init, once per process. `client` names what cannot start if libcurl cannot ("the etcd client").
void global_init(std::string_view client);

// Sets an option whose failure means curl itself is unusable (out of memory, a feature compiled out).
template <typename T>
void set(CURL* handle, CURLoption option, T value) {
  if (CURLcode rc = curl_easy_setopt(handle, option, value); rc != CURLE_OK)
    throw Error(Code::kInternal,
                fmt::format("libcurl refused option {}: {}", static_cast<int>(option), curl_easy_strerror(rc)));
}

// A request's extra header lines, freed with the list.
class HeaderList {
 public:
  HeaderList() = default;
  ~HeaderList();
  HeaderList(const HeaderList&) = delete;
  HeaderList& operator=(const HeaderList&) = delete;

  void add(const char* line);
  void add(const std::string& line) { add(line.c_str()); }
  curl_slist* list() const noexcept { return list_; }

 private:
  curl_slist* list_ = nullptr;
};

// Easy handles kept between transfers with their live connections (keep-alive), for threads that each take one.
class HandlePool {
 public:
  explicit HandlePool(std::size_t max_idle) : max_idle_(max_idle) {}
  ~HandlePool();
  HandlePool(const HandlePool&) = delete;
  HandlePool& operator=(const HandlePool&) = delete;

  // An idle handle, or a new one.
  CURL* take();
  // Back into the pool with its connections, or closed when the pool is full.
  void give_back(CURL* handle);
  std::size_t idle() const;

  // One handle for one scope: given back at its end, or closed if discard() was called (a transfer that failed in a
  // way that leaves the handle in doubt).
  class Lease {
   public:
    explicit Lease(HandlePool& pool) : pool_(pool), handle_(pool.take()) {}
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    CURL* get() const noexcept { return handle_; }
    void discard() noexcept { keep_ = false; }

   private:
    HandlePool& pool_;
    CURL* handle_;
    bool keep_ = true;
  };

 private:
  const std::size_t max_idle_;
  mutable std::mutex mu_;
  std::vector<CURL*> idle_;
};

// What every dsec transfer sets the same way. C strings (curl copies them), so that a transfer makes no copies of
// its own; null or empty: not given.
struct TransferOptions {
  const char* url = nullptr;
  const char* unix_socket = nullptr;  // a unix socket path to connect to instead of the URL's host; none: TCP
  const char* user_agent = "dsec/0.1.0";
  const char* ca_file = nullptr;      // TLS: the CAs to trust; none: the system's
  const char* client_cert = nullptr;  // TLS: a client certificate and its key; none: no client certificate
  const char* client_key = nullptr;
  const HeaderList* headers = nullptr;
  char* error_buffer = nullptr;  // CURL_ERROR_SIZE bytes: curl's own words for a failure
};

// Resets `handle`'s options (its connections stay) and sets the URL, TLS files, headers and the options dsec uses on
// every transfer: HTTP/1.1 over http or https only, no redirects followed, no signals, TCP keepalive and no Nagle.
void start_transfer(CURL* handle, const TransferOptions& options);

// Percent-encodes everything but RFC 3986's unreserved characters: one safe URL path segment or query value.
std::string url_escape(std::string_view text);

// What a failed transfer was, for each client to word for its caller.
enum class Failure {
  kUnreachable,           // no connection: refused, no route, name not resolved, TLS handshake failed
  kTimedOut,              // the transfer's time ran out
  kBroken,                // the connection broke mid-transfer, or the server closed it without an answer
  kOutOfMemory,           //
  kNotHttp,               // the server's answer is not HTTP/1.1
  kUnsupportedProtocol,   // a URL scheme other than http or https
  kMalformedUrl,          //
  kUntrustedCertificate,  // the server's certificate is not signed by a trusted CA
  kBadCaFile,             // the CA file given cannot be read or used
  kOther,
};
Failure classify(CURLcode rc);
// curl's error buffer when it says something, else curl's name for `rc`.
std::string describe(CURLcode rc, const char* error_buffer);
// Whether the request may have reached the server: curl was ready to send, or sent a byte.
bool may_have_sent(CURL* handle);
long response_code(CURL* handle);

}  // namespace dsec::http::curl
