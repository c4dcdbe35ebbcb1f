// What the agent knows about a sandbox and about itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsec/spec.hpp"

namespace dsec {

// What a node gave a sandbox's class of service and memory policies (docs/qos.md): the mechanisms in force
// ("cpu.shares 4096", "SCHED_IDLE", "cpuset 1") and those asked for that the node could not give, each with why
// ("core scheduling: the kernel has none"). A class is never honoured partly in silence.
struct QosGrant {
  std::vector<std::string> granted;
  std::vector<std::string> missing;
};

// What the node's cold-memory reclaimer took from a sandbox (docs/qos.md).
struct ColdMemoryInfo {
  std::uint64_t reclaimed_bytes = 0;  // its charge released by the reclaimer, all rounds together
  std::uint32_t reclaims = 0;         // rounds that reclaimed it
  double last_reclaim_at = 0;         // unix seconds; 0: never
  std::uint64_t refaults = 0;         // pages read back in after a reclaim, since it was made
};

struct SandboxInfo {
  std::string id;  // "<node>-<random>": names the node that hosts it
  std::string node;
  std::string state;  // creating | running | failed | destroyed
  std::string image;
  // What `docker run` of its image runs: the image's Entrypoint, then its Cmd (registry images); empty when the
  // image names neither. A sandbox has no main process: `dsec run IMAGE` with no command execs this.
  std::vector<std::string> image_command;
  std::string kind;
  std::string tenant;
  Labels labels;
  std::string group;  // the lease group it belongs to, if any
  Resources resources;
  double created_at = 0;  // unix seconds
  double expires_at = 0;  // 0 = no TTL
  std::string message;    // why it failed, when it did
  NetworkPolicy network;  // the network policy in force (the spec's, or what set_network made it)
  QosGrant qos;           // what its class of service got on this node
  ColdMemoryInfo cold_memory;
};

// A layer of an image in a store (Client::images()).
struct ImageLayerInfo {
  std::string role;               // "base", "toolchain", "task" or "snapshot"
  std::string digest;             // "sha256:..." of the layer's EROFS image
  std::uint64_t size = 0;         // bytes of the EROFS image
  std::uint64_t stored_size = 0;  // bytes of its compressed chunks in the store
};

// An image in one of the client's stores, as `dsec image ls` shows it (Client::images()).
struct ImageInfo {
  std::string name;                    // normalised repository, "swe/task-17"
  std::string tag;                     // "latest"
  std::string reference;               // "name:tag", what a create's image names
  std::string digest;                  // "sha256:..." of its manifest
  std::vector<ImageLayerInfo> layers;  // lowest first
  std::uint64_t size = 0;              // bytes of all layers
  std::uint64_t stored_size = 0;       // bytes of their compressed chunks
  double created_at = 0;               // unix seconds
  std::string source;                  // what it was built from ("busybox-static", "snapshot of sandbox ...")
  std::string parent;                  // "name:tag@sha256:..." of the image it was built on, or empty
  std::string store;                   // the store that holds it, as the client names it
};

// A layer in a node's local cache.
struct CachedLayer {
  std::string digest;              // "sha256:..." of the layer's EROFS image
  std::uint64_t size = 0;          // bytes of the layer
  std::uint64_t cached_bytes = 0;  // bytes of it on the node's disk (fetched chunks, or its extracted files)
  std::uint32_t users = 0;         // sandboxes using it now
  // The images ("name:tag") the node knows to hold it; a tenant is shown only the layers of images it may use.
  std::vector<std::string> images;
};

// One of the node's QEMU tiers (GET /v1/node "microvm" and "vm"): whether it offers its kind, and on what.
struct QemuTierNodeInfo {
  bool offered = false;            // the node serves the kind ("microvm", "vm")
  std::string unavailable;         // why it does not, or why its VMs cannot start (empty when they can)
  bool ready = false;              // the accelerator probe is done
  std::string accelerator;         // "kvm" or "tcg"
  std::string accelerator_reason;  // why this accelerator (e.g. why KVM was not usable)
  std::string kernel;              // microvm: the guest kernel's release (a full VM boots its image's own)
  std::uint32_t vms = 0;           // running VMs
  // Pre-booted pools (dsecd --microvm-pool): VMs kept ready per shape in use, ready now, creates served from a
  // pool and creates of a pooled shape that found it empty.
  std::uint32_t pool_size = 0;
  std::uint32_t pool_ready = 0;
  std::uint64_t pool_claims = 0;
  std::uint64_t pool_misses = 0;
  // Templates (frozen guests creates start from) kept now and the guest RAM they hold.
  std::uint32_t templates = 0;
  std::uint64_t template_bytes = 0;
};
using MicroVmNodeInfo = QemuTierNodeInfo;

// Pressure stall information of the node (/proc/pressure): the share of the last 10 s in which some task (for
// "full": every runnable task at once) waited on the resource, in percent. psi false: the kernel has none.
struct NodePressure {
  bool psi = false;
  double cpu_some = 0;
  double memory_some = 0;
  double memory_full = 0;
  double io_some = 0;
  double io_full = 0;
};

// What the node's kernel gives classes of service and memory policies (GET /v1/node "qos", docs/qos.md).
struct QosNodeInfo {
  // Core scheduling (PR_SCHED_CORE): a latency sandbox's tasks never share a physical core with another sandbox's.
  bool core_scheduling = false;
  std::string core_scheduling_reason;  // why not, when not
  // CPUs reserved for latency sandboxes (the cpuset fallback, dsecd --latency-cpus): latency sandboxes run there
  // only, every other sandbox elsewhere. Empty: none reserved.
  std::string latency_cpus;
  bool cpu_idle = false;  // cgroup v2 cpu.idle for batch groups (v1: SCHED_IDLE per task only)
  // The cold-memory reclaimer: "damon" (DAMON's physical-address monitor with per-sandbox memcg filters),
  // "memory.reclaim" (v2, driven by the agent's idle tracking), "limit steps" (v1, the same by lowering a
  // sandbox's limit for a moment) or "off"; reclaim_reason says why this one.
  std::string reclaim;
  std::string reclaim_reason;
  std::uint64_t reclaimed_bytes = 0;  // by the reclaimer since the agent started
  bool ksm = false;                   // same-page merging for sandboxes that ask (PR_SET_MEMORY_MERGE)
  std::uint32_t ksm_sandboxes = 0;    // live sandboxes that asked
  std::uint64_t ksm_saved_bytes = 0;  // memory the kernel's merging saves now (pages_sharing)
};

struct NodeInfo {
  std::string id;
  std::string version;
  std::string protocol = "v1";
  std::vector<std::string> backends;
  std::uint32_t cores = 0;
  std::uint64_t memory_bytes = 0;
  std::uint64_t disk_bytes = 0;
  std::uint64_t disk_free_bytes = 0;
  std::uint32_t gpus = 0;  // GPUs of the node, and those no sandbox holds
  std::uint32_t gpus_free = 0;
  Labels labels;                       // the node's labels (dsecd --label k=v), for SandboxSpec::node_selector
  std::uint32_t sandboxes = 0;         // live sandboxes
  double cpu_requested = 0;            // sum of the live sandboxes' cpu
  std::uint64_t memory_requested = 0;  // sum of their memory limits
  double cpu_overcommit = 8.0;         // how far requests may exceed capacity
  double memory_overcommit = 1.0;
  std::string cgroup_version;       // "v1" or "v2"
  std::vector<std::string> images;  // images in the node's store
  // How the node mounts image layers: "erofs-lazy" (EROFS over a lazily filled file), or "extract (...)" with the
  // reason the node fell back to extracting whole layers.
  std::string layer_mode;
  // Whether container sandboxes get user namespaces: "idmapped (ids from F, N blocks of 65536)", or "off (why)".
  std::string userns;
  // Sandbox networks: "routed (10.88.0.0/16, N sandboxes with a network, ...)", or "none (why)".
  std::string network;
  std::vector<CachedLayer> cached_layers;  // the layers in the node's cache
  double load1 = 0;
  // The node's swap (every swap area of the host): where sleeping sandboxes' anonymous memory goes. 0: none.
  std::uint64_t swap_bytes = 0;
  std::uint64_t swap_free_bytes = 0;
  QemuTierNodeInfo microvm;
  QemuTierNodeInfo vm;  // full VMs with a screen (docs/vm.md)
  // What the node really uses, for placement beyond requests: memory in use (MemTotal - MemAvailable) and the
  // pressure on its CPU, memory and I/O.
  std::uint64_t memory_used_bytes = 0;
  NodePressure pressure;
  QosNodeInfo qos;
  // Warm pools of container sandboxes (dsecd --warm-pool, docs/qos.md): kept ready, ready now, creates they served,
  // and creates of a pooled shape that found its pool empty.
  std::uint32_t warm_pool_size = 0;
  std::uint32_t warm_pool_ready = 0;
  std::uint64_t warm_pool_claims = 0;
  std::uint64_t warm_pool_misses = 0;
};

}  // namespace dsec
