// An exec on the v1 wire (POST /v1/sandboxes/{id}/exec): its request, checked as every command is (spawned
// processes and shell sessions take the same rules), and its result.
#pragma once

#include "common/protocol/body.hpp"
#include "dsec/exec.hpp"

namespace dsec::protocol {

json encode(const ExecRequest& request);
ExecRequest decode_exec_request(const json& j);
// The checks decode_exec_request holds a request to, on the request as encode() sends it (with a shell, argv is not
// sent): INVALID_ARGUMENT naming the field. A client validates before a round trip without encoding and decoding.
void validate(const ExecRequest& request);
// The exec body's "stream" flag (true: output as NDJSON lines while the command runs, then its result line):
// set_exec_stream adds it to an encoded request, exec_streams reads it (absent or null: false).
void set_exec_stream(json& body);
bool exec_streams(const json& body);

json encode(const ExecResult& result);
ExecResult decode_exec_result(const json& j);

}  // namespace dsec::protocol
