// The private dsecd a Client starts when it is given no endpoints: one machine, zero configuration.
//
// The agent listens on a unix socket in a private directory, dies with the trainer (PR_SET_PDEATHSIG), and is
// stopped with SIGTERM (then SIGKILL after a grace period) when its Client goes away. A keeper thread spawns it and
// stays alive as long as the agent does: PR_SET_PDEATHSIG fires when the spawning *thread* exits, so spawning from
// a short-lived trainer thread would kill the agent with that thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "dsec/client.hpp"

namespace dsec::detail {

struct EmbeddedAgentOptions {
  std::string binary;                   // explicit path; empty: search (see find_agent_binary)
  std::vector<std::string> candidates;  // further paths tried after the build tree's dsecd, before PATH
  std::string home;                     // empty: $DSEC_HOME, then /var/lib/dsec
  std::vector<std::string> stores;      // image stores (--store); empty: the agent's default, <home>/store
  std::vector<std::string> extra_args;  // appended to dsecd's command line ("--backends", "null", ...)
  RegistrySettings registry;            // OCI registries: flags, and credentials in a private file
  std::chrono::milliseconds start_timeout{30'000};
  std::chrono::milliseconds stop_grace{10'000};
};

// The dsecd to run: `explicit_path` if given; else $DSEC_AGENT; else the dsecd of the build tree this library
// came from; else each of `candidates`; else `dsecd` on PATH. Throws NOT_FOUND listing where it looked.
std::string find_agent_binary(const std::string& explicit_path, const std::vector<std::string>& candidates);

class EmbeddedAgent {
 public:
  // Starts dsecd and returns once it wrote "ready" on its ready fd. Throws FAILED_PRECONDITION with the tail of
  // its log when it exits first, DEADLINE_EXCEEDED when it takes longer than start_timeout.
  explicit EmbeddedAgent(const EmbeddedAgentOptions& options);
  ~EmbeddedAgent();
  EmbeddedAgent(const EmbeddedAgent&) = delete;
  EmbeddedAgent& operator=(const EmbeddedAgent&) = delete;

  // SIGTERM, wait up to stop_grace, SIGKILL; then removes the private directory's own files. Idempotent.
  void stop();

  std::string endpoint() const { return "unix:" + socket_path_; }
  const std::string& binary() const noexcept { return binary_; }
  const std::string& log_path() const noexcept { return log_path_; }
  const std::string& home() const noexcept { return home_; }
  pid_t pid() const noexcept { return pid_; }

  // Set once the agent exited on its own (crashed, killed): a description with its exit status and log tail.
  std::optional<std::string> exited_unexpectedly() const;

  // The last `max_bytes` of the agent's log (its stdout and stderr).
  std::string log_tail(std::size_t max_bytes = 4096) const;

 private:
  void keeper_main(int ready_write_fd, int log_fd, int null_fd);
  // dsecd's registry flags; credentials go to a private file (registry_auth_file_).
  void add_registry_args(const RegistrySettings& registry);
  // keeper_main's steps. The agent's process, its descriptors handed over (closed here); -1 when it did not start
  // (`err` says why).
  pid_t spawn_child(int ready_write_fd, int log_fd, int null_fd, int& err);
  // waitpid(pid, options) for the agent; true once it is reaped (reaped_ and wait_status_ set).
  bool reap(pid_t pid, int options);
  // Waits up to `timeout` for the agent to end (on its pidfd, when it has one, else polling); true once reaped.
  bool wait_exit(pid_t pid, int pidfd, std::chrono::milliseconds timeout);
  void wait_ready(int ready_read_fd);
  void cleanup_files() noexcept;

  std::string home_;

  std::string binary_;
  std::vector<std::string> argv_;
  pid_t owner_pid_;  // the process that started the agent (a forked child must not stop it)
  std::chrono::milliseconds start_timeout_;
  std::chrono::milliseconds stop_grace_;
  std::string dir_;                 // private directory: dsecd.sock, dsecd.log, run/
  std::string registry_auth_file_;  // in dir_: registry credentials for the agent, or empty
  std::string socket_path_;
  std::string run_dir_;
  std::string log_path_;
  bool keep_log_ = false;  // the log was asked for by path ($DSEC_AGENT_LOG): leave it

  mutable std::mutex mu_;
  std::condition_variable cv_;
  pid_t pid_ = -1;
  int spawn_errno_ = 0;
  bool spawned_ = false;  // the keeper finished spawning (pid_ or spawn_errno_ is set)
  bool stop_requested_ = false;
  bool reaped_ = false;
  int wait_status_ = 0;
  bool stopping_ = false;  // stop() asked for the exit, so it is expected
  int stop_fd_ = -1;       // eventfd: stop() wakes the keeper through it
  std::thread keeper_;
  bool stopped_ = false;
};

}  // namespace dsec::detail
