// Warm pools of container sandboxes (dsecd --warm-pool, docs/qos.md): for each (image, resources) the node is told
// to keep, sandboxes started ahead of any create, so that a create of that image and those resources claims one
// (its id, hostname and network are given to it then) instead of making one. A pool refills in the background.
//
// What a claimed sandbox gets is what a cold create gives: its own namespaces, cgroups, user-id block and init,
// started for it alone and never used before; only its name changes at the claim (run directory and cgroups
// renamed to the sandbox's id, hostname set). Nothing is reused between sandboxes: a destroyed sandbox's
// namespaces, cgroups and writable layer go with it, as always, because what ran inside it may have left anything
// there (a process escaped into a cgroup, a mount, a file in its upper layer, a socket in its network namespace).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "agent/config.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent::container {

// One --warm-pool value: "IMAGE,size=N[,cpu=C][,memory=M][,disk=D][,pids=P][,open_files=F][,priority=CLASS]
// [,ksm=true]"; resources default as a create's do. INVALID_ARGUMENT naming the part that is wrong.
WarmPoolConfig parse_warm_pool(std::string_view value);
// "busybox, 8 x (cpu 0.5, memory 128 MiB, priority batch)".
std::string describe_warm_pool(const WarmPoolConfig& pool);

// A pool's shape, resolved at start: the image's layers (kept mounted while the pool lives) and its resources.
struct WarmShape {
  WarmPoolConfig config;
  std::vector<std::filesystem::path> layers;  // lowest first, as CreateParams::image_layers
  std::shared_ptr<const void> image_hold;
};

// Whether a create can claim a sandbox of `shape`: a container of the shape's image layers and resources, not a
// fork, without ptrace (its seccomp filter is set at start). What is set at the claim (id, hostname, network,
// env, user, workdir, labels) may differ.
bool matches(const WarmShape& shape, const SandboxSpec& spec, const std::vector<std::filesystem::path>& layers);

// A sandbox started ahead of a create, under a name of its own ("w-<hex>"). Its backend defines what it holds;
// dropping it destroys it.
class PreMade {
 public:
  virtual ~PreMade() = default;
};

struct WarmPoolStats {
  std::uint32_t size = 0;      // sandboxes the pools keep, all shapes
  std::uint32_t ready = 0;     // ready now
  std::uint64_t claims = 0;    // creates served from a pool
  std::uint64_t misses = 0;    // creates of a pooled shape that found its pool empty
  std::uint64_t failures = 0;  // pre-made sandboxes that could not be started
};

class WarmPools {
 public:
  // Makes one pre-made sandbox of a shape; throws what the start threw.
  using Make = std::function<std::unique_ptr<PreMade>(const WarmShape&)>;
  WarmPools(std::vector<WarmShape> shapes, Make make);
  ~WarmPools();
  WarmPools(const WarmPools&) = delete;
  WarmPools& operator=(const WarmPools&) = delete;

  // Starts the refill: a few sandboxes at a time, and only once creates have left the node alone for a moment (the
  // node's CPU goes to creates first).
  void start();
  // Stops refilling and destroys every sandbox still waiting.
  void stop();
  // A ready sandbox of the shape a create matches, or null: no shape matches, or its pool is empty (a miss; the
  // refill is woken either way).
  std::unique_ptr<PreMade> take(const SandboxSpec& spec, const std::vector<std::filesystem::path>& layers);
  WarmPoolStats stats() const;

 private:
  struct Pool {
    WarmShape shape;
    std::deque<std::unique_ptr<PreMade>> ready;
    std::uint32_t starting = 0;  // being started by the refill now
    std::uint32_t failures_in_a_row = 0;
  };
  void refill_loop();

  Make make_;
  std::deque<Pool> pools_;  // a deque: a Pool (its queue of unique_ptrs) is never moved
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;  // the refill's workers
  std::uint64_t claims_ = 0, misses_ = 0, failures_ = 0;
  std::chrono::steady_clock::time_point last_take_{};
};

}  // namespace dsec::agent::container
