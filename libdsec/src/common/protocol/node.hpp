// A node on the v1 wire (GET /v1/node): NodeInfo, its capacity, load, pressure, QoS, pools and cached layers.
#pragma once

#include "common/protocol/body.hpp"
#include "dsec/sandbox_info.hpp"

namespace dsec::protocol {

json encode(const NodeInfo& info);
NodeInfo decode_node_info(const json& j);

}  // namespace dsec::protocol
