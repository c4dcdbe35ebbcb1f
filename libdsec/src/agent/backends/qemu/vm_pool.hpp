// Pre-booted pools: VMs restored from a shape's template and warmed up (one command run inside, so that TCG has
// translated the guest's exec path and the first exec of a sandbox does not pay for it), idle, waiting for a create
// of their shape, which then only claims one: its directories and QEMU move to the new sandbox's name, the guest is
// greeted with the sandbox's hostname (and a fresh clock and entropy), and the pool makes the next one in the
// background.
//
// A shape is what a template is made for (image layers, memory, vCPUs, disk) plus the cgroup's CPU quota; its pool
// starts with its first create (which itself starts from the template, or boots it) and is dropped once no create
// of the shape came for the idle time. Pooled VMs are not sandboxes: no record, no TTL, not counted by admission;
// they run in cgroups of their own names ("pool-<hex>"), which a claimed VM keeps (cgroup v2 cannot rename a group),
// and an agent that starts removes those an earlier run left unclaimed.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "agent/backends/container/cgroup.hpp"
#include "agent/backends/qemu/tier_context.hpp"
#include "agent/backends/qemu/vm_instance.hpp"

namespace dsec::agent::qemu {

// One VM of a pool and what it holds. Destroying it (unclaimed) kills its QEMU and releases its cgroup, uid and
// directories; claim_into() hands all of them to a sandbox instead.
class PooledVm {
 public:
  explicit PooledVm(BackendContext& ctx);
  ~PooledVm();
  PooledVm(const PooledVm&) = delete;
  PooledVm& operator=(const PooledVm&) = delete;

  // Where a pooled VM's files live until it is claimed: <work dir>/pool/<name> (sockets, logs) and
  // <data dir>/pool/<name> (its writable disk, and "cgroup", the name of its cgroup, which a sandbox the VM
  // becomes keeps in its data directory).
  static std::filesystem::path run_dir_of(const BackendContext& ctx, const std::string& name);
  static std::filesystem::path data_dir_of(const BackendContext& ctx, const std::string& name);

  // Moves the VM's directories to the sandbox's (`run_dir`, <data dir>/<id>), greets its guest as `hostname` and
  // returns the VM; boot() is then the spec of the sandbox (its id, directories, disk and hostname). The PooledVm
  // keeps nothing afterwards: cgroup() and uid are the sandbox's. On failure it still owns (and releases) it all.
  std::unique_ptr<VmInstance> claim_into(const std::string& id, const std::filesystem::path& run_dir,
                                         const std::string& hostname, Clock::time_point deadline);

  BackendContext& ctx;
  std::string name;  // "pool-<16 hex>": its cgroup's name
  std::uint32_t uid = 0;
  bool has_uid = false;
  std::unique_ptr<container::SandboxCgroup> cgroup;
  std::filesystem::path run_dir, data_dir;  // where they are now
  VmBootSpec boot;
  std::unique_ptr<VmInstance> vm;

 private:
  bool claimed_ = false;
};

struct VmPoolStatus {
  std::uint32_t size = 0;      // VMs kept ready per shape (0: no pools)
  std::uint32_t ready = 0;     // VMs waiting now, over all shapes
  std::uint32_t shapes = 0;    // shapes with a pool
  std::uint64_t claims = 0;    // creates served from a pool
  std::uint64_t misses = 0;    // creates of a pooled shape that found its pool empty
  std::uint64_t failures = 0;  // pooled VMs that could not be made
};

class VmPool {
 public:
  using Maker = std::function<std::unique_ptr<PooledVm>()>;

  // `size` VMs per shape (0: take() never returns one and nothing runs in the background).
  VmPool(std::uint32_t size, std::chrono::milliseconds idle);
  ~VmPool();

  // A ready VM of shape `key`, or null when none is; either way the shape counts as used now, and its pool is filled
  // up to the size in the background with VMs `make` makes (the latest maker of a shape is the one used).
  std::unique_ptr<PooledVm> take(const std::string& key, Maker make);
  VmPoolStatus status() const;
  // Ends the background filler and drops every pooled VM (at agent shutdown). Idempotent.
  void stop();

 private:
  struct Shape {
    Maker make;
    std::deque<std::unique_ptr<PooledVm>> ready;
    Clock::time_point last_used;
    Clock::time_point next_try;  // after failures: when to make the next one
    std::uint32_t failures_in_row = 0;
  };
  void fill();
  // Shapes nobody created for the idle time, taken out (the caller destroys them outside the lock).
  std::vector<std::unique_ptr<PooledVm>> take_idle(Clock::time_point now);

  const std::uint32_t size_;
  const std::chrono::milliseconds idle_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::map<std::string, Shape, std::less<>> shapes_;
  VmPoolStatus counts_;
  bool stopping_ = false;
  std::thread filler_;
};

// Removes what pooled VMs of an earlier run left (they were never claimed): their QEMU processes and cgroups, and
// their directories.
void remove_pool_leftovers(BackendContext& ctx);

}  // namespace dsec::agent::qemu
