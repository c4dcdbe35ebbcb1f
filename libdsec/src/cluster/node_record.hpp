// What an agent writes into etcd about itself, and where: the key <prefix>nodes/<node id> holds
// {"endpoint": "http://10.0.0.7:7070", "node": <the JSON of GET /v1/node>}, attached to the agent's lease so that it
// disappears when the agent stops renewing. Agents (registration) and clients (discovery) share this codec.
#pragma once

#include <string>
#include <string_view>

#include "dsec/sandbox_info.hpp"

namespace dsec::cluster {

struct NodeRecord {
  std::string endpoint;  // where clients reach the agent
  NodeInfo node;
  // The "fncall" object of GET /v1/node (the node's function-call pools, warm or not), as JSON text; empty for a
  // node that serves no function calls. Kept in the record so that clients placing calls see warm pools without
  // asking each node.
  std::string fncall;
};

// "<prefix>nodes/": every registration lives under it ("/dsec/" by default; a prefix without a trailing '/' gets
// one, so "/dsec" also gives "/dsec/nodes/"). Throws INVALID_ARGUMENT for an empty prefix.
std::string nodes_prefix(std::string_view prefix);
std::string node_key(std::string_view prefix, std::string_view node_id);

std::string encode_node_record(const NodeRecord& record);
// Throws INVALID_ARGUMENT naming what is wrong: not JSON, no endpoint, no node object or no node id.
NodeRecord decode_node_record(std::string_view value);

}  // namespace dsec::cluster
