// The v1 requests the client sends about a sandbox, one function per operation: method, target and body, and how
// the call may be repeated. Both engines send them as they are: ClientCore::call_sandbox (the blocking API: Sandbox,
// Process, Session) and AsyncTransport (the asyncio core of bindings/python/_dsec_aio.cpp). Each function checks its
// arguments by the agent's rules first (INVALID_ARGUMENT naming the field): a malformed request never costs a round
// trip. The decoders of their answers follow (answers::).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "client/transport.hpp"
#include "dsec/exec.hpp"
#include "dsec/network.hpp"
#include "dsec/process.hpp"
#include "dsec/sandbox.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/screen.hpp"
#include "dsec/session.hpp"

namespace dsec::detail {

// The content types of request bodies.
inline constexpr std::string_view kJson = "application/json";
inline constexpr std::string_view kTar = "application/x-tar";
inline constexpr std::string_view kOctets = "application/octet-stream";

// How a call about a sandbox may be repeated, and how long each of its exchanges may take.
struct SandboxCall {
  SandboxCall(std::chrono::milliseconds extra_in = {}, bool repeatable_in = true, std::string request_id_in = {})
      : extra(extra_in), repeatable(repeatable_in), request_id(std::move(request_id_in)) {}
  // Beyond request_timeout for each exchange: a long poll's wait, a command's timeout.
  std::chrono::milliseconds extra{0};
  // False for a call that must not act twice (it starts something, writes bytes, sends a signal): it is not
  // retried once the request may have reached the agent, and an error the agent answered is final.
  bool repeatable = true;
  // Set: the request carries this id, which makes it exactly-once on the agent (an exec, a session's run). It is
  // then retried like a repeatable call, and a failure that leaves its outcome unknown (the answer lost and no
  // retry could learn it, or the agent says so) is thrown as dsec::OutcomeUnknown.
  std::string request_id;
  // Sleep and wake: an exchange that timed out with time left is retried too (the agent answers the request id in
  // their body with the first attempt's outcome).
  bool retry_timeouts = false;
};

// One request about sandbox `sandbox_id`, as both engines send it.
struct SandboxRequest {
  std::string sandbox_id;
  std::string method = "GET";  // GET, POST, PUT, DELETE
  std::string target;          // sandbox_path(sandbox_id, suffix): escaped
  std::string body;            // the request's own body (JSON)
  std::string_view bytes;      // or the caller's bytes (a file, stdin), not copied: they must outlive the call
  std::string content_type;
  SandboxCall how;
  std::string what;  // the call as messages name it: "POST /v1/sandboxes/{id}/exec"

  std::string_view payload() const noexcept { return bytes.empty() ? std::string_view(body) : bytes; }
  // The exchange; it views this request, which must outlive it.
  HttpRequest http() const { return http_request(method, target, payload(), content_type); }
};

// "/v1/sandboxes/{id}{suffix}", the id escaped (suffix is taken as it is).
std::string sandbox_path(std::string_view id, std::string_view suffix = {});

namespace requests {

// Any request about a sandbox: `suffix` after its path, already escaped.
SandboxRequest sandbox(std::string_view id, std::string method, std::string_view suffix, std::string body = {},
                       std::string_view content_type = {}, SandboxCall how = {});

// The sandbox itself.
SandboxRequest info(std::string_view id);     // GET /v1/sandboxes/{id}
SandboxRequest destroy(std::string_view id);  // DELETE
SandboxRequest set_ttl(std::string_view id, std::chrono::seconds ttl);
SandboxRequest sleep_or_wake(std::string_view id, bool sleep);  // with a fresh request id in the body
SandboxRequest snapshot(std::string_view id, std::string_view name);
SandboxRequest fork(std::string_view id, std::size_t count);

// Its network and ports.
SandboxRequest network(std::string_view id);
SandboxRequest set_network(std::string_view id, const NetworkPolicy& policy);
SandboxRequest network_usage(std::string_view id);
SandboxRequest expose(std::string_view id, std::uint32_t port);
SandboxRequest unexpose(std::string_view id, std::uint32_t port);
SandboxRequest exposed(std::string_view id);

// A full VM's screen.
SandboxRequest screenshot(std::string_view id);
SandboxRequest screen_state(std::string_view id);
SandboxRequest screen_input(std::string_view id, const std::vector<InputAction>& actions);
SandboxRequest vnc(std::string_view id);
SandboxRequest stop_vnc(std::string_view id);

// Files: `data` is sent as it is, not copied.
SandboxRequest write_file(std::string_view id, std::string_view path, std::string_view data, unsigned mode);
SandboxRequest read_file(std::string_view id, std::string_view path);
SandboxRequest upload_tar(std::string_view id, std::string_view dir, std::string_view tar_bytes);
SandboxRequest download_tar(std::string_view id, std::string_view dir);

// Commands, exactly once under request.request_id (a fresh one when it has none); `stream`: the answer is NDJSON.
SandboxRequest exec(std::string_view id, const ExecRequest& request, bool stream);
// A shell session's run, under a fresh request id.
SandboxRequest session_run(std::string_view id, std::string_view name, std::string_view command, double timeout_seconds,
                           std::size_t max_output, bool stream);

// Shell sessions.
SandboxRequest open_session(std::string_view id, const SessionOptions& options);
SandboxRequest sessions(std::string_view id);
SandboxRequest session_info(std::string_view id, std::string_view name);
SandboxRequest restart_session(std::string_view id, std::string_view name);
SandboxRequest close_session(std::string_view id, std::string_view name);

// Spawned processes. spawn is exactly once under request.request_id (a fresh one when it has none).
SandboxRequest spawn(std::string_view id, const ProcessRequest& request);
SandboxRequest processes(std::string_view id);
SandboxRequest process_info(std::string_view id, int pid);
// Its info once it ends or `wait_seconds` pass (0: at once).
SandboxRequest process_wait(std::string_view id, int pid, double wait_seconds);
// A long poll's wait: INVALID_ARGUMENT when it is not a number or longer than the agent allows.
void check_process_wait(double wait_seconds);
// Output from the offsets of the streams asked for, waiting up to `wait_seconds` for some.
SandboxRequest process_output(std::string_view id, int pid, std::optional<std::uint64_t> stdout_offset,
                              std::optional<std::uint64_t> stderr_offset, double wait_seconds, std::size_t max_bytes);
// Writes, closes and signals carry a fresh request id, which makes them exactly once.
SandboxRequest write_stdin(std::string_view id, int pid, std::string_view data);
SandboxRequest close_stdin(std::string_view id, int pid);
SandboxRequest signal(std::string_view id, int pid, int sig, bool group);
SandboxRequest resize(std::string_view id, int pid, unsigned rows, unsigned cols);
SandboxRequest kill(std::string_view id, int pid);

// A long poll of `seconds`, or a command's timeout, as the time it adds to an exchange (whole milliseconds, up).
std::chrono::milliseconds wait_time(double seconds);

}  // namespace requests

// The answers' decoders; `what` names the call in messages. A body that is not JSON is INTERNAL; a malformed answer
// is named as each decoder of the wire says.
namespace answers {

SandboxInfo sandbox_info(const HttpResponse& r, std::string_view what);
std::vector<SandboxInfo> sandbox_list(const HttpResponse& r, std::string_view what);  // {"sandboxes": [...]}
ExecResult exec_result(const HttpResponse& r, std::string_view what);
SleepResult sleep_result(const HttpResponse& r, bool sleep);
// A file's bytes; INVALID_ARGUMENT when the answer is a directory's tar (`path` of sandbox `id` names it).
std::string file(HttpResponse&& r, std::string_view path, std::string_view id);
SessionInfo session_info(const HttpResponse& r, std::string_view what);
std::vector<SessionInfo> session_list(const HttpResponse& r, std::string_view what);
ProcessInfo process_info(const HttpResponse& r, std::string_view what);
std::vector<ProcessInfo> process_list(const HttpResponse& r, std::string_view what);
// A stream that was not asked for says nothing, whatever the agent put there.
ProcessOutput process_output(const HttpResponse& r, std::string_view what, bool want_stdout, bool want_stderr);

}  // namespace answers

}  // namespace dsec::detail
