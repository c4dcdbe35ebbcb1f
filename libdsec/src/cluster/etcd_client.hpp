// A small client of etcd's v3 API through its JSON gateway (POST /v3/kv/range, /v3/kv/put, /v3/lease/grant, ...
// with base64 keys and values), on libcurl. dsec uses etcd only for discovery: agents register under a lease, clients
// list and watch the registrations. Several endpoints may be given (the members of one etcd cluster); a request that
// cannot reach one member tries the next, and the member that answered last is tried first next time.
//
// Every request is bounded by EtcdOptions::request_timeout. Errors are dsec::Error: UNAVAILABLE when no member could
// be reached (or the cluster has no leader), DEADLINE_EXCEEDED when the time ran out, the gRPC code etcd answered
// otherwise (NOT_FOUND for an unknown lease, OUT_OF_RANGE for a compacted revision, ...).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "dsec/error.hpp"

namespace dsec::http::curl {
class HandlePool;
}

namespace dsec::cluster {

struct EtcdOptions {
  // Client URLs of the cluster's members: "http://127.0.0.1:2379". At least one.
  std::vector<std::string> endpoints;
  // One request, through every member it tries.
  std::chrono::milliseconds request_timeout{5'000};
  // Connecting to one member; a member that does not answer in this time is skipped for the next.
  std::chrono::milliseconds connect_timeout{1'000};
  // TLS to https:// members: the CA bundle that signed their certificates (empty: the system's), and a client
  // certificate and key for a cluster started with --client-cert-auth.
  std::string ca_file;
  std::string client_cert;
  std::string client_key;
};

struct KeyValue {
  std::string key;
  std::string value;
  std::int64_t create_revision = 0;
  std::int64_t mod_revision = 0;
  std::int64_t version = 0;
  std::int64_t lease = 0;  // 0: not attached to a lease
};

struct RangeResult {
  std::vector<KeyValue> kvs;
  std::int64_t revision = 0;  // the store revision this answer reflects
  std::int64_t count = 0;
};

struct Lease {
  std::int64_t id = 0;
  std::int64_t ttl_seconds = 0;
};

struct WatchEvent {
  enum class Type { kPut, kDelete };
  Type type = Type::kPut;
  std::string key;
  std::string value;  // empty for a delete
  std::int64_t mod_revision = 0;
};

struct WatchCallbacks {
  // Each change, in revision order. Called on the watch's own thread.
  std::function<void(const WatchEvent&)> on_event;
  // The revisions the watch had to resume from were compacted away: here is the whole prefix as it is now (at
  // `revision`); the watch goes on from there. Whoever keeps state from events replaces it with this. When unset,
  // the watch resumes from the current revision and the compacted changes are lost.
  std::function<void(const std::vector<KeyValue>& kvs, std::int64_t revision)> on_resync;
  // The stream broke or could not be opened; the watch retries with backoff. For logs and tests.
  std::function<void(const Error& error)> on_error;
  // The stream is open (first time and after each reconnect).
  std::function<void()> on_connected;
};

struct WatchOptions {
  // Begin with a listing of the prefix (handed to on_resync) and watch from the revision after it: the way to keep
  // a table of the prefix. The listing is retried like a broken stream until etcd answers.
  bool list_first = false;
  std::chrono::milliseconds min_backoff{100};
  std::chrono::milliseconds max_backoff{2'000};
};

class EtcdWatch;

class EtcdClient {
 public:
  // Throws INVALID_ARGUMENT when no endpoint is given or one is not an http(s):// URL.
  explicit EtcdClient(EtcdOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // A lease that expires `ttl` after its last keepalive (etcd may grant a longer TTL than asked, never shorter).
  Lease grant_lease(std::chrono::seconds ttl);
  // Renews the lease; returns its TTL, or 0 when the lease no longer exists (expired or revoked).
  std::int64_t keepalive(std::int64_t lease_id);
  // Ends the lease and deletes every key attached to it. A lease that is already gone is not an error.
  void revoke_lease(std::int64_t lease_id);

  // Writes key = value, attached to `lease_id` when not 0 (NOT_FOUND when that lease is gone). Returns the
  // revision of the write.
  std::int64_t put(std::string_view key, std::string_view value, std::int64_t lease_id = 0);
  // One key (kvs holds 0 or 1 entries).
  RangeResult get(std::string_view key, std::int64_t revision = 0);
  // Every key that starts with `prefix`, sorted by key, as of `revision` (0: now). OUT_OF_RANGE when `revision`
  // was compacted.
  RangeResult range_prefix(std::string_view prefix, std::int64_t revision = 0);
  // Deletes one key / every key under a prefix; returns how many were deleted.
  std::int64_t delete_key(std::string_view key);
  std::int64_t delete_prefix(std::string_view prefix);
  // Discards the history before `revision` (what an operator's auto-compaction does).
  void compact(std::int64_t revision);

  // Watches every key under `prefix` from `start_revision` (0: from now) on a thread of its own until the returned
  // watch is stopped or destroyed. A broken stream is reopened (next member, growing backoff) from the revision
  // after the last event handed out, so no change is lost or repeated; a compacted revision re-lists the prefix
  // (on_resync) and watches on from there. This client must outlive the watch.
  std::unique_ptr<EtcdWatch> watch_prefix(std::string prefix, std::int64_t start_revision, WatchCallbacks callbacks,
                                          WatchOptions options = {});

  // The member that answered last (the first one tried by the next request).
  std::string current_endpoint() const;
  const EtcdOptions& options() const noexcept { return options_; }

  // The key just past every key that starts with `prefix` (etcd's range_end for a prefix).
  static std::string prefix_end(std::string_view prefix);

 private:
  friend class EtcdWatch;
  // POSTs `body` to `path` on the members in turn until one answers; returns the parsed JSON text of the answer.
  std::string call(std::string_view path, const std::string& body);

  EtcdOptions options_;
  std::atomic<std::size_t> preferred_{0};
  std::unique_ptr<http::curl::HandlePool> handles_;  // easy handles kept with their connections
};

// A running watch (see EtcdClient::watch_prefix). Callbacks run on its thread, never after stop() returns.
class EtcdWatch {
 public:
  ~EtcdWatch();
  EtcdWatch(const EtcdWatch&) = delete;
  EtcdWatch& operator=(const EtcdWatch&) = delete;

  // Ends the stream and joins the thread. Idempotent; must not be called from a callback.
  void stop();
  // The next revision the watch waits for.
  std::int64_t next_revision() const noexcept { return next_revision_.load(); }
  // Whether the stream is open now.
  bool connected() const noexcept { return connected_.load(); }
  // How many times the stream was (re)opened.
  std::uint64_t connects() const noexcept { return connects_.load(); }

 private:
  friend class EtcdClient;
  EtcdWatch(EtcdClient& client, std::string prefix, std::int64_t start_revision, WatchCallbacks callbacks,
            WatchOptions options);
  void run();
  // What ended one watch stream (etcd_client.cpp).
  struct StreamEnd;
  // One stream, from next_revision_ until it breaks, is cancelled by etcd, or stop() is called.
  void stream_once(const std::string& endpoint);
  // One message of the stream from `endpoint`; false ends the stream (`end` says why, unless stop() was called).
  bool on_stream_message(const nlohmann::json& message, const std::string& endpoint, StreamEnd& end, bool& ended);
  // The stream's "created" answer: the revision to resume from, when there was none, and on_connected.
  void on_stream_created(const nlohmann::json& result);
  // The stream's events to on_event, in order; false when stop() was called.
  bool deliver_events(const nlohmann::json& events);
  void sleep_for(std::chrono::milliseconds d);

  EtcdClient& client_;
  std::string prefix_;
  WatchCallbacks callbacks_;
  WatchOptions options_;
  std::atomic<std::int64_t> next_revision_;
  std::atomic<bool> connected_{false};
  std::atomic<std::uint64_t> connects_{0};
  std::atomic<bool> stopping_{false};
  std::mutex mu_;
  std::condition_variable wake_;
  void* multi_ = nullptr;  // CURLM*, woken by stop()
  std::thread thread_;
};

}  // namespace dsec::cluster
