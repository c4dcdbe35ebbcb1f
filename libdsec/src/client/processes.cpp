// Spawned processes (dsec/process.hpp): Sandbox::spawn, processes(), and the Process handle's calls, over
// /v1/sandboxes/{id}/processes.
#include "dsec/process.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "common/protocol/process.hpp"
#include "dsec/sandbox.hpp"

namespace dsec {
namespace {

using detail::SteadyClock;
using std::chrono::milliseconds;

constexpr std::string_view kJson = "application/json";
constexpr std::string_view kOctets = "application/octet-stream";
// Process::wait long-polls in slices of at most this many seconds.
constexpr double kWaitSlice = 60;
// How long each read of Process::follow waits for output.
constexpr double kFollowWait = 30;

// What a long poll of `seconds` adds to an exchange's time.
milliseconds poll_time(double seconds) {
  return milliseconds{static_cast<std::int64_t>(std::ceil(std::max(seconds, 0.0) * 1000.0))};
}

ProcessInfo info_of(const detail::HttpResponse& r, std::string_view what) {
  return protocol::decode_process_info(detail::parse_json(r, what));
}

void check_wait(double seconds, std::string_view field) {
  if (std::isnan(seconds) || seconds > protocol::kMaxProcessWait)
    throw Error(Code::kInvalidArgument,
                fmt::format("{}: at most {} seconds, got {}", field, protocol::kMaxProcessWait, seconds));
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

std::string Process::path(std::string_view suffix) const {
  return core().sandbox_path(sandbox_id_, fmt::format("/processes/{}{}", pid_, suffix));
}

ProcessInfo Process::info() const {
  if (never_started_) return *never_started_;
  auto r = core().call_sandbox(sandbox_id_, detail::http_request("GET", path("")));
  return info_of(r, "GET /v1/sandboxes/{id}/processes/{pid}");
}

ProcessInfo Process::wait(double timeout_seconds) const {
  if (std::isnan(timeout_seconds)) throw Error(Code::kInvalidArgument, "timeout: not a number");
  if (never_started_) return *never_started_;
  std::optional<SteadyClock::time_point> until;
  if (!std::isinf(timeout_seconds) || timeout_seconds < 0)
    until = SteadyClock::now() + poll_time(std::min(timeout_seconds, 366.0 * 86400));
  for (;;) {
    double left = kWaitSlice;
    if (until) left = std::chrono::duration<double>(*until - SteadyClock::now()).count();
    const double slice = std::clamp(left, 0.0, kWaitSlice);
    auto r = core().call_sandbox(
        sandbox_id_, detail::http_request("GET", path(slice > 0 ? "?wait=" + protocol::query_seconds(slice) : "")),
        {poll_time(slice), true});
    ProcessInfo info = info_of(r, "GET /v1/sandboxes/{id}/processes/{pid}?wait");
    if (!info.running || (until && SteadyClock::now() >= *until) || slice <= 0) return info;
  }
}

ProcessOutput Process::read(std::optional<std::uint64_t> stdout_offset, std::optional<std::uint64_t> stderr_offset,
                            double wait_seconds, std::size_t max_bytes) const {
  check_wait(wait_seconds, "wait");
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
  if (max_bytes < 1 || max_bytes > protocol::kMaxOutputRead)
    throw Error(Code::kInvalidArgument, fmt::format("max_bytes: 1 to {}, got {}", protocol::kMaxOutputRead, max_bytes));
  std::string query;
  auto add = [&query](std::string_view key, const std::string& value) {
    query += fmt::format("{}{}={}", query.empty() ? '?' : '&', key, value);
  };
  if (stdout_offset) add("stdout", std::to_string(*stdout_offset));
  if (stderr_offset) add("stderr", std::to_string(*stderr_offset));
  if (wait_seconds > 0) add("wait", protocol::query_seconds(wait_seconds));
  if (max_bytes != protocol::kMaxOutputRead) add("max", std::to_string(max_bytes));
  auto r = core().call_sandbox(sandbox_id_, detail::http_request("GET", path("/output" + query)),
                               {poll_time(wait_seconds), true});
  ProcessOutput out =
      protocol::decode_process_output(detail::parse_json(r, "GET /v1/sandboxes/{id}/processes/{pid}/output"));
  // A stream that was not asked for says nothing, whatever the agent put there.
  if (!stdout_offset) out.stdout_data.clear(), out.stdout_offset = out.stdout_end = 0;
  if (!stderr_offset) out.stderr_data.clear(), out.stderr_offset = out.stderr_end = 0;
  return out;
}

// Writes, closes and signals carry a request id of their own, which makes them exactly-once on the agent: a lost
// answer is retried without writing the bytes or sending the signal twice.
void Process::write_stdin(std::string_view data) const {
  check_started("stdin");
  const std::string id = detail::random_request_id();
  core().call_sandbox(sandbox_id_, detail::http_request("POST", path("/stdin?request_id=" + id), data, kOctets),
                      {milliseconds{0}, true, id});
}

void Process::close_stdin() const {
  check_started("stdin");
  const std::string id = detail::random_request_id();
  core().call_sandbox(sandbox_id_,
                      detail::http_request("POST", path("/stdin?close=true&request_id=" + id), {}, kOctets),
                      {milliseconds{0}, true, id});
}

ProcessInfo Process::signal(int sig, bool group) const {
  if (sig < 0) throw Error(Code::kInvalidArgument, fmt::format("signal: {} is not a signal number", sig));
  check_started("signal");
  const std::string id = detail::random_request_id();
  const std::string body = protocol::json{{"signal", sig}, {"group", group}, {"request_id", id}}.dump();
  auto r = core().call_sandbox(sandbox_id_, detail::http_request("POST", path("/signal"), body, kJson),
                               {milliseconds{0}, true, id});
  return info_of(r, "POST /v1/sandboxes/{id}/processes/{pid}/signal");
}

ProcessInfo Process::resize(unsigned rows, unsigned cols) const {
  protocol::check_terminal_size(rows, cols);
  check_started("resize");
  // The same size twice is the same state: retried like a read.
  const std::string body = protocol::json{{"rows", rows}, {"cols", cols}}.dump();
  auto r = core().call_sandbox(sandbox_id_, detail::http_request("POST", path("/resize"), body, kJson));
  return info_of(r, "POST /v1/sandboxes/{id}/processes/{pid}/resize");
}

ProcessInfo Process::kill() const {
  if (never_started_) return *never_started_;
  auto r = core().call_sandbox(sandbox_id_, detail::http_request("DELETE", path("")));
  return info_of(r, "DELETE /v1/sandboxes/{id}/processes/{pid}");
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
  // Exactly-once on the agent by its request id (one is made when the caller gave none): a retry after a lost
  // answer gets the first spawn's process, never a second one.
  protocol::json encoded = protocol::encode(request);
  const std::string request_id = request.request_id.empty() ? detail::random_request_id() : request.request_id;
  encoded["request_id"] = request_id;
  auto r = core().call_sandbox(
      id_, detail::http_request("POST", core().sandbox_path(id_, "/processes"), encoded.dump(), kJson),
      {milliseconds{0}, true, request_id});
  ProcessInfo info = info_of(r, "POST /v1/sandboxes/{id}/processes");
  if (info.pid == 0) return Process(core_, id_, std::move(info));  // it never started: a result, not an error
  return Process(core_, id_, info.pid);
}

Process Sandbox::process(int pid) const {
  if (pid <= 0) throw Error(Code::kInvalidArgument, fmt::format("pid: {} is not a process id", pid));
  core();  // an empty handle fails here, not at the process's first call
  return Process(core_, id_, pid);
}

std::vector<ProcessInfo> Sandbox::processes() const {
  auto r = core().call_sandbox(id_, detail::http_request("GET", core().sandbox_path(id_, "/processes")));
  return protocol::decode_process_list(detail::parse_json(r, "GET /v1/sandboxes/{id}/processes"));
}

}  // namespace dsec
