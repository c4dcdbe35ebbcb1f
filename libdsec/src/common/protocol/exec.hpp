// An exec on the v1 wire (POST /v1/sandboxes/{id}/exec): its request, checked as every command is (spawned
// processes and shell sessions take the same rules), and its result.
#pragma once

#include "common/protocol/body.hpp"
#include "dsec/exec.hpp"

namespace dsec::protocol {

json encode(const ExecRequest& request);
ExecRequest decode_exec_request(const json& j);

json encode(const ExecResult& result);
ExecResult decode_exec_result(const json& j);

}  // namespace dsec::protocol
