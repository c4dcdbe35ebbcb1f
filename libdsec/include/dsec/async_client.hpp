// Calls about sandboxes without a thread per call: dsec::AsyncClient starts each call as a non-blocking exchange and
// returns at once; ONE I/O thread per AsyncClient drives them all, however many are in flight, and runs each call's
// completion when it ends. A call is what the blocking handle's method does (Sandbox::exec, Process::read, ...):
// the same request, routed to the sandbox's node, retried with the same request id and body under one deadline,
// OutcomeUnknown when no retry can learn an exactly-once request's outcome; only the backoff between attempts is a
// timer of the I/O thread instead of a sleeping thread. The asyncio binding (dsec.AsyncClient) stands on it.
//
//   dsec::Client client;
//   dsec::AsyncClient calls(client);
//   dsec::ExecRequest r;
//   r.shell = "make test";
//   calls.exec(sandbox.id(), r, [](dsec::AsyncOutcome<dsec::ExecResult>&& o) {
//     if (o.ok()) use(*o.value);  // on the I/O thread: hand the result on, do not block here
//   });
//
// Completions and output callbacks run on the I/O thread, one at a time: they must not block, and must not call
// close() or destroy the AsyncClient. What one throws is dropped (a completion) or ends its call with it (an output
// callback: the completion gets it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/exec.hpp"
#include "dsec/process.hpp"
#include "dsec/sandbox.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/session.hpp"

namespace dsec {

class Client;

// How an asynchronous call ended: its value, or the error (a dsec::Error, e.g. dsec::OutcomeUnknown) the blocking
// call would have thrown.
template <typename T>
struct AsyncOutcome {
  std::exception_ptr error;
  std::optional<T> value;  // set when error is null

  bool ok() const noexcept { return !error; }
  // The value, or the error rethrown.
  T& get() {
    if (error) std::rethrow_exception(error);
    return *value;
  }
};

template <>
struct AsyncOutcome<void> {
  std::exception_ptr error;

  bool ok() const noexcept { return !error; }
  void get() const {
    if (error) std::rethrow_exception(error);
  }
};

// What runs on the I/O thread when a call ends (once, unless the call was cancelled first).
template <typename T>
using Completion = std::function<void(AsyncOutcome<T>&&)>;

// A streamed command's output as it arrives: fd 1 (stdout) or 2 (stderr), and the bytes. Each byte once, in
// order, also when a retry replays the output from its start.
using OutputCallback = std::function<void(int fd, std::string_view data)>;

class AsyncClient {
 public:
  // A call in flight, for cancel().
  using Ticket = std::uint64_t;

  // The I/O thread starts here; calls go to `client`'s nodes (it must outlive this AsyncClient). `after_events`
  // (optional) runs on the I/O thread after each round of events in which calls ended or streamed: a binding hands
  // the round's completions on together from there.
  explicit AsyncClient(const Client& client, std::function<void()> after_events = {});
  ~AsyncClient();  // close()
  AsyncClient(const AsyncClient&) = delete;
  AsyncClient& operator=(const AsyncClient&) = delete;

  // Takes the call's transfer off the I/O thread (its connection is dropped) and forgets it: its completion never
  // runs. What the request started in the sandbox is not stopped (a command runs on to its end or timeout). A
  // finished or unknown ticket is ignored.
  void cancel(Ticket ticket);
  // Ends the I/O thread; calls in flight complete with FAILED_PRECONDITION "closed", later ones throw it.
  // Idempotent.
  void close();
  // Calls started and not ended or cancelled yet (a cancel counts once the I/O thread has taken it, at its next
  // round).
  std::size_t in_flight() const noexcept;

  // Every call below checks its arguments as the blocking one does and throws INVALID_ARGUMENT at once (nothing is
  // sent); other errors reach the completion.

  // Sandbox::exec, exactly once under request.request_id (a fresh one when it has none). With on_output, the
  // output is streamed to it as the command writes it and the result's stdout/stderr are empty.
  Ticket exec(std::string_view sandbox_id, const ExecRequest& request, Completion<ExecResult> done,
              OutputCallback on_output = {});
  Ticket info(std::string_view sandbox_id, Completion<SandboxInfo> done);
  // NOT_FOUND when the sandbox is gone already.
  Ticket destroy(std::string_view sandbox_id, Completion<void> done);
  Ticket sleep(std::string_view sandbox_id, Completion<SleepResult> done);
  Ticket wake(std::string_view sandbox_id, Completion<SleepResult> done);

  // Files (Sandbox::write_file, ...). The bytes are the call's until it ends.
  Ticket write_file(std::string_view sandbox_id, std::string_view path, std::string data, unsigned mode,
                    Completion<void> done);
  Ticket read_file(std::string_view sandbox_id, std::string_view path, Completion<std::string> done);
  Ticket upload_tar(std::string_view sandbox_id, std::string_view dir, std::string tar_bytes, Completion<void> done);
  Ticket download_tar(std::string_view sandbox_id, std::string_view dir, Completion<std::string> done);

  // Spawned processes (Sandbox::spawn, Process). spawn is exactly once under request.request_id (a fresh one when
  // it has none); a command that cannot start answers its info with pid 0 and the reason.
  Ticket spawn(std::string_view sandbox_id, const ProcessRequest& request, Completion<ProcessInfo> done);
  Ticket processes(std::string_view sandbox_id, Completion<std::vector<ProcessInfo>> done);
  Ticket process_info(std::string_view sandbox_id, int pid, Completion<ProcessInfo> done);
  // Its info once it ends or `wait_seconds` pass (0: at once); one long poll, as long as the agent allows.
  Ticket process_wait(std::string_view sandbox_id, int pid, double wait_seconds, Completion<ProcessInfo> done);
  // Process::read.
  Ticket process_output(std::string_view sandbox_id, int pid, std::optional<std::uint64_t> stdout_offset,
                        std::optional<std::uint64_t> stderr_offset, double wait_seconds, std::size_t max_bytes,
                        Completion<ProcessOutput> done);
  Ticket write_stdin(std::string_view sandbox_id, int pid, std::string data, Completion<void> done);
  Ticket close_stdin(std::string_view sandbox_id, int pid, Completion<void> done);
  Ticket signal(std::string_view sandbox_id, int pid, int sig, bool group, Completion<ProcessInfo> done);
  Ticket resize(std::string_view sandbox_id, int pid, unsigned rows, unsigned cols, Completion<ProcessInfo> done);
  Ticket kill(std::string_view sandbox_id, int pid, Completion<ProcessInfo> done);

  // Shell sessions (Sandbox::shell, Session).
  Ticket open_session(std::string_view sandbox_id, const SessionOptions& options, Completion<SessionInfo> done);
  Ticket sessions(std::string_view sandbox_id, Completion<std::vector<SessionInfo>> done);
  Ticket session_info(std::string_view sandbox_id, std::string_view name, Completion<SessionInfo> done);
  Ticket restart_session(std::string_view sandbox_id, std::string_view name, Completion<SessionInfo> done);
  Ticket close_session(std::string_view sandbox_id, std::string_view name, Completion<void> done);
  // Session::run (exactly once under a request id of its own); streamed to on_output as exec is.
  Ticket session_run(std::string_view sandbox_id, std::string_view name, std::string_view command,
                     double timeout_seconds, std::size_t max_output, Completion<ExecResult> done,
                     OutputCallback on_output = {});

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsec
