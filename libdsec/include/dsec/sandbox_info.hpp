// What the agent knows about a sandbox and about itself.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dsec/spec.hpp"

namespace dsec {

struct SandboxInfo {
  std::string id;          // "<node>-<random>": names the node that hosts it
  std::string node;
  std::string state;       // creating | running | failed | destroyed
  std::string image;
  std::string kind;
  std::string tenant;
  Labels labels;
  std::string group;       // the lease group it belongs to, if any
  Resources resources;
  double created_at = 0;   // unix seconds
  double expires_at = 0;   // 0 = no TTL
  std::string message;     // why it failed, when it did
  NetworkPolicy network;   // the network policy in force (the spec's, or what set_network made it)
};

// A layer of an image in a store (Client::images()).
struct ImageLayerInfo {
  std::string role;                // "base", "toolchain", "task" or "snapshot"
  std::string digest;              // "sha256:..." of the layer's EROFS image
  std::uint64_t size = 0;          // bytes of the EROFS image
  std::uint64_t stored_size = 0;   // bytes of its compressed chunks in the store
};

// An image in one of the client's stores, as `dsec image ls` shows it (Client::images()).
struct ImageInfo {
  std::string name;                // normalised repository, "swe/task-17"
  std::string tag;                 // "latest"
  std::string reference;           // "name:tag", what a create's image names
  std::string digest;              // "sha256:..." of its manifest
  std::vector<ImageLayerInfo> layers;  // lowest first
  std::uint64_t size = 0;          // bytes of all layers
  std::uint64_t stored_size = 0;   // bytes of their compressed chunks
  double created_at = 0;           // unix seconds
  std::string source;              // what it was built from ("busybox-static", "snapshot of sandbox ...")
  std::string parent;              // "name:tag@sha256:..." of the image it was built on, or empty
  std::string store;               // the store that holds it, as the client names it
};

// A layer in a node's local cache.
struct CachedLayer {
  std::string digest;             // "sha256:..." of the layer's EROFS image
  std::uint64_t size = 0;         // bytes of the layer
  std::uint64_t cached_bytes = 0; // bytes of it on the node's disk (fetched chunks, or its extracted files)
  std::uint32_t users = 0;        // sandboxes using it now
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

struct NodeInfo {
  std::string id;
  std::string version;
  std::string protocol = "v1";
  std::vector<std::string> backends;
  std::uint32_t cores = 0;
  std::uint64_t memory_bytes = 0;
  std::uint64_t disk_bytes = 0;
  std::uint64_t disk_free_bytes = 0;
  std::uint32_t gpus = 0;                // GPUs of the node, and those no sandbox holds
  std::uint32_t gpus_free = 0;
  Labels labels;                         // the node's labels (dsecd --label k=v), for SandboxSpec::node_selector
  std::uint32_t sandboxes = 0;           // live sandboxes
  double cpu_requested = 0;              // sum of the live sandboxes' cpu
  std::uint64_t memory_requested = 0;    // sum of their memory limits
  double cpu_overcommit = 8.0;           // how far requests may exceed capacity
  double memory_overcommit = 1.0;
  std::string cgroup_version;            // "v1" or "v2"
  std::vector<std::string> images;       // images in the node's store
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
};

}  // namespace dsec
