#include "agent/backends/container/container_backend.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <optional>
#include <random>

#include "agent/backends/container/container_backend_internal.hpp"
#include "agent/backends/container/container_sandbox_internal.hpp"
#include "agent/backends/container/process_identity.hpp"
#include "agent/backends/container/spawn.hpp"
#include "agent/node/qos/ksm.hpp"
#include "common/cgroupfs.hpp"
#include "common/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent {
namespace container {

namespace fs = std::filesystem;

namespace {

int read_cap_last_cap() {
  std::ifstream in("/proc/sys/kernel/cap_last_cap");
  int v = 40;
  in >> v;
  return v;
}

// A sandbox's run directory: rw (its scratch tmpfs), root (its overlay) and the exec markers. A step that fails
// leaves none of it.
void make_run_directory(const fs::path& run_dir) {
  if (::mkdir(run_dir.c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}", run_dir.string());
  try {
    for (const char* sub : {"rw", "root", kExecMarkers})
      if (::mkdir((run_dir / sub).c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}/{}", run_dir.string(), sub);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(run_dir, ec);
    throw;
  }
}

// A unix socket listening at `path`: a sandbox's init.sock, which its init serves.
UniqueFd listen_on(const std::string& path) {
  UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!listener) throw_errno(errno, "socket");
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    throw_errno_fmt(errno, "bind {}", path);
  if (::listen(listener.get(), 256) != 0) throw_errno(errno, "listen");
  return listener;
}

// The steps that build a sandbox's root in its run directory: its image layers (lowest first) stacked top first.
RootfsPlan plan_sandbox_root(const fs::path& run_dir, const std::vector<fs::path>& image_layers,
                             const Resources& resources, const RootfsOptions& options) {
  std::vector<std::string> layers;
  for (auto it = image_layers.rbegin(); it != image_layers.rend(); ++it) layers.push_back(it->string());
  if (layers.empty()) throw Error(Code::kInvalidArgument, "image has no layers");
  return plan_rootfs(run_dir.string(), layers, resources, options);
}

}  // namespace

std::string layer_devices(const std::vector<fs::path>& layers) {
  std::string out;
  for (const auto& layer : layers) {
    struct stat st {};
    if (::stat(layer.c_str(), &st) != 0) return {};
    if (!out.empty()) out += ',';
    out += fmt::format("{}:{}", major(st.st_dev), minor(st.st_dev));
  }
  return out;
}

struct ContainerBackend::PreMadeSandbox final : PreMade {
  std::unique_ptr<ContainerSandbox> sandbox;
};

ContainerBackend::ContainerBackend(const AgentConfig& config, std::shared_ptr<UserNamespaces> userns,
                                   std::shared_ptr<network::NodeNetwork> network, std::vector<WarmShape> warm_pools)
    : config_(config), cap_last_cap_(read_cap_last_cap()), userns_(std::move(userns)), network_(std::move(network)) {
  if (::geteuid() != 0)
    throw Error(Code::kFailedPrecondition, "the container backend needs root (namespaces, cgroups, mounts)");
  std::ifstream filesystems("/proc/filesystems");
  std::string text((std::istreambuf_iterator<char>(filesystems)), std::istreambuf_iterator<char>());
  if (text.find("\toverlay\n") == std::string::npos)
    throw Error(Code::kFailedPrecondition, "the kernel has no overlayfs (modprobe overlay)");
  // A sandbox's output pipe closing early must not kill the agent.
  ::signal(SIGPIPE, SIG_IGN);
  // Every sandbox holds a few descriptors in the agent: thousands of sandboxes need more than a login's hard limit
  // (20,000 on some hosts). Root with CAP_SYS_RESOURCE may raise the hard limit to 1,048,576 (the kernel's default
  // nr_open); otherwise the soft one goes up to the hard one.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0) {
    rlimit wanted{1u << 20, 1u << 20};
    if (files.rlim_max >= wanted.rlim_max || ::setrlimit(RLIMIT_NOFILE, &wanted) != 0) {
      files.rlim_cur = files.rlim_max;
      ::setrlimit(RLIMIT_NOFILE, &files);
    }
  }
  fs::path init = config.init_binary;
  if (init.empty()) init = fs::read_symlink("/proc/self/exe").parent_path() / "dsec-init";
  init_binary_.reset(::open(init.c_str(), O_PATH | O_CLOEXEC));
  if (!init_binary_)
    throw Error(Code::kFailedPrecondition,
                fmt::format("sandbox init binary {} cannot be opened: {}", init.string(), std::strerror(errno)));
  fs::create_directories(config_.run_dir);
  ::chmod(config_.run_dir.c_str(), 0700);
  boot_id_ = boot_id();
  if (config_.cgroup_favordynmods) log_info("{}", enable_cgroup_favordynmods());
  cgroups_ = make_cgroup_driver(config_.cgroup_name);
  cgroups_->remove_empty_groups();
  kernel_qos_ = qos::probe_kernel_qos();
  cpus_ = qos::resolve_cpu_reservation(config_.latency_cpus, kernel_qos_);
  if (!cpus_.empty()) cgroups_->reserve_cpus(cpus_.latency, cpus_.shared);
  seccomp_default_ = build_seccomp_program(false);
  seccomp_ptrace_ = build_seccomp_program(true);
  netns_ = std::make_unique<NetnsPool>(config_.netns_pool_size);
  // Sandboxes a warm pool of an earlier run had started and no create claimed: nobody knows them.
  std::error_code ec;
  std::vector<std::string> unclaimed;
  for (const auto& entry : fs::directory_iterator(config_.run_dir, ec))
    if (entry.path().filename().string().rfind(kPreMadePrefix, 0) == 0)
      unclaimed.push_back(entry.path().filename().string());
  for (const auto& name : unclaimed) remove_leftovers(name);
  if (!warm_pools.empty())
    warm_ =
        std::make_unique<WarmPools>(std::move(warm_pools), [this](const WarmShape& shape) { return pre_make(shape); });
}

// The pools fill once the earlier run's sandboxes were taken over: a pool's first start releases the user

std::unique_ptr<BackendSandbox> ContainerBackend::create(const CreateParams& params) {
  if (warm_ && !params.fork_of) {
    if (std::unique_ptr<PreMade> made = warm_->take(params.spec, params.image_layers)) {
      std::unique_ptr<ContainerSandbox> sandbox = std::move(static_cast<PreMadeSandbox&>(*made).sandbox);
      try {
        sandbox->claim_as(params.id, params.spec, config_.run_dir / params.id);
        return sandbox;
      } catch (const std::exception& e) {
        // Dropped (destroyed); a sandbox is made for the create as if there were no pool.
        log_warn("sandbox {}: claiming a warm pool's sandbox failed ({}); making one", params.id, e.what());
      }
    }
  }
  return create_cold(params);
}

PoolStats ContainerBackend::pool_stats() {
  if (!warm_) return {};
  WarmPoolStats s = warm_->stats();
  return PoolStats{s.size, s.ready, s.claims, s.misses, s.failures};
}

std::unique_ptr<PreMade> ContainerBackend::pre_make(const WarmShape& shape) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  CreateParams params;
  params.id = fmt::format("{}{:012x}", kPreMadePrefix, rng() & 0xffffffffffffULL);
  params.spec.image = shape.config.image;
  params.spec.resources = shape.config.resources;
  params.image_layers = shape.layers;
  auto made = std::make_unique<PreMadeSandbox>();
  std::unique_ptr<BackendSandbox> sandbox = create_cold(params);
  made->sandbox.reset(static_cast<ContainerSandbox*>(sandbox.release()));
  return made;
}

std::optional<UserNamespaces::Namespace> ContainerBackend::take_user_namespace(const std::vector<fs::path>& layers) {
  if (!userns_ || !userns_->enabled() ||
      !std::all_of(layers.begin(), layers.end(), [&](const fs::path& layer) { return userns_->can_idmap(layer); }))
    return std::nullopt;
  return userns_->take();
}

SpawnRequest ContainerBackend::spawn_request(const std::string& id, const SandboxSpec& spec) const {
  SpawnRequest req;
  req.hostname = spec.hostname.empty() ? id : spec.hostname;
  if (req.hostname.size() > 64) req.hostname.resize(64);
  req.init_binary_fd = init_binary_.get();
  req.cap_last_cap = cap_last_cap_;
  req.open_files = spec.resources.open_files;
  req.sched_idle = spec.resources.priority == Priority::kBatch;
  req.core_cookie = spec.resources.priority == Priority::kLatency && kernel_qos_.core_scheduling;
  req.memory_merge = spec.resources.ksm && kernel_qos_.memory_merge;
  return req;
}

std::unique_ptr<BackendSandbox> ContainerBackend::create_cold(const CreateParams& params) {
  // A user namespace of its own, when the node has them and every layer's file system can be idmapped; taken
  // first, so that a node out of id blocks has nothing to undo.
  std::optional<UserNamespaces::Namespace> userns = take_user_namespace(params.image_layers);
  Undo give_back([&] {
    if (userns) userns_->give_back(userns->first);
  });

  fs::path run_dir = config_.run_dir / params.id;
  std::string socket_path = (run_dir / "init.sock").string();
  if (socket_path.size() >= sizeof(sockaddr_un::sun_path))
    throw Error(Code::kFailedPrecondition,
                fmt::format("run directory {} is too long for a unix socket path", config_.run_dir.string()));
  make_run_directory(run_dir);
  Undo remove_run_dir([&] {
    std::error_code ec;
    fs::remove_all(run_dir, ec);
  });
  UniqueFd listener = listen_on(socket_path);

  std::unique_ptr<SandboxCgroup> cgroup = cgroups_->create(params.id, params.spec.resources);
  if (userns) cgroup->let_join_as(userns->first);
  std::vector<UniqueFd> procs = cgroup->open_procs();
  UniqueFd netns = netns_->take();

  RootfsOptions options;
  if (userns) options.userns_first = userns->first;
  RootfsPlan plan = plan_sandbox_root(run_dir, params.image_layers, params.spec.resources, options);

  SpawnRequest req = spawn_request(params.id, params.spec);
  req.rootfs = &plan;
  req.netns_fd = netns.get();
  for (const auto& fd : procs) req.cgroup_procs_fds.push_back(fd.get());
  req.listen_fd = listener.get();
  auto prog = params.spec.allow_ptrace ? seccomp_ptrace_.fprog() : seccomp_default_.fprog();
  req.seccomp = &prog;
  std::shared_ptr<void> ksm_hold;
  if (req.memory_merge) ksm_hold = qos::hold_ksm();
  if (userns) req.userns_fd = userns->fd.get();

  Identity identity{
      boot_id_,    0, netns_inode_of_fd(netns.get()), layer_devices(params.image_layers), options.userns_first,
      std::nullopt};
  // Its network, when the spec asks for one: the link is in its namespace before its first process runs.
  Undo detach([&] {
    if (identity.link) network_->detach(params.id);
  });
  if (params.spec.network.mode != "none") {
    if (!network_) throw Error(Code::kUnimplemented, "network: this agent gives sandboxes no network");
    identity.link = network_->attach(params.id, netns.get(), params.spec.network, link_limits(params.spec.resources));
  }
  // The root is built by the child in the sandbox's groups: at a small CPU share it would wait out quota periods
  // (a create of 0.01 cores took 40 ms instead of 4.5). Its limit holds from dsec-init's exec on.
  cgroup->unthrottle();
  SpawnedInit init = spawn_init(req);
  cgroup->limit_cpu(params.spec.resources.cpu);
  remove_run_dir.disarm();
  give_back.disarm();
  detach.disarm();
  // Read while the agent holds init's pidfd: the pid cannot name another process yet (init is this process's
  // unreaped child). A sandbox whose init already died has no start time; it turns failed like any dead one.
  identity.init_start_time = process_start_time(init.pid).value_or(0);
  auto sandbox = std::make_unique<ContainerSandbox>(params.id, params.spec, run_dir, std::move(init), std::move(cgroup),
                                                    config_.sleep_reclaim_timeout, std::move(identity),
                                                    cgroups_->version(), userns_, network_);
  sandbox->set_qos(describe_qos(params.spec, req.memory_merge), std::move(ksm_hold));
  sandbox->write_resolv_conf();
  return sandbox;
}

QosGrant ContainerBackend::describe_qos(const SandboxSpec& spec, bool merged) const {
  return qos::describe_grant(spec.resources,
                             {&kernel_qos_, &cpus_, cgroups_->version(), cgroups_->cpu_idle(), /*vm=*/false, merged});
}

void ContainerBackend::remove_leftovers(const std::string& id) {
  if (id.empty() || id.find('/') != std::string::npos || id.find("..") != std::string::npos)
    throw Error(Code::kInvalidArgument, fmt::format("'{}' is not a sandbox id", id));
  // Killing every process in the sandbox's groups kills its init, and with it the pid and mount namespaces.
  cgroups_->remove_sandbox_groups(id);
  std::error_code ec;
  fs::remove_all(config_.run_dir / id, ec);
}

void ContainerBackend::shutdown() {
  if (warm_) warm_->stop();  // its sandboxes are destroyed
  netns_.reset();
  if (cgroups_) {
    cgroups_->remove_empty_groups();
    cgroups_->remove_subtree_if_empty();
  }
}

}  // namespace container

std::unique_ptr<Backend> make_container_backend(const AgentConfig& config,
                                                std::shared_ptr<container::UserNamespaces> userns,
                                                std::shared_ptr<network::NodeNetwork> network,
                                                std::vector<container::WarmShape> warm_pools) {
  return std::make_unique<container::ContainerBackend>(config, std::move(userns), std::move(network),
                                                       std::move(warm_pools));
}

std::string container_cgroup_version() {
  struct statfs st {};
  if (::statfs("/sys/fs/cgroup", &st) == 0 && st.f_type == CGROUP2_SUPER_MAGIC) return "v2";
  return "v1";
}

bool container_cgroup_cpu_idle(const std::string& cgroup_name) {
  std::string dir = "/sys/fs/cgroup/" + cgroup_name;
  if (container_cgroup_version() == "v1") {
    auto mounts = cgroup_v1_mounts();
    auto it = mounts.find("cpu");
    if (it == mounts.end()) return false;
    dir = it->second + "/" + cgroup_name;
  }
  return ::access((dir + "/cpu.idle").c_str(), F_OK) == 0;
}

}  // namespace dsec::agent
