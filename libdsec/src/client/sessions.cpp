// Shell sessions (dsec/session.hpp): Sandbox::shell, sessions(), and the Session handle's calls, over
// /v1/sandboxes/{id}/sessions.
#include "dsec/session.hpp"

#include <chrono>
#include <utility>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "client/endpoint.hpp"
#include "common/protocol/exec.hpp"
#include "common/protocol/process.hpp"
#include "dsec/sandbox.hpp"

namespace dsec {
namespace {

using std::chrono::milliseconds;

constexpr std::string_view kJson = "application/json";

SessionInfo info_of(const detail::HttpResponse& r, std::string_view what) {
  return protocol::decode_session_info(detail::parse_json(r, what));
}

// What a run of `timeout_seconds` adds to an exchange's time.
milliseconds run_time(double timeout_seconds) {
  return milliseconds{static_cast<std::int64_t>(timeout_seconds * 1000.0)};
}

}  // namespace

Session::Session(std::shared_ptr<detail::ClientCore> core, std::string sandbox_id, std::string name)
    : core_(std::move(core)), sandbox_id_(std::move(sandbox_id)), name_(std::move(name)) {}

detail::ClientCore& Session::core() const {
  if (!core_) throw Error(Code::kFailedPrecondition, "empty dsec::Session handle");
  return *core_;
}

std::string Session::path(std::string_view suffix) const {
  return fmt::format("/sessions/{}{}", detail::url_escape(name_), suffix);
}

ExecResult Session::run(std::string command, double timeout_seconds, std::size_t max_output) const {
  // Exactly once on the agent by a request id of its own, so a retry never runs the command twice in the shell.
  const std::string request_id = detail::random_request_id();
  protocol::json encoded = protocol::encode_session_run(command, timeout_seconds, max_output, false);
  encoded["request_id"] = request_id;
  auto r = core().call_sandbox(
      sandbox_id_, detail::http_request("POST", core().sandbox_path(sandbox_id_, path("/run")), encoded.dump(), kJson),
      {run_time(timeout_seconds), true, request_id});
  return protocol::decode_exec_result(detail::parse_json(r, "POST /v1/sandboxes/{id}/sessions/{name}/run"));
}

ExecResult Session::run_stream(std::string command, const std::function<void(int fd, std::string_view data)>& on_output,
                               double timeout_seconds, std::size_t max_output) const {
  const std::string request_id = detail::random_request_id();
  protocol::json encoded = protocol::encode_session_run(command, timeout_seconds, max_output, true);
  encoded["request_id"] = request_id;
  return core().stream_command(sandbox_id_, path("/run"), encoded.dump(), run_time(timeout_seconds), on_output,
                               request_id);
}

SessionInfo Session::info() const {
  auto r = core().call_sandbox(sandbox_id_, detail::http_request("GET", core().sandbox_path(sandbox_id_, path(""))));
  return info_of(r, "GET /v1/sandboxes/{id}/sessions/{name}");
}

SessionInfo Session::restart() const {
  // Not retried once the agent may have it: a second restart would throw away the shell the first one started.
  auto r = core().call_sandbox(
      sandbox_id_, detail::http_request("POST", core().sandbox_path(sandbox_id_, path("/restart")), "{}", kJson),
      {milliseconds{0}, false});
  return info_of(r, "POST /v1/sandboxes/{id}/sessions/{name}/restart");
}

void Session::close() const {
  try {
    core().call_sandbox(sandbox_id_, detail::http_request("DELETE", core().sandbox_path(sandbox_id_, path(""))));
  } catch (const Error& e) {
    if (e.code() != Code::kNotFound) throw;
  }
}

Session Sandbox::shell(const SessionOptions& options) const {
  const std::string body = protocol::encode(options).dump();
  // Not retried once the agent may have it: a second attempt would start a second shell (or find the name taken).
  auto r = core().call_sandbox(id_, detail::http_request("POST", core().sandbox_path(id_, "/sessions"), body, kJson),
                               {milliseconds{0}, false});
  return Session(core_, id_, info_of(r, "POST /v1/sandboxes/{id}/sessions").name);
}

Session Sandbox::session(std::string name) const {
  if (name.empty()) throw Error(Code::kInvalidArgument, "name: a session's name is not empty");
  core();  // an empty handle fails here, not at the session's first call
  return Session(core_, id_, std::move(name));
}

std::vector<SessionInfo> Sandbox::sessions() const {
  auto r = core().call_sandbox(id_, detail::http_request("GET", core().sandbox_path(id_, "/sessions")));
  return protocol::decode_session_list(detail::parse_json(r, "GET /v1/sandboxes/{id}/sessions"));
}

}  // namespace dsec
