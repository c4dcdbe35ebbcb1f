// Commands: exec, its streamed form, and any command whose answer streams as NDJSON (a session's run).
#include <exception>
#include <optional>

#include "client/client_core.hpp"
#include "client/client_core_internal.hpp"
#include "client/exec_stream.hpp"
#include "common/protocol.hpp"

namespace dsec::detail {

using std::chrono::milliseconds;

ExecResult ClientCore::exec(const std::string& id, const ExecRequest& request) {
  // The agent's own validation, run here first: a malformed request fails before it costs a round trip.
  const protocol::json encoded = protocol::encode(request);
  protocol::decode_exec_request(encoded);
  const milliseconds exec_time{static_cast<std::int64_t>(request.timeout_seconds * 1000.0)};
  // Exactly once on the agent by its request id (one is made when the caller gave none), so retries are safe.
  const std::string request_id = request.request_id.empty() ? random_request_id() : request.request_id;
  protocol::json with_id = encoded;
  with_id["request_id"] = request_id;
  auto r = call_sandbox(id, http_request("POST", sandbox_path(id, "/exec"), with_id.dump(), kJson),
                        {exec_time, true, request_id});
  return protocol::decode_exec_result(parse_json(r, "POST /v1/sandboxes/{id}/exec"));
}

namespace {
// Carries an on_output exception through curl and the retry loop, which must neither wrap nor retry it.
struct OutputCallbackFailed {};
}  // namespace

ExecResult ClientCore::exec_stream(const std::string& id, const ExecRequest& request,
                                   const std::function<void(int fd, std::string_view data)>& on_output) {
  protocol::json encoded = protocol::encode(request);
  protocol::decode_exec_request(encoded);
  encoded["stream"] = true;
  const std::string request_id = request.request_id.empty() ? random_request_id() : request.request_id;
  encoded["request_id"] = request_id;
  const milliseconds exec_time{static_cast<std::int64_t>(request.timeout_seconds * 1000.0)};
  return stream_command(id, "/exec", encoded.dump(), exec_time, on_output, request_id);
}

ExecResult ClientCore::stream_command(const std::string& id, std::string_view suffix, const std::string& body,
                                      milliseconds run_time,
                                      const std::function<void(int fd, std::string_view data)>& on_output,
                                      const std::string& request_id) {
  auto deadline = deadline_after(run_time);
  std::exception_ptr callback_error;
  std::optional<ExecStreamDecoder> decoder;
  HttpRequest http = http_request("POST", sandbox_path(id, suffix), body, kJson);
  http.on_body = [&](std::string_view bytes) { decoder->feed(bytes); };
  // What on_output has had, over every attempt: a retry's answer starts again from the first byte.
  StreamReplayFilter replay;
  bool maybe_sent = false;
  auto attempts = [&] {
    return retrying(deadline, [&] {
      NodePtr node = route(id, deadline);
      replay.new_attempt();
      decoder.emplace([&](int fd, std::string_view data) {
        data = replay.fresh(fd, data);
        if (data.empty() || !on_output) return;
        try {
          on_output(fd, data);
        } catch (...) {
          callback_error = std::current_exception();
          throw OutputCallbackFailed{};
        }
      });
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
  return decoder->finish();
}

}  // namespace dsec::detail
