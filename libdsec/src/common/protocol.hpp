// The v1 wire format: JSON codecs for the public types, shared by the client and the agent. Decoders validate and
// throw dsec::Error(INVALID_ARGUMENT) naming the offending field ("resources.memory: ...").
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/error.hpp"
#include "dsec/exec.hpp"
#include "dsec/fncall.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/spec.hpp"

namespace dsec::protocol {

using nlohmann::json;

// Parses a request or response body; a syntax error is INVALID_ARGUMENT with the parser's position.
json parse_body(std::string_view body);

json encode(const SandboxSpec& spec);
SandboxSpec decode_spec(const json& j);
// A network policy: {"mode": ..., "rules": [{"allow", "cidr", "protocol", "ports"}]}; decoding also takes the bare
// mode ("none", "egress", "open") and validates the whole policy (INVALID_ARGUMENT naming the field).
json encode(const NetworkPolicy& policy);
NetworkPolicy decode_network(const json& j);
// {"bytes_out", "packets_out", "bytes_in", "packets_in", "refused", "resolved": {name: [address, ...]}}
json encode(const NetworkUsage& usage);
NetworkUsage decode_network_usage(const json& j);
void validate(const SandboxSpec& spec);  // ranges and formats; throws INVALID_ARGUMENT naming the field

// A lease group's id: 1 to 128 of letters, digits, '.', '_' and '-'. Group TTLs are 1 to 86400 seconds.
bool valid_group_id(std::string_view id) noexcept;
inline constexpr double kMaxGroupTtlSeconds = 86400;
// A sandbox's TTL: 0 (none) to one year, in seconds.
inline constexpr std::int64_t kMaxTtlSeconds = 365LL * 86400;

// Sandbox::fork labels the sandboxes it makes from a snapshot under a generated name ("fork/...") with this label,
// whose value is the snapshot's "name:tag"; when the last sandbox carrying it goes from a node, the node removes
// that tag from its snapshot store. Only names under kForkSnapshotPrefix are ever removed so.
inline constexpr std::string_view kForkSnapshotLabel = "dsec.fork-snapshot";
inline constexpr std::string_view kForkSnapshotPrefix = "fork/";

json encode(const ExecRequest& request);
ExecRequest decode_exec_request(const json& j);

// A `user` field (SandboxSpec::user, ExecRequest::user) by its form: "" (root), a user name (1 to 64 letters, digits,
// '.', '_', '-', not starting with '-', an optional trailing '$'), "uid" or "uid:gid" (decimal, 0 to kMaxUserId).
// Whether a name exists is known only inside the sandbox, at exec. Throws INVALID_ARGUMENT naming `field`.
inline constexpr std::uint32_t kMaxUserId = 65535;
struct UserRef {
  std::string name;                  // set for a name
  std::optional<std::uint32_t> uid;  // set for "uid" and "uid:gid"
  std::optional<std::uint32_t> gid;  // set for "uid:gid"
};
UserRef parse_user(std::string_view user, std::string_view field = "user");

// SandboxSpec::protected_paths: at most kMaxProtectedPaths, each absolute and normalized (no "//", ".", ".." or
// trailing '/'), not "/" and not under /proc, /sys or /dev. Part of validate(SandboxSpec).
inline constexpr std::size_t kMaxProtectedPaths = 32;
void validate_protected_paths(const std::vector<std::string>& paths, std::string_view field = "protected_paths");

json encode(const ExecResult& result);
ExecResult decode_exec_result(const json& j);

// Function calls (POST /v1/fncall, docs/protocol.md). The request decoder validates every field; a request body may
// also carry "image_manifest" (a pinned image's manifest, as create sends it), which the route reads itself.
json encode(const FnCallRequest& request);
FnCallRequest decode_fncall_request(const json& j);

// The answer of one call. decode_fncall_result also reads a batch element that is {"error": {"code", "message"}}:
// the result then carries error_code and error and nothing else.
json encode(const FnCallResult& result);
FnCallResult decode_fncall_result(const json& j);

// "none", "exclusive", "shared"; parse_gpu_mode throws INVALID_ARGUMENT naming `field` for anything else.
std::string_view gpu_mode_name(GpuMode mode) noexcept;
GpuMode parse_gpu_mode(std::string_view name, std::string_view field = "gpu_mode");

// The languages a call may name (a node serves those it has pools for; GET /v1/node lists them).
inline constexpr const char* kFnCallLanguages[] = {"python", "shell", "c", "cpp"};
// Bounds of one call's request: the code, stdin, and all files together; one batch's number of calls.
inline constexpr std::size_t kMaxFnCallCodeBytes = 4u << 20;
inline constexpr std::size_t kMaxFnCallInputBytes = 64u << 20;
inline constexpr std::size_t kMaxFnCallFiles = 1024;
inline constexpr std::size_t kMaxFnCallArgs = 4096;
inline constexpr std::size_t kMaxFnCallBatch = 1024;
inline constexpr double kMaxFnCallTimeoutSeconds = 3600;

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
