// Spawned processes (dsec/process.hpp): Sandbox::spawn, processes(), and the Process handle's calls, over
// /v1/sandboxes/{id}/processes.
#include "dsec/process.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "client/requests.hpp"
#include "dsec/sandbox.hpp"

namespace dsec {
namespace {

using detail::SteadyClock;
namespace requests = detail::requests;
namespace answers = detail::answers;

// Process::wait long-polls in slices of at most this many seconds.
constexpr double kWaitSlice = 60;
// How long each read of Process::follow waits for output.
constexpr double kFollowWait = 30;

// Sends `request` on `core` and decodes its ProcessInfo answer.
ProcessInfo process_call(detail::ClientCore& core, const detail::SandboxRequest& request) {
  return answers::process_info(core.call_sandbox(request), request.what);
}

}  // namespace

Process::Process(std::shared_ptr<detail::ClientCore> core, std::string sandbox_id, int pid)
    : core_(std::move(core)), sandbox_id_(std::move(sandbox_id)), pid_(pid) {}

Process::Process(std::shared_ptr<detail::ClientCore> core, std::string sandbox_id, ProcessInfo never_started)
    : core_(std::move(core)),
      sandbox_id_(std::move(sandbox_id)),
      never_started_(std::make_shared<const ProcessInfo>(std::move(never_started))) {}

void Process::check_started(std::string_view what) const {
  if (never_started_)
    throw Error(Code::kFailedPrecondition, fmt::format("{}: the command never started ({}): {}", what,
                                                       never_started_->reason, never_started_->message));
}

detail::ClientCore& Process::core() const {
  if (!core_) throw Error(Code::kFailedPrecondition, "empty dsec::Process handle");
  return *core_;
}

ProcessInfo Process::info() const {
  if (never_started_) return *never_started_;
  return process_call(core(), requests::process_info(sandbox_id_, pid_));
}

ProcessInfo Process::wait(double timeout_seconds) const {
  if (std::isnan(timeout_seconds)) throw Error(Code::kInvalidArgument, "timeout: not a number");
  if (never_started_) return *never_started_;
  std::optional<SteadyClock::time_point> until;
  if (!std::isinf(timeout_seconds) || timeout_seconds < 0)
    until = SteadyClock::now() + requests::wait_time(std::min(timeout_seconds, 366.0 * 86400));
  for (;;) {
    double left = kWaitSlice;
    if (until) left = std::chrono::duration<double>(*until - SteadyClock::now()).count();
    const double slice = std::clamp(left, 0.0, kWaitSlice);
    ProcessInfo info = process_call(core(), requests::process_wait(sandbox_id_, pid_, slice));
    if (!info.running || (until && SteadyClock::now() >= *until) || slice <= 0) return info;
  }
}

ProcessOutput Process::read(std::optional<std::uint64_t> stdout_offset, std::optional<std::uint64_t> stderr_offset,
                            double wait_seconds, std::size_t max_bytes) const {
  requests::check_process_wait(wait_seconds);
  if (never_started_) {  // its stderr is the message
    ProcessOutput out;
    const std::string& message = never_started_->message;
    if (stderr_offset) {
      out.stderr_offset = std::min<std::uint64_t>(*stderr_offset, message.size());
      out.stderr_data = message.substr(out.stderr_offset, max_bytes);
    }
    out.stderr_end = message.size();
    out.exit_code = never_started_->exit_code;
    return out;
  }
  const detail::SandboxRequest request =
      requests::process_output(sandbox_id_, pid_, stdout_offset, stderr_offset, wait_seconds, max_bytes);
  return answers::process_output(core().call_sandbox(request), request.what, stdout_offset.has_value(),
                                 stderr_offset.has_value());
}

// Writes, closes and signals carry a request id of their own, which makes them exactly-once on the agent: a lost
// answer is retried without writing the bytes or sending the signal twice.
void Process::write_stdin(std::string_view data) const {
  check_started("stdin");
  core().call_sandbox(requests::write_stdin(sandbox_id_, pid_, data));
}

void Process::close_stdin() const {
  check_started("stdin");
  core().call_sandbox(requests::close_stdin(sandbox_id_, pid_));
}

ProcessInfo Process::signal(int sig, bool group) const {
  const detail::SandboxRequest request = requests::signal(sandbox_id_, pid_, sig, group);
  check_started("signal");
  return process_call(core(), request);
}

ProcessInfo Process::resize(unsigned rows, unsigned cols) const {
  const detail::SandboxRequest request = requests::resize(sandbox_id_, pid_, rows, cols);
  check_started("resize");
  return process_call(core(), request);
}

ProcessInfo Process::kill() const {
  if (never_started_) return *never_started_;
  return process_call(core(), requests::kill(sandbox_id_, pid_));
}

ProcessInfo Process::follow(const std::function<void(int fd, std::string_view data)>& on_output) const {
  std::uint64_t out_at = 0, err_at = 0;
  for (;;) {
    ProcessOutput out = read(out_at, err_at, kFollowWait);
    if (!out.stdout_data.empty() && on_output) on_output(1, out.stdout_data);
    if (!out.stderr_data.empty() && on_output) on_output(2, out.stderr_data);
    // Bytes no longer kept are skipped: the next read starts where this one's answer ended.
    out_at = std::max(out_at, out.stdout_offset + out.stdout_data.size());
    err_at = std::max(err_at, out.stderr_offset + out.stderr_data.size());
    if (!out.running && out_at >= out.stdout_end && err_at >= out.stderr_end) return info();
  }
}

Process Sandbox::spawn(const ProcessRequest& request) const {
  ProcessInfo info = process_call(core(), requests::spawn(id_, request));
  if (info.pid == 0) return Process(core_, id_, std::move(info));  // it never started: a result, not an error
  return Process(core_, id_, info.pid);
}

Process Sandbox::process(int pid) const {
  if (pid <= 0) throw Error(Code::kInvalidArgument, fmt::format("pid: {} is not a process id", pid));
  core();  // an empty handle fails here, not at the process's first call
  return Process(core_, id_, pid);
}

std::vector<ProcessInfo> Sandbox::processes() const {
  const detail::SandboxRequest request = requests::processes(id_);
  return answers::process_list(core().call_sandbox(request), request.what);
}

}  // namespace dsec
