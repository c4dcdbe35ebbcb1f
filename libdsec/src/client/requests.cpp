#include "client/requests.hpp"

#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "client/endpoint.hpp"
#include "common/network_rules.hpp"
#include "common/protocol.hpp"
#include "common/protocol/process.hpp"
#include "common/protocol/screen.hpp"

namespace dsec::detail {
namespace {

using protocol::json;
using std::chrono::milliseconds;

// A sleep pushes the sandbox's memory out to swap, which takes as long as writing it (about 10 s per GiB on a
// plain disk); the agent gives up after its --sleep-reclaim-timeout, 60 s by default. Each exchange may take that
// much more than request_timeout.
constexpr milliseconds kSleepTime{60'000};
// The longest one snapshot exchange may take on top of request_timeout (a large writable layer to copy and pack):
// a snapshot, and a fork that copies a running sandbox on its node.
constexpr milliseconds kSnapshotTime{600'000};

SandboxRequest make(std::string_view id, std::string method, std::string_view suffix, std::string what,
                    std::string body = {}, std::string_view content_type = {}, SandboxCall how = {}) {
  SandboxRequest r;
  r.sandbox_id = id;
  r.method = std::move(method);
  r.target = sandbox_path(id, suffix);
  r.body = std::move(body);
  r.content_type = content_type;
  r.how = std::move(how);
  r.what = std::move(what);
  return r;
}

// A request carrying the caller's bytes as its body.
SandboxRequest with_bytes(SandboxRequest r, std::string_view bytes) {
  r.bytes = bytes;
  return r;
}

std::string session_suffix(std::string_view name, std::string_view suffix = {}) {
  return fmt::format("/sessions/{}{}", url_escape(name), suffix);
}

std::string process_suffix(int pid, std::string_view suffix = {}) {
  return fmt::format("/processes/{}{}", pid, suffix);
}

}  // namespace

std::string sandbox_path(std::string_view id, std::string_view suffix) {
  return fmt::format("/v1/sandboxes/{}{}", url_escape(id), suffix);
}

namespace requests {

milliseconds wait_time(double seconds) {
  return milliseconds{static_cast<std::int64_t>(std::ceil(std::max(seconds, 0.0) * 1000.0))};
}

SandboxRequest sandbox(std::string_view id, std::string method, std::string_view suffix, std::string body,
                       std::string_view content_type, SandboxCall how) {
  std::string what = fmt::format("{} {}", method, suffix);
  return make(id, std::move(method), suffix, std::move(what), std::move(body), content_type, std::move(how));
}

SandboxRequest info(std::string_view id) { return make(id, "GET", "", "GET /v1/sandboxes/{id}"); }

SandboxRequest destroy(std::string_view id) { return make(id, "DELETE", "", "DELETE /v1/sandboxes/{id}"); }

SandboxRequest set_ttl(std::string_view id, std::chrono::seconds ttl) {
  if (ttl.count() < 0 || ttl.count() > protocol::kMaxTtlSeconds)
    throw Error(Code::kInvalidArgument, fmt::format("ttl: {} s is not from 0 to one year", ttl.count()));
  // A retry moves the deadline by the time between the two: retried like a read.
  return make(id, "PUT", "/ttl", "PUT /v1/sandboxes/{id}/ttl", json{{"ttl", ttl.count()}}.dump(), kJson);
}

SandboxRequest sleep_or_wake(std::string_view id, bool sleep) {
  // Every attempt of this call carries the same request id: when an answer is lost and the call is retried, the
  // agent answers the retry as it answered the first attempt instead of "already sleeping".
  SandboxCall how{kSleepTime, true};
  how.retry_timeouts = true;
  return make(id, "POST", sleep ? "/sleep" : "/wake",
              sleep ? "POST /v1/sandboxes/{id}/sleep" : "POST /v1/sandboxes/{id}/wake",
              protocol::encode_sleep_request(random_request_id()).dump(), kJson, std::move(how));
}

SandboxRequest snapshot(std::string_view id, std::string_view name) {
  // A snapshot copies files and compresses a layer: each exchange may take far longer than request_timeout. A
  // retry carries the same request id, so the agent answers it with the snapshot the first attempt takes.
  return make(
      id, "POST", "/snapshot", "POST /v1/sandboxes/{id}/snapshot",
      protocol::encode(protocol::SnapshotCall{.name = std::string(name), .request_id = random_request_id()}).dump(),
      kJson, {kSnapshotTime, true});
}

SandboxRequest fork(std::string_view id, std::size_t count) {
  // Not retried: the copies may exist once the request arrived.
  return make(id, "POST", "/fork", "POST /v1/sandboxes/{id}/fork",
              protocol::encode(protocol::ForkRequest{.count = count, .labels = {}}).dump(), kJson,
              {kSnapshotTime, false});
}

SandboxRequest network(std::string_view id) { return make(id, "GET", "/network", "GET /v1/sandboxes/{id}/network"); }

SandboxRequest set_network(std::string_view id, const NetworkPolicy& policy) {
  network::validate(policy);  // a malformed policy never leaves the client
  // Idempotent (the same policy twice is the same state): retried like a read.
  return make(id, "PUT", "/network", "PUT /v1/sandboxes/{id}/network", protocol::encode(policy).dump(), kJson);
}

SandboxRequest network_usage(std::string_view id) {
  return make(id, "GET", "/network/usage", "GET /v1/sandboxes/{id}/network/usage");
}

SandboxRequest expose(std::string_view id, std::uint32_t port) {
  if (port < 1 || port > 65535) throw Error(Code::kInvalidArgument, fmt::format("port: {} is not a TCP port", port));
  // Not retried blindly: a lost answer would expose the port twice (the retry is refused as exposed already).
  return make(id, "POST", "/ports", "POST /v1/sandboxes/{id}/ports", json{{"port", port}}.dump(), kJson,
              {milliseconds{0}, false});
}

SandboxRequest unexpose(std::string_view id, std::uint32_t port) {
  return make(id, "DELETE", fmt::format("/ports?port={}", port), "DELETE /v1/sandboxes/{id}/ports");
}

SandboxRequest exposed(std::string_view id) { return make(id, "GET", "/ports", "GET /v1/sandboxes/{id}/ports"); }

SandboxRequest screenshot(std::string_view id) { return make(id, "GET", "/screen", "GET /v1/sandboxes/{id}/screen"); }

SandboxRequest screen_state(std::string_view id) {
  return make(id, "GET", "/screen/state", "GET /v1/sandboxes/{id}/screen/state");
}

SandboxRequest screen_input(std::string_view id, const std::vector<InputAction>& actions) {
  std::string body = protocol::encode_input(actions).dump();
  (void)protocol::decode_input(json::parse(body));  // a malformed action never leaves the client
  // Not retried once sent: a lost answer would press the keys twice.
  return make(id, "POST", "/screen/input", "POST /v1/sandboxes/{id}/screen/input", std::move(body), kJson,
              {milliseconds{0}, false});
}

SandboxRequest vnc(std::string_view id) {
  // Idempotent: the same endpoint while it lasts.
  return make(id, "POST", "/screen/vnc", "POST /v1/sandboxes/{id}/screen/vnc", "{}", kJson);
}

SandboxRequest stop_vnc(std::string_view id) {
  return make(id, "DELETE", "/screen/vnc", "DELETE /v1/sandboxes/{id}/screen/vnc");
}

SandboxRequest write_file(std::string_view id, std::string_view path, std::string_view data, unsigned mode) {
  if (mode > 07777) throw Error(Code::kInvalidArgument, fmt::format("mode: {:#o} is above 07777", mode));
  return with_bytes(make(id, "PUT", fmt::format("/files?path={}&mode={:04o}", url_escape(path), mode),
                         "PUT /v1/sandboxes/{id}/files", {}, kOctets),
                    data);
}

SandboxRequest read_file(std::string_view id, std::string_view path) {
  return make(id, "GET", fmt::format("/files?path={}", url_escape(path)), "GET /v1/sandboxes/{id}/files");
}

SandboxRequest upload_tar(std::string_view id, std::string_view dir, std::string_view tar_bytes) {
  return with_bytes(
      make(id, "PUT", fmt::format("/files?path={}", url_escape(dir)), "PUT /v1/sandboxes/{id}/files", {}, kTar),
      tar_bytes);
}

SandboxRequest download_tar(std::string_view id, std::string_view dir) {
  return make(id, "GET", fmt::format("/files?path={}&format=tar", url_escape(dir)),
              "GET /v1/sandboxes/{id}/files?format=tar");
}

SandboxRequest exec(std::string_view id, const ExecRequest& request, bool stream) {
  protocol::validate(request);  // the agent's own checks: a malformed request fails before it costs a round trip
  // Exactly once on the agent by its request id (one is made when the caller gave none), so retries are safe.
  std::string request_id = request.request_id.empty() ? random_request_id() : request.request_id;
  json body = protocol::encode(request);
  body["request_id"] = request_id;
  if (stream) protocol::set_exec_stream(body);
  return make(id, "POST", "/exec", "POST /v1/sandboxes/{id}/exec", body.dump(), kJson,
              {wait_time(request.timeout_seconds), true, std::move(request_id)});
}

SandboxRequest session_run(std::string_view id, std::string_view name, std::string_view command, double timeout_seconds,
                           std::size_t max_output, bool stream) {
  // Exactly once on the agent by a request id of its own, so a retry never runs the command twice in the shell.
  std::string request_id = random_request_id();
  json body = protocol::encode_session_run(command, timeout_seconds, max_output, stream);
  body["request_id"] = request_id;
  return make(id, "POST", session_suffix(name, "/run"), "POST /v1/sandboxes/{id}/sessions/{name}/run", body.dump(),
              kJson, {wait_time(timeout_seconds), true, std::move(request_id)});
}

SandboxRequest open_session(std::string_view id, const SessionOptions& options) {
  // Not retried once the agent may have it: a second attempt would start a second shell (or find the name taken).
  return make(id, "POST", "/sessions", "POST /v1/sandboxes/{id}/sessions", protocol::encode(options).dump(), kJson,
              {milliseconds{0}, false});
}

SandboxRequest sessions(std::string_view id) { return make(id, "GET", "/sessions", "GET /v1/sandboxes/{id}/sessions"); }

SandboxRequest session_info(std::string_view id, std::string_view name) {
  return make(id, "GET", session_suffix(name), "GET /v1/sandboxes/{id}/sessions/{name}");
}

SandboxRequest restart_session(std::string_view id, std::string_view name) {
  // Not retried once the agent may have it: a second restart would throw away the shell the first one started.
  return make(id, "POST", session_suffix(name, "/restart"), "POST /v1/sandboxes/{id}/sessions/{name}/restart", "{}",
              kJson, {milliseconds{0}, false});
}

SandboxRequest close_session(std::string_view id, std::string_view name) {
  return make(id, "DELETE", session_suffix(name), "DELETE /v1/sandboxes/{id}/sessions/{name}");
}

SandboxRequest spawn(std::string_view id, const ProcessRequest& request) {
  // Exactly-once on the agent by its request id (one is made when the caller gave none): a retry after a lost
  // answer gets the first spawn's process, never a second one.
  json body = protocol::encode(request);
  std::string request_id = request.request_id.empty() ? random_request_id() : request.request_id;
  body["request_id"] = request_id;
  return make(id, "POST", "/processes", "POST /v1/sandboxes/{id}/processes", body.dump(), kJson,
              {milliseconds{0}, true, std::move(request_id)});
}

SandboxRequest processes(std::string_view id) {
  return make(id, "GET", "/processes", "GET /v1/sandboxes/{id}/processes");
}

SandboxRequest process_info(std::string_view id, int pid) {
  return make(id, "GET", process_suffix(pid), "GET /v1/sandboxes/{id}/processes/{pid}");
}

SandboxRequest process_wait(std::string_view id, int pid, double wait_seconds) {
  return make(id, "GET", process_suffix(pid, wait_seconds > 0 ? "?wait=" + protocol::query_seconds(wait_seconds) : ""),
              "GET /v1/sandboxes/{id}/processes/{pid}?wait", {}, {}, {wait_time(wait_seconds), true});
}

void check_process_wait(double seconds) {
  if (std::isnan(seconds) || seconds > protocol::kMaxProcessWait)
    throw Error(Code::kInvalidArgument,
                fmt::format("wait: at most {} seconds, got {}", protocol::kMaxProcessWait, seconds));
}

SandboxRequest process_output(std::string_view id, int pid, std::optional<std::uint64_t> stdout_offset,
                              std::optional<std::uint64_t> stderr_offset, double wait_seconds, std::size_t max_bytes) {
  check_process_wait(wait_seconds);
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
  return make(id, "GET", process_suffix(pid, "/output" + query), "GET /v1/sandboxes/{id}/processes/{pid}/output", {},
              {}, {wait_time(wait_seconds), true});
}

SandboxRequest write_stdin(std::string_view id, int pid, std::string_view data) {
  std::string request_id = random_request_id();
  return with_bytes(
      make(id, "POST", process_suffix(pid, "/stdin?request_id=" + request_id),
           "POST /v1/sandboxes/{id}/processes/{pid}/stdin", {}, kOctets, {milliseconds{0}, true, request_id}),
      data);
}

SandboxRequest close_stdin(std::string_view id, int pid) {
  std::string request_id = random_request_id();
  return make(id, "POST", process_suffix(pid, "/stdin?close=true&request_id=" + request_id),
              "POST /v1/sandboxes/{id}/processes/{pid}/stdin?close", {}, kOctets, {milliseconds{0}, true, request_id});
}

SandboxRequest signal(std::string_view id, int pid, int sig, bool group) {
  if (sig < 0) throw Error(Code::kInvalidArgument, fmt::format("signal: {} is not a signal number", sig));
  std::string request_id = random_request_id();
  return make(id, "POST", process_suffix(pid, "/signal"), "POST /v1/sandboxes/{id}/processes/{pid}/signal",
              json{{"signal", sig}, {"group", group}, {"request_id", request_id}}.dump(), kJson,
              {milliseconds{0}, true, request_id});
}

SandboxRequest resize(std::string_view id, int pid, unsigned rows, unsigned cols) {
  protocol::check_terminal_size(rows, cols);
  // The same size twice is the same state: retried like a read.
  return make(id, "POST", process_suffix(pid, "/resize"), "POST /v1/sandboxes/{id}/processes/{pid}/resize",
              json{{"rows", rows}, {"cols", cols}}.dump(), kJson);
}

SandboxRequest kill(std::string_view id, int pid) {
  return make(id, "DELETE", process_suffix(pid), "DELETE /v1/sandboxes/{id}/processes/{pid}");
}

}  // namespace requests

namespace answers {

SandboxInfo sandbox_info(const HttpResponse& r, std::string_view what) {
  return protocol::decode_sandbox_info(parse_json(r, what));
}

std::vector<SandboxInfo> sandbox_list(const HttpResponse& r, std::string_view what) {
  auto j = parse_json(r, what);
  auto it = j.find("sandboxes");
  if (it == j.end() || !it->is_array())
    throw Error(Code::kInternal, fmt::format("{}: the agent's answer has no \"sandboxes\" array", what));
  std::vector<SandboxInfo> out;
  out.reserve(it->size());
  for (const auto& s : *it) out.push_back(protocol::decode_sandbox_info(s));
  return out;
}

ExecResult exec_result(const HttpResponse& r, std::string_view what) {
  return protocol::decode_exec_result(parse_json(r, what));
}

SleepResult sleep_result(const HttpResponse& r, bool sleep) {
  const char* what = sleep ? "POST /v1/sandboxes/{id}/sleep" : "POST /v1/sandboxes/{id}/wake";
  json j = parse_json(r, what);
  SleepResult out;
  out.info = protocol::decode_sandbox_info(j);
  try {
    out.memory_before_bytes = j.at("memory_before_bytes").get<std::uint64_t>();
    out.memory_after_bytes = j.at("memory_after_bytes").get<std::uint64_t>();
    out.memory_released_bytes = j.at("memory_released_bytes").get<std::uint64_t>();
    out.seconds = j.at("seconds").get<double>();
    out.swap_bytes = j.value("swap_bytes", std::uint64_t{0});
  } catch (const std::exception& e) {
    throw Error(Code::kInternal, fmt::format("{}: malformed answer: {}", what, e.what()));
  }
  return out;
}

std::string file(HttpResponse&& r, std::string_view path, std::string_view id) {
  if (r.content_type.starts_with(kTar))
    throw Error(Code::kInvalidArgument,
                fmt::format("{} in sandbox {} is a directory (download_tar reads a directory)", path, id));
  return std::move(r.body);
}

SessionInfo session_info(const HttpResponse& r, std::string_view what) {
  return protocol::decode_session_info(parse_json(r, what));
}

std::vector<SessionInfo> session_list(const HttpResponse& r, std::string_view what) {
  return protocol::decode_session_list(parse_json(r, what));
}

ProcessInfo process_info(const HttpResponse& r, std::string_view what) {
  return protocol::decode_process_info(parse_json(r, what));
}

std::vector<ProcessInfo> process_list(const HttpResponse& r, std::string_view what) {
  return protocol::decode_process_list(parse_json(r, what));
}

ProcessOutput process_output(const HttpResponse& r, std::string_view what, bool want_stdout, bool want_stderr) {
  ProcessOutput out = protocol::decode_process_output(parse_json(r, what));
  if (!want_stdout) out.stdout_data.clear(), out.stdout_offset = out.stdout_end = 0;
  if (!want_stderr) out.stderr_data.clear(), out.stderr_offset = out.stderr_end = 0;
  return out;
}

}  // namespace answers

}  // namespace dsec::detail
