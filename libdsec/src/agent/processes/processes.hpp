// The processes a sandbox keeps running for its callers (docs/protocol.md, "Processes"): commands that outlive
// the call that started them, whose output is kept in the sandbox (by its init) and read from any offset by any
// number of calls, and whose stdin stays open. Shell sessions (shell_sessions.hpp) are processes too. Backends
// whose sandboxes run processes hand one of these out (BackendSandbox::processes()); InitProcesses speaks
// dsec-init's side of it (init/process_protocol.hpp) over whatever carries a request to the sandbox's init.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "common/wire/process_protocol.hpp"
#include "dsec/exec.hpp"

namespace dsec::agent {

using ProcessEntry = process_protocol::Entry;

struct SpawnOptions {
  bool pty = false;
  unsigned rows = 24, cols = 80;
  process_protocol::Kind kind = process_protocol::Kind::kProcess;
  std::string meta;  // a process's tag; a session's description
};

// What a read found: the process as it is, and its output from the offsets asked (or the first kept byte after).
struct ProcessOutput {
  ProcessEntry entry;
  std::uint64_t stdout_offset = 0;
  std::string stdout_data;
  std::uint64_t stderr_offset = 0;
  std::string stderr_data;
};

// Every method throws dsec::Error: NOT_FOUND for a pid the sandbox does not keep, FAILED_PRECONDITION for what an
// ended process (or one whose stdin was closed) cannot do, and the sandbox's own errors (a destroyed sandbox).
class Processes {
 public:
  virtual ~Processes() = default;
  // The process, running; or, when the command could not start for what it names (a missing executable or
  // working directory), the result an exec would have given (exit code 127 or 126, reason, the line on stderr).
  virtual std::variant<ProcessEntry, ExecResult> spawn(const ExecRequest& command, const SpawnOptions& options) = 0;
  virtual std::vector<ProcessEntry> list() = 0;
  // Offsets process_protocol::kSkip: that stream is not read. Answers at once when there is output past an offset
  // (and max > 0) or the process ended; else waits up to `wait`.
  virtual ProcessOutput read(int pid, std::uint64_t stdout_offset, std::uint64_t stderr_offset, std::uint32_t max,
                             std::chrono::milliseconds wait) = 0;
  // The bytes go to its stdin in order (init holds what the pipe does not take yet); then closes it if asked.
  virtual void write_stdin(int pid, std::string_view data, bool close) = 0;
  // Returns how many processes got the signal.
  virtual std::uint32_t signal(int pid, int sig, process_protocol::Scope scope,
                               const std::vector<int>& spared = {}) = 0;
  virtual void resize(int pid, unsigned rows, unsigned cols) = 0;
  // Kills its process group if it runs, and forgets it and its output; returns it as it was.
  virtual ProcessEntry forget(int pid) = 0;
  // Its children now (pids in the sandbox).
  virtual std::vector<int> children(int pid) = 0;
};

// Processes kept by a dsec-init (process_protocol.hpp). A backend supplies the transport and the spawn's
// preparation (who the command runs as, its environment, its cgroup).
class InitProcesses : public Processes {
 public:
  explicit InitProcesses(std::string sandbox_id) : sandbox_id_(std::move(sandbox_id)) {}

  std::vector<ProcessEntry> list() override;
  ProcessOutput read(int pid, std::uint64_t stdout_offset, std::uint64_t stderr_offset, std::uint32_t max,
                     std::chrono::milliseconds wait) override;
  void write_stdin(int pid, std::string_view data, bool close) override;
  std::uint32_t signal(int pid, int sig, process_protocol::Scope scope, const std::vector<int>& spared) override;
  void resize(int pid, unsigned rows, unsigned cols) override;
  ProcessEntry forget(int pid) override;
  std::vector<int> children(int pid) override;

 protected:
  // Sends one request to the sandbox's init and returns its reply's payload (status first). Throws the sandbox's
  // errors (UNAVAILABLE when init does not answer within `reply_within`, NOT_FOUND for a destroyed sandbox).
  virtual std::string exchange(process_protocol::Op op, const std::string& payload,
                               std::chrono::milliseconds reply_within) = 0;
  // The most output one read brings back per stream (a VM's line carries less than a socket in one answer).
  virtual std::uint32_t max_read_bytes() const { return process_protocol::kMaxReadBytes; }
  // A spawn's payload (process_protocol.hpp) for a command already resolved into init's start payload.
  static std::string spawn_payload(const SpawnOptions& options, const std::string& start_payload);
  // Decodes a spawn's reply; a failed start becomes the exec's result (start_failure_result) or its error.
  std::variant<ProcessEntry, ExecResult> spawn_reply(const std::string& reply, const std::string& argv0,
                                                     const std::string& cwd) const;

  const std::string& sandbox_id() const { return sandbox_id_; }
  // A sandbox started ahead of its create (a warm pool's) takes its id when a create claims it, before anyone
  // else sees it.
  void set_sandbox_id(std::string id) { sandbox_id_ = std::move(id); }

 private:
  // Reads the status that starts a reply and throws the error it stands for (naming pid).
  void check_status(process_protocol::Reader& r, int pid) const;

  std::string sandbox_id_;
};

}  // namespace dsec::agent
