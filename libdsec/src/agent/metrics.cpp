#include "agent/metrics.hpp"

#include <fmt/format.h>

namespace dsec::agent {
namespace {

// Label values are escaped as the text format requires: backslash, double quote and newline.
std::string escape_label(std::string_view v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out.push_back(c);
  }
  return out;
}

void header(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void render_by_kind(std::string& out, std::string_view name, std::string_view help,
                    const std::map<std::string, std::uint64_t, std::less<>>& counters) {
  header(out, name, "counter", help);
  for (const auto& [kind, n] : counters) out += fmt::format("{}{{kind=\"{}\"}} {}\n", name, escape_label(kind), n);
}

}  // namespace

void LatencyHistogram::observe(double seconds) {
  std::size_t i = 0;
  while (i < kBounds.size() && seconds > kBounds[i]) ++i;
  std::lock_guard lock(mutex_);
  ++counts_[i];
  sum_ += seconds;
  ++count_;
}

void LatencyHistogram::render(std::string& out, std::string_view name, std::string_view labels) const {
  std::lock_guard lock(mutex_);
  std::uint64_t cumulative = 0;
  for (std::size_t i = 0; i < kBounds.size(); ++i) {
    cumulative += counts_[i];
    out += fmt::format("{}_bucket{{{}le=\"{}\"}} {}\n", name, labels, kBounds[i], cumulative);
  }
  cumulative += counts_[kBounds.size()];
  out += fmt::format("{}_bucket{{{}le=\"+Inf\"}} {}\n", name, labels, cumulative);
  // _sum and _count carry the same labels without the trailing ','.
  std::string plain = labels.empty() ? std::string{} : fmt::format("{{{}}}", labels.substr(0, labels.size() - 1));
  out += fmt::format("{}_sum{} {}\n", name, plain, sum_);
  out += fmt::format("{}_count{} {}\n", name, plain, count_);
}

void Metrics::bump(Counters& counters, std::string_view key) {
  auto it = counters.find(key);
  if (it == counters.end()) it = counters.emplace(std::string(key), 0).first;
  ++it->second;
}

void Metrics::count_request(std::string_view route, std::string_view method, int status) {
  std::lock_guard lock(mutex_);
  ++requests_[{std::string(route), std::string(method), status}];
}

void Metrics::sandbox_created(std::string_view kind, double seconds) {
  {
    std::lock_guard lock(mutex_);
    bump(created_, kind);
  }
  create_latency_.observe(seconds);
}

void Metrics::sandbox_create_error(std::string_view kind, std::string_view code) {
  std::lock_guard lock(mutex_);
  ++create_errors_[{std::string(kind), std::string(code)}];
}

void Metrics::sandbox_destroyed(std::string_view kind) {
  std::lock_guard lock(mutex_);
  bump(destroyed_, kind);
}

void Metrics::sandbox_failed(std::string_view kind) {
  std::lock_guard lock(mutex_);
  bump(failed_, kind);
}

void Metrics::sandbox_recovered(std::string_view kind, std::string_view outcome) {
  std::lock_guard lock(mutex_);
  ++recovered_[{std::string(kind), std::string(outcome)}];
}

void Metrics::exec_done(std::string_view kind, double seconds) { exec_latency_.observe(seconds); }

void Metrics::fncall_done(std::string_view language, std::string_view outcome, double seconds) {
  {
    std::lock_guard lock(mutex_);
    ++fncalls_[{std::string(language), std::string(outcome)}];
  }
  if (outcome != "error") fncall_latency_.observe(seconds);
}

std::uint64_t Metrics::fncalls(std::string_view language, std::string_view outcome) const {
  std::lock_guard lock(mutex_);
  auto it = fncalls_.find({std::string(language), std::string(outcome)});
  return it == fncalls_.end() ? 0 : it->second;
}

std::uint64_t Metrics::requests(std::string_view route, std::string_view method, int status) const {
  std::lock_guard lock(mutex_);
  auto it = requests_.find({std::string(route), std::string(method), status});
  return it == requests_.end() ? 0 : it->second;
}

std::uint64_t Metrics::created(std::string_view kind) const {
  std::lock_guard lock(mutex_);
  auto it = created_.find(kind);
  return it == created_.end() ? 0 : it->second;
}

std::uint64_t Metrics::destroyed(std::string_view kind) const {
  std::lock_guard lock(mutex_);
  auto it = destroyed_.find(kind);
  return it == destroyed_.end() ? 0 : it->second;
}

std::uint64_t Metrics::recovered(std::string_view kind, std::string_view outcome) const {
  std::lock_guard lock(mutex_);
  auto it = recovered_.find({std::string(kind), std::string(outcome)});
  return it == recovered_.end() ? 0 : it->second;
}

std::string Metrics::render(const std::map<std::string, std::uint64_t, std::less<>>& live) const {
  std::string out;
  out.reserve(4096);
  {
    std::lock_guard lock(mutex_);
    header(out, "dsec_requests_total", "counter", "HTTP requests answered, by route template, method and status.");
    for (const auto& [key, n] : requests_) {
      const auto& [route, method, status] = key;
      out += fmt::format("dsec_requests_total{{route=\"{}\",method=\"{}\",code=\"{}\"}} {}\n", escape_label(route),
                         escape_label(method), status, n);
    }
    render_by_kind(out, "dsec_sandboxes_created_total", "Sandboxes created.", created_);
    render_by_kind(out, "dsec_sandboxes_destroyed_total", "Sandboxes destroyed (by request, TTL or shutdown).",
                   destroyed_);
    render_by_kind(out, "dsec_sandboxes_failed_total", "Live sandboxes found dead (their processes gone).", failed_);
    header(out, "dsec_sandbox_create_errors_total", "counter", "Creates refused or failed, by error code.");
    for (const auto& [key, n] : create_errors_)
      out += fmt::format("dsec_sandbox_create_errors_total{{kind=\"{}\",code=\"{}\"}} {}\n", escape_label(key.first),
                         key.second, n);
    header(out, "dsec_sandboxes_recovered_total", "counter",
           "Sandboxes of an earlier agent run found at start-up, by what became of them.");
    for (const auto& [key, n] : recovered_)
      out += fmt::format("dsec_sandboxes_recovered_total{{kind=\"{}\",outcome=\"{}\"}} {}\n", escape_label(key.first),
                         key.second, n);
    header(out, "dsec_fncalls_total", "counter", "Function calls answered, by language and how they ended.");
    for (const auto& [key, n] : fncalls_)
      out += fmt::format("dsec_fncalls_total{{language=\"{}\",outcome=\"{}\"}} {}\n", escape_label(key.first),
                         escape_label(key.second), n);
  }
  header(out, "dsec_fncall_seconds", "histogram", "Wall time of function calls' runs (compiles excluded).");
  fncall_latency_.render(out, "dsec_fncall_seconds", "");
  header(out, "dsec_sandboxes_live", "gauge", "Sandboxes on this node now (running or failed, not yet destroyed).");
  for (const auto& [kind, n] : live)
    out += fmt::format("dsec_sandboxes_live{{kind=\"{}\"}} {}\n", escape_label(kind), n);
  header(out, "dsec_sandbox_create_seconds", "histogram", "Time from a create request to a ready sandbox.");
  create_latency_.render(out, "dsec_sandbox_create_seconds", "");
  header(out, "dsec_exec_seconds", "histogram", "Time of one exec, request to result.");
  exec_latency_.render(out, "dsec_exec_seconds", "");
  header(out, "dsec_connections", "gauge", "Open client connections.");
  out += fmt::format("dsec_connections {}\n", connections_.load(std::memory_order_relaxed));
  header(out, "dsec_connections_refused_total", "counter", "Connections refused beyond max_connections.");
  out += fmt::format("dsec_connections_refused_total {}\n", connections_refused_.load(std::memory_order_relaxed));
  auto counter = [&](std::string_view name, std::string_view help, const std::atomic<std::uint64_t>& value) {
    header(out, name, "counter", help);
    out += fmt::format("{} {}\n", name, value.load(std::memory_order_relaxed));
  };
  counter("dsec_tls_handshakes_failed_total",
          "TCP connections whose TLS handshake failed (no or a wrong client "
          "certificate, a client that is not speaking TLS, a stalled handshake).",
          tls_handshakes_failed_);
  counter("dsec_requests_unauthenticated_total", "Requests refused for their credentials (401 UNAUTHENTICATED).",
          unauthenticated_);
  counter("dsec_layer_chunk_fetches_total", "Layer chunks fetched from a store, checked and cached.",
          layers_.chunk_fetches);
  counter("dsec_layer_chunk_refetches_total",
          "Layer chunks fetched again while the layer stayed cached (readers of one chunk share a fetch: stays 0).",
          layers_.chunk_refetches);
  counter("dsec_layer_fetched_bytes_total", "Stored (compressed) layer bytes read from stores.", layers_.fetched_bytes);
  counter("dsec_layer_chunk_errors_total", "Layer chunk fetches that failed (store errors, digest mismatches).",
          layers_.chunk_errors);
  counter("dsec_layer_cache_hits_total", "Layer chunk reads served from the local cache.", layers_.cache_hits);
  counter("dsec_layer_read_errors_total", "Reads of a layer answered with EIO (a chunk could not be fetched).",
          layers_.read_errors);
  counter("dsec_layer_evictions_total", "Layers evicted from the local cache.", layers_.evictions);
  std::vector<std::function<void(std::string&)>> sources;
  {
    std::lock_guard lock(mutex_);
    sources = sources_;
  }
  for (const auto& source : sources) source(out);
  return out;
}

void Metrics::add_source(std::function<void(std::string&)> source) {
  std::lock_guard lock(mutex_);
  sources_.push_back(std::move(source));
}

void Metrics::render_network_usage(std::string& out, const std::map<std::string, NetworkUsage>& usage) {
  header(out, "dsec_sandbox_network_bytes_total", "counter",
         "Bytes a sandbox's network link carried since it was made, by direction (out: sent by the sandbox).");
  for (const auto& [id, u] : usage)
    out += fmt::format(
        "dsec_sandbox_network_bytes_total{{sandbox=\"{0}\",direction=\"out\"}} {1}\n"
        "dsec_sandbox_network_bytes_total{{sandbox=\"{0}\",direction=\"in\"}} {2}\n",
        escape_label(id), u.bytes_out, u.bytes_in);
  header(out, "dsec_sandbox_network_packets_total", "counter", "Packets a sandbox's network link carried.");
  for (const auto& [id, u] : usage)
    out += fmt::format(
        "dsec_sandbox_network_packets_total{{sandbox=\"{0}\",direction=\"out\"}} {1}\n"
        "dsec_sandbox_network_packets_total{{sandbox=\"{0}\",direction=\"in\"}} {2}\n",
        escape_label(id), u.packets_out, u.packets_in);
  header(out, "dsec_sandbox_network_refused_total", "counter",
         "Packets of new connections a sandbox's rules (or what is always blocked) refused, since the agent started.");
  for (const auto& [id, u] : usage)
    out += fmt::format("dsec_sandbox_network_refused_total{{sandbox=\"{}\"}} {}\n", escape_label(id), u.refused);
}

}  // namespace dsec::agent
