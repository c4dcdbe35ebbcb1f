// What a sandbox is asked to be: the typed spec a trainer fills in, the same for every backend.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/network.hpp"

namespace dsec {

using Labels = std::map<std::string, std::string>;
using Env = std::map<std::string, std::string>;

// Limits of one sandbox. The agent enforces each one: cpu and memory and pids through the sandbox's cgroup, disk
// through the size of its writable layer.
// A sandbox's class of service on its node (docs/qos.md): latency-critical work gets more CPU weight and its memory
// protected from reclaim; batch work runs SCHED_IDLE (only on CPU nobody else wants, and it cannot leave that
// policy) and is throttled (v2 memory.high) before its hard limit; standard is neither.
enum class Priority { kStandard, kLatency, kBatch };
std::string_view priority_name(Priority p) noexcept;            // "standard", "latency", "batch"
std::optional<Priority> parse_priority(std::string_view name);  // nullopt for anything else

struct Resources {
  double cpu = 1.0;                           // cores (CFS quota); fractions allowed
  std::uint64_t memory_bytes = 512ull << 20;  // hard limit, OOM-kill inside the sandbox beyond it
  std::uint64_t disk_bytes = 1ull << 30;      // writable layer size; writes beyond it fail with ENOSPC
  std::uint32_t pids = 512;                   // processes + threads
  std::uint32_t open_files = 4096;            // RLIMIT_NOFILE for every process inside
  std::uint32_t gpus = 0;                     // whole GPUs; only nodes with this many free are chosen
  // Its network link (docs/networking.md), 0 = unlimited: what it sends is shaped to egress_mbps megabits a second,
  // and it holds at most `connections` connections (and UDP flows) to the outside at once; more are refused.
  std::uint32_t egress_mbps = 0;
  std::uint32_t connections = 0;
  Priority priority = Priority::kStandard;  // in a spec's JSON: "priority" at its top level
  // Memory policies on the node (docs/qos.md), in a spec's JSON at its top level too. ksm: its processes' memory is
  // offered to the kernel's same-page merging (identical pages of sandboxes that opt in are kept once). reclaim:
  // false keeps the node's cold-memory reclaimer away from it (latency sandboxes are never reclaimed either way).
  bool ksm = false;
  bool reclaim = true;
};

struct SandboxSpec {
  std::string image = "busybox";   // image name in the node's store
  std::string kind = "container";  // backend: container, microvm or vm (a full VM with a screen)
  Resources resources;
  std::chrono::seconds ttl{3600};  // the agent destroys the sandbox this long after creation; 0 = never
  Env env;                         // environment every exec starts with (exec env overrides)
  Labels labels;                   // free-form; list() filters on them
  std::string tenant;              // who owns it; list() filters on it
  std::string hostname;            // empty: the sandbox id
  std::string workdir;             // default cwd for exec; empty: the image's WorkingDir, else "/"
  bool allow_ptrace = false;       // allow ptrace inside the sandbox (debuggers); denied by default
  // Who every exec runs as unless the exec names its own user: a user name of the sandbox's own /etc/passwd, or
  // "uid" / "uid:gid" (0 to 65535 each). Empty: the image's User (registry images), else root inside the sandbox
  // (which holds no capability either way). The image's Env is under `env` the same way (env wins).
  // See docs/security.md, "Users inside a sandbox and protected paths".
  std::string user;
  // Absolute paths (at most 32, e.g. "/grader") the agent makes root's own before the sandbox is handed out: each
  // is created as a directory if missing, then owned by 0:0 with mode 0700, so execs as another user cannot read,
  // list or link what root puts there. A path that is a symbolic link (or lies under one) fails the create.
  std::vector<std::string> protected_paths;
  // Its network (docs/networking.md): none (loopback only), egress through rules, or open. Sandbox::set_network
  // changes it while the sandbox lives.
  NetworkPolicy network;
  std::string request_id;  // idempotency key: the same key returns the same sandbox
  // Placement (client side): a node must carry every one of these labels (dsecd --label k=v).
  Labels node_selector;
  // Placement (client side): a key of `labels`. Sandboxes whose labels give this key the same value prefer
  // different nodes: placement spreads them over distinct nodes first and puts two on one node only when every
  // node that fits already has one (soft, never a reason to refuse a create). Empty: none.
  std::string anti_affinity;
  // A lease group (see docs/protocol.md, groups): the agent destroys every sandbox of the group once its lease is
  // not renewed for group_ttl seconds, so no sandbox outlives a crashed trainer. Empty: no group. A group id is 1 to
  // 128 of letters, digits, '.', '_' and '-'; group_ttl is 1 to 86400 s and required with a group.
  std::string group;
  std::chrono::seconds group_ttl{0};
  // The screen of a full VM (kind "vm"): "WIDTHxHEIGHT" (from 320x200 to 3840x2160) or "none". Empty: the kind's
  // default (a vm gets 1024x768; other kinds have no screen and refuse one).
  std::string display;
  // How long a create may wait on a node that has no room for it (its admission would refuse it): creates wait in
  // the order they came, and the first whose resources fit goes once a sandbox ends or sleeps; past this it is
  // RESOURCE_EXHAUSTED as without a wait. 0 (the default): refused at once. At most 3600 s. Not part of what a
  // request_id must repeat (a retry sends what is left of its deadline).
  std::chrono::milliseconds queue_timeout{0};
};

// A screen's size; parse_display("1280x800") -> {1280, 800}; nullopt for "", "none" and anything not WxH.
struct DisplaySize {
  std::uint32_t width = 0;
  std::uint32_t height = 0;
};
std::optional<DisplaySize> parse_display(std::string_view text);

// Parses "512Mi", "2G", "1.5GiB", "4096", "100k" into bytes. SI suffixes (k, M, G, T) are powers of 1000, binary ones
// (Ki, Mi, Gi, Ti) powers of 1024; a trailing "B" is allowed. Returns nullopt for anything else.
std::optional<std::uint64_t> parse_size(std::string_view text);

}  // namespace dsec
