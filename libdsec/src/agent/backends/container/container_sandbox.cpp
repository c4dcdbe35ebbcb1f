// A container sandbox: its files, sleep and wake, its network, its record, its destroy. Its commands (exec, spawn)
// are in container_exec.cpp.
#include <fcntl.h>
#include <linux/magic.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <exception>
#include <filesystem>

#include "agent/backends/container/container_sandbox_internal.hpp"
#include "agent/backends/container/init_socket.hpp"
#include "agent/backends/container/process_identity.hpp"
#include "common/log.hpp"
#include "common/syscall.hpp"
#include "common/wire/init_protocol.hpp"

namespace dsec::agent::container {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// How long destroy waits for an adopted sandbox's init (not the agent's child: it cannot be waited for) to go.
constexpr int kAdoptedExitWaitMs = 10000;

// Sets the hostname in the UTS namespace of process `pid` (a sandbox's init): the calling thread joins it for the
// moment and goes back to its own (a UTS namespace is per thread; the sandbox's belongs to the host's user
// namespace, so the agent may).
void set_hostname_of(pid_t pid, const std::string& hostname) {
  UniqueFd own(::open("/proc/thread-self/ns/uts", O_RDONLY | O_CLOEXEC));
  if (!own) throw_errno(errno, "open this thread's UTS namespace");
  UniqueFd uts(::open(fmt::format("/proc/{}/ns/uts", pid).c_str(), O_RDONLY | O_CLOEXEC));
  if (!uts) throw_errno(errno, fmt::format("open the UTS namespace of pid {}", pid));
  if (::setns(uts.get(), CLONE_NEWUTS) != 0)
    throw_errno(errno, fmt::format("setns into the UTS namespace of pid {}", pid));
  const int err = ::sethostname(hostname.data(), hostname.size()) == 0 ? 0 : errno;
  if (::setns(own.get(), CLONE_NEWUTS) != 0) {
    // Cannot happen with a descriptor of its own namespace; a thread left elsewhere would name the wrong host.
    log_error("setns back into the agent's UTS namespace: {}", std::strerror(errno));
    std::abort();
  }
  if (err) throw_errno(err, fmt::format("sethostname for pid {}", pid));
}

}  // namespace

ContainerSandbox::ContainerSandbox(std::string id, SandboxSpec spec, fs::path run_dir, SpawnedInit init,
                                   std::unique_ptr<SandboxCgroup> cgroup, std::chrono::milliseconds reclaim_timeout,
                                   Identity identity, std::string cgroup_version,
                                   std::shared_ptr<UserNamespaces> userns,
                                   std::shared_ptr<network::NodeNetwork> network, bool adopted, bool sleeping,
                                   std::uint64_t first_exec)
    : InitProcesses(id),
      reclaim_timeout_(reclaim_timeout),
      id_(std::move(id)),
      spec_(std::move(spec)),
      run_dir_(std::move(run_dir)),
      socket_path_((run_dir_ / "init.sock").string()),
      init_(std::move(init)),
      cgroup_(std::move(cgroup)),
      identity_(std::move(identity)),
      cgroup_version_(std::move(cgroup_version)),
      userns_(std::move(userns)),
      network_(std::move(network)),
      adopted_(adopted),
      exec_counter_(first_exec),
      sleeping_(sleeping) {
  cgroup_->spare(init_.pid);
  try {
    oom_kills_seen_ = cgroup_->oom_kills();
  } catch (const std::exception&) {
  }
  schedule_init_placement();
}

ContainerSandbox::~ContainerSandbox() {
  try {
    destroy();
  } catch (...) {
  }
  join_placement();
}

void ContainerSandbox::write_file(std::string_view path, std::string_view data, unsigned mode) {
  ScopedFsIds as_root_inside(identity_.userns_first);
  files().write_file(path, data, mode);
}

std::string ContainerSandbox::read_file(std::string_view path) {
  ScopedFsIds as_root_inside(identity_.userns_first);
  return files().read_file(path, kMaxFileBytes);
}

void ContainerSandbox::put_archive(std::string_view dir, std::string_view tar_bytes) {
  ScopedFsIds as_root_inside(identity_.userns_first);
  files().put_archive(dir, tar_bytes);
}

std::string ContainerSandbox::get_archive(std::string_view dir) {
  ScopedFsIds as_root_inside(identity_.userns_first);
  return files().get_archive(dir, kMaxFileBytes);
}

bool ContainerSandbox::is_directory(std::string_view path) {
  ScopedFsIds as_root_inside(identity_.userns_first);
  return files().is_directory(path);
}

SleepReport ContainerSandbox::sleep() {
  auto started = Clock::now();
  std::lock_guard lock(power_mu_);
  check_running();
  if (sleeping_) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is already sleeping", id_));
  // A running exec would stall, unkillable, until the wake.
  if (running_execs_ > 0)
    throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} has {} exec{} running; it can sleep once they end",
                                                       id_, running_execs_, running_execs_ == 1 ? "" : "s"));
  SleepReport report;
  report.memory_before_bytes = cgroup_->memory_current();
  report.reclaim_timed_out = freeze_and_reclaim(started + reclaim_timeout_);
  sleeping_ = true;
  report.memory_after_bytes = cgroup_->memory_current();
  report.swap_bytes = cgroup_->swap_current();
  report.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  if (report.reclaim_timed_out)
    log_warn("sandbox {}: sleep stopped releasing memory after {:.1f} s with {} bytes still charged", id_,
             report.seconds, report.memory_after_bytes);
  return report;
}

bool ContainerSandbox::freeze_and_reclaim(Clock::time_point deadline) {
  cgroup_->freeze();
  try {
    return cgroup_->reclaim_memory(deadline);
  } catch (...) {
    try {
      cgroup_->restore_memory();
      cgroup_->thaw();
    } catch (...) {
    }
    throw;
  }
}

std::optional<ColdReclaim> ContainerSandbox::reclaim_cold(Clock::time_point deadline) {
  auto started = Clock::now();
  // Held throughout: an exec that comes now waits for the thaw instead of starting inside a frozen sandbox.
  std::lock_guard lock(power_mu_);
  check_running();
  if (sleeping_ || running_execs_ > 0) return std::nullopt;
  ColdReclaim report;
  report.memory_before_bytes = cgroup_->memory_current();
  // An idle sandbox its last reclaim took to its floor has nothing new to give: stopping it again for nothing
  // would cost its processes a pause every age period. Growth of less than a MiB (or a tenth) counts as none.
  if (cold_floor_bytes_ > 0 &&
      report.memory_before_bytes <= cold_floor_bytes_ + std::max<std::uint64_t>(1 << 20, cold_floor_bytes_ / 10)) {
    report.memory_after_bytes = report.memory_before_bytes;
    report.at_floor = true;
    return report;
  }
  freeze_and_reclaim(deadline);
  cgroup_->restore_memory();
  cgroup_->thaw();
  report.memory_after_bytes = cgroup_->memory_current();
  cold_floor_bytes_ = std::max<std::uint64_t>(report.memory_after_bytes, 1);
  report.swap_bytes = cgroup_->swap_current();
  report.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return report;
}

void ContainerSandbox::set_network(const NetworkPolicy& policy) {
  check_running();
  if (!network_) throw Error(Code::kUnimplemented, "this agent gives sandboxes no network");
  std::lock_guard lock(network_mu_);
  if (identity_.link) {
    network_->update(id_, policy);
    return;
  }
  if (policy.mode == "none") return;  // no link, none needed
  attach_now(policy);
}

std::string ContainerSandbox::expose(std::uint32_t port) {
  check_running();
  if (!network_) throw Error(Code::kUnimplemented, "this agent gives sandboxes no network");
  std::lock_guard lock(network_mu_);
  // A sandbox without a network gets a link that allows no egress: the port is reached from outside only.
  if (!identity_.link) attach_now(NetworkPolicy{});
  return network_->expose(id_, port);
}

void ContainerSandbox::unexpose(std::uint32_t port) {
  check_running();
  if (!network_) throw Error(Code::kNotFound, fmt::format("port: {} of sandbox {} is not exposed", port, id_));
  network_->unexpose(id_, port);
}

std::map<std::uint32_t, std::string> ContainerSandbox::exposed() {
  std::map<std::uint32_t, std::string> out;
  if (!network_) return out;
  for (const auto& [port, node_port] : network_->exposed(id_)) out[port] = network_->address_of(node_port);
  return out;
}

SleepReport ContainerSandbox::wake() {
  auto started = Clock::now();
  std::lock_guard lock(power_mu_);
  check_running();
  if (!sleeping_) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is not sleeping", id_));
  SleepReport report;
  report.memory_before_bytes = cgroup_->memory_current();
  cgroup_->restore_memory();
  cgroup_->thaw();
  sleeping_ = false;
  report.memory_after_bytes = cgroup_->memory_current();
  report.swap_bytes = cgroup_->swap_current();
  report.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return report;
}

FilesCapture ContainerSandbox::capture_files(const fs::path& dest, const image::UpperTreeLimits& limits) {
  std::lock_guard lock(power_mu_);  // one capture at a time, never during a sleep or a wake
  check_running();
  // The writable layer is a tmpfs in the sandbox's own mount namespace, mounted before pivot_root and reachable by
  // no path, neither on the host nor inside. dsec-init holds it open for this (init_protocol::kScratchFd); the
  // agent borrows that descriptor through init's pidfd, so nothing the sandbox controls is on the way.
  UniqueFd scratch(static_cast<int>(::syscall(SYS_pidfd_getfd, init_.pidfd.get(), init_protocol::kScratchFd, 0)));
  if (!scratch) {
    int err = errno;
    check_running();
    throw_errno(err, fmt::format("sandbox {}: take its writable layer from its init", id_));
  }
  struct statfs sfs {};
  if (::fstatfs(scratch.get(), &sfs) != 0 || sfs.f_type != TMPFS_MAGIC)
    throw Error(Code::kInternal, fmt::format("sandbox {}: its init's descriptor {} is not its writable layer", id_,
                                             init_protocol::kScratchFd));
  UniqueFd upper(::openat(scratch.get(), "upper", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!upper) throw_errno(errno, fmt::format("sandbox {}: open its upper directory", id_));

  FilesCapture out;
  const bool asleep = sleeping_;  // frozen already, and stays so
  const auto started = Clock::now();
  if (!asleep) cgroup_->freeze();
  try {
    out.stats = image::copy_upper_tree(upper.get(), dest, limits, out.notes);
  } catch (...) {
    if (!asleep) {
      try {
        cgroup_->thaw();
      } catch (const std::exception& e) {
        log_warn("sandbox {}: thaw after a failed capture: {}", id_, e.what());
      }
    }
    throw;
  }
  if (!asleep) {
    cgroup_->thaw();
    out.frozen_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  }
  return out;
}

void ContainerSandbox::claim_as(const std::string& id, const SandboxSpec& spec, const fs::path& run_dir) {
  join_placement();
  if (::rename(run_dir_.c_str(), run_dir.c_str()) != 0)
    throw_errno_fmt(errno, "rename {} to {}", run_dir_.string(), run_dir.string());
  run_dir_ = run_dir;
  socket_path_ = (run_dir_ / "init.sock").string();
  id_ = id;
  set_sandbox_id(id);
  spec_ = spec;
  cgroup_->rename(id);
  set_hostname_of(init_.pid, hostname());
  if (spec.network.mode != "none") {
    if (!network_) throw Error(Code::kUnimplemented, "network: this agent gives sandboxes no network");
    std::lock_guard lock(network_mu_);
    attach_now(spec.network);
  }
}

BackendState ContainerSandbox::recovery_state() {
  BackendState state{{key::kBootId, identity_.boot_id},
                     {key::kInitPid, std::to_string(init_.pid)},
                     {key::kInitStartTime, std::to_string(identity_.init_start_time)},
                     {key::kCgroupVersion, cgroup_version_},
                     {key::kCgroup, cgroup_->path()},
                     {key::kNetnsInode, std::to_string(identity_.netns_inode)},
                     {key::kRunDir, run_dir_.string()},
                     {key::kLayerDevices, identity_.layer_devices}};
  if (identity_.userns_first) state[key::kUsernsFirst] = std::to_string(*identity_.userns_first);
  std::lock_guard lock(network_mu_);
  if (identity_.link) {
    state[key::kNetBlock] = std::to_string(identity_.link->block);
    state[key::kNetInterface] = identity_.link->interface;
    std::string ports;
    for (const auto& [port, node_port] : network_->exposed(id_))
      ports += fmt::format("{}{}:{}", ports.empty() ? "" : ",", port, node_port);
    if (!ports.empty()) state[key::kExposed] = ports;
  }
  return state;
}

bool ContainerSandbox::alive() {
  if (destroyed_.load()) return false;
  pollfd p{init_.pidfd.get(), POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}

void ContainerSandbox::destroy() {
  std::lock_guard lock(destroy_mu_);
  if (destroyed_.exchange(true)) return;
  thaw_for_destroy();
  if (init_.pidfd) kill_init();
  join_placement();
  cgroup_->destroy();
  {
    std::lock_guard lock(network_mu_);
    if (identity_.link && network_) network_->detach(id_);
  }
  // Every process that had the block's ids is gone: another sandbox may have them.
  if (identity_.userns_first && userns_) userns_->give_back(*identity_.userns_first);
  std::error_code ec;
  fs::remove_all(run_dir_, ec);
}

void ContainerSandbox::thaw_for_destroy() {
  std::lock_guard power(power_mu_);
  if (!sleeping_) return;
  try {
    cgroup_->restore_memory();
    cgroup_->thaw();
  } catch (const std::exception& e) {
    log_warn("sandbox {}: thaw before destroy: {}", id_, e.what());
  }
  sleeping_ = false;
}

void ContainerSandbox::kill_init() {
  cgroup_->unthrottle();
  // Killing pid 1 of the sandbox's pid namespace kills every process in it; the kernel reports init's exit
  // only after all of them are gone. Its mount namespace, with the overlay and tmpfs, goes with the last one.
  ::syscall(SYS_pidfd_send_signal, init_.pidfd.get(), SIGKILL, nullptr, 0);
  if (adopted_) {
    // Not this agent's child (its parent was the old agent): it cannot be reaped here, but its pidfd turns
    // readable once it and, being pid 1 of its namespace, everything else in the sandbox has exited.
    pollfd p{init_.pidfd.get(), POLLIN, 0};
    for (auto until = Clock::now() + std::chrono::milliseconds(kAdoptedExitWaitMs);
         ::poll(&p, 1, 100) == 0 && Clock::now() < until;) {
    }
  } else {
    siginfo_t info{};
    while (::waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(init_.pidfd.get()), &info, WEXITED) != 0 &&
           errno == EINTR) {
    }
  }
  init_.pidfd.reset();
}

std::string ContainerSandbox::exchange_with(process_protocol::Op op, const std::string& payload,
                                            const std::vector<int>& fds, std::chrono::milliseconds reply_within) {
  check_awake();
  try {
    return exchange_process_request(socket_path_, id_, op, payload, fds, Clock::now() + reply_within,
                                    [this] { return sleeping_now() || destroyed_.load(); });
  } catch (const Error&) {
    check_awake();
    throw;
  }
}

void ContainerSandbox::check_awake() {
  check_running();
  if (sleeping_now()) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is sleeping; wake it first", id_));
}

void ContainerSandbox::check_running() {
  if (destroyed_.load()) throw Error(Code::kNotFound, fmt::format("sandbox {} was destroyed", id_));
  if (!alive())
    throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is not running: its init process has exited", id_),
                false, Fault::kInfrastructure);
}

void ContainerSandbox::attach_now(const NetworkPolicy& policy) {
  std::string path = fmt::format("/proc/{}/ns/net", init_.pid);
  UniqueFd ns(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!ns) throw_errno(errno, fmt::format("open the network namespace of sandbox {}", id_));
  check_running();  // the pid named its init when it was opened
  identity_.link = network_->attach(id_, ns.get(), policy, link_limits(spec_.resources));
  write_resolv_conf();
}

void ContainerSandbox::write_resolv_conf() {
  if (!identity_.link) return;
  try {
    files().write_file("/etc/resolv.conf", network::NodeNetwork::resolv_conf(*identity_.link), 0644);
  } catch (const std::exception& e) {
    log_warn("sandbox {}: /etc/resolv.conf: {}", id_, e.what());
  }
}

RootfsFiles ContainerSandbox::files() {
  check_running();
  std::string path = fmt::format("/proc/{}/root", init_.pid);
  UniqueFd root(::open(path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!root) throw_errno(errno, fmt::format("open the root of sandbox {}", id_));
  // The pid could have been reused between the liveness check and the open: check again through the pidfd.
  check_running();
  return RootfsFiles(std::move(root), identity_.userns_first);
}

}  // namespace dsec::agent::container
