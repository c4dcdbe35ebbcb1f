// The agents a client knows. Each node has its endpoint and connections, the node id it answered with (a sandbox id is
// "<node>-<hex>", so the node that made a sandbox follows from the id alone), what it last said about itself (for
// placement), its health, and what this client placed on it since. Nodes come from the static endpoint list or from
// discovery (etcd), and leave when discovery says so.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "client/fncall_placement.hpp"
#include "client/transport.hpp"
#include "dsec/sandbox_info.hpp"

namespace dsec::detail {

struct Node {
  Node(std::string endpoint_text, std::shared_ptr<const Credentials> credentials);
  const std::string endpoint;
  Transport transport;

  // Everything below is guarded by the NodeTable's mutex; read it through NodeTable::view().
  std::string id;                // empty until learned
  std::optional<NodeInfo> info;  // the last GET /v1/node (or discovery record)
  SteadyClock::time_point info_at{};
  int failures = 0;  // consecutive failed exchanges
  SteadyClock::time_point ejected_until{};
  bool gone = false;      // discovery removed it
  double cpu_placed = 0;  // placed by this client since info_at
  std::uint64_t memory_placed = 0;
  std::size_t sandboxes_placed = 0;
  std::optional<FnCallNodeState> fncall;  // the "fncall" part of the last GET /v1/node, when it had one

  // Function calls this client has sent there and not yet had answered (run_code and run_code_many's chunks).
  std::atomic<int> calls_in_flight{0};
};
using NodePtr = std::shared_ptr<Node>;

// A copy of a node's mutable state.
struct NodeView {
  NodePtr node;
  std::string id;
  std::optional<NodeInfo> info;
  SteadyClock::time_point info_at{};
  int failures = 0;
  bool ejected = false;
  bool gone = false;
  double cpu_placed = 0;
  std::uint64_t memory_placed = 0;
  std::size_t sandboxes_placed = 0;
  std::optional<FnCallNodeState> fncall;
  int calls_in_flight = 0;
};

class NodeTable {
 public:
  // Every node's transport presents `credentials` (none: no token, the system's CAs).
  explicit NodeTable(std::shared_ptr<const Credentials> credentials = nullptr) : credentials_(std::move(credentials)) {}

  // Ejection: after kEjectAfter consecutive failures a node gets no new sandboxes and calls about its sandboxes fail
  // fast with NodeLost, for kEjectBase doubling with each further failure up to kEjectMax.
  static constexpr int kEjectAfter = 3;
  static constexpr std::chrono::milliseconds kEjectBase{1000};
  static constexpr std::chrono::milliseconds kEjectMax{60'000};

  // The node at `endpoint`, added if new (a node that had gone comes back).
  NodePtr add(const std::string& endpoint);
  // Discovery says node `id` is at `endpoint` with `info` / has left.
  NodePtr up(const std::string& id, const std::string& endpoint, const NodeInfo& info);
  void down(const std::string& id);

  std::vector<NodeView> view() const;  // every node that has not gone, in the order they were added
  std::size_t live_count() const;
  NodeView view(const NodePtr& node) const;

  void learn(const NodePtr& node, const std::string& id);
  // A fresh GET /v1/node: its numbers include what was placed before, so the client's own tally starts over.
  void set_info(const NodePtr& node, NodeInfo info);
  // The node's function-call pools from the same answer (nullopt: it reported none).
  void set_fncall(const NodePtr& node, std::optional<FnCallNodeState> state);
  void placed(const NodePtr& node, double cpu, std::uint64_t memory, std::size_t count);

  void succeeded(const NodePtr& node);
  // Counts a failed exchange; returns true when the node is ejected now.
  bool failed(const NodePtr& node);

  // The node that made `sandbox_id`: the longest node id that, followed by '-', prefixes it (ids may contain '-'),
  // gone nodes included. nullptr when no node matches.
  NodePtr route(std::string_view sandbox_id) const;
  // Nodes whose id is not known yet (asked by route's caller).
  std::vector<NodePtr> unidentified() const;

 private:
  NodeView view_locked(const NodePtr& node, SteadyClock::time_point now) const;

  std::shared_ptr<const Credentials> credentials_;
  mutable std::mutex mu_;
  std::vector<NodePtr> nodes_;
};

// Whether `id` is shaped like a sandbox id: 1..256 bytes of letters, digits, '-', '_' and '.', not starting
// with '.'. Ids travel in URL paths, so anything else is refused before a call is made.
bool valid_sandbox_id(std::string_view id);

}  // namespace dsec::detail
