#include "agent/processes/shell_sessions.hpp"

#include <signal.h>
#include <sys/random.h>
#include <sys/wait.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <optional>

#include "common/protocol/process.hpp"
#include "common/syscall.hpp"

namespace dsec::agent {
namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;
using process_protocol::Kind;
using process_protocol::kSkip;
using process_protocol::Scope;

// A run's timeout signals the shell (kAbandon: its trap returns from the run's function, abandoning the rest of
// the command, once the command the shell waits for has ended) and kills every process the run started; when the
// markers still have not come kShellGrace later (the command replaced the trap, or ignores the signal), the shell
// is killed too.
constexpr int kAbandon = SIGUSR1;  // the trap's signal in kStartLines; the run's exit code is then 124, as timeout(1)'s
constexpr auto kShellGrace = std::chrono::seconds(2);
// How long a new shell has to answer its first marker.
constexpr auto kStartWithin = std::chrono::seconds(20);
// At start: copies of the shell's stdout and stderr for the markers (closed for every command, so what a command
// does to its own stdout and stderr cannot hide a marker; single digits, which every POSIX shell has), and the trap
// a timeout springs: inside a run, it returns from the run's function. A run defines that function with its
// command and calls it (so `$1` and friends are the shell's own, and a `return` in the command ends only the run).
constexpr const char* kStartLines =
    "exec 8>&1 9>&2\n"
    "trap '[ -n \"${__dsec_in_run-}\" ] && __dsec_in_run= && return 124' USR1\n";
constexpr const char* kBashStartLines = "shopt -s expand_aliases\n";

std::string random_nonce() {
  unsigned char bytes[16];
  if (::getrandom(bytes, sizeof bytes, 0) != static_cast<ssize_t>(sizeof bytes)) throw_errno(errno, "getrandom");
  std::string out;
  for (unsigned char b : bytes) out += fmt::format("{:02x}", b);
  return out;
}

bool is_bash(std::string_view shell) {
  auto slash = shell.rfind('/');
  return shell.substr(slash == std::string_view::npos ? 0 : slash + 1) == "bash";
}

// The command as one single-quoted shell word.
std::string single_quoted(std::string_view text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') out += "'\\''";
    else out += c;
  }
  out += '\'';
  return out;
}

std::string encode_meta(const SessionOptions& o) {
  return json{{"name", o.name}, {"shell", o.shell}, {"env", o.env}, {"cwd", o.cwd}, {"user", o.user}}.dump();
}

std::optional<SessionOptions> decode_meta(const std::string& meta) {
  try {
    json j = json::parse(meta);
    SessionOptions o;
    o.name = j.at("name").get<std::string>();
    o.shell = j.at("shell").get<std::string>();
    o.env = j.at("env").get<Env>();
    o.cwd = j.at("cwd").get<std::string>();
    o.user = j.at("user").get<std::string>();
    return o;
  } catch (const std::exception&) {
    return std::nullopt;  // not one of ours
  }
}

// One output stream of a run: passes on what surely is the command's output, and finds the marker that ends it.
class MarkerScan {
 public:
  MarkerScan(std::string marker, std::size_t cap, int fd, const OutputSink* sink)
      : marker_(std::move(marker)), cap_(cap), fd_(fd), sink_(sink) {}

  void feed(std::string_view data) {
    if (found_) {
      after_.append(data);
      return;
    }
    held_.append(data);
    std::size_t at = held_.find(marker_);
    if (at != std::string::npos) {
      emit(std::string_view(held_).substr(0, at));
      after_ = held_.substr(at + marker_.size());
      held_.clear();
      found_ = true;
      return;
    }
    // Keep back the longest end of what we have that could begin a marker.
    std::size_t keep = std::min(held_.size(), marker_.size() - 1);
    while (keep > 0 && held_.compare(held_.size() - keep, keep, marker_, 0, keep) != 0) --keep;
    emit(std::string_view(held_).substr(0, held_.size() - keep));
    held_.erase(0, held_.size() - keep);
  }
  // The run ended without a marker (its shell is gone): what was held back is output too.
  void flush() {
    emit(held_);
    held_.clear();
  }
  bool found() const { return found_; }
  // The marker's text up to its closing \037, once it has all arrived.
  std::optional<std::string> marker_rest() const {
    auto end = after_.find('\037');
    if (end == std::string::npos) return std::nullopt;
    return after_.substr(0, end);
  }
  std::string take() { return std::move(data_); }
  bool truncated() const { return truncated_; }

 private:
  void emit(std::string_view bytes) {
    std::size_t room = cap_ > kept_ ? cap_ - kept_ : 0;
    std::size_t take = std::min(room, bytes.size());
    if (take < bytes.size()) truncated_ = true;
    if (take == 0) return;
    kept_ += take;
    if (sink_) (*sink_)(fd_, bytes.substr(0, take));
    else data_.append(bytes.substr(0, take));
  }

  std::string marker_;
  std::size_t cap_;
  int fd_;
  const OutputSink* sink_;
  std::string held_, after_, data_;
  std::size_t kept_ = 0;
  bool found_ = false, truncated_ = false;
};

// The steps a timeout takes, in order: abandon the run and kill its processes, then kill the shell.
class TimeoutSteps {
 public:
  TimeoutSteps(Processes& processes, int pid, const std::vector<int>& spared, Clock::time_point deadline)
      : processes_(processes), pid_(pid), spared_(spared), next_step_(deadline) {}

  Clock::time_point next_step() const { return next_step_; }
  // The step due at `now` (once next_step() has come).
  void take(Clock::time_point now) {
    switch (step_) {
      case Step::kRunning:
        // The shell first (its trap waits for the command it runs to end), then what the run started.
        ignore_ended([&] { processes_.signal(pid_, kAbandon, Scope::kProcess); });
        ignore_ended([&] { processes_.signal(pid_, SIGKILL, Scope::kTreeExcept, spared_); });
        step_ = Step::kAbandoned;
        next_step_ = now + kShellGrace;
        break;
      case Step::kAbandoned:
        ignore_ended([&] { processes_.signal(pid_, SIGKILL, Scope::kGroup); });
        step_ = Step::kShellKilled;
        next_step_ = Clock::time_point::max();
        break;
      case Step::kShellKilled:
        break;
    }
  }

 private:
  static void ignore_ended(const std::function<void()>& send) {
    try {
      send();
    } catch (const Error& e) {
      if (e.code() != Code::kFailedPrecondition) throw;  // the shell ended meanwhile
    }
  }

  enum class Step { kRunning, kAbandoned, kShellKilled };
  Processes& processes_;
  int pid_;
  const std::vector<int>& spared_;
  Step step_ = Step::kRunning;
  Clock::time_point next_step_;
};

// A run's result from its two streams: the exit code its markers carry (`marked`), else, when the shell is gone
// (`last`), how it ended.
void finish_result(ExecResult& result, MarkerScan& out, MarkerScan& err, bool marked, const ProcessEntry& last) {
  if (marked) {
    std::string rest = *out.marker_rest();
    int code = 0;
    auto [ptr, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), code);
    result.exit_code = ec == std::errc() ? code : -1;
  } else {
    out.flush();
    err.flush();
    if (!last.running) {
      // The shell is gone: by `exit`, or killed. What it printed is the run's output.
      result.reason = "session_ended";
      if (WIFEXITED(last.wait_status)) {
        result.exit_code = WEXITSTATUS(last.wait_status);
      } else if (WIFSIGNALED(last.wait_status)) {
        result.exit_code = -1;
        result.signal = WTERMSIG(last.wait_status);
      }
    }
  }
  result.stdout_data = out.take();
  result.stderr_data = err.take();
  result.stdout_truncated = out.truncated();
  result.stderr_truncated = err.truncated();
}

}  // namespace

void ShellSessions::check_name(std::string_view name) { protocol::check_session_name(name); }

std::vector<ShellSessions::Found> ShellSessions::all(Processes& processes) {
  std::vector<Found> out;
  for (auto& e : processes.list()) {
    if (e.kind != Kind::kSession) continue;
    if (auto options = decode_meta(e.meta)) out.push_back({std::move(e), std::move(*options)});
  }
  return out;
}

ShellSessions::Found ShellSessions::find(const std::string& sandbox_id, Processes& processes, const std::string& name) {
  for (auto& f : all(processes))
    if (f.options.name == name) return std::move(f);
  throw Error(Code::kNotFound, fmt::format("sandbox {} has no session '{}'", sandbox_id, name));
}

SessionInfo ShellSessions::info(const std::string& sandbox_id, const Found& f) {
  SessionInfo i;
  i.name = f.options.name;
  i.shell = f.entry.argv.empty() ? f.options.shell : f.entry.argv[0];
  i.pid = f.entry.pid;
  i.alive = f.entry.running;
  if (!f.entry.running) {
    if (WIFEXITED(f.entry.wait_status)) i.exit_code = WEXITSTATUS(f.entry.wait_status);
    else if (WIFSIGNALED(f.entry.wait_status)) i.signal = WTERMSIG(f.entry.wait_status);
  }
  std::lock_guard lock(mu_);
  i.busy = busy_.count({sandbox_id, f.options.name}) > 0;
  return i;
}

ShellSessions::Found ShellSessions::start(Processes& processes, const SessionOptions& options) {
  SpawnOptions spawn;
  spawn.kind = Kind::kSession;
  spawn.meta = encode_meta(options);
  auto try_shell = [&](const std::string& shell) {
    ExecRequest command;
    command.argv = is_bash(shell) ? std::vector<std::string>{shell, "--noprofile", "--norc", "-s"}
                                  : std::vector<std::string>{shell, "-s"};
    command.env = options.env;
    command.cwd = options.cwd;
    command.user = options.user;
    return processes.spawn(command, spawn);
  };
  std::string shell = options.shell.empty() ? "/bin/bash" : options.shell;
  auto started = try_shell(shell);
  if (options.shell.empty() && std::holds_alternative<ExecResult>(started) &&
      std::get<ExecResult>(started).reason == "executable_not_found") {
    shell = "/bin/sh";
    started = try_shell(shell);
  }
  if (auto* failed = std::get_if<ExecResult>(&started)) {
    Code code = failed->reason.rfind("cwd_", 0) == 0 || failed->reason == "executable_not_found"
                    ? Code::kInvalidArgument
                    : Code::kFailedPrecondition;
    std::string text = failed->stderr_data;
    while (!text.empty() && text.back() == '\n') text.pop_back();
    throw Error(code, fmt::format("the session's shell could not start: {}", text));
  }
  Found f{std::get<ProcessEntry>(std::move(started)), options};
  std::string start_lines = kStartLines;
  if (is_bash(shell)) start_lines += kBashStartLines;
  // Whatever the shell says as it starts is nobody's run's: the first marker ends it.
  ExecResult first = run_framed(processes, f.entry.pid, start_lines, f.entry.stdout_end, f.entry.stderr_end,
                                Clock::now() + kStartWithin, 1 << 20, {}, /*interrupt=*/false);
  if (first.reason == "session_ended" || first.timed_out) {
    try {
      processes.forget(f.entry.pid);
    } catch (const Error&) {
    }
    std::string said = first.stderr_data.substr(0, 500);
    while (!said.empty() && (said.back() == '\n' || said.back() == '\r')) said.pop_back();
    throw Error(Code::kFailedPrecondition,
                fmt::format("the session's shell {} {}{}", shell,
                            first.timed_out ? "did not answer its first command" : "exited as it started",
                            said.empty() ? "" : ": " + said));
  }
  return f;
}

SessionInfo ShellSessions::open(const std::string& sandbox_id, Processes& processes, SessionOptions options) {
  std::vector<Found> existing = all(processes);
  if (!options.name.empty()) {
    check_name(options.name);
  } else {
    for (std::size_t n = 1; options.name.empty(); ++n) {
      std::string candidate = fmt::format("s{}", n);
      if (std::none_of(existing.begin(), existing.end(), [&](const Found& f) { return f.options.name == candidate; }))
        options.name = candidate;
    }
  }
  for (const auto& f : existing)
    if (f.options.name == options.name)
      throw Error(Code::kAlreadyExists, fmt::format("sandbox {} has a session '{}' already", sandbox_id, options.name));
  if (existing.size() >= kMaxSessions)
    throw Error(Code::kResourceExhausted,
                fmt::format("sandbox {} has {} sessions, its most; close one first", sandbox_id, kMaxSessions),
                /*retryable=*/false);
  return info(sandbox_id, start(processes, options));
}

std::vector<SessionInfo> ShellSessions::list(const std::string& sandbox_id, Processes& processes) {
  std::vector<SessionInfo> out;
  for (const auto& f : all(processes)) out.push_back(info(sandbox_id, f));
  std::sort(out.begin(), out.end(), [](const SessionInfo& a, const SessionInfo& b) { return a.name < b.name; });
  return out;
}

SessionInfo ShellSessions::get(const std::string& sandbox_id, Processes& processes, const std::string& name) {
  return info(sandbox_id, find(sandbox_id, processes, name));
}

SessionInfo ShellSessions::restart(const std::string& sandbox_id, Processes& processes, const std::string& name) {
  Found old = find(sandbox_id, processes, name);
  processes.forget(old.entry.pid);
  return info(sandbox_id, start(processes, old.options));
}

SessionInfo ShellSessions::close(const std::string& sandbox_id, Processes& processes, const std::string& name) {
  Found f = find(sandbox_id, processes, name);
  SessionInfo last = info(sandbox_id, f);
  processes.forget(f.entry.pid);
  last.alive = false;
  return last;
}

ExecResult ShellSessions::run(const std::string& sandbox_id, Processes& processes, const std::string& name,
                              const SessionRun& run, const OutputSink& sink) {
  if (run.command.find('\0') != std::string::npos)
    throw Error(Code::kInvalidArgument, "command: holds a NUL byte, which no shell command can");
  // It travels through the shell's stdin, which init buffers up to kStdinBuffer (and a VM's line carries frames of
  // 1 MiB): longer scripts belong in a file (write_file, then `. file` or `sh file`).
  if (run.command.size() > kMaxCommandBytes)
    throw Error(Code::kInvalidArgument,
                fmt::format("command: {} bytes, over the {} a session run takes; write longer scripts to a file and "
                            "run that",
                            run.command.size(), kMaxCommandBytes));
  const auto started = Clock::now();
  Found f = find(sandbox_id, processes, name);
  if (!f.entry.running)
    throw Error(Code::kFailedPrecondition,
                fmt::format("session '{}' of sandbox {} has ended; restart it", name, sandbox_id));
  {
    std::lock_guard lock(mu_);
    if (!busy_.insert({sandbox_id, name}).second)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("session '{}' of sandbox {} is running a command; one at a time", name, sandbox_id));
  }
  struct NotBusy {
    ShellSessions& self;
    std::pair<std::string, std::string> key;
    ~NotBusy() {
      std::lock_guard lock(self.mu_);
      self.busy_.erase(key);
    }
  } not_busy{*this, {sandbox_id, name}};

  const auto deadline = started + std::chrono::microseconds(static_cast<std::int64_t>(run.timeout_seconds * 1e6));
  // `command` keeps a syntax error in the command from ending the shell (eval is a special built-in).
  std::string line = "__dsec_run() { __dsec_in_run=1; command eval " + single_quoted(run.command) +
                     "; }\n__dsec_run </dev/null 8>&- 9>&-\n";
  ExecResult result = run_framed(processes, f.entry.pid, line, f.entry.stdout_end, f.entry.stderr_end, deadline,
                                 run.max_output_bytes, sink, /*interrupt=*/true);
  result.duration_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return result;
}

ExecResult ShellSessions::run_framed(Processes& processes, int pid, const std::string& lines, std::uint64_t out_at,
                                     std::uint64_t err_at, Clock::time_point deadline, std::size_t cap,
                                     const OutputSink& sink, bool interrupt) {
  // What runs in the background from earlier runs is spared by this run's timeout.
  const std::vector<int> spared = interrupt ? processes.children(pid) : std::vector<int>{};
  const std::string nonce = random_nonce();
  const std::string marker = "\037" + nonce;
  processes.write_stdin(pid,
                        lines + fmt::format("__dsec_rc=$?; __dsec_in_run=; printf '\\037%s %d\\037' {} \"$__dsec_rc\" "
                                            ">&8; printf '\\037%s\\037' {} >&9\n",
                                            nonce, nonce),
                        false);

  const OutputSink* to = sink ? &sink : nullptr;
  MarkerScan out(marker + " ", cap, 1, to);
  MarkerScan err(marker, cap, 2, to);
  ExecResult result;
  TimeoutSteps timeout(processes, pid, spared, deadline);
  ProcessEntry last;
  auto out_done = [&] { return out.found() && out.marker_rest().has_value(); };
  for (;;) {
    if (out_done() && err.found()) break;
    auto now = Clock::now();
    if (now >= timeout.next_step()) {
      result.timed_out = true;
      if (!interrupt) break;  // a start that did not answer
      timeout.take(now);
    }
    auto until = std::min(timeout.next_step(), now + std::chrono::seconds(60));
    auto wait = std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(until - now),
                           std::chrono::milliseconds(0), std::chrono::milliseconds(60'000));
    ProcessOutput got = processes.read(pid, out_done() ? kSkip : out_at, err.found() ? kSkip : err_at,
                                       process_protocol::kMaxReadBytes, wait);
    last = got.entry;
    if (!out_done()) {
      out.feed(got.stdout_data);
      out_at = got.stdout_offset + got.stdout_data.size();
    }
    if (!err.found()) {
      err.feed(got.stderr_data);
      err_at = got.stderr_offset + got.stderr_data.size();
    }
    if (!got.entry.running && got.stdout_data.empty() && got.stderr_data.empty()) break;
  }

  finish_result(result, out, err, out_done() && err.found(), last);
  return result;
}

}  // namespace dsec::agent
