// Persistent shell sessions: every run of a Session executes in the same shell process, so `cd`, `export`,
// functions, aliases, sourced files and shell options carry over from run to run (an agent's terminal).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "dsec/exec.hpp"
#include "dsec/spec.hpp"

namespace dsec {

namespace detail {
class ClientCore;
}

// How Sandbox::shell starts a session. Every field may stay empty.
struct SessionOptions {
  // 1 to 64 letters, digits, '.', '_', '-', new in the sandbox (ALREADY_EXISTS otherwise); empty: the agent
  // names it (s1, s2, ...).
  std::string name;
  // Run as `shell -s`; empty: /bin/bash where the sandbox has it, else /bin/sh.
  std::string shell;
  Env env;           // as ExecRequest::env
  std::string cwd;   // as ExecRequest::cwd
  std::string user;  // as ExecRequest::user
};

struct SessionInfo {
  std::string name, shell;
  int pid = 0;         // the shell's pid inside the sandbox
  bool alive = false;  // false once the shell ended (an `exit`, a kill) until restart()
  bool busy = false;   // a run is in progress
  int exit_code = -1;  // once the shell ended: its exit status, or -1 when a signal ended it
  int signal = 0;      // the signal that ended the shell, 0 if it exited or runs
};

// A handle on one session: its sandbox's id and its name. It owns nothing (dropping it leaves the shell running;
// close() ends it) and costs nothing to copy. One run at a time per session: a run while another runs is
// FAILED_PRECONDITION.
class Session {
 public:
  Session() = default;
  Session(std::shared_ptr<detail::ClientCore> core, std::string sandbox_id, std::string name);

  const std::string& name() const noexcept { return name_; }
  const std::string& sandbox_id() const noexcept { return sandbox_id_; }
  explicit operator bool() const noexcept { return core_ != nullptr; }

  // Runs shell text (several lines too; no NUL) in the session's shell with stdin /dev/null, and answers like an
  // exec: exit_code is the command's $?, stdout/stderr what was written during the run (at most max_output each).
  // At the timeout the processes the run started are killed and the result says timed_out; the session stays
  // usable. A command that ends the shell (`exit 3`) answers reason "session_ended" with the shell's status.
  // Never retried once the request may have reached the agent.
  ExecResult run(const std::string& command, double timeout_seconds = 600, std::size_t max_output = 16u << 20) const;
  // Like run, but the output goes to on_output (fd 1 stdout, 2 stderr) as the shell writes it, and the result's
  // stdout/stderr are empty, as Sandbox::exec_stream.
  ExecResult run_stream(const std::string& command, const std::function<void(int fd, std::string_view data)>& on_output,
                        double timeout_seconds = 600, std::size_t max_output = 16u << 20) const;
  SessionInfo info() const;
  // Kills the shell (and its process group) if it still runs and starts a new one as the session was first
  // started: same shell, env, cwd and user; what earlier runs set is gone.
  SessionInfo restart() const;
  // Ends the shell and everything in its process group, and forgets the session. A session that is gone already
  // is not an error.
  void close() const;

 private:
  detail::ClientCore& core() const;
  std::string path(std::string_view suffix) const;  // /sessions/{name}{suffix}, under the sandbox's path

  std::shared_ptr<detail::ClientCore> core_;
  std::string sandbox_id_;
  std::string name_;
};

}  // namespace dsec
