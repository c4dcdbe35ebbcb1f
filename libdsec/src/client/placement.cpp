// The built-in placement policies, spread and pack: static filters once per node, then a heap of the nodes that fit,
// keyed by (anti-affinity peers, score); each pick updates only the chosen node, which goes back into the heap.
#include "dsec/placement.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dsec/error.hpp"

namespace dsec {
namespace {

constexpr double kCpuEpsilon = 1e-9;
constexpr std::size_t kNodesNamedInErrors = 16;

std::string bytes_text(double bytes) {
  if (bytes >= static_cast<double>(1ull << 30)) return fmt::format("{:.1f}Gi", bytes / static_cast<double>(1ull << 30));
  return fmt::format("{:.0f}Mi", bytes / static_cast<double>(1ull << 20));
}

double cpu_capacity(const NodeInfo& n) { return static_cast<double>(n.cores) * n.cpu_overcommit; }
double memory_capacity(const NodeInfo& n) { return static_cast<double>(n.memory_bytes) * n.memory_overcommit; }

// What never changes while one request is placed: health, kind, node selector.
std::string static_refusal(const SandboxSpec& spec, const NodeCandidate& node) {
  if (!node.healthy) return "unhealthy: unreachable, ejected or not reported yet";
  const auto& backends = node.info.backends;
  if (std::find(backends.begin(), backends.end(), spec.kind) == backends.end())
    return fmt::format("kind: does not serve '{}' (serves: {})", spec.kind,
                       backends.empty() ? std::string("nothing") : fmt::format("{}", fmt::join(backends, ", ")));
  const NodePressure& p = node.info.pressure;
  if (p.psi && p.memory_full >= kMemoryFullRefusal)
    return fmt::format("memory pressure: every task stalled on memory {:.1f}% of the last 10 s (refused from {:.0f}%)",
                       p.memory_full, kMemoryFullRefusal);
  for (const auto& [key, value] : spec.node_selector) {
    auto it = node.info.labels.find(key);
    if (it == node.info.labels.end()) return fmt::format("node_selector: no label '{}'", key);
    if (it->second != value) return fmt::format("node_selector: label {}={}, not {}={}", key, it->second, key, value);
  }
  return {};
}

// The node's load as one placement call sees it: its report, the caller's placements since, and this call's picks.
struct Usage {
  double cpu = 0;
  double memory = 0;
  std::uint64_t gpus = 0;  // held: reported as not free, plus placed
};

Usage usage_of(const NodeCandidate& node) {
  Usage u;
  u.cpu = node.info.cpu_requested + node.cpu_placed;
  u.memory = static_cast<double>(node.info.memory_requested) + static_cast<double>(node.memory_placed);
  u.gpus =
      static_cast<std::uint64_t>(node.info.gpus - std::min(node.info.gpus, node.info.gpus_free)) + node.gpus_placed;
  return u;
}

// Why one more sandbox of `r` does not fit on top of `u`; empty when it does.
std::string capacity_refusal(const Resources& r, const NodeInfo& info, const Usage& u) {
  if (r.gpus > 0) {
    std::uint64_t free = info.gpus > u.gpus ? info.gpus - u.gpus : 0;
    if (free < r.gpus) return fmt::format("gpus: {} free of {}, {} wanted", free, info.gpus, r.gpus);
  }
  const double cpu_cap = cpu_capacity(info);
  if (u.cpu + r.cpu > cpu_cap + kCpuEpsilon)
    return fmt::format("cpu: {:.2f} + {} cores requested would pass {:.2f} ({} cores x cpu_overcommit {})", u.cpu,
                       r.cpu, cpu_cap, info.cores, info.cpu_overcommit);
  const double memory_cap = memory_capacity(info);
  if (u.memory + static_cast<double>(r.memory_bytes) > memory_cap + 0.5)
    return fmt::format("memory: {} + {} requested would pass {} ({} x memory_overcommit {})", bytes_text(u.memory),
                       bytes_text(static_cast<double>(r.memory_bytes)), bytes_text(memory_cap),
                       bytes_text(static_cast<double>(info.memory_bytes)), info.memory_overcommit);
  return {};
}

double pressure_of(const NodeInfo& info) {
  const NodePressure& p = info.pressure;
  if (!p.psi) return 0;
  return std::clamp(std::max({p.cpu_some / 100.0, p.memory_some / 50.0, p.io_full / 50.0}), 0.0, 1.0);
}

// Free capacity after one more sandbox of `r`: the smaller of the free cpu and memory fractions.
double free_after(const Resources& r, const NodeInfo& info, const Usage& u) {
  const double cpu_cap = cpu_capacity(info);
  const double memory_cap = memory_capacity(info);
  const double cpu_free = cpu_cap > 0 ? (cpu_cap - u.cpu - r.cpu) / cpu_cap : 0;
  const double memory_free =
      memory_cap > 0 ? (memory_cap - u.memory - static_cast<double>(r.memory_bytes)) / memory_cap : 0;
  return std::clamp(std::min(cpu_free, memory_free), 0.0, 1.0);
}

class HeapPolicy : public PlacementPolicy {
 public:
  explicit HeapPolicy(bool pack) : pack_(pack) {}

  std::string name() const override { return pack_ ? "pack" : "spread"; }

  std::vector<std::size_t> place(const PlacementRequest& request, const std::vector<NodeCandidate>& nodes) override {
    if (!request.spec) throw Error(Code::kInvalidArgument, "placement: the request has no spec");
    const SandboxSpec& spec = *request.spec;
    const Resources& r = spec.resources;
    if (request.count == 0) return {};
    const bool anti = !spec.anti_affinity.empty();
    if (anti && !spec.labels.count(spec.anti_affinity))
      throw Error(Code::kInvalidArgument,
                  fmt::format("anti_affinity: the spec has no label '{}' to spread by", spec.anti_affinity));

    struct State {
      Usage usage;
      double locality = 0;
      std::size_t peers = 0;
      std::string refusal;  // why it left the heap (or never entered it)
    };
    std::vector<State> state(nodes.size());
    struct Entry {
      std::size_t peers;
      double score;
      std::size_t rank;  // tie-break: the node's index rotated by the request's offset
      std::size_t index;
    };
    // Equal nodes (a fresh cluster) are taken in index order starting at an offset drawn from the request id, so
    // trainers placing at the same moment start on different nodes instead of all on the first.
    const std::size_t offset =
        spec.request_id.empty() || nodes.empty() ? 0 : std::hash<std::string>{}(spec.request_id) % nodes.size();
    auto rank_of = [&](std::size_t i) { return (i + nodes.size() - offset) % nodes.size(); };
    // The heap's top is the best node: fewest anti-affinity peers, then the highest score, then the lowest rank.
    auto worse = [](const Entry& a, const Entry& b) {
      if (a.peers != b.peers) return a.peers > b.peers;
      if (a.score != b.score) return a.score < b.score;
      return a.rank > b.rank;
    };
    auto score = [&](std::size_t i) {
      double free = free_after(r, nodes[i].info, state[i].usage);
      return (pack_ ? 1.0 - free : free) + state[i].locality - kPressureWeight * pressure_of(nodes[i].info);
    };

    std::vector<Entry> heap;
    heap.reserve(nodes.size());
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      const NodeCandidate& node = nodes[i];
      State& s = state[i];
      s.refusal = static_refusal(spec, node);
      if (!s.refusal.empty()) continue;
      s.usage = usage_of(node);
      s.refusal = capacity_refusal(r, node.info, s.usage);
      if (!s.refusal.empty()) continue;
      if (request.image_bytes > 0)
        s.locality = kLocalityWeight * std::min(1.0, static_cast<double>(node.cached_image_bytes) /
                                                         static_cast<double>(request.image_bytes));
      s.peers = anti ? node.anti_affinity_peers : 0;
      heap.push_back(Entry{s.peers, score(i), rank_of(i), i});
    }
    std::make_heap(heap.begin(), heap.end(), worse);

    std::vector<std::size_t> out;
    out.reserve(request.count);
    while (out.size() < request.count) {
      if (heap.empty()) throw exhausted(request, nodes, state, out.size());
      std::pop_heap(heap.begin(), heap.end(), worse);
      const std::size_t i = heap.back().index;
      State& s = state[i];
      // Only the node just chosen changes, so every other entry's key is still current; this one is re-checked.
      s.refusal = capacity_refusal(r, nodes[i].info, s.usage);
      if (!s.refusal.empty()) {
        heap.pop_back();
        continue;
      }
      out.push_back(i);
      s.usage.cpu += r.cpu;
      s.usage.memory += static_cast<double>(r.memory_bytes);
      s.usage.gpus += r.gpus;
      if (anti) ++s.peers;
      heap.back() = Entry{s.peers, score(i), rank_of(i), i};
      std::push_heap(heap.begin(), heap.end(), worse);
    }
    return out;
  }

 private:
  template <typename State>
  static Error exhausted(const PlacementRequest& request, const std::vector<NodeCandidate>& nodes,
                         const std::vector<State>& state, std::size_t placed) {
    const SandboxSpec& spec = *request.spec;
    const Resources& r = spec.resources;
    std::string message = fmt::format(
        "placement: cannot place {} of {} sandboxes (kind {}, cpu {}, memory {}{}) on {} node{}",
        request.count - placed, request.count, spec.kind, r.cpu, bytes_text(static_cast<double>(r.memory_bytes)),
        r.gpus ? fmt::format(", gpus {}", r.gpus) : std::string(), nodes.size(), nodes.size() == 1 ? "" : "s");
    if (placed > 0) message += fmt::format(" ({} fit before the nodes filled up)", placed);
    if (nodes.empty()) return Error(Code::kResourceExhausted, message + ": no nodes");
    message += ":";
    std::map<std::string, std::size_t> unnamed;  // refusal category -> nodes not named one by one
    for (std::size_t i = 0; i < nodes.size(); ++i) {
      const std::string& why = state[i].refusal;
      if (i < kNodesNamedInErrors) {
        message += fmt::format(" node {}: {};", nodes[i].id, why);
      } else {
        ++unnamed[why.substr(0, why.find(':'))];
      }
    }
    if (!unnamed.empty()) {
      message += fmt::format(" and {} more nodes (", nodes.size() - kNodesNamedInErrors);
      bool first = true;
      for (const auto& [category, n] : unnamed) {
        message += fmt::format("{}{}: {}", first ? "" : ", ", category, n);
        first = false;
      }
      message += ");";
    }
    message.pop_back();
    return Error(Code::kResourceExhausted, message);
  }

  bool pack_;
};

}  // namespace

std::unique_ptr<PlacementPolicy> make_placement_policy(std::string_view name) {
  if (name == "spread") return std::make_unique<HeapPolicy>(false);
  if (name == "pack") return std::make_unique<HeapPolicy>(true);
  throw Error(Code::kInvalidArgument, fmt::format("placement: unknown policy '{}' (known: spread, pack)", name));
}

std::string placement_refusal(const SandboxSpec& spec, const NodeCandidate& node) {
  std::string why = static_refusal(spec, node);
  if (!why.empty()) return why;
  return capacity_refusal(spec.resources, node.info, usage_of(node));
}

void record_placement(const PlacementRequest& request, const std::vector<std::size_t>& chosen,
                      std::vector<NodeCandidate>& nodes) {
  if (!request.spec) throw Error(Code::kInvalidArgument, "placement: the request has no spec");
  const Resources& r = request.spec->resources;
  const bool anti = !request.spec->anti_affinity.empty();
  for (std::size_t i : chosen) {
    if (i >= nodes.size())
      throw Error(Code::kInvalidArgument, fmt::format("placement: node index {} of {} nodes", i, nodes.size()));
    NodeCandidate& node = nodes[i];
    node.cpu_placed += r.cpu;
    node.memory_placed += r.memory_bytes;
    node.gpus_placed += r.gpus;
    ++node.sandboxes_placed;
    if (anti) ++node.anti_affinity_peers;
  }
}

}  // namespace dsec
