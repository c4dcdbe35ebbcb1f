#include "agent/backends/container/container_backend.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "agent/backends/command/exec_command.hpp"
#include "agent/backends/command/exec_user.hpp"
#include "agent/backends/container/cgroup.hpp"
#include "agent/backends/container/init_socket.hpp"
#include "agent/backends/container/netns_pool.hpp"
#include "agent/backends/container/process_identity.hpp"
#include "agent/backends/container/rootfs_files.hpp"
#include "agent/backends/container/seccomp.hpp"
#include "agent/backends/container/spawn.hpp"
#include "agent/backends/container/user_namespace.hpp"
#include "agent/backends/container/warm_pool.hpp"
#include "agent/network/node_network.hpp"
#include "agent/node/qos/kernel_qos.hpp"
#include "agent/node/qos/ksm.hpp"
#include "agent/processes/processes.hpp"
#include "common/cgroupfs.hpp"
#include "common/log.hpp"
#include "common/syscall.hpp"
#include "common/wire/init_protocol.hpp"
#include "common/wire/start_error.hpp"

namespace dsec::agent {
namespace container {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using init_protocol::FailStage;
using init_protocol::Reply;
using init_protocol::ReplyType;

constexpr std::size_t kMaxFileBytes = 1ull << 30;
// After an exec's main process ends, how long to wait for its output pipes to close (a background process it left
// may hold them open forever).
constexpr auto kOutputGrace = std::chrono::milliseconds(50);
// A sandbox's run directory keeps one empty file per exec in flight in this subdirectory, named like the exec's
// cgroup: an agent that restarts kills the groups of execs whose callers went with the old agent, and leaves the
// groups of ended execs (their background processes) alone.
constexpr const char* kExecMarkers = "execs";
// How long a restarted agent waits for a sandbox's init to answer its probe.
constexpr auto kProbeTimeout = std::chrono::seconds(5);
// How long destroy waits for an adopted sandbox's init (not the agent's child: it cannot be waited for) to go.
constexpr int kAdoptedExitWaitMs = 10000;

// The keys of a container sandbox's BackendState.
network::LinkLimits link_limits(const Resources& r) { return {r.egress_mbps, r.connections}; }

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

int read_cap_last_cap() {
  std::ifstream in("/proc/sys/kernel/cap_last_cap");
  int v = 40;
  in >> v;
  return v;
}

void append_u32(std::string& out, std::uint32_t v) { out.append(reinterpret_cast<const char*>(&v), 4); }

struct Pipe {
  UniqueFd read, write;
  static Pipe make() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw_errno(errno, "pipe2");
    return Pipe{UniqueFd(fds[0]), UniqueFd(fds[1])};
  }
};

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

// One output stream of an exec, capped: kept in `data`, or handed to the sink as it is read.
struct Capture {
  Capture(UniqueFd fd_in, int stream_in, std::size_t cap_in, const OutputSink* sink_in)
      : fd(std::move(fd_in)), stream(stream_in), cap(cap_in), sink(sink_in) {}
  UniqueFd fd;
  int stream;  // 1 stdout, 2 stderr
  std::size_t cap;
  const OutputSink* sink;  // null: keep the output in `data`
  std::string data;
  std::size_t kept = 0;  // bytes kept or delivered so far
  bool truncated = false;
  // Reads what is available; false at EOF.
  bool drain() {
    char buf[65536];
    for (;;) {
      ssize_t n = ::read(fd.get(), buf, sizeof buf);
      if (n > 0) {
        std::size_t room = cap > kept ? cap - kept : 0;
        std::size_t take = std::min(room, static_cast<std::size_t>(n));
        if (take < static_cast<std::size_t>(n)) truncated = true;
        if (take == 0) continue;
        kept += take;
        if (sink) (*sink)(stream, std::string_view(buf, take));
        else data.append(buf, take);
        continue;
      }
      if (n == 0) return false;
      if (errno == EINTR) continue;
      return errno == EAGAIN;  // nothing more for now
    }
  }
};

// The on-disk mark of one exec in flight (see kExecMarkers): made before its cgroup, removed after it ended.
class ExecMarker {
 public:
  ExecMarker(const fs::path& dir, const std::string& group) : path_(dir / group) {
    UniqueFd fd(::open(path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
    if (!fd) throw_errno_fmt(errno, "create exec marker {}", path_.string());
  }
  ~ExecMarker() { ::unlink(path_.c_str()); }
  ExecMarker(const ExecMarker&) = delete;
  ExecMarker& operator=(const ExecMarker&) = delete;

 private:
  fs::path path_;
};

// What a sandbox's creator knows about it beyond its spec: the identity an agent restart checks it by.
struct Identity {
  std::string boot_id;
  std::uint64_t init_start_time = 0;
  std::uint64_t netns_inode = 0;
  std::string layer_devices;                  // of the image layers its overlay stacks
  std::optional<std::uint32_t> userns_first;  // its user namespace's block of host ids, if it has one
  std::optional<network::Attachment> link;    // its veth pair and /30, if it has a network
};

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

class ContainerSandbox final : public BackendSandbox, public InitProcesses {
 public:
  ContainerSandbox(std::string id, SandboxSpec spec, fs::path run_dir, SpawnedInit init,
                   std::unique_ptr<SandboxCgroup> cgroup, std::chrono::milliseconds reclaim_timeout, Identity identity,
                   std::string cgroup_version, std::shared_ptr<UserNamespaces> userns,
                   std::shared_ptr<network::NodeNetwork> network, bool adopted = false, bool sleeping = false,
                   std::uint64_t first_exec = 0)
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

  ~ContainerSandbox() override {
    try {
      destroy();
    } catch (...) {
    }
    join_placement();
  }

  ExecResult exec(const ExecRequest& req, const OutputSink& sink) override {
    check_running();
    {
      std::lock_guard lock(power_mu_);
      if (sleeping_) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is sleeping; wake it first", id_));
      ++running_execs_;
    }
    struct ExecCount {
      ContainerSandbox& self;
      ~ExecCount() {
        std::lock_guard lock(self.power_mu_);
        --self.running_execs_;
      }
    } exec_count{*this};
    auto started = Clock::now();
    ExecCommand command = resolve_command(req);
    const std::vector<std::string>& argv = command.argv;
    const std::string& cwd = command.cwd;
    std::string payload = command.start_payload();

    // Declared before the group below, so it goes after it: while the mark exists, an agent restart takes the group
    // for one whose caller is gone.
    std::optional<ExecMarker> marker;
    CommandGroup group(*this);
    try {
      marker.emplace(run_dir_ / kExecMarkers, group.name);
    } catch (const Error&) {
      check_running();  // a destroy removed the run directory: say that
      throw;
    }
    group.make();
    Pipe in = Pipe::make(), out = Pipe::make(), err = Pipe::make();

    UniqueFd conn;
    try {
      conn = connect_init(socket_path_, id_);
    } catch (const Error&) {
      check_running();
      throw;
    }

    std::string message;
    append_u32(message, static_cast<std::uint32_t>(payload.size()));
    message += payload;
    std::vector<int> pass{in.read.get(), out.write.get(), err.write.get()};
    for (const auto& fd : group.fds) pass.push_back(fd.get());
    send_init_request(conn.get(), message, pass);
    in.read.reset();
    out.write.reset();
    err.write.reset();
    group.fds.clear();

    Reply reply{};
    if (!read_init_reply(conn.get(), &reply, sizeof reply, started + std::chrono::seconds(30))) {
      check_running();
      throw Error(Code::kUnavailable, fmt::format("sandbox {}: its init did not answer", id_));
    }
    // Init forked the command (or tried): once this exec is over, the next group is made and init moved there. Not
    // while the command runs: the move holds the kernel's threadgroup lock for writing, which every fork and exit
    // on the host waits for, the command's own exit among them (milliseconds after an idle spell).
    group.place_next_when_done();
    if (reply.type == ReplyType::kFailed) {
      if (auto r = init::start_failure_result(reply.a, static_cast<FailStage>(reply.b), argv[0], cwd)) {
        r->duration_seconds = std::chrono::duration<double>(Clock::now() - started).count();
        if (sink) sink(2, r->stderr_data);
        return *r;
      }
      throw init::start_error(reply.a, static_cast<FailStage>(reply.b), argv[0], cwd,
                              fmt::format("uid {}, gid {}", command.uid, command.gid));
    }

    ExecResult result;
    const OutputSink* to = sink ? &sink : nullptr;
    Capture cout{std::move(out.read), 1, req.max_output_bytes, to};
    Capture cerr{std::move(err.read), 2, req.max_output_bytes, to};
    set_nonblocking(cout.fd.get());
    set_nonblocking(cerr.fd.get());
    std::string_view stdin_left = req.stdin_data;
    if (stdin_left.empty()) in.write.reset();
    else set_nonblocking(in.write.get());

    auto deadline = started + std::chrono::microseconds(static_cast<std::int64_t>(req.timeout_seconds * 1e6));
    std::optional<Clock::time_point> exited_at;
    bool out_open = true, err_open = true, conn_open = true;
    int status = 0;
    // Whatever ends the wait early (a sink that throws, a lost init) leaves nothing of the command running.
    struct KillOnUnwind {
      SandboxCgroup& cgroup;
      const std::string& group;
      int uncaught = std::uncaught_exceptions();
      ~KillOnUnwind() {
        if (std::uncaught_exceptions() > uncaught) {
          try {
            cgroup.kill_exec_group(group);
          } catch (...) {
          }
        }
      }
    } kill_on_unwind{*cgroup_, group.name};
    for (;;) {
      auto now = Clock::now();
      if (exited_at && ((!out_open && !err_open) || now >= *exited_at + kOutputGrace)) break;
      if (!result.timed_out && now >= deadline) {
        result.timed_out = true;
        cgroup_->kill_exec_group(group.name);
      }
      if (result.timed_out && !exited_at && now >= deadline + std::chrono::seconds(10)) {
        // Killed but never reported: treat as killed rather than wait forever.
        status = SIGKILL;
        exited_at = now;
        continue;
      }
      if (!conn_open && !exited_at) {
        // init went away without reporting: the sandbox died or is being destroyed.
        check_running();
        throw Error(Code::kUnavailable, fmt::format("sandbox {}: lost its init during exec", id_));
      }
      pollfd fds[4];
      int n = 0;
      int i_out = -1, i_err = -1, i_in = -1, i_conn = -1;
      if (out_open) fds[i_out = n++] = {cout.fd.get(), POLLIN, 0};
      if (err_open) fds[i_err = n++] = {cerr.fd.get(), POLLIN, 0};
      if (in.write) fds[i_in = n++] = {in.write.get(), POLLOUT, 0};
      if (conn_open && !exited_at) fds[i_conn = n++] = {conn.get(), POLLIN, 0};
      auto until =
          exited_at ? *exited_at + kOutputGrace : (result.timed_out ? now + std::chrono::seconds(1) : deadline);
      auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count();
      int rc = ::poll(fds, static_cast<nfds_t>(n), static_cast<int>(std::clamp<long long>(wait_ms + 1, 0, 1000)));
      if (rc < 0 && errno != EINTR) throw_errno(errno, "poll exec streams");
      if (rc <= 0) continue;
      if (i_out >= 0 && fds[i_out].revents) out_open = cout.drain();
      if (i_err >= 0 && fds[i_err].revents) err_open = cerr.drain();
      if (i_in >= 0 && fds[i_in].revents) {
        ssize_t w = ::write(in.write.get(), stdin_left.data(), std::min<std::size_t>(stdin_left.size(), 65536));
        if (w > 0) stdin_left.remove_prefix(static_cast<std::size_t>(w));
        if ((w < 0 && errno != EAGAIN && errno != EINTR) || stdin_left.empty()) in.write.reset();
      }
      if (i_conn >= 0 && fds[i_conn].revents) {
        Reply exit_reply{};
        if (read_init_reply(conn.get(), &exit_reply, sizeof exit_reply, Clock::now() + std::chrono::seconds(1)) &&
            exit_reply.type == ReplyType::kExited) {
          status = exit_reply.a;
          exited_at = Clock::now();
          // Output written before the exit is already in the pipes.
          if (out_open) out_open = cout.drain();
          if (err_open) err_open = cerr.drain();
        } else {
          conn_open = false;
        }
      }
    }
    if (WIFEXITED(status)) {
      result.exit_code = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      result.exit_code = -1;
      result.signal = WTERMSIG(status);
      if (result.signal == SIGKILL && !result.timed_out) result.oom_killed = oom_killed_since_last_look();
    }
    result.stdout_data = std::move(cout.data);
    result.stderr_data = std::move(cerr.data);
    result.stdout_truncated = cout.truncated;
    result.stderr_truncated = cerr.truncated;
    result.duration_seconds = std::chrono::duration<double>(Clock::now() - started).count();
    return result;
  }

  Processes* processes() override { return this; }

  std::variant<ProcessEntry, ExecResult> spawn(const ExecRequest& req, const SpawnOptions& options) override {
    check_awake();
    ExecCommand command = resolve_command(req);
    std::string payload = spawn_payload(options, command.start_payload());
    // The process gets an exec group of its own, as an exec does, and as an exec starts in the one init was placed
    // in ahead when there is one (a move after an idle spell costs ~10 ms); no mark: an agent restart leaves it
    // running.
    CommandGroup group(*this);
    group.make();
    std::vector<int> fds;
    for (const auto& fd : group.fds) fds.push_back(fd.get());
    std::string reply = exchange_with(process_protocol::Op::kSpawn, payload, fds, std::chrono::seconds(30));
    group.fds.clear();
    group.place_next_when_done();
    return spawn_reply(reply, command.argv[0], command.cwd);
  }

  // The files API works as root inside: in a user namespace, with the file-system ids of its root.
  void write_file(std::string_view path, std::string_view data, unsigned mode) override {
    ScopedFsIds as_root_inside(identity_.userns_first);
    files().write_file(path, data, mode);
  }
  std::string read_file(std::string_view path) override {
    ScopedFsIds as_root_inside(identity_.userns_first);
    return files().read_file(path, kMaxFileBytes);
  }
  void put_archive(std::string_view dir, std::string_view tar_bytes) override {
    ScopedFsIds as_root_inside(identity_.userns_first);
    files().put_archive(dir, tar_bytes);
  }
  std::string get_archive(std::string_view dir) override {
    ScopedFsIds as_root_inside(identity_.userns_first);
    return files().get_archive(dir, kMaxFileBytes);
  }
  bool is_directory(std::string_view path) override {
    ScopedFsIds as_root_inside(identity_.userns_first);
    return files().is_directory(path);
  }

  SleepReport sleep() override {
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

  // Freezes the sandbox and pushes its memory out until `deadline` (true: stopped there with some left). A failure
  // leaves it as it was: limits back, running.
  bool freeze_and_reclaim(Clock::time_point deadline) {
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

  std::optional<ColdReclaim> reclaim_cold(Clock::time_point deadline) override {
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

  std::uint64_t refaults() override { return cgroup_->refaults(); }

  void set_network(const NetworkPolicy& policy) override {
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

  std::string expose(std::uint32_t port) override {
    check_running();
    if (!network_) throw Error(Code::kUnimplemented, "this agent gives sandboxes no network");
    std::lock_guard lock(network_mu_);
    // A sandbox without a network gets a link that allows no egress: the port is reached from outside only.
    if (!identity_.link) attach_now(NetworkPolicy{});
    return network_->expose(id_, port);
  }

  void unexpose(std::uint32_t port) override {
    check_running();
    if (!network_) throw Error(Code::kNotFound, fmt::format("port: {} of sandbox {} is not exposed", port, id_));
    network_->unexpose(id_, port);
  }

  NetworkUsage network_usage() override { return network_ ? network_->usage(id_) : NetworkUsage{}; }

  std::map<std::uint32_t, std::string> exposed() override {
    std::map<std::uint32_t, std::string> out;
    if (!network_) return out;
    for (const auto& [port, node_port] : network_->exposed(id_)) out[port] = network_->address_of(node_port);
    return out;
  }

  SleepReport wake() override {
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

  FilesCapture capture_files(const fs::path& dest, const image::UpperTreeLimits& limits) override {
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

  // A sandbox started ahead of its create (a warm pool's) becomes the create's: its run directory and cgroups take
  // the sandbox's id (v2 cannot rename cgroups: they keep the pool's name, which its record keeps), its hostname
  // is set, and it gets the network its spec asks for. Called before anyone else sees it; throws what failed (the
  // caller then drops it: destroy() cleans up under whichever names it had by then).
  void claim_as(const std::string& id, const SandboxSpec& spec, const fs::path& run_dir) {
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

  void set_qos(QosGrant grant, std::shared_ptr<void> ksm_hold) {
    qos_ = std::move(grant);
    ksm_hold_ = std::move(ksm_hold);
  }
  QosGrant qos_grant() override { return qos_; }

  BackendState recovery_state() override {
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

  bool alive() override {
    if (destroyed_.load()) return false;
    pollfd p{init_.pidfd.get(), POLLIN, 0};
    return ::poll(&p, 1, 0) == 0;
  }

  void destroy() override {
    std::lock_guard lock(destroy_mu_);
    if (destroyed_.exchange(true)) return;
    {
      // Frozen processes would not die (cgroup v1): a sleeping sandbox is thawed first.
      std::lock_guard power(power_mu_);
      if (sleeping_) {
        try {
          cgroup_->restore_memory();
          cgroup_->thaw();
        } catch (const std::exception& e) {
          log_warn("sandbox {}: thaw before destroy: {}", id_, e.what());
        }
        sleeping_ = false;
      }
    }
    if (init_.pidfd) {
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

 private:
  std::string hostname() const { return spec_.hostname.empty() ? id_ : spec_.hostname; }

  // Process requests to init (InitProcesses). A sandbox that sleeps has its init frozen: refused before, and a
  // read that waits gives up when a sleep begins.
  std::string exchange(process_protocol::Op op, const std::string& payload,
                       std::chrono::milliseconds reply_within) override {
    return exchange_with(op, payload, {}, reply_within);
  }

  std::string exchange_with(process_protocol::Op op, const std::string& payload, const std::vector<int>& fds,
                            std::chrono::milliseconds reply_within) {
    check_awake();
    try {
      return exchange_process_request(socket_path_, id_, op, payload, fds, Clock::now() + reply_within,
                                      [this] { return sleeping_now() || destroyed_.load(); });
    } catch (const Error&) {
      check_awake();
      throw;
    }
  }

  bool sleeping_now() {
    std::lock_guard lock(power_mu_);
    return sleeping_;
  }

  void check_awake() {
    check_running();
    if (sleeping_now())
      throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is sleeping; wake it first", id_));
  }

  // What an exec or a spawn runs: its argv, environment, directory and user (resolved in the sandbox's own
  // /etc/passwd and /etc/group).
  ExecCommand resolve_command(const ExecRequest& req) {
    ExecUser user = resolve_exec_user(spec_, req, [this](const std::string& path) -> std::optional<std::string> {
      RootfsFiles root = files();  // outside the try: a sandbox destroyed meanwhile is NOT_FOUND as itself
      try {
        return root.read_file(path, kMaxUserDatabaseBytes);
      } catch (const Error& e) {
        if (e.code() == Code::kNotFound) return std::nullopt;
        throw;
      }
    });
    return exec_command(spec_, req, hostname(), user);
  }

  // Whether the sandbox's memory cgroup counted an OOM kill since the last look (a command killed by SIGKILL that
  // no timeout sent: the OOM killer's, unless something inside sent it while another process hit the limit).
  bool oom_killed_since_last_look() {
    std::uint64_t now = 0;
    try {
      now = cgroup_->oom_kills();
    } catch (const std::exception&) {
      return false;
    }
    std::uint64_t seen = oom_kills_seen_.exchange(now);
    return now > seen;
  }

  void check_running() {
    if (destroyed_.load()) throw Error(Code::kNotFound, fmt::format("sandbox {} was destroyed", id_));
    if (!alive())
      throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is not running: its init process has exited", id_),
                  false, Fault::kInfrastructure);
  }

  // Init is moved into the group of the next exec ahead of it, on a thread of its own (one at a time per sandbox),
  // where the driver can (cgroup v1): that move waits on the kernel after an idle spell, which an agent loop's think
  // time always is. The command init forks next then starts in that group with no move on the exec's path.
  void schedule_init_placement() {
    std::lock_guard lock(placement_mu_);
    if (placing_ || placement_unsupported_ || destroyed_.load() || !init_group_.empty()) return;
    if (placement_.joinable()) placement_.join();  // the last one, finished
    placing_ = true;
    std::string name = "x" + std::to_string(exec_counter_.fetch_add(1));
    placement_ = std::thread([this, name] {
      bool placed = false;
      try {
        placed = !destroyed_.load() && cgroup_->place_in_exec_group(name, init_.pid);
        // The groups of ended execs that are empty now (the last one, init having left it) go.
        if (placed) cgroup_->release_exec_group("");
      } catch (const std::exception& e) {
        if (!destroyed_.load()) log_warn("sandbox {}: placing init in the next exec's group: {}", id_, e.what());
        placed = false;
      }
      std::lock_guard lock(placement_mu_);
      if (placed) init_group_ = name;
      else placement_unsupported_ = true;  // the driver does not (v2), or cannot here: execs join groups themselves
      placing_ = false;
      placed_.notify_all();
    });
  }

  // The exec group a command (an exec's or a spawned process's) starts in: the one init was placed in ahead, if no
  // command has used it (the command is born there: no move), else a new one the command joins itself (`fds` go to
  // init). However the command ends, the group is handed back and removed once empty; until then no other
  // command's clean-up touches it, even while it is still empty because the command has not joined it yet.
  struct CommandGroup {
    ContainerSandbox& sandbox;
    std::string name;
    bool placed;
    std::vector<UniqueFd> fds;
    bool place_next = false;

    explicit CommandGroup(ContainerSandbox& s) : sandbox(s), name(s.take_init_group()), placed(!name.empty()) {
      if (!placed) name = "x" + std::to_string(sandbox.exec_counter_.fetch_add(1));
    }
    // Makes a new group (not for a placed one).
    void make() {
      if (placed) return;
      try {
        fds = sandbox.cgroup_->create_exec_group(name);
      } catch (const Error&) {
        sandbox.check_running();
        throw;
      }
    }
    // Init started the command (or tried): once this is over, init moves on to the next group.
    void place_next_when_done() { place_next = placed; }
    ~CommandGroup() {
      if (place_next) sandbox.schedule_init_placement();
      try {
        // A placed group is removed by the placement that moves init on (no wait here).
        if (placed) sandbox.cgroup_->end_exec_group(name);
        else sandbox.cgroup_->release_exec_group(name);
      } catch (...) {
      }
    }
  };

  // The group init sits in for the next exec, taken by this exec; empty when there is none. A placement under way
  // is waited for: the command's own move into a group of its own would wait on the same kernel work.
  std::string take_init_group() {
    std::unique_lock lock(placement_mu_);
    placed_.wait_for(lock, std::chrono::milliseconds(50), [&] { return !placing_; });
    return std::exchange(init_group_, std::string());
  }

  void join_placement() {
    std::thread t;
    {
      std::lock_guard lock(placement_mu_);
      t = std::move(placement_);
    }
    if (t.joinable()) t.join();
  }

  // The first link of a sandbox made without a network, into its namespace now. Holds network_mu_.
  void attach_now(const NetworkPolicy& policy) {
    std::string path = fmt::format("/proc/{}/ns/net", init_.pid);
    UniqueFd ns(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!ns) throw_errno(errno, fmt::format("open the network namespace of sandbox {}", id_));
    check_running();  // the pid named its init when it was opened
    identity_.link = network_->attach(id_, ns.get(), policy, link_limits(spec_.resources));
    write_resolv_conf();
  }

 public:
  // A sandbox with a link resolves names through the agent (NodeNetwork::resolv_conf). Holds network_mu_, or the
  // sandbox is new.
  void write_resolv_conf() {
    if (!identity_.link) return;
    try {
      files().write_file("/etc/resolv.conf", network::NodeNetwork::resolv_conf(*identity_.link), 0644);
    } catch (const std::exception& e) {
      log_warn("sandbox {}: /etc/resolv.conf: {}", id_, e.what());
    }
  }

 private:
  RootfsFiles files() {
    check_running();
    std::string path = fmt::format("/proc/{}/root", init_.pid);
    UniqueFd root(::open(path.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    if (!root) throw_errno(errno, fmt::format("open the root of sandbox {}", id_));
    // The pid could have been reused between the liveness check and the open: check again through the pidfd.
    check_running();
    return RootfsFiles(std::move(root), identity_.userns_first);
  }

  std::chrono::milliseconds reclaim_timeout_;
  std::string id_;
  SandboxSpec spec_;
  fs::path run_dir_;
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

class ContainerBackend final : public Backend {
 public:
  ContainerBackend(const AgentConfig& config, std::shared_ptr<UserNamespaces> userns,
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
      warm_ = std::make_unique<WarmPools>(std::move(warm_pools),
                                          [this](const WarmShape& shape) { return pre_make(shape); });
  }

  // The pools fill once the earlier run's sandboxes were taken over: a pool's first start releases the user
  // namespace claims nobody took back (UserNamespaces::take), and an adoption still to come would find its block
  // claimed by a pooled sandbox.
  void start_background() override {
    if (warm_) warm_->start();
  }

  ~ContainerBackend() override { shutdown(); }

  std::string_view kind() const override { return "container"; }

  std::unique_ptr<BackendSandbox> create(const CreateParams& params) override {
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

  PoolStats pool_stats() override {
    if (!warm_) return {};
    WarmPoolStats s = warm_->stats();
    return PoolStats{s.size, s.ready, s.claims, s.misses, s.failures};
  }

 private:
  // What a warm pool keeps: a sandbox started under a name of its own, destroyed with it when never claimed.
  struct PreMadeSandbox final : PreMade {
    std::unique_ptr<ContainerSandbox> sandbox;
  };
  static constexpr const char* kPreMadePrefix = "w-";

  std::unique_ptr<PreMade> pre_make(const WarmShape& shape) {
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

 public:
  std::unique_ptr<BackendSandbox> create_cold(const CreateParams& params) {
    // A user namespace of its own, when the node has them and every layer's file system can be idmapped; taken
    // first, so that a node out of id blocks has nothing to undo.
    std::optional<UserNamespaces::Namespace> userns;
    if (userns_ && userns_->enabled() &&
        std::all_of(params.image_layers.begin(), params.image_layers.end(),
                    [&](const fs::path& layer) { return userns_->can_idmap(layer); }))
      userns.emplace(userns_->take());
    struct GiveBack {
      UserNamespaces* pool;
      std::optional<UserNamespaces::Namespace>& ns;
      bool armed = true;
      ~GiveBack() {
        if (armed && ns) pool->give_back(ns->first);
      }
    } give_back{userns_.get(), userns};

    fs::path run_dir = config_.run_dir / params.id;
    std::string socket_path = (run_dir / "init.sock").string();
    if (socket_path.size() >= sizeof(sockaddr_un::sun_path))
      throw Error(Code::kFailedPrecondition,
                  fmt::format("run directory {} is too long for a unix socket path", config_.run_dir.string()));
    if (::mkdir(run_dir.c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}", run_dir.string());
    struct Cleanup {
      fs::path dir;
      bool armed = true;
      ~Cleanup() {
        std::error_code ec;
        if (armed) fs::remove_all(dir, ec);
      }
    } cleanup{run_dir};
    for (const char* sub : {"rw", "root", kExecMarkers})
      if (::mkdir((run_dir / sub).c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}/{}", run_dir.string(), sub);

    UniqueFd listener(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!listener) throw_errno(errno, "socket");
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket_path.c_str(), sizeof addr.sun_path - 1);
    if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
      throw_errno_fmt(errno, "bind {}", socket_path);
    if (::listen(listener.get(), 256) != 0) throw_errno(errno, "listen");

    std::unique_ptr<SandboxCgroup> cgroup = cgroups_->create(params.id, params.spec.resources);
    if (userns) cgroup->let_join_as(userns->first);
    std::vector<UniqueFd> procs = cgroup->open_procs();
    UniqueFd netns = netns_->take();

    std::vector<std::string> layers;
    for (auto it = params.image_layers.rbegin(); it != params.image_layers.rend(); ++it) layers.push_back(it->string());
    if (layers.empty()) throw Error(Code::kInvalidArgument, "image has no layers");
    RootfsOptions options;
    if (userns) options.userns_first = userns->first;
    RootfsPlan plan = plan_rootfs(run_dir.string(), layers, params.spec.resources, options);

    SpawnRequest req;
    req.rootfs = &plan;
    req.hostname = params.spec.hostname.empty() ? params.id : params.spec.hostname;
    if (req.hostname.size() > 64) req.hostname.resize(64);
    req.netns_fd = netns.get();
    for (const auto& fd : procs) req.cgroup_procs_fds.push_back(fd.get());
    req.listen_fd = listener.get();
    req.init_binary_fd = init_binary_.get();
    auto prog = params.spec.allow_ptrace ? seccomp_ptrace_.fprog() : seccomp_default_.fprog();
    req.seccomp = &prog;
    req.cap_last_cap = cap_last_cap_;
    req.open_files = params.spec.resources.open_files;
    req.sched_idle = params.spec.resources.priority == Priority::kBatch;
    req.core_cookie = params.spec.resources.priority == Priority::kLatency && kernel_qos_.core_scheduling;
    std::shared_ptr<void> ksm_hold;
    if (params.spec.resources.ksm && kernel_qos_.memory_merge) {
      ksm_hold = qos::hold_ksm();
      req.memory_merge = true;
    }
    if (userns) req.userns_fd = userns->fd.get();

    Identity identity{
        boot_id_,    0, netns_inode_of_fd(netns.get()), layer_devices(params.image_layers), options.userns_first,
        std::nullopt};
    // Its network, when the spec asks for one: the link is in its namespace before its first process runs.
    struct Detach {
      network::NodeNetwork* network;
      const std::string& id;
      bool armed = false;
      ~Detach() {
        if (armed) network->detach(id);
      }
    } detach{network_.get(), params.id};
    if (params.spec.network.mode != "none") {
      if (!network_) throw Error(Code::kUnimplemented, "network: this agent gives sandboxes no network");
      identity.link = network_->attach(params.id, netns.get(), params.spec.network, link_limits(params.spec.resources));
      detach.armed = true;
    }
    // The root is built by the child in the sandbox's groups: at a small CPU share it would wait out quota periods
    // (a create of 0.01 cores took 40 ms instead of 4.5). Its limit holds from dsec-init's exec on.
    cgroup->unthrottle();
    SpawnedInit init = spawn_init(req);
    cgroup->limit_cpu(params.spec.resources.cpu);
    cleanup.armed = false;
    give_back.armed = false;
    detach.armed = false;
    // Read while the agent holds init's pidfd: the pid cannot name another process yet (init is this process's
    // unreaped child). A sandbox whose init already died has no start time; it turns failed like any dead one.
    identity.init_start_time = process_start_time(init.pid).value_or(0);
    auto sandbox = std::make_unique<ContainerSandbox>(params.id, params.spec, run_dir, std::move(init),
                                                      std::move(cgroup), config_.sleep_reclaim_timeout,
                                                      std::move(identity), cgroups_->version(), userns_, network_);
    sandbox->set_qos(describe_qos(params.spec, req.memory_merge), std::move(ksm_hold));
    sandbox->write_resolv_conf();
    return sandbox;
  }

  std::unique_ptr<BackendSandbox> adopt(const AdoptParams& params) override {
    const BackendState& state = params.state;
    auto value = [&](const char* name) -> const std::string& {
      auto it = state.find(name);
      if (it == state.end() || it->second.empty())
        throw Error(Code::kFailedPrecondition,
                    fmt::format("its record lacks '{}' (it was made by an agent that did not keep it)", name));
      return it->second;
    };
    auto number = [&](const char* name) -> std::uint64_t {
      const std::string& text = value(name);
      std::uint64_t v = 0;
      auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec != std::errc() || ptr != text.data() + text.size())
        throw Error(Code::kFailedPrecondition, fmt::format("its record's '{}' is not a number: '{}'", name, text));
      return v;
    };
    if (value(key::kBootId) != boot_id_)
      throw Error(Code::kNotFound, "the host rebooted since it was made (another boot id)");
    const auto pid = static_cast<pid_t>(number(key::kInitPid));
    const std::uint64_t start_time = number(key::kInitStartTime);
    const std::uint64_t netns_inode = number(key::kNetnsInode);
    const std::string& version = value(key::kCgroupVersion);
    const std::string& cgroup_path = value(key::kCgroup);
    const fs::path run_dir = value(key::kRunDir);
    if (!run_dir.is_absolute() || run_dir.filename() != params.id)
      throw Error(
          Code::kFailedPrecondition,
          fmt::format("its record's run directory {} is not one of a sandbox named {}", run_dir.string(), params.id));
    if (version != cgroups_->version())
      throw Error(Code::kFailedPrecondition,
                  fmt::format("it runs under cgroup {}, this agent drives cgroup {}", version, cgroups_->version()));

    // The pid alone proves nothing: open a pidfd, then check that the process it names started when init did.
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

    // Its root stacks the image layers as they were mounted then: a layer whose mount did not survive the agent (the
    // layer file system's connection was lost, the mount detached and perhaps made again) cannot serve it any more.
    const std::string devices = layer_devices(params.image_layers);
    if (auto it = state.find(key::kLayerDevices); it != state.end() && !it->second.empty() && it->second != devices)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("its image layers are no longer the mounts it runs on (devices {}, now {}): they did "
                              "not survive the agent",
                              it->second, devices.empty() ? "missing" : devices));

    // Its user namespace's block: the uid map proves it, and no other agent on the host may hold it now.
    std::optional<std::uint32_t> userns_first;
    if (auto it = state.find(key::kUsernsFirst); it != state.end() && !it->second.empty()) {
      userns_first = static_cast<std::uint32_t>(number(key::kUsernsFirst));
      const std::string expected = fmt::format("0 {} {}", *userns_first, kUsernsIds);
      const std::string map = uid_map_of(pid);
      if (map != expected)
        throw Error(Code::kFailedPrecondition,
                    fmt::format("its init's uid map is '{}', not its record's '{}'", map, expected));
      if (!userns_ || !userns_->adopt(*userns_first))
        throw Error(Code::kFailedPrecondition,
                    fmt::format("its user namespace's host ids from {} are held by another agent on this host (or "
                                "are outside this agent's --userns-range)",
                                *userns_first));
    }
    struct GiveBack {
      UserNamespaces* pool;
      std::optional<std::uint32_t> first;
      ~GiveBack() {
        if (first) pool->give_back(*first);
      }
    } give_back{userns_.get(), userns_first};

    // From here the groups are this object's: if taking the sandbox over fails, they (and its processes) go.
    std::unique_ptr<SandboxCgroup> cgroup = cgroups_->adopt(cgroup_path);
    if (userns_first) cgroup->let_join_as(*userns_first);
    // A freeze the record does not explain (a sleep, wake or snapshot cut short) is undone, and a sleeping sandbox
    // stays asleep; either way the memory limit a wake puts back is the sandbox's own.
    const bool frozen = cgroup->frozen();
    if (params.sleeping) {
      if (!frozen) {
        cgroup->freeze();
        cgroup->reclaim_memory(std::chrono::steady_clock::now() + config_.sleep_reclaim_timeout);
      }
      cgroup->set_restore_limit(params.spec.resources.memory_bytes);
    } else if (frozen) {
      log_info("sandbox {}: frozen, but recorded running; thawing it", params.id);
      cgroup->set_restore_limit(params.spec.resources.memory_bytes);
      cgroup->restore_memory();
      cgroup->thaw();
    }

    // Execs in flight when the old agent died lost their caller with it (their output went to its pipes): their
    // processes are killed with their groups. Groups of ended execs hold background processes, which stay.
    // Init may sit in an exec group (placed there ahead of an exec): the kills below leave it alone.
    cgroup->spare(pid);
    const fs::path markers = run_dir / kExecMarkers;
    std::set<std::string> in_flight;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(markers, ec)) in_flight.insert(entry.path().filename().string());
    std::uint64_t next_exec = 0;
    std::size_t killed = 0;
    for (const std::string& group : cgroup->exec_groups()) {
      if (group.size() > 1 && group[0] == 'x') {
        std::uint64_t n = 0;
        auto [ptr, err] = std::from_chars(group.data() + 1, group.data() + group.size(), n);
        if (err == std::errc() && ptr == group.data() + group.size()) next_exec = std::max(next_exec, n + 1);
      }
      const bool kill = in_flight.count(group) > 0;
      killed += kill;
      cgroup->adopt_exec_group(group, kill);
    }
    for (const auto& name : in_flight) ::unlink((markers / name).c_str());
    if (killed > 0)
      log_info("sandbox {}: killed {} exec{} whose caller went with the previous agent", params.id, killed,
               killed == 1 ? "" : "s");
    if (::mkdir(markers.c_str(), 0700) != 0 && errno != EEXIST) throw_errno_fmt(errno, "mkdir {}", markers.string());

    std::string why;
    if (!probe_init((run_dir / "init.sock").string(), !params.sleeping,
                    std::chrono::duration_cast<std::chrono::milliseconds>(kProbeTimeout), &why))
      throw Error(Code::kUnavailable, fmt::format("its init (pid {}) does not answer: {}", pid, why));

    // Its network: the link must still be there, and its rules go back in force.
    std::optional<network::Attachment> link;
    if (auto it = state.find(key::kNetBlock); it != state.end() && !it->second.empty()) {
      network::Attachment a;
      a.block = static_cast<std::uint32_t>(number(key::kNetBlock));
      a.interface = value(key::kNetInterface);
      std::map<std::uint16_t, std::uint16_t> exposed;
      if (auto e = state.find(key::kExposed); e != state.end()) {
        std::string_view rest = e->second;
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
      }
      if (!network_ || !network_->adopt(params.id, a, params.spec.network, exposed))
        throw Error(Code::kFailedPrecondition,
                    fmt::format("its network link {} is gone, or its addresses are another agent's", a.interface));
      link = a;
    }
    Identity identity{boot_id_, start_time, netns_inode, devices, userns_first, link};
    give_back.first.reset();
    auto sandbox = std::make_unique<ContainerSandbox>(
        params.id, params.spec, run_dir, std::move(init), std::move(cgroup), config_.sleep_reclaim_timeout,
        std::move(identity), version, userns_, network_, true, params.sleeping, next_exec);
    // Its processes kept whatever they were started with; ksmd runs again while it lives.
    const bool merged = params.spec.resources.ksm && kernel_qos_.memory_merge;
    std::shared_ptr<void> ksm_hold;
    if (merged) ksm_hold = qos::hold_ksm();
    sandbox->set_qos(describe_qos(params.spec, merged), std::move(ksm_hold));
    return sandbox;
  }

  QosGrant describe_qos(const SandboxSpec& spec, bool merged) const {
    return qos::describe_grant(spec.resources,
                               {&kernel_qos_, &cpus_, cgroups_->version(), cgroups_->cpu_idle(), /*vm=*/false, merged});
  }

  void remove_leftovers(const std::string& id) override {
    if (id.empty() || id.find('/') != std::string::npos || id.find("..") != std::string::npos)
      throw Error(Code::kInvalidArgument, fmt::format("'{}' is not a sandbox id", id));
    // Killing every process in the sandbox's groups kills its init, and with it the pid and mount namespaces.
    cgroups_->remove_sandbox_groups(id);
    std::error_code ec;
    fs::remove_all(config_.run_dir / id, ec);
  }

  void shutdown() override {
    if (warm_) warm_->stop();  // its sandboxes are destroyed
    netns_.reset();
    if (cgroups_) {
      cgroups_->remove_empty_groups();
      cgroups_->remove_subtree_if_empty();
    }
  }

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

}  // namespace
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
