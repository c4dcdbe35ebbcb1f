// Shell sessions (dsec/session.hpp): Sandbox::shell, sessions(), and the Session handle's calls, over
// /v1/sandboxes/{id}/sessions.
#include "dsec/session.hpp"

#include <utility>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "client/requests.hpp"
#include "dsec/sandbox.hpp"

namespace dsec {
namespace {

namespace requests = detail::requests;
namespace answers = detail::answers;

// Sends `request` on `core` and decodes its SessionInfo answer.
SessionInfo session_call(detail::ClientCore& core, const detail::SandboxRequest& request) {
  return answers::session_info(core.call_sandbox(request), request.what);
}

}  // namespace

Session::Session(std::shared_ptr<detail::ClientCore> core, std::string sandbox_id, std::string name)
    : core_(std::move(core)), sandbox_id_(std::move(sandbox_id)), name_(std::move(name)) {}

detail::ClientCore& Session::core() const {
  if (!core_) throw Error(Code::kFailedPrecondition, "empty dsec::Session handle");
  return *core_;
}

ExecResult Session::run(const std::string& command, double timeout_seconds, std::size_t max_output) const {
  const detail::SandboxRequest request =
      requests::session_run(sandbox_id_, name_, command, timeout_seconds, max_output, false);
  return answers::exec_result(core().call_sandbox(request), request.what);
}

ExecResult Session::run_stream(const std::string& command,
                               const std::function<void(int fd, std::string_view data)>& on_output,
                               double timeout_seconds, std::size_t max_output) const {
  return core().stream_command(requests::session_run(sandbox_id_, name_, command, timeout_seconds, max_output, true),
                               on_output);
}

SessionInfo Session::info() const { return session_call(core(), requests::session_info(sandbox_id_, name_)); }

SessionInfo Session::restart() const { return session_call(core(), requests::restart_session(sandbox_id_, name_)); }

void Session::close() const {
  try {
    core().call_sandbox(requests::close_session(sandbox_id_, name_));
  } catch (const Error& e) {
    if (e.code() != Code::kNotFound) throw;
  }
}

Session Sandbox::shell(const SessionOptions& options) const {
  return Session(core_, id_, session_call(core(), requests::open_session(id_, options)).name);
}

Session Sandbox::session(std::string name) const {
  if (name.empty()) throw Error(Code::kInvalidArgument, "name: a session's name is not empty");
  core();  // an empty handle fails here, not at the session's first call
  return Session(core_, id_, std::move(name));
}

std::vector<SessionInfo> Sandbox::sessions() const {
  const detail::SandboxRequest request = requests::sessions(id_);
  return answers::session_list(core().call_sandbox(request), request.what);
}

}  // namespace dsec
