// The agent's counters, gauges and latency histograms, rendered in the Prometheus text format for GET /metrics.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "dsec/network.hpp"
#include "http/server_events.hpp"

namespace dsec::agent {

// A latency histogram with fixed buckets in seconds (cumulative in the output, as Prometheus expects).
class LatencyHistogram {
 public:
  static constexpr std::array<double, 14> kBounds{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                                  0.1,    0.25,  0.5,    1,     2.5,  10,    60};
  void observe(double seconds);
  // Appends "<name>_bucket{<labels>le=...}" lines, _sum and _count. `labels` is empty or "k=\"v\",".
  void render(std::string& out, std::string_view name, std::string_view labels) const;

 private:
  mutable std::mutex mutex_;
  std::array<std::uint64_t, kBounds.size() + 1> counts_{};  // the last one is +Inf
  double sum_ = 0;
  std::uint64_t count_ = 0;
};

// The node's layer cache (agent/layers): updated by the cache and its FUSE file system, read when rendering.
struct LayerMetrics {
  std::atomic<std::uint64_t> chunk_fetches{0};    // chunks fetched from a store, checked and cached
  std::atomic<std::uint64_t> chunk_refetches{0};  // of those, chunks fetched again for the same cache entry (stays 0)
  std::atomic<std::uint64_t> fetched_bytes{0};    // stored (compressed) bytes read from stores
  std::atomic<std::uint64_t> chunk_errors{0};     // chunk fetches that failed (store errors, digest mismatches)
  std::atomic<std::uint64_t> cache_hits{0};       // chunk reads served from the local cache
  std::atomic<std::uint64_t> read_errors{0};      // reads answered with EIO by the layer file system
  std::atomic<std::uint64_t> evictions{0};        // layers evicted from the cache
};

class Metrics final : public ServerEvents {
 public:
  void count_request(std::string_view route, std::string_view method, int status) override;
  void sandbox_created(std::string_view kind, double seconds);
  void sandbox_create_error(std::string_view kind, std::string_view code);
  void sandbox_destroyed(std::string_view kind);
  void sandbox_failed(std::string_view kind);
  // A sandbox of an earlier agent run, at start-up: outcome "adopted", "failed", "rolled_back" or "destroyed".
  void sandbox_recovered(std::string_view kind, std::string_view outcome);
  void exec_done(std::string_view kind, double seconds);
  // A function call answered: its language, how it ended ("ok", "failed", "timed_out", "oom_killed",
  // "compile_error", or "error" when it could not run) and its run's wall time (0 for "error").
  void fncall_done(std::string_view language, std::string_view outcome, double seconds);
  std::uint64_t fncalls(std::string_view language, std::string_view outcome) const;
  void connection_opened() override { connections_.fetch_add(1, std::memory_order_relaxed); }
  void connection_closed() override { connections_.fetch_sub(1, std::memory_order_relaxed); }
  void connection_refused() override { connections_refused_.fetch_add(1, std::memory_order_relaxed); }
  void tls_handshake_failed() override { tls_handshakes_failed_.fetch_add(1, std::memory_order_relaxed); }
  // A request refused for its credentials (no token, a token that is not the node's: 401).
  void unauthenticated() { unauthenticated_.fetch_add(1, std::memory_order_relaxed); }

  // `live` maps kind -> live sandboxes (the registry's gauge, read when rendering).
  std::string render(const std::map<std::string, std::uint64_t, std::less<>>& live) const;

  // Sections rendered after the agent's own, each appending Prometheus text (the sandboxes' networks).
  void add_source(std::function<void(std::string&)> source);
  // Per sandbox: dsec_sandbox_network_bytes_total{sandbox,direction}, ..._packets_total, ..._refused_total.
  static void render_network_usage(std::string& out, const std::map<std::string, NetworkUsage>& usage);

  LayerMetrics& layers() noexcept { return layers_; }
  const LayerMetrics& layers() const noexcept { return layers_; }

  // For tests and the node's own introspection.
  std::uint64_t requests(std::string_view route, std::string_view method, int status) const;
  std::uint64_t created(std::string_view kind) const;
  std::uint64_t destroyed(std::string_view kind) const;
  std::uint64_t recovered(std::string_view kind, std::string_view outcome) const;

 private:
  using Counters = std::map<std::string, std::uint64_t, std::less<>>;
  static void bump(Counters& counters, std::string_view key);

  mutable std::mutex mutex_;
  std::map<std::tuple<std::string, std::string, int>, std::uint64_t> requests_;
  Counters created_, destroyed_, failed_;
  std::map<std::pair<std::string, std::string>, std::uint64_t> create_errors_;  // (kind, code)
  std::map<std::pair<std::string, std::string>, std::uint64_t> recovered_;      // (kind, outcome)
  LatencyHistogram create_latency_;
  LatencyHistogram exec_latency_;
  std::map<std::pair<std::string, std::string>, std::uint64_t> fncalls_;  // (language, outcome)
  LatencyHistogram fncall_latency_;
  std::atomic<std::int64_t> connections_{0};
  std::atomic<std::uint64_t> connections_refused_{0};
  std::atomic<std::uint64_t> tls_handshakes_failed_{0};
  std::atomic<std::uint64_t> unauthenticated_{0};
  LayerMetrics layers_;
  std::vector<std::function<void(std::string&)>> sources_;  // guarded by mutex_
};

}  // namespace dsec::agent
