#include "common/protocol/exec.hpp"

#include <fmt/format.h>

#include "common/protocol/body.hpp"
#include "common/protocol/sandbox.hpp"

#include "common/protocol/fields_internal.hpp"

namespace dsec::protocol {

using namespace fields;

json encode(const ExecRequest& r) {
  json j{{"env", r.env}, {"cwd", r.cwd}, {"timeout", r.timeout_seconds}, {"max_output", r.max_output_bytes}};
  if (!r.shell.empty()) j["shell"] = r.shell;
  else j["argv"] = r.argv;
  if (!r.stdin_data.empty()) j["stdin"] = base64_encode(r.stdin_data);
  if (!r.user.empty()) j["user"] = r.user;
  if (!r.request_id.empty()) j["request_id"] = r.request_id;
  return j;
}

ExecRequest decode_exec_request(const json& j) {
  if (!j.is_object()) bad("exec", "must be a JSON object");
  ExecRequest r;
  r.shell = get_string(j, "shell", "shell");
  if (const json* a = find(j, "argv")) {
    if (!a->is_array()) bad("argv", "must be an array of strings");
    for (const auto& x : *a) {
      if (!x.is_string()) bad("argv", "must be an array of strings");
      r.argv.push_back(x.get<std::string>());
    }
  }
  if (r.shell.empty() == r.argv.empty()) bad("argv", "give exactly one of a non-empty argv or shell");
  if (!r.argv.empty() && r.argv[0].empty()) bad("argv[0]", "must not be empty");
  for (const auto& a : r.argv)
    if (has_nul(a)) bad("argv", "arguments must not contain NUL");
  if (has_nul(r.shell)) bad("shell", "must not contain NUL");
  r.env = get_string_map(j, "env", "env");
  validate_env(r.env, "env");
  r.cwd = get_string(j, "cwd", "cwd");
  if (!r.cwd.empty() && (r.cwd.front() != '/' || has_nul(r.cwd))) bad("cwd", "must be an absolute path");
  if (const json* s = find(j, "stdin")) {
    if (!s->is_string()) bad("stdin", "must be a base64 string");
    r.stdin_data = base64_decode(s->get<std::string>());
  }
  r.timeout_seconds = get_number(j, "timeout", "timeout", r.timeout_seconds);
  if (!(r.timeout_seconds > 0) || r.timeout_seconds > kMaxExecTimeoutSeconds)
    bad("timeout", fmt::format("must be in (0, {}] seconds", kMaxExecTimeoutSeconds));
  r.max_output_bytes = get_unsigned(j, "max_output", "max_output", r.max_output_bytes);
  if (r.max_output_bytes > kMaxOutputBytes) bad("max_output", "at most 1 GiB");
  r.user = get_string(j, "user", "user");
  (void)parse_user(r.user, "user");
  r.request_id = get_string(j, "request_id", "request_id");
  validate_request_id(r.request_id);
  return r;
}

void validate(const ExecRequest& r) {
  if (r.shell.empty()) {
    if (r.argv.empty()) bad("argv", "give exactly one of a non-empty argv or shell");
    if (r.argv[0].empty()) bad("argv[0]", "must not be empty");
    for (const auto& a : r.argv)
      if (has_nul(a)) bad("argv", "arguments must not contain NUL");
  }
  if (has_nul(r.shell)) bad("shell", "must not contain NUL");
  validate_env(r.env, "env");
  if (!r.cwd.empty() && (r.cwd.front() != '/' || has_nul(r.cwd))) bad("cwd", "must be an absolute path");
  if (!(r.timeout_seconds > 0) || r.timeout_seconds > kMaxExecTimeoutSeconds)
    bad("timeout", fmt::format("must be in (0, {}] seconds", kMaxExecTimeoutSeconds));
  if (r.max_output_bytes > kMaxOutputBytes) bad("max_output", "at most 1 GiB");
  (void)parse_user(r.user, "user");
  validate_request_id(r.request_id);
}

json encode(const ExecResult& r) {
  json j = encode_run_outcome(r);
  j["duration"] = r.duration_seconds;
  if (!r.reason.empty()) j["reason"] = r.reason;
  if (r.oom_killed) j["oom_killed"] = true;
  return j;
}

ExecResult decode_exec_result(const json& j) {
  expect_object(j, "exec result");
  ExecResult r;
  decode_run_outcome(j, r);
  r.duration_seconds = member(j, "duration", 0.0);
  r.reason = member(j, "reason", "");
  r.oom_killed = member(j, "oom_killed", false);
  return r;
}

void set_exec_stream(json& body) { body["stream"] = true; }

bool exec_streams(const json& body) {
  if (!body.is_object()) return false;
  auto it = body.find("stream");
  if (it == body.end() || it->is_null()) return false;
  if (!it->is_boolean()) throw Error(Code::kInvalidArgument, "stream: must be true or false");
  return it->get<bool>();
}

}  // namespace dsec::protocol
