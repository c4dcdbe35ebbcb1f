#include "cluster/etcd_client.hpp"

#include <curl/curl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <algorithm>
#include <exception>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/protocol.hpp"
#include "http/curl.hpp"

namespace dsec::cluster {
namespace {

namespace curl = http::curl;
using curl::set;

using nlohmann::json;
using std::chrono::duration_cast;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// TCP keepalive on every connection: a member whose host died (no FIN, no RST) is noticed in about
// kKeepIdle + kKeepCount * kKeepInterval seconds even on a silent watch stream.
constexpr long kKeepIdleSeconds = 5;
constexpr long kKeepIntervalSeconds = 2;
constexpr int kKeepCount = 3;
constexpr std::size_t kMaxAnswerBytes = 64u << 20;
constexpr std::size_t kMaxIdleHandles = 8;
constexpr std::size_t kMaxErrorBodyBytes = 64u << 10;

// The headers of every request. hasleader: a member cut off from the cluster's leader refuses (UNAVAILABLE) instead
// of answering stale data or keeping a watch open that will never see another event.
struct EtcdHeaders : curl::HeaderList {
  EtcdHeaders() {
    for (const char* h :
         {"Content-Type: application/json", "Accept: application/json", "Expect:", "Grpc-Metadata-hasleader: true"})
      add(h);
  }
};

int set_keepalive_count(void*, curl_socket_t fd, curlsocktype) {
  int count = kKeepCount;
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  return CURL_SOCKOPT_OK;
}

void common_options(CURL* h, const std::string& url, const EtcdHeaders& headers, const std::string& body, char* errbuf,
                    const EtcdOptions& options) {
  curl::start_transfer(h, {.url = url.c_str(),
                           .user_agent = "dsec-etcd/0.1.0",
                           .ca_file = options.ca_file.c_str(),
                           .client_cert = options.client_cert.c_str(),
                           .client_key = options.client_key.c_str(),
                           .headers = &headers,
                           .error_buffer = errbuf});
  set(h, CURLOPT_TCP_KEEPIDLE, kKeepIdleSeconds);
  set(h, CURLOPT_TCP_KEEPINTVL, kKeepIntervalSeconds);
  set(h, CURLOPT_SOCKOPTFUNCTION, &set_keepalive_count);
  set(h, CURLOPT_POST, 1L);
  set(h, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(body.size()));
  set(h, CURLOPT_POSTFIELDS, body.c_str());
}

std::size_t collect(char* data, std::size_t size, std::size_t count, void* user) {
  auto* out = static_cast<std::string*>(user);
  if (out->size() + size * count > kMaxAnswerBytes) return 0;
  out->append(data, size * count);
  return size * count;
}

// etcd's JSON gateway writes int64 fields as strings and leaves out fields that hold their default.
std::int64_t i64(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return 0;
  if (it->is_number_integer()) return it->get<std::int64_t>();
  if (it->is_string()) {
    const auto& s = it->get_ref<const std::string&>();
    try {
      std::size_t used = 0;
      long long v = std::stoll(s, &used);
      if (used == s.size()) return v;
    } catch (const std::exception&) {
    }
  }
  throw Error(Code::kInternal, fmt::format("etcd answered a malformed '{}': {}", name, it->dump()));
}

std::string b64(const json& j, const char* name) {
  auto it = j.find(name);
  if (it == j.end() || !it->is_string()) return {};
  try {
    return protocol::base64_decode(it->get_ref<const std::string&>());
  } catch (const Error& e) {
    throw Error(Code::kInternal, fmt::format("etcd answered a malformed '{}': {}", name, e.what()));
  }
}

KeyValue decode_kv(const json& j) {
  KeyValue kv;
  kv.key = b64(j, "key");
  kv.value = b64(j, "value");
  kv.create_revision = i64(j, "create_revision");
  kv.mod_revision = i64(j, "mod_revision");
  kv.version = i64(j, "version");
  kv.lease = i64(j, "lease");
  return kv;
}

// gRPC status codes (which etcd answers with) are dsec's codes by number; anything unknown is UNKNOWN.
Code code_from_grpc(std::int64_t grpc) {
  if (grpc >= static_cast<int>(Code::kCancelled) && grpc <= static_cast<int>(Code::kUnauthenticated))
    return static_cast<Code>(grpc);
  return Code::kUnknown;
}

// The error etcd answered: {"error": "...", "code": 5, "message": "..."} for unary calls, {"error": {"grpc_code":
// 14, "message": "..."}} inside a stream.
Error etcd_error(const json& j, long http_status, std::string_view endpoint) {
  Code code = Code::kUnknown;
  std::string message;
  if (j.is_object()) {
    if (auto e = j.find("error"); e != j.end() && e->is_object()) {
      code = code_from_grpc(e->value("grpc_code", 2));
      message = e->value("message", "");
    } else {
      if (auto c = j.find("code"); c != j.end() && c->is_number_integer()) code = code_from_grpc(c->get<int>());
      message = j.value("message", j.value("error", std::string{}));
    }
  }
  if (message.empty()) message = fmt::format("HTTP {}", http_status);
  if (code == Code::kUnknown && http_status == 503) code = Code::kUnavailable;
  return Error(code, fmt::format("etcd {}: {}", endpoint, message));
}

bool valid_endpoint(const std::string& e) {
  return (e.rfind("http://", 0) == 0 && e.size() > 7) || (e.rfind("https://", 0) == 0 && e.size() > 8);
}

}  // namespace

EtcdClient::EtcdClient(EtcdOptions options)
    : options_(std::move(options)), handles_(std::make_unique<curl::HandlePool>(kMaxIdleHandles)) {
  curl::global_init("the etcd client");
  if (options_.endpoints.empty()) throw Error(Code::kInvalidArgument, "etcd: no endpoint given");
  for (auto& e : options_.endpoints) {
    if (!valid_endpoint(e))
      throw Error(Code::kInvalidArgument,
                  fmt::format("etcd endpoint '{}' is not an http:// or https:// URL such as http://127.0.0.1:2379", e));
    while (e.size() > 8 && e.back() == '/') e.pop_back();
  }
  if (options_.request_timeout.count() <= 0)
    throw Error(Code::kInvalidArgument, "etcd: request timeout must be positive");
  if (options_.connect_timeout.count() <= 0) options_.connect_timeout = options_.request_timeout;
}

EtcdClient::~EtcdClient() = default;

std::string EtcdClient::prefix_end(std::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    auto& c = reinterpret_cast<unsigned char&>(end.back());
    if (c < 0xff) {
      ++c;
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key (etcd's "\0" range end)
}

std::string EtcdClient::current_endpoint() const {
  return options_.endpoints[preferred_.load() % options_.endpoints.size()];
}

std::string EtcdClient::call(std::string_view path, const std::string& body) {
  const auto deadline = Clock::now() + options_.request_timeout;
  const std::size_t n = options_.endpoints.size();
  const std::size_t first = preferred_.load();
  std::vector<std::string> failures;

  curl::HandlePool::Lease lease(*handles_);
  CURL* h = lease.get();
  EtcdHeaders headers;
  for (std::size_t i = 0; i < n; ++i) {
    const std::size_t index = (first + i) % n;
    const std::string& endpoint = options_.endpoints[index];
    auto remaining = duration_cast<milliseconds>(deadline - Clock::now()).count();
    if (remaining <= 0) {
      failures.push_back(
          fmt::format("{}: not tried, the request's {} ms were spent", endpoint, options_.request_timeout.count()));
      continue;
    }
    // A member that hangs must leave time for the others.
    long attempt_ms = static_cast<long>(
        std::max<long long>(remaining / static_cast<long long>(n - i), std::min<long long>(remaining, 500)));
    std::string answer;
    char errbuf[CURL_ERROR_SIZE] = {0};
    std::string url = endpoint + std::string(path);
    common_options(h, url, headers, body, errbuf, options_);
    set(h, CURLOPT_TIMEOUT_MS, attempt_ms);
    set(h, CURLOPT_CONNECTTIMEOUT_MS, std::min<long>(attempt_ms, static_cast<long>(options_.connect_timeout.count())));
    set(h, CURLOPT_WRITEFUNCTION, &collect);
    set(h, CURLOPT_WRITEDATA, static_cast<void*>(&answer));
    CURLcode rc = curl_easy_perform(h);
    if (rc != CURLE_OK) {
      failures.push_back(fmt::format("{}: {}", endpoint, curl::describe(rc, errbuf)));
      continue;
    }
    const long status = curl::response_code(h);
    json j = json::parse(answer, nullptr, false);
    if (status == 200 && j.is_object()) {
      preferred_.store(index);
      return answer;
    }
    Error e = j.is_discarded() ? Error(status == 503 ? Code::kUnavailable : Code::kInternal,
                                       fmt::format("etcd {}: HTTP {} with a body that is not JSON: {}", endpoint,
                                                   status, answer.substr(0, 200)))
                               : etcd_error(j, status, endpoint);
    // A member without a leader (or shutting down) cannot answer; another member may.
    if (e.code() == Code::kUnavailable) {
      failures.push_back(e.what());
      continue;
    }
    throw e;
  }
  std::string all;
  for (const auto& f : failures) all += (all.empty() ? "" : "; ") + f;
  throw Error(Code::kUnavailable, fmt::format("etcd cannot be reached for {}: {}", path, all));
}

Lease EtcdClient::grant_lease(std::chrono::seconds ttl) {
  if (ttl.count() <= 0) throw Error(Code::kInvalidArgument, "etcd lease TTL must be at least 1 s");
  json j = json::parse(call("/v3/lease/grant", json{{"TTL", ttl.count()}}.dump()));
  if (j.contains("error") && j["error"].is_string() && !j["error"].get_ref<const std::string&>().empty())
    throw Error(Code::kResourceExhausted, fmt::format("etcd refused a lease: {}", j["error"].get<std::string>()));
  Lease lease{i64(j, "ID"), i64(j, "TTL")};
  if (lease.id == 0) throw Error(Code::kInternal, "etcd granted a lease without an ID");
  return lease;
}

std::int64_t EtcdClient::keepalive(std::int64_t lease_id) {
  // A bidirectional stream in gRPC; through the gateway one request gives one answer: {"result": {..., "TTL"}}.
  std::string answer = call("/v3/lease/keepalive", json{{"ID", std::to_string(lease_id)}}.dump());
  auto line_end = answer.find('\n');
  json j = json::parse(answer.substr(0, line_end), nullptr, false);
  if (!j.is_object())
    throw Error(Code::kInternal, fmt::format("etcd keepalive answer is not JSON: {}", answer.substr(0, 200)));
  if (j.contains("error")) throw etcd_error(j, 200, current_endpoint());
  auto r = j.find("result");
  if (r == j.end() || !r->is_object()) return 0;
  return i64(*r, "TTL");
}

void EtcdClient::revoke_lease(std::int64_t lease_id) {
  try {
    call("/v3/lease/revoke", json{{"ID", std::to_string(lease_id)}}.dump());
  } catch (const Error& e) {
    if (e.code() != Code::kNotFound) throw;
  }
}

std::int64_t EtcdClient::put(std::string_view key, std::string_view value, std::int64_t lease_id) {
  json req{{"key", protocol::base64_encode(key)}, {"value", protocol::base64_encode(value)}};
  if (lease_id != 0) req["lease"] = std::to_string(lease_id);
  json j = json::parse(call("/v3/kv/put", req.dump()));
  return j.contains("header") ? i64(j["header"], "revision") : 0;
}

namespace {

RangeResult decode_range(const json& j) {
  RangeResult r;
  if (auto h = j.find("header"); h != j.end() && h->is_object()) r.revision = i64(*h, "revision");
  if (auto kvs = j.find("kvs"); kvs != j.end() && kvs->is_array())
    for (const auto& kv : *kvs) r.kvs.push_back(decode_kv(kv));
  r.count = i64(j, "count");
  return r;
}

}  // namespace

RangeResult EtcdClient::get(std::string_view key, std::int64_t revision) {
  json req{{"key", protocol::base64_encode(key)}};
  if (revision > 0) req["revision"] = std::to_string(revision);
  return decode_range(json::parse(call("/v3/kv/range", req.dump())));
}

RangeResult EtcdClient::range_prefix(std::string_view prefix, std::int64_t revision) {
  json req{{"key", protocol::base64_encode(prefix)}, {"range_end", protocol::base64_encode(prefix_end(prefix))}};
  if (revision > 0) req["revision"] = std::to_string(revision);
  return decode_range(json::parse(call("/v3/kv/range", req.dump())));
}

std::int64_t EtcdClient::delete_key(std::string_view key) {
  json j = json::parse(call("/v3/kv/deleterange", json{{"key", protocol::base64_encode(key)}}.dump()));
  return i64(j, "deleted");
}

std::int64_t EtcdClient::delete_prefix(std::string_view prefix) {
  json req{{"key", protocol::base64_encode(prefix)}, {"range_end", protocol::base64_encode(prefix_end(prefix))}};
  json j = json::parse(call("/v3/kv/deleterange", req.dump()));
  return i64(j, "deleted");
}

void EtcdClient::compact(std::int64_t revision) {
  call("/v3/kv/compaction", json{{"revision", std::to_string(revision)}, {"physical", true}}.dump());
}

std::unique_ptr<EtcdWatch> EtcdClient::watch_prefix(std::string prefix, std::int64_t start_revision,
                                                    WatchCallbacks callbacks, WatchOptions options) {
  if (!callbacks.on_event) throw Error(Code::kInvalidArgument, "etcd watch: on_event is required");
  std::unique_ptr<EtcdWatch> w(new EtcdWatch(*this, std::move(prefix), start_revision, std::move(callbacks), options));
  w->thread_ = std::thread([raw = w.get()] { raw->run(); });
  return w;
}

// ----------------------------------------------------------------------------------------------------------------
// Watch

EtcdWatch::EtcdWatch(EtcdClient& client, std::string prefix, std::int64_t start_revision, WatchCallbacks callbacks,
                     WatchOptions options)
    : client_(client),
      prefix_(std::move(prefix)),
      callbacks_(std::move(callbacks)),
      options_(options),
      next_revision_(start_revision) {
  if (options_.min_backoff.count() <= 0) options_.min_backoff = milliseconds(1);
  if (options_.max_backoff < options_.min_backoff) options_.max_backoff = options_.min_backoff;
}

EtcdWatch::~EtcdWatch() { stop(); }

void EtcdWatch::stop() {
  stopping_.store(true);
  {
    std::lock_guard lock(mu_);
    if (multi_) curl_multi_wakeup(static_cast<CURLM*>(multi_));
  }
  wake_.notify_all();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void EtcdWatch::sleep_for(milliseconds d) {
  std::unique_lock lock(mu_);
  wake_.wait_for(lock, d, [&] { return stopping_.load(); });
}

// What ended one watch stream.
struct EtcdWatch::StreamEnd {
  enum class Why { kBroken, kCompacted, kStopped } why = Why::kBroken;
  std::string message;
  Code code = Code::kUnavailable;
};

void EtcdWatch::run() {
  const std::size_t n = client_.options_.endpoints.size();
  std::size_t index = client_.preferred_.load() % n;
  milliseconds backoff = options_.min_backoff;
  bool resync_needed = options_.list_first;

  auto report = [&](const Error& e) {
    if (callbacks_.on_error) {
      try {
        callbacks_.on_error(e);
      } catch (...) {
      }
    }
  };

  while (!stopping_.load()) {
    if (resync_needed) {
      try {
        RangeResult now = client_.range_prefix(prefix_);
        if (stopping_.load()) break;
        if (callbacks_.on_resync) {
          try {
            callbacks_.on_resync(now.kvs, now.revision);
          } catch (const std::exception& e) {
            report(Error(Code::kInternal, fmt::format("etcd watch resync callback threw: {}", e.what())));
          }
        }
        next_revision_.store(now.revision + 1);
        resync_needed = false;
      } catch (const Error& e) {
        report(e);
        sleep_for(backoff);
        backoff = std::min(backoff * 2, options_.max_backoff);
        continue;
      }
    }

    const std::uint64_t connects_before = connects_.load();
    try {
      stream_once(client_.options_.endpoints[index]);
    } catch (const Error& e) {
      connected_.store(false);
      if (stopping_.load()) break;
      if (e.code() == Code::kOutOfRange) {
        // The history we would resume from is gone: re-list, then watch on from the listing's revision.
        resync_needed = true;
        continue;
      }
      report(e);
    }
    connected_.store(false);
    if (stopping_.load()) break;
    // A stream that was opened fine and broke later starts the backoff over; one that could not open grows it.
    if (connects_.load() != connects_before) backoff = options_.min_backoff;
    index = (index + 1) % n;
    sleep_for(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
  connected_.store(false);
}

namespace {

struct StreamState {
  EtcdWatch* watch = nullptr;
  CURL* handle = nullptr;
  std::string buffer;                           // bytes of a 2xx stream not yet split into messages
  std::string error_body;                       // the body of a non-2xx answer
  std::function<bool(const json&)> on_message;  // false: abort the stream
};

std::size_t stream_write(char* data, std::size_t size, std::size_t count, void* user) {
  auto* s = static_cast<StreamState*>(user);
  const std::size_t n = size * count;
  if (curl::response_code(s->handle) != 200) {
    if (s->error_body.size() < kMaxErrorBodyBytes) s->error_body.append(data, n);
    return n;
  }
  s->buffer.append(data, n);
  if (s->buffer.size() > kMaxAnswerBytes) return 0;
  std::size_t start = 0;
  for (std::size_t nl; (nl = s->buffer.find('\n', start)) != std::string::npos; start = nl + 1) {
    std::string_view line(s->buffer.data() + start, nl - start);
    if (line.find_first_not_of(" \r\t") == std::string_view::npos) continue;
    json j = json::parse(line, nullptr, false);
    if (!s->on_message(j)) return 0;
  }
  s->buffer.erase(0, start);
  return n;
}

}  // namespace

void EtcdWatch::stream_once(const std::string& endpoint) {
  json create{{"key", protocol::base64_encode(prefix_)},
              {"range_end", protocol::base64_encode(EtcdClient::prefix_end(prefix_))}};
  if (next_revision_.load() > 0) create["start_revision"] = std::to_string(next_revision_.load());
  const std::string body = json{{"create_request", create}}.dump();

  CURL* h = curl_easy_init();
  CURLM* m = curl_multi_init();
  if (!h || !m) {
    if (h) curl_easy_cleanup(h);
    if (m) curl_multi_cleanup(m);
    throw Error(Code::kResourceExhausted, "etcd watch: out of memory for a curl handle");
  }
  struct Cleanup {
    EtcdWatch* w;
    CURL* h;
    CURLM* m;
    ~Cleanup() {
      {
        std::lock_guard lock(w->mu_);
        w->multi_ = nullptr;
      }
      curl_multi_remove_handle(m, h);
      curl_easy_cleanup(h);
      curl_multi_cleanup(m);
    }
  } cleanup{this, h, m};

  EtcdHeaders headers;
  char errbuf[CURL_ERROR_SIZE] = {0};
  const std::string url = endpoint + "/v3/watch";
  common_options(h, url, headers, body, errbuf, client_.options_);
  set(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(client_.options_.connect_timeout.count()));
  // No overall timeout: the stream lives as long as the watch. A member that stops answering is found by TCP
  // keepalive; one that has lost its leader cancels the stream itself (hasleader).

  StreamEnd end;
  bool ended = false;
  StreamState state;
  state.watch = this;
  state.handle = h;
  state.on_message = [&](const json& j) { return on_stream_message(j, endpoint, end, ended); };
  set(h, CURLOPT_WRITEFUNCTION, &stream_write);
  set(h, CURLOPT_WRITEDATA, static_cast<void*>(&state));

  if (curl_multi_add_handle(m, h) != CURLM_OK) throw Error(Code::kInternal, "etcd watch: curl_multi_add_handle failed");
  {
    std::lock_guard lock(mu_);
    multi_ = m;
  }
  int running = 1;
  while (running && !stopping_.load()) {
    if (curl_multi_perform(m, &running) != CURLM_OK) break;
    if (!running || stopping_.load()) break;
    curl_multi_poll(m, nullptr, 0, 1000, nullptr);
  }
  if (stopping_.load()) return;

  CURLcode rc = CURLE_OK;
  int left = 0;
  while (CURLMsg* msg = curl_multi_info_read(m, &left))
    if (msg->msg == CURLMSG_DONE) rc = msg->data.result;
  if (ended) {
    if (end.why == StreamEnd::Why::kCompacted) throw Error(Code::kOutOfRange, end.message);
    throw Error(end.code, end.message);
  }
  const long status = curl::response_code(h);
  if (status != 0 && status != 200) {
    json j = json::parse(state.error_body, nullptr, false);
    throw etcd_error(j, status, endpoint);
  }
  if (rc != CURLE_OK)
    throw Error(Code::kUnavailable, fmt::format("etcd {} watch: {}", endpoint, curl::describe(rc, errbuf)));
  throw Error(Code::kUnavailable, fmt::format("etcd {} ended the watch stream", endpoint));
}

bool EtcdWatch::on_stream_message(const json& j, const std::string& endpoint, StreamEnd& end, bool& ended) {
  if (!j.is_object()) {
    end = {StreamEnd::Why::kBroken, "etcd watch stream sent a message that is not JSON", Code::kInternal};
    ended = true;
    return false;
  }
  if (j.contains("error")) {
    Error e = etcd_error(j, 200, endpoint);
    end = {StreamEnd::Why::kBroken, e.what(), e.code()};
    ended = true;
    return false;
  }
  auto r = j.find("result");
  if (r == j.end() || !r->is_object()) return true;
  if (r->value("created", false)) on_stream_created(*r);
  if (auto ev = r->find("events"); ev != r->end() && ev->is_array()) {
    if (!deliver_events(*ev)) return false;
  }
  if (r->value("canceled", false)) {
    std::int64_t compact = i64(*r, "compact_revision");
    if (compact > 0)
      end = {StreamEnd::Why::kCompacted,
             fmt::format("revision {} was compacted (history starts at {})", next_revision_.load(), compact),
             Code::kOutOfRange};
    else
      end = {StreamEnd::Why::kBroken,
             fmt::format("etcd {} cancelled the watch: {}", endpoint,
                         r->value("cancel_reason", std::string("no reason given"))),
             Code::kUnavailable};
    ended = true;
    return false;
  }
  return true;
}

void EtcdWatch::on_stream_created(const json& r) {
  if (next_revision_.load() == 0) {
    if (auto hd = r.find("header"); hd != r.end() && hd->is_object()) next_revision_.store(i64(*hd, "revision") + 1);
  }
  connected_.store(true);
  connects_.fetch_add(1);
  if (callbacks_.on_connected) {
    try {
      callbacks_.on_connected();
    } catch (...) {
    }
  }
}

bool EtcdWatch::deliver_events(const json& events) {
  for (const auto& e : events) {
    if (stopping_.load()) return false;
    WatchEvent event;
    event.type = e.value("type", std::string("PUT")) == "DELETE" ? WatchEvent::Type::kDelete : WatchEvent::Type::kPut;
    if (auto kv = e.find("kv"); kv != e.end() && kv->is_object()) {
      event.key = b64(*kv, "key");
      event.value = b64(*kv, "value");
      event.mod_revision = i64(*kv, "mod_revision");
    }
    try {
      callbacks_.on_event(event);
    } catch (const std::exception& x) {
      if (callbacks_.on_error) {
        try {
          callbacks_.on_error(Error(Code::kInternal, fmt::format("etcd watch callback threw: {}", x.what())));
        } catch (...) {
        }
      }
    }
    if (event.mod_revision >= next_revision_.load()) next_revision_.store(event.mod_revision + 1);
  }
  return true;
}

}  // namespace dsec::cluster
