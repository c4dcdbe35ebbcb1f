// The v1 wire format: JSON codecs for the public types, shared by the client and the agent. Decoders validate and
// throw dsec::Error(INVALID_ARGUMENT) naming the offending field ("resources.memory: ...").
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "dsec/error.hpp"
#include "dsec/exec.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/spec.hpp"

namespace dsec::protocol {

using nlohmann::json;

// Parses a request or response body; a syntax error is INVALID_ARGUMENT with the parser's position.
json parse_body(std::string_view body);

json encode(const SandboxSpec& spec);
SandboxSpec decode_spec(const json& j);
void validate(const SandboxSpec& spec);  // ranges and formats; throws INVALID_ARGUMENT naming the field

// A lease group's id: 1 to 128 of letters, digits, '.', '_' and '-'. Group TTLs are 1 to 86400 seconds.
bool valid_group_id(std::string_view id) noexcept;
inline constexpr double kMaxGroupTtlSeconds = 86400;

json encode(const ExecRequest& request);
ExecRequest decode_exec_request(const json& j);

json encode(const ExecResult& result);
ExecResult decode_exec_result(const json& j);

json encode(const SandboxInfo& info);
SandboxInfo decode_sandbox_info(const json& j);

json encode(const NodeInfo& info);
NodeInfo decode_node_info(const json& j);

// {"code": "NOT_FOUND", "message": "...", "retryable": false}
json encode_error(const Error& error);
Error decode_error(const json& j, int http_status);

// Binary data travels base64-encoded inside JSON.
std::string base64_encode(std::string_view bytes);
std::string base64_decode(std::string_view text);  // throws INVALID_ARGUMENT on malformed input

}  // namespace dsec::protocol
