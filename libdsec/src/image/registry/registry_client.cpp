#include "image/registry/registry_client.hpp"

#include <fcntl.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include <curl/curl.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "http/curl.hpp"
#include "image/store/digest.hpp"

namespace dsec::image::registry {
namespace {

namespace curl = http::curl;
using curl::set;
using Clock = std::chrono::steady_clock;

constexpr std::size_t kMaxManifestBytes = 4u << 20;
constexpr std::size_t kMaxConfigBytes = 16u << 20;
constexpr std::size_t kMaxTokenBytes = 1u << 20;
constexpr std::size_t kMaxErrorBytes = 2048;
constexpr std::size_t kMaxIdleHandles = 8;
constexpr int kMaxRedirects = 3;
constexpr long kLowSpeedBytes = 1024;
constexpr auto kMaxRetryAfter = std::chrono::seconds(30);

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// "host:port" -> "host"; "[::1]:5000" -> "::1".
std::string host_only(std::string_view host) {
  if (host.starts_with('[')) return std::string(host.substr(1, host.find(']') - 1));
  return std::string(host.substr(0, host.rfind(':') == std::string_view::npos ? host.size() : host.rfind(':')));
}

bool loopback_host(std::string_view host) {
  std::string h = host_only(host);
  return h == "localhost" || h == "::1" || h.starts_with("127.");
}

// A URL's scheme and authority: "https://h:5000/v2/x" -> "https://h:5000".
std::string origin_of(std::string_view url) {
  auto scheme = url.find("://");
  if (scheme == std::string_view::npos) return std::string(url);
  auto path = url.find('/', scheme + 3);
  return lower(url.substr(0, path));
}

// The WWW-Authenticate challenge: its scheme and parameters (realm, service, scope, error).
struct Challenge {
  std::string scheme;  // "bearer", "basic" (lowercase)
  std::map<std::string, std::string> params;
};

Challenge parse_challenge(std::string_view header) {
  Challenge c;
  header = trim(header);
  auto space = header.find(' ');
  c.scheme = lower(header.substr(0, space));
  if (space == std::string_view::npos) return c;
  std::string_view rest = header.substr(space + 1);
  while (!rest.empty()) {
    rest = trim(rest);
    auto eq = rest.find('=');
    if (eq == std::string_view::npos) break;
    std::string key = lower(trim(rest.substr(0, eq)));
    rest.remove_prefix(eq + 1);
    std::string value;
    if (!rest.empty() && rest.front() == '"') {
      std::size_t i = 1;
      for (; i < rest.size() && rest[i] != '"'; ++i) {
        if (rest[i] == '\\' && i + 1 < rest.size()) ++i;
        value.push_back(rest[i]);
      }
      rest.remove_prefix(std::min(rest.size(), i + 1));
    } else {
      auto comma = rest.find(',');
      value = std::string(trim(rest.substr(0, comma)));
      rest.remove_prefix(comma == std::string_view::npos ? rest.size() : comma);
    }
    c.params[key] = value;
    rest = trim(rest);
    if (!rest.empty() && rest.front() == ',') rest.remove_prefix(1);
  }
  return c;
}

std::string base64(std::string_view bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3) + 1, '\0');
  int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
  out.resize(static_cast<std::size_t>(n));
  return out;
}

// One HTTP exchange.
struct Request {
  const char* method = "GET";
  std::string url;
  std::vector<std::string> headers;
  std::size_t max_body = kMaxManifestBytes;
  // Streams a 2xx body (with its status) instead of keeping it; false stops the transfer.
  std::function<bool(long, const char*, std::size_t)> sink;
};

struct Response {
  CURLcode result = CURLE_OK;
  std::string curl_error;
  long status = 0;
  std::string body;  // a kept 2xx body, or the start of an error body
  bool overflow = false;
  bool sink_stopped = false;
  std::map<std::string, std::string> headers;  // lowercase names; the last response's (after 100 Continue)
  std::string header(const std::string& name) const {
    auto it = headers.find(name);
    return it == headers.end() ? std::string() : it->second;
  }
};

struct Exchange {
  CURL* handle;
  const Request* request;
  Response* response;
};

std::size_t on_body(char* data, std::size_t size, std::size_t count, void* user) {
  auto* ex = static_cast<Exchange*>(user);
  const std::size_t n = size * count;
  Response& r = *ex->response;
  const long status = curl::response_code(ex->handle);
  if (status < 200 || status >= 300) {
    if (r.body.size() < kMaxErrorBytes) r.body.append(data, std::min(n, kMaxErrorBytes - r.body.size()));
    return n;
  }
  if (ex->request->sink) {
    if (!ex->request->sink(status, data, n)) {
      r.sink_stopped = true;
      return 0;
    }
    return n;
  }
  if (r.body.size() + n > ex->request->max_body) {
    r.overflow = true;
    return 0;
  }
  r.body.append(data, n);
  return n;
}

std::size_t on_header(char* data, std::size_t size, std::size_t count, void* user) {
  auto* ex = static_cast<Exchange*>(user);
  const std::size_t n = size * count;
  std::string_view line(data, n);
  if (line.starts_with("HTTP/")) {
    ex->response->headers.clear();
    return n;
  }
  auto colon = line.find(':');
  if (colon == std::string_view::npos) return n;
  std::string name = lower(trim(line.substr(0, colon)));
  std::string value(trim(line.substr(colon + 1)));
  if (name == "www-authenticate" && ex->response->headers.count(name)) {
    // Several challenges: keep the first Bearer one.
    if (lower(ex->response->headers[name]).starts_with("bearer")) return n;
  }
  if (value.size() <= 8192) ex->response->headers[name] = std::move(value);
  return n;
}

// The cancellation check while bytes flow.
int on_progress(void* user, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  auto* cancelled = static_cast<const CancelFn*>(user);
  return (*cancelled && (*cancelled)()) ? 1 : 0;
}

bool transient(const Response& r) {
  if (r.result != CURLE_OK) {
    if (r.result == CURLE_WRITE_ERROR || r.result == CURLE_ABORTED_BY_CALLBACK) return false;
    const curl::Failure f = curl::classify(r.result);
    return f == curl::Failure::kUnreachable || f == curl::Failure::kTimedOut || f == curl::Failure::kBroken;
  }
  return r.status == 408 || r.status == 429 || (r.status >= 500 && r.status != 501 && r.status != 505);
}

// What Retry-After asks for (seconds only; an HTTP date is taken as a second), capped.
std::optional<std::chrono::milliseconds> retry_after(const Response& r) {
  std::string v = r.header("retry-after");
  if (v.empty()) return std::nullopt;
  if (!std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; }) || v.size() > 6)
    return std::chrono::milliseconds(1000);
  return std::min<std::chrono::milliseconds>(std::chrono::seconds(std::stoul(v)), kMaxRetryAfter);
}

// The first line of a registry's error body: {"errors":[{"code":"MANIFEST_UNKNOWN","message":"..."}]}.
std::string registry_says(const Response& r) {
  try {
    auto j = nlohmann::json::parse(r.body);
    const auto& e = j.at("errors").at(0);
    std::string code = e.value("code", "");
    std::string message = e.value("message", "");
    if (!code.empty() || !message.empty()) return fmt::format(" ({}: {})", code, message.substr(0, 300));
  } catch (const std::exception&) {
  }
  return {};
}

struct Token {
  std::string value;
  Clock::time_point expires;
};

// What dsec knows of one registry host: how to reach it and how it wants to be asked.
struct HostState {
  std::mutex mu;
  bool pinged = false;
  std::string base;    // "https://h:5000"
  std::string scheme;  // challenge scheme: "", "basic", "bearer"
  std::string realm, service;
  std::map<std::string, Token> tokens;  // by scope
};

}  // namespace

void add_mirror(RegistryOptions& options, std::string_view flag) {
  auto eq = flag.find('=');
  if (eq == std::string_view::npos || eq == 0 || eq + 1 == flag.size())
    throw Error(Code::kInvalidArgument, fmt::format("registry mirror '{}': expected HOST=URL", flag.substr(0, 200)));
  std::string url(flag.substr(eq + 1));
  if (!url.starts_with("http://") && !url.starts_with("https://"))
    throw Error(Code::kInvalidArgument,
                fmt::format("registry mirror '{}': the URL must start with http:// or https://", flag.substr(0, 200)));
  while (url.ends_with('/')) url.pop_back();
  options.mirrors[credential_host(flag.substr(0, eq))] = url;
}

RegistryOptions registry_options(const RegistryFlags& flags) {
  RegistryOptions o;
  for (const auto& a : flags.auth) o.credentials.add_flag(a);
  if (!flags.auth_file.empty()) {
    std::ifstream in(flags.auth_file);
    if (!in) throw Error(Code::kInvalidArgument, fmt::format("registry credentials: cannot read {}", flags.auth_file));
    for (std::string line; std::getline(in, line);)
      if (!line.empty() && line.front() != '#') o.credentials.add_flag(line);
  }
  o.credentials.load_docker_config(flags.docker_config == "default" ? Credentials::default_docker_config()
                                                                    : std::filesystem::path(flags.docker_config));
  for (const auto& m : flags.mirrors) add_mirror(o, m);
  for (const auto& h : flags.insecure) o.insecure.push_back(credential_host(h));
  o.ca_file = flags.ca_file;
  if (!flags.platform.empty()) o.platform = parse_platform(flags.platform);
  return o;
}

ImageReference with_default_registry(const ImageReference& ref, std::string_view default_registry) {
  if (!ref.registry().empty() || default_registry.empty()) return ref;
  std::string host = credential_host(default_registry);
  std::string name = ref.name;
  if (host == "docker.io" && name.find('/') == std::string::npos) name = "library/" + name;
  ImageReference out = parse_reference(fmt::format("{}/{}:{}", host, name, ref.tag));
  out.digest = ref.digest;
  return out;
}

std::string RegistryImage::source() const { return fmt::format("registry {}@{}", reference.name, reference.digest); }

struct RegistryClient::Impl {
  RegistryOptions options;
  curl::HandlePool handles{kMaxIdleHandles};
  std::mutex hosts_mu;
  std::map<std::string, std::unique_ptr<HostState>> hosts;

  explicit Impl(RegistryOptions o) : options(std::move(o)) { curl::global_init("the registry client"); }

  HostState& host_state(const std::string& key) {
    std::lock_guard lock(hosts_mu);
    auto& s = hosts[key];
    if (!s) s = std::make_unique<HostState>();
    return *s;
  }

  // The API host of a registry name: Docker Hub's registry is not at docker.io.
  static std::string api_host(std::string_view host) {
    return host == "docker.io" ? std::string("registry-1.docker.io") : std::string(host);
  }

  bool insecure(std::string_view host) const {
    if (loopback_host(host)) return true;
    return std::any_of(options.insecure.begin(), options.insecure.end(),
                       [&](const std::string& h) { return credential_host(h) == host; });
  }

  Response perform(const Request& req, const CancelFn& cancelled = {}) {
    curl::HandlePool::Lease lease(handles);
    CURL* h = lease.get();
    Response r;
    curl::HeaderList headers;
    for (const auto& line : req.headers) headers.add(line);
    char error[CURL_ERROR_SIZE];
    curl::TransferOptions t;
    t.url = req.url.c_str();
    t.ca_file = options.ca_file.empty() ? nullptr : options.ca_file.c_str();
    t.headers = &headers;
    t.error_buffer = error;
    curl::start_transfer(h, t);
    if (std::string_view(req.method) == "HEAD") set(h, CURLOPT_NOBODY, 1L);
    set(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options.connect_timeout.count()));
    set(h, CURLOPT_LOW_SPEED_LIMIT, kLowSpeedBytes);
    set(h, CURLOPT_LOW_SPEED_TIME, std::max(1L, static_cast<long>(options.stall_timeout.count() / 1000)));
    // Small requests have a whole-request limit too; blobs are bounded by the low-speed limit and their size.
    if (!req.sink) set(h, CURLOPT_TIMEOUT_MS, static_cast<long>(options.stall_timeout.count()));
    Exchange ex{h, &req, &r};
    set(h, CURLOPT_WRITEFUNCTION, on_body);
    set(h, CURLOPT_WRITEDATA, &ex);
    set(h, CURLOPT_HEADERFUNCTION, on_header);
    set(h, CURLOPT_HEADERDATA, &ex);
    if (cancelled) {
      set(h, CURLOPT_NOPROGRESS, 0L);
      set(h, CURLOPT_XFERINFOFUNCTION, on_progress);
      set(h, CURLOPT_XFERINFODATA, &cancelled);
    }
    r.result = curl_easy_perform(h);
    r.status = curl::response_code(h);
    if (r.result != CURLE_OK) {
      r.curl_error = curl::describe(r.result, error);
      lease.discard();
    }
    if (r.result == CURLE_ABORTED_BY_CALLBACK) throw Error(Code::kCancelled, "the import was cancelled");
    return r;
  }

  // Backoff before attempt `attempt` (2-based), full jitter, or what Retry-After asked.
  void back_off(int attempt, const Response& r) {
    auto wait = retry_after(r);
    if (!wait) {
      auto cap = std::min<std::chrono::milliseconds>(std::chrono::milliseconds(100) * (1 << std::min(attempt, 8)),
                                                     options.max_backoff);
      static thread_local std::mt19937_64 rng{std::random_device{}()};
      wait = std::chrono::milliseconds(std::uniform_int_distribution<std::int64_t>(cap.count() / 2, cap.count())(rng));
    }
    std::this_thread::sleep_for(*wait);
  }

  // The host's base URL and challenge, from a ping of /v2/ (once per host).
  HostState& contact(std::string_view registry, const CancelFn& cancelled) {
    const std::string key(registry);
    HostState& state = host_state(key);
    std::lock_guard lock(state.mu);
    if (state.pinged) return state;
    const std::string host = api_host(registry);
    std::vector<std::string> bases;
    if (auto m = options.mirrors.find(key); m != options.mirrors.end()) bases.push_back(m->second);
    bases.push_back("https://" + host);
    if (insecure(registry)) bases.push_back("http://" + host);
    std::string failures;
    for (const auto& base : bases) {
      Response r;
      for (int attempt = 1;; ++attempt) {
        r = perform(Request{"GET", base + "/v2/", {}, kMaxErrorBytes, {}}, cancelled);
        if (!transient(r) || attempt >= options.attempts || r.result == CURLE_SSL_CONNECT_ERROR) break;
        back_off(attempt + 1, r);
      }
      if (r.result == CURLE_OK && (r.status == 200 || r.status == 401)) {
        state.base = base;
        if (r.status == 401) {
          Challenge c = parse_challenge(r.header("www-authenticate"));
          state.scheme = c.scheme;
          state.realm = c.params["realm"];
          state.service = c.params["service"];
        }
        state.pinged = true;
        return state;
      }
      failures += fmt::format("{}{}/v2/: {}", failures.empty() ? "" : "; ", base,
                              r.result != CURLE_OK ? r.curl_error : fmt::format("HTTP {}", r.status));
      if (r.result == CURLE_OK && r.status != 200 && r.status != 401 && !transient(r))
        failures += " (not an OCI registry's answer)";
    }
    throw Error(Code::kUnavailable, fmt::format("registry {} cannot be reached: {}", registry, failures));
  }

  // A bearer token for `scope` from the realm, anonymous or with the host's credentials.
  std::string token(HostState& state, std::string_view registry, const std::string& scope, bool fresh,
                    const CancelFn& cancelled) {
    {
      std::lock_guard lock(state.mu);
      auto it = state.tokens.find(scope);
      if (!fresh && it != state.tokens.end() && Clock::now() < it->second.expires) return it->second.value;
    }
    std::string realm, service;
    {
      std::lock_guard lock(state.mu);
      realm = state.realm;
      service = state.service;
    }
    if (realm.empty() || (!realm.starts_with("https://") && !realm.starts_with("http://")))
      throw Error(Code::kUnavailable, fmt::format("registry {} asks for a bearer token without a usable realm ('{}')",
                                                  registry, realm.substr(0, 200)));
    if (realm.starts_with("http://") && !insecure(registry))
      throw Error(Code::kFailedPrecondition,
                  fmt::format("registry {} names a token service over plain HTTP ({}): credentials would cross the "
                              "network in the clear (--insecure-registry {} allows it)",
                              registry, origin_of(realm), registry));
    std::string url = fmt::format("{}{}service={}&scope={}", realm, realm.find('?') == std::string::npos ? "?" : "&",
                                  curl::url_escape(service), curl::url_escape(scope));
    Request req{"GET", url, {}, kMaxTokenBytes, {}};
    auto credential = options.credentials.find(registry);
    if (credential)
      req.headers.push_back("Authorization: Basic " + base64(credential->username + ":" + credential->password));
    Response r;
    for (int attempt = 1;; ++attempt) {
      r = perform(req, cancelled);
      if (!transient(r) || attempt >= options.attempts) break;
      back_off(attempt + 1, r);
    }
    if (r.result != CURLE_OK)
      throw Error(Code::kUnavailable, fmt::format("registry {}: its token service {} cannot be reached: {}", registry,
                                                  origin_of(realm), r.curl_error));
    if (r.status == 401 || r.status == 403)
      throw Error(Code::kUnauthenticated,
                  fmt::format("registry {}: its token service refused {} for {} (HTTP {})", registry,
                              credential ? fmt::format("the credentials of user '{}'", credential->username)
                                         : std::string("anonymous access"),
                              scope, r.status));
    if (r.status != 200)
      throw Error(transient(r) ? Code::kUnavailable : Code::kFailedPrecondition,
                  fmt::format("registry {}: its token service answered HTTP {} for {}", registry, r.status, scope));
    Token t;
    try {
      auto j = nlohmann::json::parse(r.body);
      t.value = j.value("token", std::string());
      if (t.value.empty()) t.value = j.value("access_token", std::string());
      std::int64_t expires_in = 60;
      if (auto e = j.find("expires_in"); e != j.end() && e->is_number_integer()) expires_in = e->get<std::int64_t>();
      // Renewed 10 s early; a token of under a minute is kept for half its life.
      expires_in = std::clamp<std::int64_t>(expires_in, 1, std::int64_t{24} * 3600);
      t.expires = Clock::now() + std::chrono::seconds(expires_in > 60 ? expires_in - 10 : expires_in / 2);
    } catch (const std::exception&) {
      t.value.clear();
    }
    if (t.value.empty())
      throw Error(Code::kFailedPrecondition,
                  fmt::format("registry {}: its token service's answer has no token", registry));
    std::lock_guard lock(state.mu);
    state.tokens[scope] = t;
    return t.value;
  }

  // A GET or HEAD of a repository's resource with authentication, retries and the registry's errors mapped.
  // `what` names the resource for messages ("manifest swebench/x:latest").
  Response call(const ImageReference& ref, const char* method, const std::string& path, std::size_t max_body,
                const std::vector<std::string>& extra_headers, const std::string& what, const CancelFn& cancelled,
                const std::function<bool(long, const char*, std::size_t)>& sink = {},
                const std::function<void(std::vector<std::string>&)>& attempt_headers = {}) {
    const std::string registry(ref.registry());
    HostState& state = contact(registry, cancelled);
    const std::string repo(ref.repository());
    const std::string scope = fmt::format("repository:{}:pull", repo);
    const auto credential = options.credentials.find(registry);
    bool fresh_token = false;
    bool authenticated_once = false;
    std::string url = state.base + path;
    int redirects = 0;
    for (int attempt = 1;; ++attempt) {
      Request req{method, url, extra_headers, max_body, sink};
      const bool same_origin = origin_of(url) == origin_of(state.base);  // base is set once, by contact()
      std::string scheme;
      {
        std::lock_guard lock(state.mu);
        scheme = state.scheme;
      }
      if (same_origin) {
        if (scheme == "bearer") {
          req.headers.push_back("Authorization: Bearer " + token(state, registry, scope, fresh_token, cancelled));
          fresh_token = false;
        } else if (scheme == "basic" && credential) {
          req.headers.push_back("Authorization: Basic " + base64(credential->username + ":" + credential->password));
        }
      }
      if (attempt_headers) attempt_headers(req.headers);
      Response r = perform(req, cancelled);
      if (r.result == CURLE_OK &&
          (r.status == 301 || r.status == 302 || r.status == 303 || r.status == 307 || r.status == 308)) {
        std::string location = r.header("location");
        if (location.starts_with("/")) location.insert(0, origin_of(url));
        const bool allowed = sink && (location.starts_with("https://") || origin_of(location) == origin_of(state.base));
        if (!allowed || ++redirects > kMaxRedirects)
          throw Error(Code::kFailedPrecondition,
                      fmt::format("registry {}: {} is redirected to '{}': dsec follows at most {} redirects, of blobs "
                                  "only, to https or within the registry",
                                  registry, what, location.substr(0, 200), kMaxRedirects));
        url = location;
        --attempt;
        continue;
      }
      if (r.result == CURLE_OK && r.status == 401 && same_origin && !authenticated_once) {
        // A first 401: learn the challenge (a registry may answer /v2/ without one) and ask again once.
        Challenge c = parse_challenge(r.header("www-authenticate"));
        {
          std::lock_guard lock(state.mu);
          if (!c.scheme.empty()) {
            state.scheme = c.scheme;
            if (c.scheme == "bearer") {
              if (!c.params["realm"].empty()) state.realm = c.params["realm"];
              state.service = c.params["service"];
            }
          }
          scheme = state.scheme;
        }
        authenticated_once = true;
        fresh_token = true;
        if (scheme == "bearer" || (scheme == "basic" && credential)) {
          --attempt;
          continue;
        }
      }
      if (r.result == CURLE_OK && r.status >= 200 && r.status < 300) return r;
      if (transient(r) && attempt < options.attempts) {
        back_off(attempt + 1, r);
        continue;
      }
      fail(registry, repo, what, r, credential.has_value());
    }
  }

  [[noreturn]] void fail(const std::string& registry, const std::string& repo, const std::string& what,
                         const Response& r, bool had_credentials) {
    if (r.result != CURLE_OK) {
      if (r.result == CURLE_WRITE_ERROR && r.sink_stopped)
        throw Error(Code::kFailedPrecondition,
                    fmt::format("registry {}: {}: the download was stopped", registry, what));
      throw Error(Code::kUnavailable, fmt::format("registry {}: {}: {} (after {} attempts)", registry, what,
                                                  r.curl_error, options.attempts));
    }
    const std::string says = registry_says(r);
    switch (r.status) {
      case 401:
        throw Error(Code::kUnauthenticated,
                    had_credentials
                        ? fmt::format("registry {} refused the credentials given for repository {}: {}{}", registry,
                                      repo, what, says)
                        : fmt::format("registry {} wants credentials for repository {} ({}){}: give them with "
                                      "--registry-auth {}=USER:PASSWORD, registry_auth= or ~/.docker/config.json",
                                      registry, repo, what, says, registry));
      case 403:
        throw Error(Code::kPermissionDenied,
                    fmt::format("registry {} denies pulling {} from repository {}{}", registry, what, repo, says));
      case 404:
        throw Error(Code::kNotFound, fmt::format("registry {} has no {}{}", registry, what, says));
      case 429:
        throw Error(Code::kResourceExhausted, fmt::format("registry {}: {}: too many requests, still after {} attempts",
                                                          registry, what, options.attempts));
      default:
        break;
    }
    throw Error(r.status >= 500 ? Code::kUnavailable : Code::kFailedPrecondition,
                fmt::format("registry {}: {}: HTTP {}{}", registry, what, r.status, says));
  }

  // A manifest by tag or digest, its bytes checked against the digest asked for (or the one the registry names).
  std::pair<std::string, std::string> manifest(const ImageReference& ref, const std::string& tag_or_digest,
                                               std::string& content_type, const CancelFn& cancelled) {
    const std::string what =
        fmt::format("manifest {}{}{}", ref.repository(), is_digest(tag_or_digest) ? "@" : ":", tag_or_digest);
    Response r = call(ref, "GET", fmt::format("/v2/{}/manifests/{}", ref.repository(), tag_or_digest),
                      kMaxManifestBytes, {fmt::format("Accept: {}", kManifestAccept)}, what, cancelled);
    if (r.overflow)
      throw Error(Code::kResourceExhausted,
                  fmt::format("registry {}: {} is larger than {} bytes", ref.registry(), what, kMaxManifestBytes));
    std::string digest = sha256_digest(r.body);
    std::string expected = is_digest(tag_or_digest) ? tag_or_digest : r.header("docker-content-digest");
    if (!expected.empty() && is_digest(expected) && expected != digest)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("registry {}: {} hashes to {}, not to {}", ref.registry(), what, digest, expected));
    content_type = r.header("content-type");
    return {digest, std::move(r.body)};
  }
};

RegistryClient::RegistryClient(RegistryOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
RegistryClient::~RegistryClient() = default;

const RegistryOptions& RegistryClient::options() const noexcept { return impl_->options; }

RegistryImage RegistryClient::fetch_image(const ImageReference& ref, const CancelFn& cancelled) {
  if (ref.registry().empty())
    throw Error(Code::kInvalidArgument, fmt::format("'{}' names no registry host", ref.to_string()));
  RegistryImage out;
  out.reference = ref;
  std::string content_type;
  auto [digest, body] = impl_->manifest(ref, ref.digest.empty() ? ref.tag : ref.digest, content_type, cancelled);
  out.reference.digest = digest;
  ManifestDocument doc;
  try {
    doc = parse_manifest(body, content_type);
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("registry {}: {}: {}", ref.registry(), ref.to_string(), e.what()));
  }
  if (doc.is_index) {
    auto picked = pick_platform(doc, impl_->options.platform);
    if (!picked)
      throw Error(Code::kNotFound, fmt::format("image {} has no {} image; it has: {}", ref.to_string(),
                                               impl_->options.platform.to_string(), platforms_of(doc)));
    std::tie(digest, body) = impl_->manifest(ref, picked->digest, content_type, cancelled);
    try {
      doc = parse_manifest(body, content_type);
    } catch (const Error& e) {
      throw Error(e.code(), fmt::format("registry {}: {}@{}: {}", ref.registry(), ref.name, picked->digest, e.what()));
    }
    if (doc.is_index)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("registry {}: {}: an index's {} entry is an index again", ref.registry(), ref.to_string(),
                              impl_->options.platform.to_string()));
  }
  out.manifest_digest = digest;
  out.manifest = std::move(doc);
  const Descriptor& config = out.manifest.config;
  if (config.size > kMaxConfigBytes)
    throw Error(Code::kResourceExhausted, fmt::format("registry {}: {}: its configuration is {} bytes, more than {}",
                                                      ref.registry(), ref.to_string(), config.size, kMaxConfigBytes));
  Response r = impl_->call(ref, "GET", fmt::format("/v2/{}/blobs/{}", ref.repository(), config.digest), kMaxConfigBytes,
                           {}, fmt::format("configuration blob {}", config.digest), cancelled);
  if (r.overflow || r.body.size() != config.size || sha256_digest(r.body) != config.digest)
    throw Error(Code::kFailedPrecondition,
                fmt::format("registry {}: {}: the configuration blob served ({} bytes) does not match its descriptor "
                            "({}, {} bytes)",
                            ref.registry(), ref.to_string(), r.body.size(), config.digest, config.size));
  out.config_json = std::move(r.body);
  try {
    out.config = parse_image_config(out.config_json);
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("registry {}: {}: {}", ref.registry(), ref.to_string(), e.what()));
  }
  const Platform& want = impl_->options.platform;
  if (!out.config.platform.os.empty() &&
      (out.config.platform.os != want.os || out.config.platform.architecture != want.architecture))
    throw Error(Code::kFailedPrecondition, fmt::format("image {} is for {}, not {}", ref.to_string(),
                                                       out.config.platform.to_string(), want.to_string()));
  if (!out.config.diff_ids.empty() && out.config.diff_ids.size() != out.manifest.layers.size())
    throw Error(Code::kInvalidArgument,
                fmt::format("registry {}: {}: the configuration lists {} layers, the manifest {}", ref.registry(),
                            ref.to_string(), out.config.diff_ids.size(), out.manifest.layers.size()));
  return out;
}

std::string RegistryClient::tag_digest(const ImageReference& ref) {
  if (!ref.digest.empty()) return ref.digest;
  Response r = impl_->call(ref, "HEAD", fmt::format("/v2/{}/manifests/{}", ref.repository(), ref.tag), kMaxErrorBytes,
                           {fmt::format("Accept: {}", kManifestAccept)},
                           fmt::format("manifest {}:{}", ref.repository(), ref.tag), {});
  std::string digest = r.header("docker-content-digest");
  if (is_digest(digest)) return digest;
  std::string content_type;
  return impl_->manifest(ref, ref.tag, content_type, {}).first;
}

namespace {

// Where a download into `fd` resumes: the bytes an earlier, cut download left, hashed again into `hash` (the digest
// covers the whole blob); 0 when the file is longer than the blob.
std::uint64_t resume_point(int fd, const std::filesystem::path& file, std::uint64_t blob_size, Sha256& hash) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_errno_fmt(errno, "registry download: stat {}", file.string());
  const auto have = static_cast<std::uint64_t>(st.st_size);
  if (have > blob_size) {
    if (::ftruncate(fd, 0) != 0) throw_errno_fmt(errno, "registry download: truncate {}", file.string());
    return 0;
  }
  std::vector<char> buf(1 << 20);
  std::uint64_t pos = 0;
  while (pos < have) {
    ssize_t n = ::pread(fd, buf.data(), std::min<std::uint64_t>(buf.size(), have - pos), static_cast<off_t>(pos));
    if (n <= 0) break;
    hash.update(buf.data(), static_cast<std::size_t>(n));
    pos += static_cast<std::uint64_t>(n);
  }
  return pos;
}

}  // namespace

std::uint64_t RegistryClient::download_blob(const ImageReference& ref, const Descriptor& blob,
                                            const std::filesystem::path& file,
                                            const std::function<void(std::uint64_t)>& progress,
                                            const CancelFn& cancelled) {
  UniqueFd fd(::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
  if (!fd) throw_errno_fmt(errno, "registry download: open {}", file.string());
  Sha256 hash;
  std::uint64_t pos = resume_point(fd.get(), file, blob.size, hash);
  const std::string what = fmt::format("blob {} of {}", blob.digest, ref.repository());
  std::uint64_t received = 0;
  bool too_long = false;
  std::optional<Error> write_error;
  bool first_bytes = true;  // of the attempt's answer
  auto sink = [&](long status, const char* data, std::size_t n) {
    const bool first = std::exchange(first_bytes, false);
    if (first && status == 200 && pos > 0) {
      // The registry ignored Range and sends the whole blob: take it from byte 0.
      if (::ftruncate(fd.get(), 0) != 0) {
        int err = errno;
        write_error = Error(code_for_errno(err),
                            fmt::format("registry download: truncate {}: {}", file.string(), std::strerror(err)));
        return false;
      }
      pos = 0;
      hash = Sha256();
    }
    if (pos + n > blob.size) {
      too_long = true;
      return false;
    }
    ssize_t w = retry_eintr([&] { return ::pwrite(fd.get(), data, n, static_cast<off_t>(pos)); });
    if (w != static_cast<ssize_t>(n)) {
      int err = w < 0 ? errno : ENOSPC;
      write_error =
          Error(code_for_errno(err), fmt::format("registry download: write {}: {}", file.string(), std::strerror(err)));
      return false;
    }
    hash.update(data, n);
    pos += n;
    received += n;
    if (progress) progress(pos);
    return true;
  };
  // Every attempt asks for the bytes after those the file holds (an attempt that broke may have added some).
  auto range = [&](std::vector<std::string>& headers) {
    first_bytes = true;
    if (pos > 0) headers.push_back(fmt::format("Range: bytes={}-", pos));
  };
  // A download that broke after bringing bytes resumes from them; each such resume renews the attempts. A file
  // that holds the whole blob already (an earlier download ended just before its check) is only checked.
  for (int rounds = 0; pos < blob.size || (blob.size == 0 && rounds == 0); ++rounds) {
    const std::uint64_t start = pos;
    try {
      impl_->call(ref, "GET", fmt::format("/v2/{}/blobs/{}", ref.repository(), blob.digest), 0, {}, what, cancelled,
                  sink, range);
    } catch (const Error& e) {
      if (write_error) throw *write_error;
      if (too_long)
        throw Error(Code::kFailedPrecondition,
                    fmt::format("registry {}: {} is longer than the {} bytes its manifest says", ref.registry(), what,
                                blob.size));
      if (e.code() == Code::kUnavailable && pos > start && rounds < 64) continue;
      throw;
    }
    // An answer that ended whole by the registry's own account but short of the manifest's size: the blob is
    // shorter than the manifest says (a broken connection is an error above, and resumes).
    if (pos < blob.size)
      throw Error(Code::kFailedPrecondition, fmt::format("registry {}: {} ended at byte {} of the {} its manifest says",
                                                         ref.registry(), what, pos, blob.size));
    break;
  }
  std::string digest = hash.finish();
  if (pos != blob.size || digest != blob.digest) {
    ::unlink(file.c_str());
    throw Error(Code::kFailedPrecondition,
                fmt::format("registry {}: {}: the {} bytes served hash to {}, not to the digest the manifest names",
                            ref.registry(), what, pos, digest));
  }
  return received;
}

}  // namespace dsec::image::registry
