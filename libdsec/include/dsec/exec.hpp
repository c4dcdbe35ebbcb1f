// Running a command in a sandbox, and what comes back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "dsec/spec.hpp"

namespace dsec {

struct ExecRequest {
  std::vector<std::string> argv;             // run this argv (PATH is searched for argv[0]) ...
  std::string shell;                         // ... or, when non-empty, `/bin/sh -c shell`
  Env env;                                   // added to (and overriding) the sandbox's env
  std::string cwd;                           // empty: the sandbox's workdir
  std::string stdin_data;                    // bytes fed to stdin, then EOF
  double timeout_seconds = 600;              // wall clock; on expiry the exec's whole process tree is killed
  std::size_t max_output_bytes = 16u << 20;  // cap for each of stdout and stderr; the rest is dropped
  // Who the command runs as: a user name of the sandbox's /etc/passwd (its primary group from there, its other
  // groups from /etc/group, HOME, USER and LOGNAME from its entry unless env sets them), or "uid" / "uid:gid"
  // (0 to 65535 each). Empty: the sandbox's SandboxSpec::user (empty there too: root).
  std::string user;
  // Makes the exec exactly-once on its sandbox (at most 128 bytes): a repeat with the same id, after a lost answer
  // or an agent restart, returns the first call's result (waiting while it runs) and never runs the command again;
  // the same id with another command is INVALID_ARGUMENT; an id whose command was under way when its agent stopped
  // is DATA_LOSS, raised as dsec::OutcomeUnknown. The client fills one in for every exec it may retry.
  std::string request_id;
};

struct ExecResult {
  int exit_code = -1;       // exit status, or -1 when killed by a signal
  int signal = 0;           // the signal that ended it, 0 if it exited
  std::string stdout_data;  // bytes, not text
  std::string stderr_data;
  bool stdout_truncated = false;
  bool stderr_truncated = false;
  bool timed_out = false;
  // The kernel's OOM killer ended it: the sandbox's memory limit was reached (signal is then 9). A result, like
  // a timeout: what the task's command used is the task's.
  bool oom_killed = false;
  double duration_seconds = 0;
  // Why the command did not run, when what it named was not there (a result like a shell's, never an exception:
  // what the task's command does is the task's): "executable_not_found" (exit code 127), "not_executable" (126),
  // "cwd_not_found" (127), "cwd_not_accessible" (126); stderr then says it in words. Empty when it ran.
  std::string reason;
};

}  // namespace dsec
