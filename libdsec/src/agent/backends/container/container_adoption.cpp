// Adoption: a restarted agent takes over the container sandboxes an earlier run left running, once each proves to
// be what its record says (the same boot, init, cgroup, network namespace, layers, user namespace and link).
#include <poll.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string_view>

#include "agent/backends/container/container_backend_internal.hpp"
#include "agent/backends/container/container_sandbox_internal.hpp"
#include "agent/backends/container/init_socket.hpp"
#include "agent/backends/container/process_identity.hpp"
#include "agent/node/qos/ksm.hpp"
#include "common/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::container {
namespace {

namespace fs = std::filesystem;

// How long a restarted agent waits for a sandbox's init to answer its probe.
constexpr auto kProbeTimeout = std::chrono::seconds(5);

// A sandbox's record (its BackendState) as its adoption reads it: a key it needs that is missing or malformed is
// FAILED_PRECONDITION.
class Record {
 public:
  explicit Record(const BackendState& state) : state_(state) {}

  const std::string& value(const char* name) const {
    auto it = state_.find(name);
    if (it == state_.end() || it->second.empty())
      throw Error(Code::kFailedPrecondition,
                  fmt::format("its record lacks '{}' (it was made by an agent that did not keep it)", name));
    return it->second;
  }

  std::uint64_t number(const char* name) const {
    const std::string& text = value(name);
    std::uint64_t v = 0;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || ptr != text.data() + text.size())
      throw Error(Code::kFailedPrecondition, fmt::format("its record's '{}' is not a number: '{}'", name, text));
    return v;
  }

  // Whether it has a key not every sandbox has (a user namespace, a link), with a value.
  bool has(const char* name) const {
    auto it = state_.find(name);
    return it != state_.end() && !it->second.empty();
  }

  // A key's value, empty when it has none.
  std::string_view get(const char* name) const {
    auto it = state_.find(name);
    return it == state_.end() ? std::string_view() : std::string_view(it->second);
  }

 private:
  const BackendState& state_;
};

// The sandbox's init, if pid `pid` still names it. The pid alone proves nothing: a pidfd is opened, then the process
// it names must have started when init did, still run, and sit in the sandbox's cgroup and network namespace.
// NOT_FOUND otherwise.
SpawnedInit find_init(pid_t pid, std::uint64_t start_time, const std::string& cgroup_path, const std::string& version,
                      std::uint64_t netns_inode) {
  SpawnedInit init;
  init.pid = pid;
  init.pidfd.reset(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!init.pidfd) {
    if (errno == ESRCH) throw Error(Code::kNotFound, fmt::format("its init (pid {}) has exited", pid));
    throw_errno(errno, fmt::format("pidfd_open of its init (pid {})", pid));
  }
  std::optional<std::uint64_t> now_started = process_start_time(pid);
  if (!now_started) throw Error(Code::kNotFound, fmt::format("its init (pid {}) has exited", pid));
  if (*now_started != start_time)
    throw Error(Code::kNotFound, fmt::format("its init (pid {}) has exited; the pid names another process now "
                                             "(started at tick {}, not {})",
                                             pid, *now_started, start_time));
  // An init that was killed but not yet reaped (its parent, the old agent, is gone) still has its pid and start
  // time: the pidfd tells.
  pollfd p{init.pidfd.get(), POLLIN, 0};
  if (::poll(&p, 1, 0) != 0) throw Error(Code::kNotFound, fmt::format("its init (pid {}) has exited", pid));
  if (!process_in_cgroup(pid, cgroup_path, version))
    throw Error(Code::kNotFound,
                fmt::format("pid {} is not in the sandbox's cgroup {}: not its init", pid, cgroup_path));
  if (netns_inode_of_pid(pid) != netns_inode)
    throw Error(Code::kNotFound, fmt::format("pid {} is not in the sandbox's network namespace: not its init", pid));
  return init;
}

// Its root stacks the image layers as they were mounted then: a layer whose mount did not survive the agent (the
// layer file system's connection was lost, the mount detached and perhaps made again) cannot serve it any more.
void check_layers(const Record& record, const std::string& devices) {
  if (record.has(key::kLayerDevices) && record.value(key::kLayerDevices) != devices)
    throw Error(Code::kFailedPrecondition,
                fmt::format("its image layers are no longer the mounts it runs on (devices {}, now {}): they did "
                            "not survive the agent",
                            record.value(key::kLayerDevices), devices.empty() ? "missing" : devices));
}

// Its user namespace's block, if it has one: the uid map proves it, and no other agent on the host may hold it now.
std::optional<std::uint32_t> adopt_user_namespace(const Record& record, pid_t pid, UserNamespaces* userns) {
  if (!record.has(key::kUsernsFirst)) return std::nullopt;
  const auto first = static_cast<std::uint32_t>(record.number(key::kUsernsFirst));
  const std::string expected = fmt::format("0 {} {}", first, kUsernsIds);
  const std::string map = uid_map_of(pid);
  if (map != expected)
    throw Error(Code::kFailedPrecondition,
                fmt::format("its init's uid map is '{}', not its record's '{}'", map, expected));
  if (!userns || !userns->adopt(first))
    throw Error(Code::kFailedPrecondition,
                fmt::format("its user namespace's host ids from {} are held by another agent on this host (or "
                            "are outside this agent's --userns-range)",
                            first));
  return first;
}

// A freeze the record does not explain (a sleep, wake or snapshot cut short) is undone, and a sleeping sandbox
// stays asleep; either way the memory limit a wake puts back is the sandbox's own.
void settle_freezer(SandboxCgroup& cgroup, const AdoptParams& params, std::chrono::milliseconds sleep_reclaim_timeout) {
  const bool frozen = cgroup.frozen();
  if (params.sleeping) {
    if (!frozen) {
      cgroup.freeze();
      cgroup.reclaim_memory(std::chrono::steady_clock::now() + sleep_reclaim_timeout);
    }
    cgroup.set_restore_limit(params.spec.resources.memory_bytes);
  } else if (frozen) {
    log_info("sandbox {}: frozen, but recorded running; thawing it", params.id);
    cgroup.set_restore_limit(params.spec.resources.memory_bytes);
    cgroup.restore_memory();
    cgroup.thaw();
  }
}

// Execs in flight when the old agent died lost their caller with it (their output went to its pipes): their
// processes are killed with their groups. Groups of ended execs hold background processes, which stay. Init may sit
// in an exec group (placed there ahead of an exec): the kills leave it alone. Returns the number the next exec's
// group takes.
std::uint64_t adopt_exec_groups(SandboxCgroup& cgroup, pid_t init_pid, const fs::path& run_dir, const std::string& id) {
  cgroup.spare(init_pid);
  const fs::path markers = run_dir / kExecMarkers;
  std::set<std::string> in_flight;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(markers, ec)) in_flight.insert(entry.path().filename().string());
  std::uint64_t next_exec = 0;
  std::size_t killed = 0;
  for (const std::string& group : cgroup.exec_groups()) {
    if (group.size() > 1 && group[0] == 'x') {
      std::uint64_t n = 0;
      auto [ptr, err] = std::from_chars(group.data() + 1, group.data() + group.size(), n);
      if (err == std::errc() && ptr == group.data() + group.size()) next_exec = std::max(next_exec, n + 1);
    }
    const bool kill = in_flight.count(group) > 0;
    killed += kill;
    cgroup.adopt_exec_group(group, kill);
  }
  for (const auto& name : in_flight) ::unlink((markers / name).c_str());
  if (killed > 0)
    log_info("sandbox {}: killed {} exec{} whose caller went with the previous agent", id, killed,
             killed == 1 ? "" : "s");
  if (::mkdir(markers.c_str(), 0700) != 0 && errno != EEXIST) throw_errno_fmt(errno, "mkdir {}", markers.string());
  return next_exec;
}

// "8000:30001,22:30002" (see key::kExposed): the sandbox's port to the node's; malformed items are skipped.
std::map<std::uint16_t, std::uint16_t> parse_exposed(std::string_view rest) {
  std::map<std::uint16_t, std::uint16_t> exposed;
  while (!rest.empty()) {
    std::string_view item = rest.substr(0, rest.find(','));
    rest.remove_prefix(std::min(rest.size(), item.size() + 1));
    unsigned port = 0, node_port = 0;
    const auto colon = item.find(':');
    if (colon == std::string_view::npos) continue;
    std::from_chars(item.data(), item.data() + colon, port);
    std::from_chars(item.data() + colon + 1, item.data() + item.size(), node_port);
    if (port >= 1 && port <= 65535 && node_port >= 1 && node_port <= 65535)
      exposed[static_cast<std::uint16_t>(port)] = static_cast<std::uint16_t>(node_port);
  }
  return exposed;
}

// Its network, if it had one: the link must still be there, and its rules go back in force.
std::optional<network::Attachment> adopt_link(const Record& record, const AdoptParams& params,
                                              network::NodeNetwork* network) {
  if (!record.has(key::kNetBlock)) return std::nullopt;
  network::Attachment a;
  a.block = static_cast<std::uint32_t>(record.number(key::kNetBlock));
  a.interface = record.value(key::kNetInterface);
  std::map<std::uint16_t, std::uint16_t> exposed = parse_exposed(record.get(key::kExposed));
  if (!network || !network->adopt(params.id, a, params.spec.network, exposed))
    throw Error(Code::kFailedPrecondition,
                fmt::format("its network link {} is gone, or its addresses are another agent's", a.interface));
  return a;
}

}  // namespace

std::unique_ptr<BackendSandbox> ContainerBackend::adopt(const AdoptParams& params) {
  const Record record(params.state);
  if (record.value(key::kBootId) != boot_id_)
    throw Error(Code::kNotFound, "the host rebooted since it was made (another boot id)");
  const auto pid = static_cast<pid_t>(record.number(key::kInitPid));
  const std::uint64_t start_time = record.number(key::kInitStartTime);
  const std::uint64_t netns_inode = record.number(key::kNetnsInode);
  const std::string& version = record.value(key::kCgroupVersion);
  const std::string& cgroup_path = record.value(key::kCgroup);
  const fs::path run_dir = record.value(key::kRunDir);
  if (!run_dir.is_absolute() || run_dir.filename() != params.id)
    throw Error(Code::kFailedPrecondition, fmt::format("its record's run directory {} is not one of a sandbox named {}",
                                                       run_dir.string(), params.id));
  if (version != cgroups_->version())
    throw Error(Code::kFailedPrecondition,
                fmt::format("it runs under cgroup {}, this agent drives cgroup {}", version, cgroups_->version()));

  SpawnedInit init = find_init(pid, start_time, cgroup_path, version, netns_inode);
  const std::string devices = layer_devices(params.image_layers);
  check_layers(record, devices);
  std::optional<std::uint32_t> userns_first = adopt_user_namespace(record, pid, userns_.get());
  Undo give_back([&] {
    if (userns_first) userns_->give_back(*userns_first);
  });

  // From here the groups are this object's: if taking the sandbox over fails, they (and its processes) go.
  std::unique_ptr<SandboxCgroup> cgroup = cgroups_->adopt(cgroup_path);
  if (userns_first) cgroup->let_join_as(*userns_first);
  settle_freezer(*cgroup, params, config_.sleep_reclaim_timeout);
  const std::uint64_t next_exec = adopt_exec_groups(*cgroup, pid, run_dir, params.id);

  std::string why;
  if (!probe_init((run_dir / "init.sock").string(), !params.sleeping,
                  std::chrono::duration_cast<std::chrono::milliseconds>(kProbeTimeout), &why))
    throw Error(Code::kUnavailable, fmt::format("its init (pid {}) does not answer: {}", pid, why));

  std::optional<network::Attachment> link = adopt_link(record, params, network_.get());
  Identity identity{boot_id_, start_time, netns_inode, devices, userns_first, link};
  give_back.disarm();
  auto sandbox = std::make_unique<ContainerSandbox>(params.id, params.spec, run_dir, std::move(init), std::move(cgroup),
                                                    config_.sleep_reclaim_timeout, std::move(identity), version,
                                                    userns_, network_, true, params.sleeping, next_exec);
  // Its processes kept whatever they were started with; ksmd runs again while it lives.
  const bool merged = params.spec.resources.ksm && kernel_qos_.memory_merge;
  std::shared_ptr<void> ksm_hold;
  if (merged) ksm_hold = qos::hold_ksm();
  sandbox->set_qos(describe_qos(params.spec, merged), std::move(ksm_hold));
  return sandbox;
}

}  // namespace dsec::agent::container
