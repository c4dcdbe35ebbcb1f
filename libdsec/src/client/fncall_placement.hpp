// Which node runs each function call. Calls are short and stateless, so placement only balances load and prefers
// warm pools: a node that already has pre-initialised servers for the call's image and language answers the first
// call without starting a pool. Pure logic (no I/O), so it is unit tested with made-up nodes.
//
// A node is refused when it is unhealthy, does not serve the fncall backend, (when it lists its languages) does not
// serve the call's language, or (for a call that wants GPUs) hands out fewer GPUs to calls than the call wants. Among
// the others each call goes to the node with the largest free fraction after it, (cores - load) / cores, where load
// is the larger of the node's load average and the calls it reports busy, plus the calls this client has in flight
// there, plus this placement's own picks; a node with a warm pool of the image and language gets kWarmPoolWeight on
// top, and one whose GPUs are free now (the call would not queue for them) kGpuFreeWeight. The bonuses decide
// between equal nodes and for single calls; a batch of hundreds levels the nodes by cores whatever they are. Equal
// nodes are taken from an offset drawn from a seed, so clients placing at once start on different nodes.
// O(calls x log nodes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "dsec/fncall.hpp"

namespace dsec::detail {

// One pool of a node, as GET /v1/node reports it under "fncall".
struct FnCallPool {
  std::string image;     // the image the pool's servers run over ("" or the node's default image)
  std::string language;  // "python", "shell", "c", "cpp"
  std::uint32_t idle = 0, busy = 0, min = 0, max = 0;
};

// The "fncall" object of GET /v1/node.
struct FnCallNodeState {
  std::vector<std::string> languages;
  std::vector<FnCallPool> pools;
  std::vector<std::string> gpus;  // the devices it hands to calls
  std::uint32_t gpu_shares = 0;   // shares each GPU is cut into
  std::uint32_t gpus_free = 0;    // GPUs no call holds
  std::uint32_t shares_free = 0;  // shares free on the GPUs no call holds whole
  std::string default_image;      // when the node names it
};

// What a call needs of a node.
struct FnCallNeeds {
  std::string_view language;
  std::string_view image;  // the resolved reference, or "" for the node's default
  GpuMode gpu_mode = GpuMode::kNone;
  std::uint32_t gpus = 0;  // GPUs (exclusive) or shares (shared)
};

// Reads the "fncall" member of a GET /v1/node answer; nullopt when the node reports none (an agent without the
// backend). Tolerant: fields it does not know or that are malformed are skipped.
std::optional<FnCallNodeState> parse_fncall_node_state(const nlohmann::json& node_info);

// Whether a pool's image is the image a call asks for. Both empty: the node's default. A pinned reference
// ("name:tag@sha256:...") matches by digest when both are pinned, else "name" and "name:latest" are the same.
bool same_fncall_image(std::string_view pool_image, std::string_view call_image, std::string_view default_image = {});

struct FnCallCandidate {
  std::string id;       // for messages: node id or endpoint
  bool healthy = true;  // false: unreachable, ejected or not reported yet; never chosen
  bool serves = true;   // false: the node does not serve the backend or the language
  std::string refusal;  // why `serves` is false
  double capacity = 1;  // the node's cores (at least 1): calls are mostly CPU-bound
  double load = 0;      // calls it reports busy + calls this client has in flight there
  bool warm = false;    // it has a pool of the call's image and language
  std::uint32_t warm_idle = 0;
  bool gpus_free = false;  // the GPUs the call wants are free there now
};

// The bonus a warm pool adds to a node's free fraction, and the one for GPUs free now.
inline constexpr double kWarmPoolWeight = 0.25;
inline constexpr double kGpuFreeWeight = 0.5;

// For each of `count` calls, the index in `nodes` of the node to send it to. UNAVAILABLE when no node is healthy,
// FAILED_PRECONDITION naming every node's refusal when healthy nodes exist but none serves the call.
std::vector<std::size_t> place_fncalls(const std::vector<FnCallCandidate>& nodes, std::size_t count,
                                       std::string_view seed);

// Builds a node's candidate for calls with `needs` from what the node reported. `info_known`: a GET /v1/node answer
// exists; `backends` its backends; `cores` its cores; `in_flight` this client's calls there.
FnCallCandidate fncall_candidate(std::string id, bool healthy, bool info_known,
                                 const std::vector<std::string>& backends, std::uint32_t cores, double load1,
                                 const std::optional<FnCallNodeState>& state, const FnCallNeeds& needs, int in_flight);

}  // namespace dsec::detail
