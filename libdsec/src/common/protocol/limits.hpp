// Every limit and constant of the v1 wire, in one place: what the agent refuses (INVALID_ARGUMENT naming the field)
// and the client checks before a round trip. The codecs in common/protocol/ hold requests to these; the agent, the
// client, the gateway and the Python binding read them from here. Header-only, std-only: dsec-init's wires use it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace dsec::protocol {

// Identifiers (bytes): request ids of creates, execs, spawns, signals and session runs; tenants; lease groups.
inline constexpr std::size_t kMaxRequestIdBytes = 128;
inline constexpr std::size_t kMaxTenantBytes = 128;
inline constexpr std::size_t kMaxGroupIdBytes = 128;

// A sandbox's TTL: 0 (none) to one year, in seconds. A lease group's TTL: 1 to a day.
inline constexpr std::int64_t kMaxTtlSeconds = 365LL * 86400;
inline constexpr double kMaxGroupTtlSeconds = 86400;
// How long a create may wait in a node's queue for capacity (SandboxSpec::queue_timeout), in seconds.
inline constexpr double kMaxQueueTimeoutSeconds = 3600;

// A sandbox's resources.
inline constexpr double kMaxCpus = 1024;
inline constexpr std::uint64_t kMinMemoryBytes = 4ull << 20;
inline constexpr std::uint64_t kMinDiskBytes = 1ull << 20;
// Memory and disk a sandbox may ask for: far beyond any node, and small enough that no sum of them in admission,
// quotas or metrics can wrap.
inline constexpr std::uint64_t kMaxResourceBytes = 16ull << 40;
inline constexpr std::uint64_t kMaxPids = 1u << 22;
inline constexpr std::uint64_t kMaxOpenFiles = 1u << 20;
inline constexpr std::uint64_t kMaxGpus = 256;
inline constexpr std::uint64_t kMaxEgressMbps = 400000;  // 400 Gbit/s; 0 is unlimited
inline constexpr std::uint64_t kMaxConnections = 1u << 20;
inline constexpr std::size_t kMaxHostnameBytes = 64;
inline constexpr std::size_t kMaxLabelKeyBytes = 253;

// A `user` field: a name of at most kMaxUserNameBytes, or uid[:gid] from 0 to kMaxUserId.
inline constexpr std::size_t kMaxUserNameBytes = 64;
inline constexpr std::uint32_t kMaxUserId = 65535;
// SandboxSpec::protected_paths: at most this many, each at most kMaxPathBytes.
inline constexpr std::size_t kMaxProtectedPaths = 32;
inline constexpr std::size_t kMaxPathBytes = 4096;

// TCP and UDP ports (network rules, exposed ports).
inline constexpr std::uint32_t kMaxPort = 65535;

// Sandbox::fork labels the sandboxes it makes from a snapshot under a generated name ("fork/...") with this label,
// whose value is the snapshot's "name:tag"; when the last sandbox carrying it goes from a node, the node removes
// that tag from its snapshot store. Only names under kForkSnapshotPrefix are ever removed so.
inline constexpr std::string_view kForkSnapshotLabel = "dsec.fork-snapshot";
inline constexpr std::string_view kForkSnapshotPrefix = "fork/";

// An exec's (and a session run's) timeout, in seconds, and the output it keeps of each stream.
inline constexpr double kMaxExecTimeoutSeconds = 7 * 86400;
inline constexpr std::uint64_t kMaxOutputBytes = 1ull << 30;

// Spawned processes and shell sessions.
inline constexpr unsigned kMaxTerminalSide = 1000;       // rows and cols
inline constexpr std::size_t kMaxProcessTag = 128;       // bytes
inline constexpr std::size_t kMaxOutputRead = 1u << 20;  // bytes of each stream per read
inline constexpr double kMaxProcessWait = 300;           // seconds one long poll may wait
inline constexpr std::size_t kMaxSessionNameBytes = 64;

// Function calls: the languages a call may name (a node serves those it has pools for; GET /v1/node lists them);
// bounds of one call's request: the code, stdin, and all files together; one batch's number of calls.
inline constexpr const char* kFnCallLanguages[] = {"python", "shell", "c", "cpp"};
inline constexpr std::size_t kMaxFnCallCodeBytes = 4u << 20;
inline constexpr std::size_t kMaxFnCallInputBytes = 64u << 20;
inline constexpr std::size_t kMaxFnCallFiles = 1024;
inline constexpr std::size_t kMaxFnCallArgs = 4096;
inline constexpr std::size_t kMaxFnCallBatch = 1024;
inline constexpr double kMaxFnCallTimeoutSeconds = 3600;
inline constexpr std::uint64_t kMaxFnCallMemoryBytes = 1ull << 40;

// Sandboxes one create call makes (POST /v1/sandboxes/batch, a fork's count).
inline constexpr std::size_t kMaxCreateBatch = 1024;

// A full VM's screen input: coordinates, a wait action, the pause between typed keys.
inline constexpr std::uint32_t kMaxScreenCoordinate = 65535;
inline constexpr std::uint32_t kMaxInputWaitMs = 10000;
inline constexpr std::uint32_t kMaxTypeIntervalMs = 1000;

}  // namespace dsec::protocol
