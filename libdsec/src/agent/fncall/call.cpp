#include "agent/fncall/call.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include <fmt/format.h>

#include "agent/fncall/wire.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::fncall {
namespace {

using Clock = std::chrono::steady_clock;

// After the child's exit is reported, how long its output pipes may take to reach end of file (every writer is gone
// by then: the kernel empties a pid namespace before its init can be reaped).
constexpr auto kOutputGrace = std::chrono::milliseconds(200);
// How often the call's CPU time is read when it has a CPU limit.
constexpr auto kCpuPoll = std::chrono::milliseconds(10);
// The compile step's processes (cc1, as, ld) need a few pids beyond the program's own.
constexpr std::uint32_t kCompilePids = 64;
// /dev/shm of a call: small; its /tmp is as large as its memory limit (tmpfs pages are charged to the call).
constexpr std::uint64_t kShmBytes = 64ull << 20;

Clock::time_point after(double seconds) {
  return Clock::now() + std::chrono::microseconds(static_cast<std::int64_t>(seconds * 1e6));
}

struct Pipe {
  UniqueFd read, write;
  static Pipe make() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw_errno(errno, "pipe2");
    ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
    return Pipe{UniqueFd(fds[0]), UniqueFd(fds[1])};
  }
};

// One output stream, capped: past the cap the pipe is closed, so a flood ends in a broken pipe for the writer
// rather than in work for the agent.
struct Capture {
  Capture(UniqueFd fd_in, std::size_t cap_in) : fd(std::move(fd_in)), cap(cap_in) {}
  UniqueFd fd;
  std::size_t cap;
  std::string data;
  bool truncated = false;
  bool open() const { return static_cast<bool>(fd); }
  void drain() {
    char buf[65536];
    while (fd) {
      ssize_t n = ::read(fd.get(), buf, sizeof buf);
      if (n > 0) {
        std::size_t room = cap - data.size();
        if (static_cast<std::size_t>(n) > room) {
          data.append(buf, room);
          truncated = true;
          fd.reset();
          return;
        }
        data.append(buf, static_cast<std::size_t>(n));
        continue;
      }
      if (n == 0) {
        fd.reset();
        return;
      }
      if (errno == EINTR) continue;
      return;  // EAGAIN: nothing more for now
    }
  }
};

void kill_child(const Slot& slot) {
  if (slot.pidfd) ::syscall(SYS_pidfd_send_signal, slot.pidfd.get(), SIGKILL, nullptr, 0);
}

// The request as the child reads it: a header and one blob of code, stdin and the files in order.
std::pair<json, std::string> call_message(const FnCallRequest& r, const CallSettings& s) {
  json files = json::array();
  std::size_t size = r.code.size() + r.stdin_data.size();
  for (const auto& [path, bytes] : r.files) {
    files.push_back(json::array({path, bytes.size()}));
    size += bytes.size();
  }
  std::string blob;
  blob.reserve(size);
  blob += r.code;
  blob += r.stdin_data;
  for (const auto& [path, bytes] : r.files) blob += bytes;
  json header{{"type", "call"},
              {"args", r.args},
              {"env", s.env},
              {"code_size", r.code.size()},
              {"stdin_size", r.stdin_data.size()},
              {"files", std::move(files)},
              {"tmp_bytes", std::max<std::uint64_t>(r.memory_bytes, 4u << 20)},
              {"shm_bytes", std::min<std::uint64_t>(kShmBytes, r.memory_bytes)},
              {"cpu_seconds", r.cpu_seconds},
              {"devices", s.device_nodes},
              {"compile_output_cap", s.compile_output_cap}};
  return {std::move(header), std::move(blob)};
}

// What a failed setup step of the child means for the caller.
Error setup_error(const Frame& f) {
  std::string stage = f.text("stage", "setup");
  std::string message = f.text("message", "failed");
  if (stage == "files")
    return Error(Code::kInvalidArgument, fmt::format("files: the call's files could not be written to its /tmp "
                                                     "(its size is the call's memory limit): {}",
                                                     message));
  return Error(Code::kInternal, fmt::format("function call setup failed at {}: {}", stage, message));
}

// One call on an armed child, from its limits to its result: the state the loop shares, and a method per step.
class CallRun {
 public:
  CallRun(Slot& slot, const FnCallRequest& req, const CallSettings& settings, bool* server_fault)
      : slot_(slot),
        req_(req),
        settings_(settings),
        server_fault_(server_fault),
        compiles_(settings.language == "c" || settings.language == "cpp"),
        // The group whose numbers are the program's: C and C++ programs move to a group of their own after the
        // compile.
        cgroup_(compiles_ && slot.run_cgroup ? *slot.run_cgroup : *slot.cgroup),
        run_limits_(compiles_ && slot.run_cgroup ? slot.run_limits : slot.limits) {}

  FnCallResult run() {
    *server_fault_ = false;
    bool limits_ok =
        compiles_ ? set_limits(*slot_.cgroup, slot_.limits, std::max(req_.memory_bytes, settings_.compile_memory_bytes),
                               std::max(req_.pids, kCompilePids))
                  : set_limits(cgroup_, run_limits_, req_.memory_bytes, req_.pids);
    if (!limits_ok) {
      result_.exit_code = -1;
      result_.signal = SIGKILL;
      return result_;
    }
    send_request();
    phase_ = compiles_ ? Phase::kCompiling : Phase::kRunning;
    deadline_ = compiles_ ? after(settings_.compile_timeout_seconds) : after(req_.timeout_seconds);
    next_cpu_check_ = Clock::now() + kCpuPoll;
    while (step()) {
    }
    if (failure_) throw *failure_;
    return finish();
  }

 private:
  enum class Phase { kCompiling, kRunning, kCompileFailed };

  // A limit below what the armed child already holds cannot be met: that is the call running out of memory.
  bool set_limits(container::SandboxCgroup& group, GroupLimits& now, std::uint64_t memory, std::uint32_t pids) {
    if (now.memory_bytes == memory && now.pids == pids) return true;
    try {
      group.set_limits(memory, pids);
      now.memory_bytes = memory;
      now.pids = pids;
      return true;
    } catch (const Error& e) {
      if (e.code() != Code::kResourceExhausted) throw;
      kill_child(slot_);
      result_.oom_killed = true;
      return false;
    }
  }

  // The call's numbers are differences: the runner used its group before the call (it joined when it was armed;
  // its few pages stay in the peak), and groups are reused from call to call.
  void begin_run() {
    cpu_base_ = cgroup_.cpu_usage_seconds();
    oom_base_ = cgroup_.oom_kills();
    started_ = Clock::now();
  }

  void send_request() {
    auto [header, blob] = call_message(req_, settings_);
    Pipe out = Pipe::make(), err = Pipe::make();
    started_ = Clock::now();
    if (!compiles_) begin_run();
    try {
      send_frame(slot_.sock.get(), header, blob, {out.write.get(), err.write.get()});
    } catch (const Error& e) {
      if (e.code() != Code::kUnavailable) throw;
      *server_fault_ = true;
      throw Error(Code::kUnavailable, "function call: the armed child was gone before the call");
    }
    out.write.reset();
    err.write.reset();
    cout_.emplace(std::move(out.read), req_.max_output_bytes);
    cerr_.emplace(std::move(err.read), req_.max_output_bytes);
  }

  void kill() {
    if (!killed_) kill_child(slot_);
    killed_ = true;
  }

  // The call's process has ended when the zygote, its parent, reports its exit status. Whatever it left running in
  // its cgroup is killed then, before the server takes another call.
  void ended() {
    exited_at_ = Clock::now();
    cpu_used_ = cgroup_.cpu_usage_seconds() - cpu_base_;
    const std::uint64_t before =
        &cgroup_ == slot_.cgroup.get() ? slot_.limits.charged_before : slot_.run_limits.charged_before;
    peak_ = cgroup_.memory_peak();
    peak_ = peak_ > before ? peak_ - before : peak_;
    ooms_ = cgroup_.oom_kills() - oom_base_;
    for (auto* group : {slot_.cgroup.get(), slot_.run_cgroup.get()})
      if (group && group->has_processes()) group->destroy();
    cout_->drain();
    cerr_->drain();
  }

  // The wall and CPU limits, and a killed call whose end never comes. False when the loop must stop.
  bool check_limits(Clock::time_point now) {
    if (!exited_at_ && !killed_ && now >= deadline_) {
      result_.timed_out = true;
      if (phase_ == Phase::kCompiling) result_.compile_exit_code = -1;
      kill();
    }
    if (!exited_at_ && !killed_ && phase_ == Phase::kRunning && req_.cpu_seconds > 0 && now >= next_cpu_check_) {
      next_cpu_check_ = now + kCpuPoll;
      if (cgroup_.cpu_usage_seconds() - cpu_base_ > req_.cpu_seconds) {
        result_.timed_out = true;
        kill();
      }
    }
    if (killed_ && !exited_at_ && now >= deadline_ + std::chrono::seconds(10)) {
      // Killed, and its end still not reported: something is wrong with the server. Give up on it.
      *server_fault_ = true;
      failure_ = Error(Code::kUnavailable, "function call: its fork server did not report the end of a killed call");
      return false;
    }
    return true;
  }

  // One turn of the loop: limits, then a poll of the outputs and the server's socket. False when the call is over.
  bool step() {
    auto now = Clock::now();
    if (exited_at_ && ((!cout_->open() && !cerr_->open()) || now >= *exited_at_ + kOutputGrace)) return false;
    if (!check_limits(now)) return false;
    pollfd fds[3];
    int n = 0, i_out = -1, i_err = -1, i_sock = -1;
    if (cout_->open()) fds[i_out = n++] = {cout_->fd.get(), POLLIN, 0};
    if (cerr_->open()) fds[i_err = n++] = {cerr_->fd.get(), POLLIN, 0};
    if (sock_open_ && !exited_at_) fds[i_sock = n++] = {slot_.sock.get(), POLLIN, 0};
    Clock::time_point until = exited_at_ ? *exited_at_ + kOutputGrace
                              : killed_  ? now + std::chrono::milliseconds(100)
                                         : deadline_;
    if (!exited_at_ && !killed_ && phase_ == Phase::kRunning && req_.cpu_seconds > 0)
      until = std::min(until, next_cpu_check_);
    auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count();
    int rc = ::poll(fds, static_cast<nfds_t>(n), static_cast<int>(std::clamp<long long>(wait_ms + 1, 0, 1000)));
    if (rc < 0 && errno != EINTR) throw_errno(errno, "poll function call");
    if (rc <= 0) return true;
    if (i_out >= 0 && fds[i_out].revents) cout_->drain();
    if (i_err >= 0 && fds[i_err].revents) cerr_->drain();
    if (i_sock >= 0 && fds[i_sock].revents) on_server_frame();
    return true;
  }

  // What the fork server says: the call's exit status, the compile's end, or a failed setup.
  void on_server_frame() {
    Frame f;
    if (!recv_frame(slot_.sock.get(), f, Clock::now() + std::chrono::seconds(5))) {
      // Nobody holds the other end any more: the server died with the call's process.
      sock_open_ = false;
      if (!killed_) failure_ = Error(Code::kUnavailable, "function call: its fork server ended during the call");
      ended();
      return;
    }
    std::string type = f.type();
    if (type == "status") {
      if (auto s = f.integer("status")) status_ = *s;
      ended();
    } else if (type == "compiled") {
      on_compiled(f);
    } else if (type == "failed") {
      failure_ = setup_error(f);
      kill();
    }
  }

  // The compile ended: a failed one is the result; after a good one the program runs under the call's own limits.
  void on_compiled(Frame& f) {
    result_.compile_exit_code = f.integer("exit_code").value_or(-1);
    result_.compile_seconds = f.number("seconds", 0.0);
    result_.compile_output = std::move(f.blob);
    if (result_.compile_exit_code != 0) {
      phase_ = Phase::kCompileFailed;
      return;
    }
    if (!set_limits(cgroup_, run_limits_, req_.memory_bytes, req_.pids)) return;
    begin_run();
    std::vector<UniqueFd> procs;
    if (&cgroup_ != slot_.cgroup.get()) procs = cgroup_.open_procs();
    std::vector<int> fds;
    fds.reserve(procs.size());
    for (const auto& fd : procs) fds.push_back(fd.get());
    send_frame(slot_.sock.get(), json{{"type", "go"}}, {}, fds);
    phase_ = Phase::kRunning;
    deadline_ = after(req_.timeout_seconds);
  }

  FnCallResult finish() {
    result_.stdout_data = std::move(cout_->data);
    result_.stderr_data = std::move(cerr_->data);
    result_.stdout_truncated = cout_->truncated;
    result_.stderr_truncated = cerr_->truncated;
    if (phase_ == Phase::kCompileFailed) {
      result_.exit_code = -1;
      return result_;
    }
    if (status_) {
      if (WIFEXITED(*status_)) {
        result_.exit_code = WEXITSTATUS(*status_);
      } else if (WIFSIGNALED(*status_)) {
        result_.exit_code = -1;
        result_.signal = WTERMSIG(*status_);
        if (result_.signal == SIGXCPU) result_.timed_out = true;
      }
    } else {
      result_.exit_code = -1;
      result_.signal = SIGKILL;
    }
    if (phase_ == Phase::kCompiling) {
      // Killed while compiling (the compile timeout): nothing ran.
      result_.exit_code = -1;
      return result_;
    }
    result_.duration_seconds =
        std::chrono::duration<double>((exited_at_ ? *exited_at_ : Clock::now()) - started_).count();
    result_.cpu_seconds = std::max(0.0, cpu_used_);
    result_.peak_memory_bytes = peak_;
    if (ooms_ > 0) result_.oom_killed = true;
    return result_;
  }

  Slot& slot_;
  const FnCallRequest& req_;
  const CallSettings& settings_;
  bool* server_fault_;
  const bool compiles_;
  container::SandboxCgroup& cgroup_;
  GroupLimits& run_limits_;
  FnCallResult result_;

  std::optional<Capture> cout_, cerr_;
  Phase phase_ = Phase::kRunning;
  Clock::time_point started_ = Clock::now();
  Clock::time_point deadline_;
  Clock::time_point next_cpu_check_;
  std::optional<Clock::time_point> exited_at_;
  std::optional<int> status_;
  bool sock_open_ = true;
  bool killed_ = false;
  std::optional<Error> failure_;
  double cpu_base_ = 0;
  double cpu_used_ = 0;
  std::uint64_t oom_base_ = 0;
  std::uint64_t peak_ = 0, ooms_ = 0;
};

}  // namespace

FnCallResult run_call(Slot& slot, const FnCallRequest& req, const CallSettings& settings, bool* server_fault) {
  return CallRun(slot, req, settings, server_fault).run();
}
}  // namespace dsec::agent::fncall
