// The container backend as its files share it: creates (cold or from a warm pool), adoption after an agent restart,
// shutdown. Private to backends/container: the agent makes it with make_container_backend (container_backend.hpp).
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "agent/backends/backend.hpp"
#include "agent/backends/container/cgroup.hpp"
#include "agent/backends/container/netns_pool.hpp"
#include "agent/backends/container/seccomp.hpp"
#include "agent/backends/container/spawn.hpp"
#include "agent/backends/container/user_namespace.hpp"
#include "agent/backends/container/warm_pool.hpp"
#include "agent/config.hpp"
#include "agent/network/node_network.hpp"
#include "agent/node/qos/kernel_qos.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::container {

class ContainerSandbox;

// What to undo should a later step of a create or an adoption throw: run at the end of its scope unless disarmed.
class Undo {
 public:
  explicit Undo(std::function<void()> undo) : undo_(std::move(undo)) {}
  ~Undo() {
    if (undo_) undo_();
  }
  Undo(const Undo&) = delete;
  Undo& operator=(const Undo&) = delete;
  void disarm() { undo_ = nullptr; }

 private:
  std::function<void()> undo_;
};

class ContainerBackend final : public Backend {
 public:
  ContainerBackend(const AgentConfig& config, std::shared_ptr<UserNamespaces> userns,
                   std::shared_ptr<network::NodeNetwork> network, std::vector<WarmShape> warm_pools);

  // The pools fill once the earlier run's sandboxes were taken over: a pool's first start releases the user
  // namespace claims nobody took back (UserNamespaces::take), and an adoption still to come would find its block
  // claimed by a pooled sandbox.
  void start_background() override {
    if (warm_) warm_->start();
  }

  ~ContainerBackend() override { shutdown(); }

  std::string_view kind() const override { return "container"; }

  std::unique_ptr<BackendSandbox> create(const CreateParams& params) override;

  PoolStats pool_stats() override;

 private:
  // What a warm pool keeps: a sandbox started under a name of its own, destroyed with it when never claimed.
  struct PreMadeSandbox;
  static constexpr const char* kPreMadePrefix = "w-";

  std::unique_ptr<PreMade> pre_make(const WarmShape& shape);

  // A user namespace of the sandbox's own, when the node has them and every layer's file system can be idmapped.
  std::optional<UserNamespaces::Namespace> take_user_namespace(const std::vector<std::filesystem::path>& layers);
  // A start's hostname, limits and kernel QoS, and this node's dsec-init and capabilities; the rest is the create's.
  SpawnRequest spawn_request(const std::string& id, const SandboxSpec& spec) const;

 public:
  std::unique_ptr<BackendSandbox> create_cold(const CreateParams& params);

  std::unique_ptr<BackendSandbox> adopt(const AdoptParams& params) override;

  QosGrant describe_qos(const SandboxSpec& spec, bool merged) const;

  void remove_leftovers(const std::string& id) override;

  void shutdown() override;

  std::string cgroup_version() const { return cgroups_->version(); }

 private:
  AgentConfig config_;
  int cap_last_cap_;
  UniqueFd init_binary_;
  std::unique_ptr<CgroupDriver> cgroups_;
  qos::KernelQos kernel_qos_;
  qos::CpuReservation cpus_;  // CPUs reserved for latency sandboxes (dsecd --latency-cpus)
  SeccompProgram seccomp_default_, seccomp_ptrace_;
  std::unique_ptr<NetnsPool> netns_;
  std::string boot_id_;
  std::shared_ptr<UserNamespaces> userns_;         // null: sandboxes run with host ids
  std::shared_ptr<network::NodeNetwork> network_;  // null: sandboxes have loopback only
  std::unique_ptr<WarmPools> warm_;                // dsecd --warm-pool; last: stopped (its sandboxes destroyed) first
};

}  // namespace dsec::agent::container
