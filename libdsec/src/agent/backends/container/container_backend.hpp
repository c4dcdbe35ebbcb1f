// The container backend: dsec's own runtime (namespaces, cgroups, overlayfs, pivot_root, seccomp, a tiny init as
// pid 1). No crun/runc process per sandbox.
#pragma once

#include <memory>
#include <vector>

#include "agent/backends/backend.hpp"
#include "agent/backends/container/warm_pool.hpp"
#include "agent/config.hpp"

namespace dsec::agent {

namespace container {
class UserNamespaces;
}
namespace network {
class NodeNetwork;
}

// Throws dsec::Error(FAILED_PRECONDITION) when the host cannot run containers (not root, no overlayfs, ...).
// Sandboxes get user namespaces from `userns` when it is given and enabled, host ids otherwise.
// Sandboxes whose spec asks for a network get it from `network` (none without it: UNIMPLEMENTED).
// `warm_pools`: the shapes whose sandboxes it starts ahead of creates (warm_pool.hpp), resolved by the caller.
std::unique_ptr<Backend> make_container_backend(const AgentConfig& config,
                                                std::shared_ptr<container::UserNamespaces> userns = nullptr,
                                                std::shared_ptr<network::NodeNetwork> network = nullptr,
                                                std::vector<container::WarmShape> warm_pools = {});

// "v1" or "v2": the cgroup hierarchy the backend drives on this host.
std::string container_cgroup_version();
// Whether the agent's groups (named `cgroup_name`) have cpu.idle: a batch sandbox's group is then idle-scheduled.
bool container_cgroup_cpu_idle(const std::string& cgroup_name);

}  // namespace dsec::agent
