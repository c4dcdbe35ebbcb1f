// Processes that outlive the call that started them: Sandbox::spawn starts a command and answers at once; its
// output is kept by the sandbox's init (the last 1 MiB of each stream), so any client can read it from any offset,
// write its stdin, signal it and wait for it, during its life and after its end, until it is killed or forgotten.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/spec.hpp"

namespace dsec {

namespace detail {
class ClientCore;
}

// What to start. Exactly one of argv or shell; env, cwd and user as for ExecRequest.
struct ProcessRequest {
  std::vector<std::string> argv;  // run this argv (PATH is searched for argv[0]) ...
  std::string shell;              // ... or, when non-empty, `/bin/sh -c shell`
  Env env;                        // added to (and overriding) the sandbox's env
  std::string cwd;                // empty: the sandbox's workdir
  std::string user;               // as ExecRequest::user; empty: the sandbox's SandboxSpec::user
  // A terminal (the sandbox's /dev/pts) of rows x cols (1 to 1000 each) as the command's stdin, stdout and stderr;
  // everything it prints arrives as stdout.
  bool pty = false;
  unsigned rows = 24, cols = 80;
  std::string tag;  // the caller's label, listed with the process (at most 128 bytes)
  // Makes the spawn exactly-once on the agent, as ExecRequest::request_id does an exec: a spawn repeated with the
  // same id answers the first one's process and starts nothing. Empty: the client makes one for its own retries.
  std::string request_id;
};

struct ProcessInfo {
  int pid = 0;  // inside the sandbox; the process's id in every call
  std::vector<std::string> argv;
  std::string tag;
  bool pty = false;
  bool running = false;
  int exit_code = -1;  // once ended: its exit status, or -1 when a signal ended it
  int signal = 0;      // the signal that ended it, 0 if it exited
  // Why it did not run, when what it named was not there: "executable_not_found" (exit code 127), ... as
  // ExecResult::reason. Empty when it ran.
  std::string reason;
  double started_at = 0, ended_at = 0;               // Unix seconds; ended_at 0 while it runs
  std::uint64_t stdout_bytes = 0, stderr_bytes = 0;  // everything it wrote so far: the offsets its output reaches
  bool stdin_open = false;
  // A command that could not start (pid 0, reason set): the line a shell would print, which is also its stderr.
  std::string message;
};

// One read of a process's output. Each stream's bytes start at its *_offset, which is the offset asked for unless
// the bytes in between were no longer kept (then it is later); *_end is the offset after everything written so
// far. A stream that was not asked for is empty with offsets 0.
struct ProcessOutput {
  std::string stdout_data, stderr_data;
  std::uint64_t stdout_offset = 0, stderr_offset = 0, stdout_end = 0, stderr_end = 0;
  bool running = false;
  int exit_code = -1;
  int signal = 0;
};

// A handle on one spawned process: its sandbox's id and its pid. It owns nothing (dropping it leaves the process
// running; kill() ends it), costs nothing to copy, and any number of handles, from any clients, may name the same
// process. Calls may run from several threads at once.
//
// Reads (info, wait, read, follow, resize, kill) are retried on transient errors; spawn, write_stdin, close_stdin
// and signal are not once the request may have reached the agent, so they never act twice.
// A handle on one process. A spawn whose command could not start for what it names (a missing executable or
// working directory) answers a handle of pid 0 that knows its end already: info() and wait() give it (exit code
// 127 or 126, reason), its stderr is the message, and stdin, signals and resizes are FAILED_PRECONDITION.
class Process {
 public:
  Process() = default;
  Process(std::shared_ptr<detail::ClientCore> core, std::string sandbox_id, int pid);
  Process(std::shared_ptr<detail::ClientCore> core, std::string sandbox_id, ProcessInfo never_started);

  int pid() const noexcept { return pid_; }
  const std::string& sandbox_id() const noexcept { return sandbox_id_; }
  explicit operator bool() const noexcept { return core_ != nullptr; }

  ProcessInfo info() const;
  // Waits until the process ends or timeout_seconds pass (0 or less: just looks; infinity: no limit), and answers
  // its info: running is still true when the timeout passed first.
  ProcessInfo wait(double timeout_seconds) const;
  // The output from the given offsets of each stream (std::nullopt: that stream is not read), at most max_bytes
  // of each (at most 1 MiB). Answers as soon as there is output past an offset, or the process has ended, or
  // wait_seconds (at most 300) passed.
  ProcessOutput read(std::optional<std::uint64_t> stdout_offset, std::optional<std::uint64_t> stderr_offset,
                     double wait_seconds = 0, std::size_t max_bytes = 1u << 20) const;
  // Bytes to its stdin, in order with earlier writes; close_stdin() gives it end of file. FAILED_PRECONDITION once
  // the process ended or its stdin was closed; RESOURCE_EXHAUSTED (retryable) while 1 MiB of earlier writes waits.
  void write_stdin(std::string_view data) const;
  void close_stdin() const;
  // Sends `sig` to the process, or with group to its whole process group. FAILED_PRECONDITION once it ended.
  ProcessInfo signal(int sig, bool group = false) const;
  // A pty process's terminal size (it gets SIGWINCH); FAILED_PRECONDITION for a process without a pty.
  ProcessInfo resize(unsigned rows, unsigned cols) const;
  // Kills the process's group if it still runs (SIGKILL) and forgets it with its output; answers its last info.
  ProcessInfo kill() const;
  // Reads both streams from offset 0 (what is still kept) until the process ends, handing each piece to
  // on_output (fd 1 stdout, 2 stderr) on the calling thread as it arrives; answers its final info. What on_output
  // throws ends the call (not the process) and is rethrown.
  ProcessInfo follow(const std::function<void(int fd, std::string_view data)>& on_output) const;

 private:
  detail::ClientCore& core() const;
  std::string path(std::string_view suffix) const;  // /v1/sandboxes/{id}/processes/{pid}{suffix}

  // FAILED_PRECONDITION for what a process that never started cannot do.
  void check_started(std::string_view what) const;

  std::shared_ptr<detail::ClientCore> core_;
  std::string sandbox_id_;
  int pid_ = 0;
  std::shared_ptr<const ProcessInfo> never_started_;  // set for pid 0
};

}  // namespace dsec
