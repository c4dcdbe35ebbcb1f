// Commands: exec, its streamed form, and any command whose answer streams as NDJSON (a session's run).
#include <exception>
#include <optional>

#include "client/client_core.hpp"
#include "client/client_core_internal.hpp"
#include "client/exec_stream.hpp"

namespace dsec::detail {

using std::chrono::milliseconds;

ExecResult ClientCore::exec(const std::string& id, const ExecRequest& request) {
  const SandboxRequest sent = requests::exec(id, request, false);
  return answers::exec_result(call_sandbox(sent), sent.what);
}

namespace {
// Carries an on_output exception through curl and the retry loop, which must neither wrap nor retry it.
struct OutputCallbackFailed {};
}  // namespace

ExecResult ClientCore::exec_stream(const std::string& id, const ExecRequest& request,
                                   const std::function<void(int fd, std::string_view data)>& on_output) {
  return stream_command(requests::exec(id, request, true), on_output);
}

ExecResult ClientCore::stream_command(const SandboxRequest& request,
                                      const std::function<void(int fd, std::string_view data)>& on_output) {
  const std::string& id = request.sandbox_id;
  const std::string& request_id = request.how.request_id;
  const milliseconds run_time = request.how.extra;
  auto deadline = deadline_after(run_time);
  std::exception_ptr callback_error;
  // What on_output has had, over every attempt: a retry's answer starts again from the first byte.
  StreamedCommand stream([&](int fd, std::string_view data) {
    if (!on_output) return;
    try {
      on_output(fd, data);
    } catch (...) {
      callback_error = std::current_exception();
      throw OutputCallbackFailed{};
    }
  });
  HttpRequest http = request.http();
  http.on_body = [&](std::string_view bytes) { stream.feed(bytes); };
  bool maybe_sent = false;
  auto attempts = [&] {
    return retrying(deadline, [&] {
      NodePtr node = route(id, deadline);
      stream.new_attempt();
      if (request_id.empty()) return call_once(node, http, deadline, run_time);  // never twice
      try {
        return call(node, http, deadline, run_time);
      } catch (const TransportError& e) {
        maybe_sent = maybe_sent || e.maybe_sent();
        throw;
      }
    });
  };
  try {
    if (request_id.empty()) attempts();
    else exactly_once(id, request_id, maybe_sent, attempts);
  } catch (const OutputCallbackFailed&) {
    std::rethrow_exception(callback_error);
  }
  return stream.finish();
}

}  // namespace dsec::detail
