#include "common/protocol/process.hpp"

#include <cctype>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#include <fmt/format.h>

#include "common/protocol/exec.hpp"
#include "dsec/error.hpp"

namespace dsec::detail {
namespace {

using protocol::json;

[[noreturn]] void bad(std::string_view field, std::string_view why) {
  throw Error(Code::kInvalidArgument, fmt::format("{}: {}", field, why));
}

[[noreturn]] void malformed(std::string_view what, std::string_view key, std::string_view why) {
  throw Error(Code::kDataLoss, fmt::format("the agent's {} is malformed: \"{}\" {}", what, key, why));
}

// argv or shell, env, cwd and user, checked by the rules exec holds them to (the agent applies the same ones to a
// spawn and a session), as exec's JSON has them.
json command_fields(ExecRequest request) {
  if (!request.argv.empty() && !request.shell.empty()) bad("argv", "give exactly one of a non-empty argv or shell");
  json j = protocol::encode(request);
  protocol::decode_exec_request(j);
  j.erase("timeout");
  j.erase("max_output");
  return j;
}

const json& object_of(const json& j, std::string_view what) {
  if (!j.is_object()) throw Error(Code::kDataLoss, fmt::format("the agent's {} is not a JSON object", what));
  return j;
}

// j[key] as a T, `fallback` when absent or null; DATA_LOSS when it has another type.
template <typename T>
T member(const json& j, std::string_view what, const char* key, T fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  bool fits;
  if constexpr (std::is_same_v<T, bool>) fits = it->is_boolean();
  else if constexpr (std::is_same_v<T, std::string>) fits = it->is_string();
  else if constexpr (std::is_floating_point_v<T>) fits = it->is_number();
  else if constexpr (std::is_unsigned_v<T>) fits = it->is_number_unsigned() || (it->is_number_integer() && *it >= 0);
  else fits = it->is_number_integer();
  if (!fits) malformed(what, key, fmt::format("has the wrong type ({})", it->type_name()));
  return it->get<T>();
}

std::string bytes_member(const json& j, std::string_view what, const char* key) {
  try {
    return protocol::base64_decode(member<std::string>(j, what, key, ""));
  } catch (const Error& e) {
    if (e.code() == Code::kDataLoss) throw;
    malformed(what, key, fmt::format("is not base64: {}", e.what()));
  }
}

template <typename T, typename Decode>
std::vector<T> list_of(const json& j, const char* key, std::string_view what, Decode&& decode) {
  const auto& o = object_of(j, what);
  auto it = o.find(key);
  if (it == o.end() || !it->is_array()) malformed(what, key, "is not an array");
  std::vector<T> out;
  out.reserve(it->size());
  for (const auto& item : *it) out.push_back(decode(item));
  return out;
}

bool valid_session_name(std::string_view name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  return true;
}

}  // namespace

void check_terminal_size(unsigned rows, unsigned cols) {
  for (auto [field, value] : {std::pair{"rows", rows}, std::pair{"cols", cols}})
    if (value < 1 || value > kMaxTerminalSide) bad(field, fmt::format("{} is not in 1 to {}", value, kMaxTerminalSide));
}

json encode(const ProcessRequest& r) {
  ExecRequest command;
  command.argv = r.argv;
  command.shell = r.shell;
  command.env = r.env;
  command.cwd = r.cwd;
  command.user = r.user;
  json j = command_fields(std::move(command));
  if (r.pty) {
    check_terminal_size(r.rows, r.cols);
    j["pty"] = true;
    j["rows"] = r.rows;
    j["cols"] = r.cols;
  }
  if (r.tag.size() > kMaxProcessTag) bad("tag", fmt::format("{} bytes, at most {}", r.tag.size(), kMaxProcessTag));
  if (r.tag.find('\0') != std::string::npos) bad("tag", "must not contain NUL");
  if (!r.tag.empty()) j["tag"] = r.tag;
  if (r.request_id.size() > 128 || r.request_id.find('\0') != std::string::npos)
    bad("request_id", "at most 128 bytes, no NUL");
  return j;
}

json encode(const SessionOptions& o) {
  ExecRequest context;
  context.shell = ":";
  context.env = o.env;
  context.cwd = o.cwd;
  context.user = o.user;
  json j = command_fields(std::move(context));
  j.erase("shell");
  if (!o.name.empty()) {
    if (!valid_session_name(o.name))
      bad("name", fmt::format("'{}' is not a session name (1 to 64 letters, digits, '.', '_', '-')", o.name));
    j["name"] = o.name;
  }
  if (o.shell.find('\0') != std::string::npos) bad("shell", "must not contain NUL");
  if (!o.shell.empty()) j["shell"] = o.shell;
  return j;
}

json encode_session_run(std::string_view command, double timeout_seconds, std::size_t max_output, bool stream) {
  if (command.find('\0') != std::string_view::npos) bad("command", "must not contain NUL");
  if (!(timeout_seconds > 0) || timeout_seconds > 86400 * 7) bad("timeout", "must be in (0, 604800] seconds");
  if (max_output > (std::size_t{1} << 30)) bad("max_output", "at most 1 GiB");
  return json{{"command", command}, {"timeout", timeout_seconds}, {"max_output", max_output}, {"stream", stream}};
}

ProcessInfo decode_process_info(const json& j) {
  constexpr std::string_view what = "process info";
  const auto& o = object_of(j, what);
  ProcessInfo p;
  p.pid = member(o, what, "pid", -1);
  // pid 0: a command that could not start for what it names (a result, with its reason and message).
  if (p.pid < 0 || (p.pid == 0 && member<std::string>(o, what, "reason", "").empty()))
    malformed(what, "pid", "is missing or not a pid");
  if (auto it = o.find("argv"); it != o.end() && !it->is_null()) {
    if (!it->is_array()) malformed(what, "argv", "is not an array");
    for (const auto& a : *it) {
      if (!a.is_string()) malformed(what, "argv", "holds a value that is not a string");
      p.argv.push_back(a.get<std::string>());
    }
  }
  p.tag = member<std::string>(o, what, "tag", "");
  p.pty = member(o, what, "pty", false);
  p.running = member(o, what, "running", false);
  p.exit_code = member(o, what, "exit_code", -1);
  p.signal = member(o, what, "signal", 0);
  p.reason = member<std::string>(o, what, "reason", "");
  p.started_at = member(o, what, "started_at", 0.0);
  p.ended_at = member(o, what, "ended_at", 0.0);
  p.stdout_bytes = member<std::uint64_t>(o, what, "stdout_bytes", 0);
  p.stderr_bytes = member<std::uint64_t>(o, what, "stderr_bytes", 0);
  p.stdin_open = member(o, what, "stdin_open", false);
  p.message = member<std::string>(o, what, "message", "");
  return p;
}

std::vector<ProcessInfo> decode_process_list(const json& j) {
  return list_of<ProcessInfo>(j, "processes", "process list", decode_process_info);
}

ProcessOutput decode_process_output(const json& j) {
  constexpr std::string_view what = "process output";
  const auto& o = object_of(j, what);
  ProcessOutput out;
  out.stdout_data = bytes_member(o, what, "stdout");
  out.stderr_data = bytes_member(o, what, "stderr");
  out.stdout_offset = member<std::uint64_t>(o, what, "stdout_offset", 0);
  out.stderr_offset = member<std::uint64_t>(o, what, "stderr_offset", 0);
  out.stdout_end = member<std::uint64_t>(o, what, "stdout_end", 0);
  out.stderr_end = member<std::uint64_t>(o, what, "stderr_end", 0);
  out.running = member(o, what, "running", false);
  out.exit_code = member(o, what, "exit_code", -1);
  out.signal = member(o, what, "signal", 0);
  if (out.stdout_offset + out.stdout_data.size() > out.stdout_end)
    malformed(what, "stdout_end", "is before the end of the bytes it answered");
  if (out.stderr_offset + out.stderr_data.size() > out.stderr_end)
    malformed(what, "stderr_end", "is before the end of the bytes it answered");
  return out;
}

SessionInfo decode_session_info(const json& j) {
  constexpr std::string_view what = "session info";
  const auto& o = object_of(j, what);
  SessionInfo s;
  s.name = member<std::string>(o, what, "name", "");
  if (s.name.empty()) malformed(what, "name", "is missing");
  s.shell = member<std::string>(o, what, "shell", "");
  s.pid = member(o, what, "pid", 0);
  s.alive = member(o, what, "alive", false);
  s.busy = member(o, what, "busy", false);
  s.exit_code = member(o, what, "exit_code", -1);
  s.signal = member(o, what, "signal", 0);
  return s;
}

std::vector<SessionInfo> decode_session_list(const json& j) {
  return list_of<SessionInfo>(j, "sessions", "session list", decode_session_info);
}

std::string query_seconds(double seconds) {
  if (!(seconds > 0)) return "0";
  const auto ms = static_cast<std::int64_t>(std::llround(seconds * 1000.0));
  if (ms % 1000 == 0) return fmt::format("{}", ms / 1000);
  std::string out = fmt::format("{}.{:03}", ms / 1000, ms % 1000);
  while (out.back() == '0') out.pop_back();
  return out;
}

}  // namespace dsec::detail
