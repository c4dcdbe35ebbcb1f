// A sandbox on the v1 wire: its spec (POST /v1/sandboxes) with the checks every spec passes, its user and protected
// paths, its network policy and usage, and the SandboxInfo answers describe it with.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/protocol/body.hpp"
#include "common/protocol/limits.hpp"
#include "dsec/network.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/spec.hpp"

namespace dsec::protocol {

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

// A lease group's id: 1 to kMaxGroupIdBytes of letters, digits, '.', '_' and '-'. Group TTLs are 1 to
// kMaxGroupTtlSeconds (limits.hpp).
bool valid_group_id(std::string_view id) noexcept;
// A group id, or a tenant's inside the agent: "<tenant>:<group id>" (dsec::agent's tenant_group_id).
bool valid_scoped_group_id(std::string_view id) noexcept;

// A `user` field (SandboxSpec::user, ExecRequest::user) by its form: "" (root), a user name (1 to 64 letters, digits,
// '.', '_', '-', not starting with '-', an optional trailing '$'), "uid" or "uid:gid" (decimal, 0 to kMaxUserId).
// Whether a name exists is known only inside the sandbox, at exec. Throws INVALID_ARGUMENT naming `field`.
struct UserRef {
  std::string name;                  // set for a name
  std::optional<std::uint32_t> uid;  // set for "uid" and "uid:gid"
  std::optional<std::uint32_t> gid;  // set for "uid:gid"
};
UserRef parse_user(std::string_view user, std::string_view field = "user");

// SandboxSpec::protected_paths: at most kMaxProtectedPaths, each absolute and normalized (no "//", ".", ".." or
// trailing '/'), not "/" and not under /proc, /sys or /dev. Part of validate(SandboxSpec).
void validate_protected_paths(const std::vector<std::string>& paths, std::string_view field = "protected_paths");

json encode(const SandboxInfo& info);
SandboxInfo decode_sandbox_info(const json& j);

// PUT /v1/sandboxes/{id}/ttl {"ttl": seconds from now, 0 to kMaxTtlSeconds; 0: none}.
json encode_ttl_request(std::chrono::seconds ttl);
std::chrono::seconds decode_ttl_request(const json& body);
// POST /v1/sandboxes/{id}/ports {"port": a TCP port}.
json encode_expose_request(std::uint32_t port);
std::uint32_t decode_expose_request(const json& body);
// POST /v1/sandboxes/{id}/fork {"count": n, "labels": {...}}: n copies of a running sandbox on its node.
struct ForkRequest {
  std::size_t count = 0;
  Labels labels;
};
json encode(const ForkRequest& request);
ForkRequest decode_fork_request(const json& body);
// POST /v1/sandboxes/{id}/sleep and /wake: an empty body or {"request_id": "..."} (at most kMaxRequestIdBytes, no
// NUL); `what` ("sleep", "wake") names the call in errors.
json encode_sleep_request(std::string_view request_id);
std::string decode_sleep_request(const json& body, std::string_view what);
// POST /v1/sandboxes/{id}/snapshot {"name": "repo[:tag]", "request_id": "..."}; the name is required.
struct SnapshotCall {
  std::string name;
  std::string request_id;
};
json encode(const SnapshotCall& call);
SnapshotCall decode_snapshot_call(const json& body);
// POST /v1/groups/{id}/renew {"ttl": seconds, 1 to kMaxGroupTtlSeconds}; 0 when absent (the group's own TTL).
json encode_group_renew(std::chrono::seconds ttl);
double decode_group_renew(const json& body);

}  // namespace dsec::protocol
