// A container sandbox's commands: an exec (its pipes, its wait, its output) and a spawned process, the exec groups
// they start in, and init's placement in the next one ahead of them.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <filesystem>
#include <optional>

#include "agent/backends/command/exec_user.hpp"
#include "agent/backends/container/container_sandbox_internal.hpp"
#include "agent/backends/container/init_socket.hpp"
#include "common/log.hpp"
#include "common/syscall.hpp"
#include "common/wire/init_protocol.hpp"
#include "common/wire/start_error.hpp"

namespace dsec::agent::container {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using init_protocol::FailStage;
using init_protocol::Reply;
using init_protocol::ReplyType;

// After an exec's main process ends, how long to wait for its output pipes to close (a background process it left
// may hold them open forever).
constexpr auto kOutputGrace = std::chrono::milliseconds(50);

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

}  // namespace

// The exec group a command (an exec's or a spawned process's) starts in: the one init was placed in ahead, if no
// command has used it (the command is born there: no move), else a new one the command joins itself (`fds` go to
// init). However the command ends, the group is handed back and removed once empty; until then no other
// command's clean-up touches it, even while it is still empty because the command has not joined it yet.
struct ContainerSandbox::CommandGroup {
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

ExecResult ContainerSandbox::exec(const ExecRequest& req, const OutputSink& sink) {
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
    auto until = exited_at ? *exited_at + kOutputGrace : (result.timed_out ? now + std::chrono::seconds(1) : deadline);
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

std::variant<ProcessEntry, ExecResult> ContainerSandbox::spawn(const ExecRequest& req, const SpawnOptions& options) {
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

ExecCommand ContainerSandbox::resolve_command(const ExecRequest& req) {
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

bool ContainerSandbox::oom_killed_since_last_look() {
  std::uint64_t now = 0;
  try {
    now = cgroup_->oom_kills();
  } catch (const std::exception&) {
    return false;
  }
  std::uint64_t seen = oom_kills_seen_.exchange(now);
  return now > seen;
}

void ContainerSandbox::schedule_init_placement() {
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

std::string ContainerSandbox::take_init_group() {
  std::unique_lock lock(placement_mu_);
  placed_.wait_for(lock, std::chrono::milliseconds(50), [&] { return !placing_; });
  return std::exchange(init_group_, std::string());
}

void ContainerSandbox::join_placement() {
  std::thread t;
  {
    std::lock_guard lock(placement_mu_);
    t = std::move(placement_);
  }
  if (t.joinable()) t.join();
}

}  // namespace dsec::agent::container
