// Shell sessions (docs/protocol.md, "Shell sessions"): a persistent shell per session, kept by the sandbox's init
// as a process of kind kSession (its options in the process's meta, so a restarted agent finds it again), into
// which each run writes one framed command. The shell runs the command with `command eval` in itself, so `cd`,
// `export`, functions, aliases and options carry over, then prints a marker with a random nonce to a copy of its
// stdout and of its stderr made at start; the run's output is what came before the markers.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "agent/backends/backend.hpp"
#include "agent/processes/processes.hpp"
#include "dsec/exec.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent {

struct SessionOptions {
  std::string name;   // empty: the first free of s1, s2, ...
  std::string shell;  // empty: /bin/bash where the sandbox has it, else /bin/sh
  Env env;
  std::string cwd;
  std::string user;
};

struct SessionInfo {
  std::string name;
  std::string shell;
  int pid = 0;
  bool alive = false;
  bool busy = false;   // a run is under way
  int exit_code = -1;  // once the shell ended
  int signal = 0;
};

struct SessionRun {
  std::string command;
  double timeout_seconds = 600;
  std::size_t max_output_bytes = 16u << 20;
};

inline constexpr std::size_t kMaxSessions = 16;
inline constexpr std::size_t kMaxCommandBytes = 512u << 10;  // one session run's command text

// Every sandbox's sessions on this node. What it keeps itself is which sessions have a run under way.
class ShellSessions {
 public:
  SessionInfo open(const std::string& sandbox_id, Processes& processes, SessionOptions options);
  std::vector<SessionInfo> list(const std::string& sandbox_id, Processes& processes);
  SessionInfo get(const std::string& sandbox_id, Processes& processes, const std::string& name);
  // Kills its shell (and its process group) if it runs, starts a new one with the same options.
  SessionInfo restart(const std::string& sandbox_id, Processes& processes, const std::string& name);
  // Kills its shell and forgets the session.
  SessionInfo close(const std::string& sandbox_id, Processes& processes, const std::string& name);
  // Runs one command; with a sink, output goes there as it comes (capped as an exec's) and the result's is empty.
  ExecResult run(const std::string& sandbox_id, Processes& processes, const std::string& name, const SessionRun& run,
                 const OutputSink& sink = {});

  // Checks a session name (1 to 64 letters, digits, '.', '_', '-'); INVALID_ARGUMENT otherwise.
  static void check_name(std::string_view name);

 private:
  struct Found {
    ProcessEntry entry;
    SessionOptions options;
  };
  // The session's shell process; NOT_FOUND naming it when the sandbox has none of that name.
  Found find(const std::string& sandbox_id, Processes& processes, const std::string& name);
  std::vector<Found> all(Processes& processes);
  SessionInfo info(const std::string& sandbox_id, const Found& found);
  // Starts a shell for `options` (which names it), writes its start-up lines and waits for its first marker.
  Found start(Processes& processes, const SessionOptions& options);
  // Writes `lines` and a marker with a fresh nonce to the shell, and collects what it writes to stdout and stderr
  // from the given offsets until both markers came (exit_code: the `$?` the marker carries), or the shell ended
  // (reason "session_ended"), or `deadline` passed: with `interrupt`, the timeout's steps (interrupt, kill the
  // run's processes, kill the shell), timed_out set; without, it returns timed_out at once.
  ExecResult run_framed(Processes& processes, int pid, const std::string& lines, std::uint64_t out_at,
                        std::uint64_t err_at, std::chrono::steady_clock::time_point deadline, std::size_t cap,
                        const OutputSink& sink, bool interrupt);

  std::mutex mu_;
  std::set<std::pair<std::string, std::string>> busy_;  // (sandbox, session) with a run under way
};

}  // namespace dsec::agent
