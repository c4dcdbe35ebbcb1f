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
  Capture(int stream_in, std::size_t cap_in, const OutputSink* sink_in)
      : stream(stream_in), cap(cap_in), sink(sink_in) {}
  UniqueFd fd;
  int stream;  // 1 stdout, 2 stderr
  std::size_t cap;
  const OutputSink* sink;  // null: keep the output in `data`
  std::string data;
  std::size_t kept = 0;  // bytes kept or delivered so far
  bool truncated = false;
  bool open = true;  // no EOF yet
  // Reads what is available, while the stream is open.
  void read() {
    if (open) open = drain();
  }
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

// One exec from the moment its command is handed to init until its result: the command's pipes, init's connection
// (which reports the command's exit), the deadline and the output caps. start() hands the command over; wait() is
// the poll loop, one step per method.
class ContainerSandbox::ExecRun {
 public:
  ExecRun(ContainerSandbox& sandbox, const std::string& group, const ExecRequest& req, const OutputSink& sink,
          Clock::time_point started);

  // Sends init the command's start with the command's ends of the pipes and `group_fds` (the exec group's, when
  // the command joins it itself), closes them here and returns init's reply: started, or why not.
  Reply start(const std::string& payload, std::vector<UniqueFd>& group_fds);

  // Feeds the command's stdin and reads its output until it exited and its output closed (or the grace after its
  // exit ended); past the deadline its group is killed. Whatever ends the wait early (a sink that throws, a lost
  // init) leaves nothing of the command running.
  ExecResult wait();

 private:
  // Done: the command exited and its output closed, or the grace after its exit is over.
  bool finished(Clock::time_point now) const;
  // Kills the command's group once the deadline passes; true when the kill was never reported within 10 s (then
  // taken as done).
  bool past_deadline(Clock::time_point now);
  // Init went away without reporting the exit: the sandbox died or is being destroyed.
  void check_init_reports();
  // Waits once for any of the pipes or init's connection, and serves what is ready.
  void poll_once(Clock::time_point now);
  int poll_timeout_ms(Clock::time_point now) const;
  void feed_stdin();
  void read_exit();
  ExecResult result();

  ContainerSandbox& sandbox_;
  const std::string& group_;
  Clock::time_point started_;
  Clock::time_point deadline_;
  UniqueFd conn_;  // to init: the start goes out, the start's and the exit's replies come back
  UniqueFd command_stdin_, command_stdout_, command_stderr_;  // the command's ends, until start() passed them
  UniqueFd stdin_;                                            // this end of the command's stdin, while it is fed
  std::string_view stdin_left_;
  Capture stdout_, stderr_;
  bool conn_open_ = true;
  std::optional<Clock::time_point> exited_at_;
  int status_ = 0;
  bool timed_out_ = false;
};

ContainerSandbox::ExecRun::ExecRun(ContainerSandbox& sandbox, const std::string& group, const ExecRequest& req,
                                   const OutputSink& sink, Clock::time_point started)
    : sandbox_(sandbox),
      group_(group),
      started_(started),
      deadline_(started + std::chrono::microseconds(static_cast<std::int64_t>(req.timeout_seconds * 1e6))),
      stdin_left_(req.stdin_data),
      stdout_(1, req.max_output_bytes, sink ? &sink : nullptr),
      stderr_(2, req.max_output_bytes, sink ? &sink : nullptr) {
  Pipe in = Pipe::make(), out = Pipe::make(), err = Pipe::make();
  command_stdin_ = std::move(in.read);
  stdin_ = std::move(in.write);
  command_stdout_ = std::move(out.write);
  stdout_.fd = std::move(out.read);
  command_stderr_ = std::move(err.write);
  stderr_.fd = std::move(err.read);
}

Reply ContainerSandbox::ExecRun::start(const std::string& payload, std::vector<UniqueFd>& group_fds) {
  try {
    conn_ = connect_init(sandbox_.socket_path_, sandbox_.id_);
  } catch (const Error&) {
    sandbox_.check_running();
    throw;
  }

  std::string message;
  append_u32(message, static_cast<std::uint32_t>(payload.size()));
  message += payload;
  std::vector<int> pass{command_stdin_.get(), command_stdout_.get(), command_stderr_.get()};
  for (const auto& fd : group_fds) pass.push_back(fd.get());
  send_init_request(conn_.get(), message, pass);
  command_stdin_.reset();
  command_stdout_.reset();
  command_stderr_.reset();
  group_fds.clear();

  Reply reply{};
  if (!read_init_reply(conn_.get(), &reply, sizeof reply, started_ + std::chrono::seconds(30))) {
    sandbox_.check_running();
    throw Error(Code::kUnavailable, fmt::format("sandbox {}: its init did not answer", sandbox_.id_));
  }
  return reply;
}

ExecResult ContainerSandbox::ExecRun::wait() {
  set_nonblocking(stdout_.fd.get());
  set_nonblocking(stderr_.fd.get());
  if (stdin_left_.empty()) stdin_.reset();
  else set_nonblocking(stdin_.get());

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
  } kill_on_unwind{*sandbox_.cgroup_, group_};
  for (;;) {
    auto now = Clock::now();
    if (finished(now)) break;
    if (past_deadline(now)) continue;
    check_init_reports();
    poll_once(now);
  }
  return result();
}

bool ContainerSandbox::ExecRun::finished(Clock::time_point now) const {
  return exited_at_ && ((!stdout_.open && !stderr_.open) || now >= *exited_at_ + kOutputGrace);
}

bool ContainerSandbox::ExecRun::past_deadline(Clock::time_point now) {
  if (!timed_out_ && now >= deadline_) {
    timed_out_ = true;
    sandbox_.cgroup_->kill_exec_group(group_);
  }
  if (timed_out_ && !exited_at_ && now >= deadline_ + std::chrono::seconds(10)) {
    // Killed but never reported: treat as killed rather than wait forever.
    status_ = SIGKILL;
    exited_at_ = now;
    return true;
  }
  return false;
}

void ContainerSandbox::ExecRun::check_init_reports() {
  if (conn_open_ || exited_at_) return;
  sandbox_.check_running();
  throw Error(Code::kUnavailable, fmt::format("sandbox {}: lost its init during exec", sandbox_.id_));
}

void ContainerSandbox::ExecRun::poll_once(Clock::time_point now) {
  pollfd fds[4];
  int n = 0;
  int i_out = -1, i_err = -1, i_in = -1, i_conn = -1;
  if (stdout_.open) fds[i_out = n++] = {stdout_.fd.get(), POLLIN, 0};
  if (stderr_.open) fds[i_err = n++] = {stderr_.fd.get(), POLLIN, 0};
  if (stdin_) fds[i_in = n++] = {stdin_.get(), POLLOUT, 0};
  if (conn_open_ && !exited_at_) fds[i_conn = n++] = {conn_.get(), POLLIN, 0};
  int rc = ::poll(fds, static_cast<nfds_t>(n), poll_timeout_ms(now));
  if (rc < 0 && errno != EINTR) throw_errno(errno, "poll exec streams");
  if (rc <= 0) return;
  if (i_out >= 0 && fds[i_out].revents) stdout_.read();
  if (i_err >= 0 && fds[i_err].revents) stderr_.read();
  if (i_in >= 0 && fds[i_in].revents) feed_stdin();
  if (i_conn >= 0 && fds[i_conn].revents) read_exit();
}

// Until the grace after the exit ends, the deadline, or (past the deadline) a second; at most a second at a time.
int ContainerSandbox::ExecRun::poll_timeout_ms(Clock::time_point now) const {
  auto until = exited_at_ ? *exited_at_ + kOutputGrace : (timed_out_ ? now + std::chrono::seconds(1) : deadline_);
  auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count();
  return static_cast<int>(std::clamp<long long>(wait_ms + 1, 0, 1000));
}

void ContainerSandbox::ExecRun::feed_stdin() {
  ssize_t w = ::write(stdin_.get(), stdin_left_.data(), std::min<std::size_t>(stdin_left_.size(), 65536));
  if (w > 0) stdin_left_.remove_prefix(static_cast<std::size_t>(w));
  if ((w < 0 && errno != EAGAIN && errno != EINTR) || stdin_left_.empty()) stdin_.reset();
}

void ContainerSandbox::ExecRun::read_exit() {
  Reply exit_reply{};
  if (read_init_reply(conn_.get(), &exit_reply, sizeof exit_reply, Clock::now() + std::chrono::seconds(1)) &&
      exit_reply.type == ReplyType::kExited) {
    status_ = exit_reply.a;
    exited_at_ = Clock::now();
    // Output written before the exit is already in the pipes.
    stdout_.read();
    stderr_.read();
  } else {
    conn_open_ = false;
  }
}

ExecResult ContainerSandbox::ExecRun::result() {
  ExecResult result;
  result.timed_out = timed_out_;
  if (WIFEXITED(status_)) {
    result.exit_code = WEXITSTATUS(status_);
  } else if (WIFSIGNALED(status_)) {
    result.exit_code = -1;
    result.signal = WTERMSIG(status_);
    if (result.signal == SIGKILL && !result.timed_out) result.oom_killed = sandbox_.oom_killed_since_last_look();
  }
  result.stdout_data = std::move(stdout_.data);
  result.stderr_data = std::move(stderr_.data);
  result.stdout_truncated = stdout_.truncated;
  result.stderr_truncated = stderr_.truncated;
  result.duration_seconds = std::chrono::duration<double>(Clock::now() - started_).count();
  return result;
}

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
  ExecRun run(*this, group.name, req, sink, started);
  Reply reply = run.start(payload, group.fds);
  // Init forked the command (or tried): once this exec is over, the next group is made and init moved there. Not
  // while the command runs: the move holds the kernel's threadgroup lock for writing, which every fork and exit
  // on the host waits for, the command's own exit among them (milliseconds after an idle spell).
  group.place_next_when_done();
  if (reply.type == ReplyType::kFailed) {
    const std::string& argv0 = command.argv[0];
    if (auto r = init::start_failure_result(reply.a, static_cast<FailStage>(reply.b), argv0, command.cwd)) {
      r->duration_seconds = std::chrono::duration<double>(Clock::now() - started).count();
      if (sink) sink(2, r->stderr_data);
      return *r;
    }
    throw init::start_error(reply.a, static_cast<FailStage>(reply.b), argv0, command.cwd,
                            fmt::format("uid {}, gid {}", command.uid, command.gid));
  }
  return run.wait();
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
