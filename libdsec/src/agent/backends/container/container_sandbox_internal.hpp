// A container sandbox as the container backend's files share it: the class, the identity an agent restart checks it
// by, the keys of its record. Private to backends/container: the agent sees a BackendSandbox.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <variant>
#include <vector>

#include "agent/backends/backend.hpp"
#include "agent/backends/command/exec_command.hpp"
#include "agent/backends/container/cgroup.hpp"
#include "agent/backends/container/rootfs_files.hpp"
#include "agent/backends/container/spawn.hpp"
#include "agent/backends/container/user_namespace.hpp"
#include "agent/network/node_network.hpp"
#include "agent/processes/processes.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::container {

constexpr std::size_t kMaxFileBytes = 1ull << 30;
// A sandbox's run directory keeps one empty file per exec in flight in this subdirectory, named like the exec's
// cgroup: an agent that restarts kills the groups of execs whose callers went with the old agent, and leaves the
// groups of ended execs (their background processes) alone.
constexpr const char* kExecMarkers = "execs";

// A sandbox's link limits, from its resources.
inline network::LinkLimits link_limits(const Resources& r) { return {r.egress_mbps, r.connections}; }

// The keys of a container sandbox's BackendState.
namespace key {
constexpr const char* kBootId = "boot_id";
constexpr const char* kInitPid = "init_pid";
constexpr const char* kInitStartTime = "init_start_time";
constexpr const char* kCgroupVersion = "cgroup_version";
constexpr const char* kCgroup = "cgroup";
constexpr const char* kNetnsInode = "netns_inode";
constexpr const char* kRunDir = "run_dir";
constexpr const char* kLayerDevices = "layer_devices";
constexpr const char* kNetBlock = "net_block";          // its network's /30 (first address); absent: no link
constexpr const char* kNetInterface = "net_interface";  // the host end of its veth pair
constexpr const char* kExposed = "exposed";             // "8000:30001,22:30002": its port:the node's port
constexpr const char* kUsernsFirst =
    "userns_first";  // the first host id of its user namespace's block; absent: host ids
}  // namespace key

// The device numbers of the image layers' directories, lowest first ("64:12,0:85"): each mounted layer is its own
// file system, so a layer mounted again (after its earlier mount was detached) has another one.
std::string layer_devices(const std::vector<std::filesystem::path>& layers);

// What a sandbox's creator knows about it beyond its spec: the identity an agent restart checks it by.
struct Identity {
  std::string boot_id;
  std::uint64_t init_start_time = 0;
  std::uint64_t netns_inode = 0;
  std::string layer_devices;                  // of the image layers its overlay stacks
  std::optional<std::uint32_t> userns_first;  // its user namespace's block of host ids, if it has one
  std::optional<network::Attachment> link;    // its veth pair and /30, if it has a network
};

class ContainerSandbox final : public BackendSandbox, public InitProcesses {
 public:
  using Clock = std::chrono::steady_clock;

  ContainerSandbox(std::string id, SandboxSpec spec, std::filesystem::path run_dir, SpawnedInit init,
                   std::unique_ptr<SandboxCgroup> cgroup, std::chrono::milliseconds reclaim_timeout, Identity identity,
                   std::string cgroup_version, std::shared_ptr<UserNamespaces> userns,
                   std::shared_ptr<network::NodeNetwork> network, bool adopted = false, bool sleeping = false,
                   std::uint64_t first_exec = 0);
  ~ContainerSandbox() override;

  ExecResult exec(const ExecRequest& req, const OutputSink& sink) override;

  Processes* processes() override { return this; }

  std::variant<ProcessEntry, ExecResult> spawn(const ExecRequest& req, const SpawnOptions& options) override;

  // The files API works as root inside: in a user namespace, with the file-system ids of its root.
  void write_file(std::string_view path, std::string_view data, unsigned mode) override;
  std::string read_file(std::string_view path) override;
  void put_archive(std::string_view dir, std::string_view tar_bytes) override;
  std::string get_archive(std::string_view dir) override;
  bool is_directory(std::string_view path) override;

  SleepReport sleep() override;

  // Freezes the sandbox and pushes its memory out until `deadline` (true: stopped there with some left). A failure
  // leaves it as it was: limits back, running.
  bool freeze_and_reclaim(Clock::time_point deadline);

  std::optional<ColdReclaim> reclaim_cold(Clock::time_point deadline) override;

  std::uint64_t refaults() override { return cgroup_->refaults(); }

  void set_network(const NetworkPolicy& policy) override;
  std::string expose(std::uint32_t port) override;
  void unexpose(std::uint32_t port) override;
  NetworkUsage network_usage() override { return network_ ? network_->usage(id_) : NetworkUsage{}; }
  std::map<std::uint32_t, std::string> exposed() override;

  SleepReport wake() override;

  FilesCapture capture_files(const std::filesystem::path& dest, const image::UpperTreeLimits& limits) override;

  // A sandbox started ahead of its create (a warm pool's) becomes the create's: its run directory and cgroups take
  // the sandbox's id (v2 cannot rename cgroups: they keep the pool's name, which its record keeps), its hostname
  // is set, and it gets the network its spec asks for. Called before anyone else sees it; throws what failed (the
  // caller then drops it: destroy() cleans up under whichever names it had by then).
  void claim_as(const std::string& id, const SandboxSpec& spec, const std::filesystem::path& run_dir);

  void set_qos(QosGrant grant, std::shared_ptr<void> ksm_hold) {
    qos_ = std::move(grant);
    ksm_hold_ = std::move(ksm_hold);
  }
  QosGrant qos_grant() override { return qos_; }

  BackendState recovery_state() override;

  bool alive() override;

  void destroy() override;

  // A sandbox with a link resolves names through the agent (NodeNetwork::resolv_conf). Holds network_mu_, or the
  // sandbox is new.
  void write_resolv_conf();

 private:
  // Frozen processes would not die (cgroup v1): a sleeping sandbox is thawed before its destroy.
  void thaw_for_destroy();
  // Kills init, and with it every process of the sandbox, and waits until they are gone.
  void kill_init();

  std::string hostname() const { return spec_.hostname.empty() ? id_ : spec_.hostname; }

  // Process requests to init (InitProcesses). A sandbox that sleeps has its init frozen: refused before, and a
  // read that waits gives up when a sleep begins.
  std::string exchange(process_protocol::Op op, const std::string& payload,
                       std::chrono::milliseconds reply_within) override {
    return exchange_with(op, payload, {}, reply_within);
  }

  std::string exchange_with(process_protocol::Op op, const std::string& payload, const std::vector<int>& fds,
                            std::chrono::milliseconds reply_within);

  bool sleeping_now() {
    std::lock_guard lock(power_mu_);
    return sleeping_;
  }

  void check_awake();

  // What an exec or a spawn runs: its argv, environment, directory and user (resolved in the sandbox's own
  // /etc/passwd and /etc/group).
  ExecCommand resolve_command(const ExecRequest& req);

  // Whether the sandbox's memory cgroup counted an OOM kill since the last look (a command killed by SIGKILL that
  // no timeout sent: the OOM killer's, unless something inside sent it while another process hit the limit).
  bool oom_killed_since_last_look();

  void check_running();

  // Init is moved into the group of the next exec ahead of it, on a thread of its own (one at a time per sandbox),
  // where the driver can (cgroup v1): that move waits on the kernel after an idle spell, which an agent loop's think
  // time always is. The command init forks next then starts in that group with no move on the exec's path.
  void schedule_init_placement();

  // The exec group a command (an exec's or a spawned process's) starts in (container_exec.cpp).
  struct CommandGroup;
  // One exec's command, from its start by init to its result (container_exec.cpp).
  class ExecRun;

  // The group init sits in for the next exec, taken by this exec; empty when there is none. A placement under way
  // is waited for: the command's own move into a group of its own would wait on the same kernel work.
  std::string take_init_group();

  void join_placement();

  // The first link of a sandbox made without a network, into its namespace now. Holds network_mu_.
  void attach_now(const NetworkPolicy& policy);

  RootfsFiles files();

  std::chrono::milliseconds reclaim_timeout_;
  std::string id_;
  SandboxSpec spec_;
  std::filesystem::path run_dir_;
  std::string socket_path_;
  SpawnedInit init_;
  std::unique_ptr<SandboxCgroup> cgroup_;
  Identity identity_;
  std::string cgroup_version_;
  std::shared_ptr<UserNamespaces> userns_;  // gets the block back at destroy
  std::shared_ptr<network::NodeNetwork> network_;
  std::mutex network_mu_;  // guards identity_.link
  bool adopted_;           // taken over after an agent restart: init is not this process's child
  std::atomic<bool> destroyed_{false};
  std::mutex destroy_mu_;
  std::atomic<std::uint64_t> exec_counter_;
  std::atomic<std::uint64_t> oom_kills_seen_{0};  // the memory cgroup's OOM kill count when last looked at
  std::mutex placement_mu_;                       // guards the three below
  std::string init_group_;                        // the exec group init sits in, unused by any exec yet; empty: none
  bool placing_ = false;                          // a placement thread is moving init
  bool placement_unsupported_ = false;
  std::condition_variable placed_;
  std::thread placement_;
  std::mutex power_mu_;  // guards sleeping_ and running_execs_; held through a sleep or a wake
  bool sleeping_ = false;
  QosGrant qos_;                    // set_qos
  std::shared_ptr<void> ksm_hold_;  // ksmd runs while it lives (qos::hold_ksm), when it asked for KSM
  int running_execs_ = 0;
  std::uint64_t cold_floor_bytes_ = 0;  // its charge after its last cold reclaim (0: none yet); under power_mu_
};

}  // namespace dsec::agent::container
