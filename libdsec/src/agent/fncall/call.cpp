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

}  // namespace

FnCallResult run_call(Slot& slot, const FnCallRequest& req, const CallSettings& settings, bool* server_fault) {
  *server_fault = false;
  const bool compiles = settings.language == "c" || settings.language == "cpp";
  // The group whose numbers are the program's: C and C++ programs move to a group of their own after the compile.
  container::SandboxCgroup& cgroup = compiles && slot.run_cgroup ? *slot.run_cgroup : *slot.cgroup;
  FnCallResult result;

  // A limit below what the armed child already holds cannot be met: that is the call running out of memory.
  auto set_limits = [&](container::SandboxCgroup& group, GroupLimits& now, std::uint64_t memory, std::uint32_t pids) {
    if (now.memory_bytes == memory && now.pids == pids) return true;
    try {
      group.set_limits(memory, pids);
      now.memory_bytes = memory;
      now.pids = pids;
      return true;
    } catch (const Error& e) {
      if (e.code() != Code::kResourceExhausted) throw;
      kill_child(slot);
      result.oom_killed = true;
      return false;
    }
  };
  GroupLimits& run_limits = compiles && slot.run_cgroup ? slot.run_limits : slot.limits;
  bool limits_ok =
      compiles ? set_limits(*slot.cgroup, slot.limits, std::max(req.memory_bytes, settings.compile_memory_bytes),
                            std::max(req.pids, kCompilePids))
               : set_limits(cgroup, run_limits, req.memory_bytes, req.pids);
  if (!limits_ok) {
    result.exit_code = -1;
    result.signal = SIGKILL;
    return result;
  }

  auto [header, blob] = call_message(req, settings);
  Pipe out = Pipe::make(), err = Pipe::make();
  Clock::time_point started = Clock::now();
  double cpu_base = 0;
  std::uint64_t oom_base = 0;
  // The call's numbers are differences: the runner used its group before the call (it joined when it was armed;
  // its few pages stay in the peak), and groups are reused from call to call.
  auto begin_run = [&] {
    cpu_base = cgroup.cpu_usage_seconds();
    oom_base = cgroup.oom_kills();
    started = Clock::now();
  };
  if (!compiles) begin_run();
  try {
    send_frame(slot.sock.get(), header, blob, {out.write.get(), err.write.get()});
  } catch (const Error& e) {
    if (e.code() != Code::kUnavailable) throw;
    *server_fault = true;
    throw Error(Code::kUnavailable, "function call: the armed child was gone before the call");
  }
  out.write.reset();
  err.write.reset();
  blob.clear();
  blob.shrink_to_fit();

  Capture cout{std::move(out.read), req.max_output_bytes};
  Capture cerr{std::move(err.read), req.max_output_bytes};
  enum class Phase { kCompiling, kRunning, kCompileFailed };
  Phase phase = compiles ? Phase::kCompiling : Phase::kRunning;
  Clock::time_point deadline = compiles ? after(settings.compile_timeout_seconds) : after(req.timeout_seconds);
  // The call's process has ended when the zygote, its parent, reports its exit status. Whatever it left running in
  // its cgroup is killed then, before the server takes another call.
  std::optional<Clock::time_point> exited_at;
  std::optional<int> status;
  bool sock_open = true;
  bool killed = false;
  std::optional<Error> failure;
  Clock::time_point next_cpu_check = Clock::now() + kCpuPoll;
  double cpu_used = 0;
  std::uint64_t peak = 0, ooms = 0;

  auto kill = [&] {
    if (!killed) kill_child(slot);
    killed = true;
  };
  auto ended = [&] {
    exited_at = Clock::now();
    cpu_used = cgroup.cpu_usage_seconds() - cpu_base;
    const std::uint64_t before =
        &cgroup == slot.cgroup.get() ? slot.limits.charged_before : slot.run_limits.charged_before;
    peak = cgroup.memory_peak();
    peak = peak > before ? peak - before : peak;
    ooms = cgroup.oom_kills() - oom_base;
    for (auto* group : {slot.cgroup.get(), slot.run_cgroup.get()})
      if (group && group->has_processes()) group->destroy();
    cout.drain();
    cerr.drain();
  };

  for (;;) {
    auto now = Clock::now();
    if (exited_at && ((!cout.open() && !cerr.open()) || now >= *exited_at + kOutputGrace)) break;
    if (!exited_at && !killed && now >= deadline) {
      result.timed_out = true;
      if (phase == Phase::kCompiling) result.compile_exit_code = -1;
      kill();
    }
    if (!exited_at && !killed && phase == Phase::kRunning && req.cpu_seconds > 0 && now >= next_cpu_check) {
      next_cpu_check = now + kCpuPoll;
      if (cgroup.cpu_usage_seconds() - cpu_base > req.cpu_seconds) {
        result.timed_out = true;
        kill();
      }
    }
    if (killed && !exited_at && now >= deadline + std::chrono::seconds(10)) {
      // Killed, and its end still not reported: something is wrong with the server. Give up on it.
      *server_fault = true;
      failure = Error(Code::kUnavailable, "function call: its fork server did not report the end of a killed call");
      break;
    }

    pollfd fds[3];
    int n = 0, i_out = -1, i_err = -1, i_sock = -1;
    if (cout.open()) fds[i_out = n++] = {cout.fd.get(), POLLIN, 0};
    if (cerr.open()) fds[i_err = n++] = {cerr.fd.get(), POLLIN, 0};
    if (sock_open && !exited_at) fds[i_sock = n++] = {slot.sock.get(), POLLIN, 0};
    Clock::time_point until = exited_at ? *exited_at + kOutputGrace
                              : killed  ? now + std::chrono::milliseconds(100)
                                        : deadline;
    if (!exited_at && !killed && phase == Phase::kRunning && req.cpu_seconds > 0)
      until = std::min(until, next_cpu_check);
    auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(until - now).count();
    int rc = ::poll(fds, static_cast<nfds_t>(n), static_cast<int>(std::clamp<long long>(wait_ms + 1, 0, 1000)));
    if (rc < 0 && errno != EINTR) throw_errno(errno, "poll function call");
    if (rc <= 0) continue;
    if (i_out >= 0 && fds[i_out].revents) cout.drain();
    if (i_err >= 0 && fds[i_err].revents) cerr.drain();
    if (i_sock >= 0 && fds[i_sock].revents) {
      Frame f;
      if (!recv_frame(slot.sock.get(), f, Clock::now() + std::chrono::seconds(5))) {
        // Nobody holds the other end any more: the server died with the call's process.
        sock_open = false;
        if (!killed) failure = Error(Code::kUnavailable, "function call: its fork server ended during the call");
        ended();
        continue;
      }
      std::string type = f.type();
      if (type == "status") {
        if (auto s = f.integer("status")) status = *s;
        ended();
      } else if (type == "compiled") {
        result.compile_exit_code = f.integer("exit_code").value_or(-1);
        result.compile_seconds = f.number("seconds", 0.0);
        result.compile_output = std::move(f.blob);
        if (result.compile_exit_code != 0) {
          phase = Phase::kCompileFailed;
          continue;
        }
        if (!set_limits(cgroup, run_limits, req.memory_bytes, req.pids)) continue;
        begin_run();
        std::vector<UniqueFd> procs;
        if (&cgroup != slot.cgroup.get()) procs = cgroup.open_procs();
        std::vector<int> fds;
        for (const auto& fd : procs) fds.push_back(fd.get());
        send_frame(slot.sock.get(), json{{"type", "go"}}, {}, fds);
        phase = Phase::kRunning;
        deadline = after(req.timeout_seconds);
      } else if (type == "failed") {
        failure = setup_error(f);
        kill();
      }
    }
  }
  if (failure) throw *failure;

  result.stdout_data = std::move(cout.data);
  result.stderr_data = std::move(cerr.data);
  result.stdout_truncated = cout.truncated;
  result.stderr_truncated = cerr.truncated;
  if (phase == Phase::kCompileFailed) {
    result.exit_code = -1;
    return result;
  }
  if (status) {
    if (WIFEXITED(*status)) {
      result.exit_code = WEXITSTATUS(*status);
    } else if (WIFSIGNALED(*status)) {
      result.exit_code = -1;
      result.signal = WTERMSIG(*status);
      if (result.signal == SIGXCPU) result.timed_out = true;
    }
  } else {
    result.exit_code = -1;
    result.signal = SIGKILL;
  }
  if (phase == Phase::kCompiling) {
    // Killed while compiling (the compile timeout): nothing ran.
    result.exit_code = -1;
    return result;
  }
  result.duration_seconds = std::chrono::duration<double>((exited_at ? *exited_at : Clock::now()) - started).count();
  result.cpu_seconds = std::max(0.0, cpu_used);
  result.peak_memory_bytes = peak;
  if (ooms > 0) result.oom_killed = true;
  return result;
}

}  // namespace dsec::agent::fncall
