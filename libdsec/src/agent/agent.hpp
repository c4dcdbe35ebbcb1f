// One node agent: the backends it serves, its registry and reaper, its HTTP server, and their lifecycle. dsecd's
// main() is flags plus this; tests run it in-process.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "agent/api/router.hpp"
#include "agent/backends/backend.hpp"
#include "agent/backends/container/warm_pool.hpp"
#include "agent/config.hpp"
#include "agent/images/image_source.hpp"
#include "agent/images/snapshots.hpp"
#include "agent/metrics.hpp"
#include "agent/node/host.hpp"
#include "agent/node/qos/kernel_qos.hpp"
#include "agent/node/qos/reclaimer.hpp"
#include "agent/node/registration.hpp"
#include "agent/node/swap.hpp"
#include "agent/registry/registry.hpp"
#include "http/server.hpp"

namespace dsec::agent {

class QemuBackend;

namespace fncall {
class FnCallService;
}
namespace container {
class UserNamespaces;
}
namespace network {
class NodeNetwork;
}

// The backends named in config.backends ("container", "null"; "fncall" is not a sandbox backend: the Agent makes
// its FnCallService itself). Unknown names are INVALID_ARGUMENT; a backend the
// host cannot run throws what its factory throws. `warm_pools`: the container backend's, resolved.
std::map<std::string, std::unique_ptr<Backend>, std::less<>> make_backends(
    const AgentConfig& config, const std::shared_ptr<container::UserNamespaces>& userns = nullptr,
    const std::shared_ptr<network::NodeNetwork>& network = nullptr, std::vector<container::WarmShape> warm_pools = {});

// What can be swapped out, mostly for tests: the image source (default: the stores of config.stores through the
// node's layer cache), the backends (default: make_backends(config)), and the node's capacity (default: probed from
// the host).
struct AgentParts {
  std::unique_ptr<ImageSource> images;
  std::map<std::string, std::unique_ptr<Backend>, std::less<>> backends;
  std::optional<HostCapacity> capacity;
};

class Agent {
 public:
  // Sets everything up without listening yet. Throws dsec::Error for a bad config or a backend that cannot start.
  explicit Agent(AgentConfig config, AgentParts parts = {});
  Agent(const Agent&) = delete;
  Agent& operator=(const Agent&) = delete;
  ~Agent();

  // Listens, starts the reaper, and registers in etcd when configured. Throws dsec::Error when an address cannot be
  // bound, or when registration has no endpoint to advertise.
  void start();
  // The orderly shutdown: leave etcd (revoke the lease), stop accepting, destroy every sandbox, shut the backends down,
  // remove the socket file, wait for the connections to end. Idempotent.
  void stop();
  // Stops serving and leaves every sandbox running, for the next start of the agent to take over (dsecd on
  // SIGUSR2): leaves etcd without revoking its lease (a restart within the lease's TTL keeps the node registered),
  // stops accepting and stops the reaper. Requests in flight are cut off when the process exits, as by a crash: a
  // create not yet answered is rolled back and an exec still running is killed by the next start. Nothing is
  // released, so the process must then exit without destroying this object (its sandbox objects would destroy their
  // sandboxes): dsecd leaks it on purpose.
  void leave();
  // What start-up found of an earlier run (with adopt_sandboxes; zeros otherwise).
  const RecoveryReport& recovery() const noexcept { return recovery_; }

  NodeInfo node_info() const;
  const AgentConfig& config() const noexcept { return config_; }
  Registry& registry() noexcept { return *registry_; }
  Metrics& metrics() noexcept { return metrics_; }
  // "127.0.0.1:43215" when listening on TCP.
  const std::string& tcp_endpoint() const noexcept { return server_->tcp_endpoint(); }

 private:
  // The steps of the constructor, in order.
  void set_up_images(AgentParts& parts);
  void set_up_shared_parts();
  void set_up_backends(AgentParts& parts);
  void set_up_registry();
  void set_up_api(AccessPolicy access);
  bool serves(std::string_view kind) const;  // whether config.backends names the kind

  void reaper_loop();
  // What stop and leave both do first: stop accepting connections, stop the reaper and the reclaimer.
  void stop_serving();
  void start_registration();
  QosNodeInfo qos_node_info() const;
  void render_cold_memory_metrics(std::string& out) const;

  AgentConfig config_;
  HostCapacity capacity_;
  std::string cgroup_version_;
  bool cgroup_cpu_idle_ = false;  // the container groups have cpu.idle (probed once at start)
  Metrics metrics_;
  std::unique_ptr<NodeSwap> swap_;  // the node's swap for sleeping sandboxes, when configured; outlives the sandboxes
  std::unique_ptr<ImageSource> images_;
  std::map<std::string, std::unique_ptr<Backend>, std::less<>> backends_;
  std::unique_ptr<Registry> registry_;
  std::unique_ptr<Snapshots> snapshots_;
  // The node's user namespaces (container and fncall backends); declared before them, so it outlives them.
  std::shared_ptr<container::UserNamespaces> userns_;
  std::shared_ptr<network::NodeNetwork> network_;  // sandboxes' links and rules (container backend)
  std::unique_ptr<fncall::FnCallService> fncall_;  // with "fncall" among config.backends
  // The QEMU tiers: in backends_ when among config.backends and the node can run them, else why not.
  struct QemuTier {
    QemuBackend* backend = nullptr;
    std::string unavailable;
    QemuTierNodeInfo node_info() const;
  };
  QemuTier microvm_;
  QemuTier vm_;
  std::shared_ptr<auth::TlsServerContext> tls_;  // the TCP listener's, when it speaks TLS
  std::unique_ptr<Router> router_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<Registration> registration_;  // with etcd endpoints only
  RecoveryReport recovery_;
  // The warm pools' shapes (config.warm_pools with their images resolved), checked against the node's capacity.
  std::vector<container::WarmShape> warm_shapes() const;
  // Classes of service (docs/qos.md): what the kernel gives them, the CPUs reserved for latency sandboxes, and the
  // cold-memory reclaimer (stopped before the registry goes).
  qos::KernelQos kernel_qos_;
  qos::CpuReservation latency_cpus_;
  std::unique_ptr<qos::ColdReclaimer> reclaimer_;

  std::mutex reaper_mutex_;
  std::condition_variable reaper_wake_;
  bool stopping_ = false;
  bool started_ = false;
  bool stopped_ = false;
  std::thread reaper_;
};

// Whether a node id can prefix sandbox ids and travel in URLs: 1-64 of letters, digits, '-', '_', '.'.
bool valid_node_id(std::string_view id) noexcept;

}  // namespace dsec::agent
