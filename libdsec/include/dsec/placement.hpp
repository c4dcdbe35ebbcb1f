// Placement: which node each sandbox of a create goes to. The client chooses (no central scheduler sits on the
// create path); a policy sees every node's last report plus what this client placed there since, and answers with a
// node for each sandbox. Pure logic: no I/O, so a policy is tested and benchmarked without a node.
//
// The built-in policies ("spread", "pack") share one set of filters and one scoring shape:
//   - a node is refused when it is unhealthy, does not serve the spec's kind, lacks a node_selector label, has too
//     few free GPUs, or would go past `cores x cpu_overcommit` cpu or `memory x memory_overcommit` memory (what the
//     node reports as requested, plus what this client placed there since, plus this placement's own choices);
//   - spread picks the node with the most free capacity after the placement (the smaller of its free cpu and free
//     memory fractions: the scarcer resource decides), pack the one with the least that still fits;
//   - both add a locality bonus, kLocalityWeight x (bytes of the image's layers the node caches / image bytes),
//     and take off kPressureWeight x the node's pressure (the largest of its PSI cpu "some" / 100, memory "some"
//     / 50 and io "full" / 50 over the last 10 s, at most 1); a node whose every task stalled on memory for
//     kMemoryFullRefusal % of the last 10 s is refused;
//   - with SandboxSpec::anti_affinity, nodes holding fewer sandboxes of the same label value come first, whatever
//     their score (soft: repeats only once every fitting node has one).
// A batch updates its own picks as it goes, so 32,000 sandboxes spread over 160 nodes by capacity instead of landing
// on the node that looked freest at the start. O(count x log nodes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/sandbox_info.hpp"
#include "dsec/spec.hpp"

namespace dsec {

// One node as placement sees it.
struct NodeCandidate {
  std::string id;  // for messages: the node id, or its endpoint when not known yet
  NodeInfo info;   // the node's last report (GET /v1/node)
  // What this client put there since `info` was fetched (the node's report does not show it yet).
  double cpu_placed = 0;
  std::uint64_t memory_placed = 0;
  std::size_t sandboxes_placed = 0;
  std::uint32_t gpus_placed = 0;
  // Bytes of the request's image layers the node caches (from info.cached_layers), for the locality bonus.
  std::uint64_t cached_image_bytes = 0;
  // Sandboxes on the node that share the request's anti-affinity label value, as far as the caller knows (placed by
  // this client, or listed). The policy adds its own picks within one call.
  std::size_t anti_affinity_peers = 0;
  bool healthy = true;  // false: unreachable or ejected; never chosen
};

struct PlacementRequest {
  const SandboxSpec* spec = nullptr;      // required
  std::size_t count = 1;                  // sandboxes to place, all of this spec
  std::vector<std::string> image_layers;  // layer digests of the resolved image (empty: not resolved)
  std::uint64_t image_bytes = 0;          // their total size (0: no locality bonus)
};

// Chooses nodes. Called concurrently by the client's threads: an implementation must be safe for that (the built-in
// ones keep no state between calls; what was placed before arrives in NodeCandidate's *_placed fields).
class PlacementPolicy {
 public:
  virtual ~PlacementPolicy() = default;
  virtual std::string name() const = 0;
  // For each of request.count sandboxes, the index in `nodes` of the node to place it on (indices may repeat).
  // All or nothing: when not every sandbox fits, throws dsec::Error(RESOURCE_EXHAUSTED) saying why each node was
  // refused. INVALID_ARGUMENT when the request itself is malformed (no spec).
  virtual std::vector<std::size_t> place(const PlacementRequest& request, const std::vector<NodeCandidate>& nodes) = 0;
};

// The locality bonus a fully cached image adds to a node's score; free capacity is a fraction in [0, 1].
inline constexpr double kLocalityWeight = 0.25;
inline constexpr double kPressureWeight = 0.5;
inline constexpr double kMemoryFullRefusal = 20.0;

// "spread" or "pack"; INVALID_ARGUMENT for any other name.
std::unique_ptr<PlacementPolicy> make_placement_policy(std::string_view name);

// Building blocks for custom policies and for callers' own accounting.
//
// Why `node` cannot take one more sandbox of `spec` on top of what it carries (its report plus its *_placed
// fields); empty when it can. E.g. "cpu: 255.5 + 1 cores requested would pass 256 (8 cores x cpu_overcommit 32)".
std::string placement_refusal(const SandboxSpec& spec, const NodeCandidate& node);
// Adds what `chosen` (a place() answer for `request`) puts on each node to the nodes' *_placed fields, and to
// anti_affinity_peers, so the next call sees it.
void record_placement(const PlacementRequest& request, const std::vector<std::size_t>& chosen,
                      std::vector<NodeCandidate>& nodes);

}  // namespace dsec
