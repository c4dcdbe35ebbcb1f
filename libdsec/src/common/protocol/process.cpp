#include "common/protocol/process.hpp"

#include <signal.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <type_traits>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/protocol/exec.hpp"
#include "dsec/error.hpp"

namespace dsec::protocol {
namespace {

[[noreturn]] void bad(std::string_view field, std::string_view why) {
  throw Error(Code::kInvalidArgument, fmt::format("{}: {}", field, why));
}

[[noreturn]] void malformed(std::string_view what, std::string_view key, std::string_view why) {
  throw Error(Code::kDataLoss, fmt::format("the agent's {} is malformed: \"{}\" {}", what, key, why));
}

// argv or shell, env, cwd and user, checked by the rules exec holds them to (the agent applies the same ones to a
// spawn and a session), as exec's JSON has them.
json command_fields(const ExecRequest& request) {
  if (!request.argv.empty() && !request.shell.empty()) bad("argv", "give exactly one of a non-empty argv or shell");
  json j = encode(request);
  decode_exec_request(j);
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
    return base64_decode(member<std::string>(j, what, key, ""));
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

// A request's body: an object (null is an empty one) holding only fields of `known`.
json known_fields(const json& j, std::initializer_list<std::string_view> known) {
  json body = j.is_null() ? json::object() : j;
  if (!body.is_object()) bad("body", "must be a JSON object");
  for (const auto& [key, value] : body.items())
    if (std::find(known.begin(), known.end(), key) == known.end())
      bad(key, fmt::format("is not a field of this request (known: {})", fmt::join(known, ", ")));
  return body;
}

template <typename T>
T number_field(const json& body, const char* key, T fallback, T low, T high) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return fallback;
  if (!it->is_number()) bad(key, "must be a number");
  double v = it->get<double>();
  if (!(v >= static_cast<double>(low) && v <= static_cast<double>(high)))
    bad(key, fmt::format("must be in [{}, {}]", low, high));
  if constexpr (std::is_integral_v<T>)
    if (v != std::floor(v)) bad(key, "must be a whole number");
  return static_cast<T>(v);
}

std::string string_field(const json& body, const char* key, std::size_t max_bytes) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return {};
  if (!it->is_string()) bad(key, "must be a string");
  std::string v = it->get<std::string>();
  if (v.size() > max_bytes) bad(key, fmt::format("at most {} bytes", max_bytes));
  if (v.find('\0') != std::string::npos) bad(key, "must not contain NUL");
  return v;
}

bool bool_field(const json& body, const char* key) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return false;
  if (!it->is_boolean()) bad(key, "must be true or false");
  return it->get<bool>();
}

// The command fields of a spawn or a session (argv or shell, env, cwd, user), decoded as an exec's are.
ExecRequest command_of(const json& body, json command) {
  for (const char* k : {"argv", "shell", "env", "cwd", "user"})
    if (body.contains(k)) command[k] = body[k];
  return decode_exec_request(command);
}

int signal_number(const json& v) {
  static constexpr std::pair<std::string_view, int> kNames[] = {
      {"HUP", SIGHUP},   {"INT", SIGINT},   {"QUIT", SIGQUIT}, {"KILL", SIGKILL}, {"TERM", SIGTERM},
      {"USR1", SIGUSR1}, {"USR2", SIGUSR2}, {"STOP", SIGSTOP}, {"CONT", SIGCONT}, {"WINCH", SIGWINCH},
      {"ALRM", SIGALRM}, {"PIPE", SIGPIPE}, {"TSTP", SIGTSTP}, {"ABRT", SIGABRT}};
  if (v.is_number_integer()) {
    int n = v.get<int>();
    if (n >= 1 && n < NSIG) return n;
  } else if (v.is_string()) {
    std::string_view name = v.get_ref<const std::string&>();
    if (name.rfind("SIG", 0) == 0) name.remove_prefix(3);
    for (auto [n, sig] : kNames)
      if (n == name) return sig;
  }
  bad("signal", "must be a signal number (1 to 64) or a name such as \"SIGTERM\"");
}

// A command that could not start for what it names: a process that ended at once, kept nowhere.
json encode_never_started(const ProcessInfo& p) {
  return json{{"pid", 0},          {"argv", p.argv},     {"tag", ""},
              {"pty", false},      {"running", false},   {"exit_code", p.exit_code},
              {"signal", 0},       {"reason", p.reason}, {"message", p.message},
              {"started_at", 0},   {"ended_at", 0},      {"stdout_bytes", 0},
              {"stderr_bytes", 0}, {"stdin_open", false}};
}

}  // namespace

void check_terminal_size(unsigned rows, unsigned cols) {
  for (auto [field, value] : {std::pair{"rows", rows}, std::pair{"cols", cols}})
    if (value < 1 || value > kMaxTerminalSide) bad(field, fmt::format("{} is not in 1 to {}", value, kMaxTerminalSide));
}

void check_session_name(std::string_view name) {
  const bool ok =
      !name.empty() && name.size() <= kMaxSessionNameBytes && std::all_of(name.begin(), name.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
      });
  if (!ok)
    bad("name", fmt::format("'{}' is not a session name (1 to {} letters, digits, '.', '_', '-')", name.substr(0, 100),
                            kMaxSessionNameBytes));
}

json encode(const ProcessRequest& r) {
  ExecRequest command;
  command.argv = r.argv;
  command.shell = r.shell;
  command.env = r.env;
  command.cwd = r.cwd;
  command.user = r.user;
  json j = command_fields(command);
  if (r.pty) {
    check_terminal_size(r.rows, r.cols);
    j["pty"] = true;
    j["rows"] = r.rows;
    j["cols"] = r.cols;
  }
  if (r.tag.size() > kMaxProcessTag) bad("tag", fmt::format("{} bytes, at most {}", r.tag.size(), kMaxProcessTag));
  if (r.tag.find('\0') != std::string::npos) bad("tag", "must not contain NUL");
  if (!r.tag.empty()) j["tag"] = r.tag;
  if (r.request_id.size() > kMaxRequestIdBytes || r.request_id.find('\0') != std::string::npos)
    bad("request_id", fmt::format("at most {} bytes, no NUL", kMaxRequestIdBytes));
  return j;
}

json encode(const SessionOptions& o) {
  ExecRequest context;
  context.shell = ":";
  context.env = o.env;
  context.cwd = o.cwd;
  context.user = o.user;
  json j = command_fields(context);
  j.erase("shell");
  if (!o.name.empty()) {
    check_session_name(o.name);
    j["name"] = o.name;
  }
  if (o.shell.find('\0') != std::string::npos) bad("shell", "must not contain NUL");
  if (!o.shell.empty()) j["shell"] = o.shell;
  return j;
}

json encode_session_run(std::string_view command, double timeout_seconds, std::size_t max_output, bool stream) {
  if (command.find('\0') != std::string_view::npos) bad("command", "must not contain NUL");
  if (!(timeout_seconds > 0) || timeout_seconds > kMaxExecTimeoutSeconds)
    bad("timeout", fmt::format("must be in (0, {}] seconds", kMaxExecTimeoutSeconds));
  if (max_output > kMaxOutputBytes) bad("max_output", "at most 1 GiB");
  return json{{"command", command}, {"timeout", timeout_seconds}, {"max_output", max_output}, {"stream", stream}};
}

ProcessRequest decode_process_request(const json& j) {
  const json body =
      known_fields(j, {"argv", "shell", "env", "cwd", "user", "pty", "rows", "cols", "tag", "request_id"});
  ProcessRequest r;
  r.request_id = string_field(body, "request_id", kMaxRequestIdBytes);
  r.pty = bool_field(body, "pty");
  r.rows = number_field<unsigned>(body, "rows", 24, 1, kMaxTerminalSide);
  r.cols = number_field<unsigned>(body, "cols", 80, 1, kMaxTerminalSide);
  r.tag = string_field(body, "tag", kMaxProcessTag);
  ExecRequest command = command_of(body, json::object());
  r.argv = std::move(command.argv);
  r.shell = std::move(command.shell);
  r.env = std::move(command.env);
  r.cwd = std::move(command.cwd);
  r.user = std::move(command.user);
  return r;
}

SessionOptions decode_session_options(const json& j) {
  const json body = known_fields(j, {"name", "shell", "env", "cwd", "user"});
  SessionOptions o;
  o.name = string_field(body, "name", kMaxSessionNameBytes);
  if (!o.name.empty()) check_session_name(o.name);
  o.shell = string_field(body, "shell", kMaxPathBytes);
  if (!o.shell.empty() && o.shell.front() != '/') bad("shell", "must be an absolute path");
  // env, cwd and user are checked as an exec's are.
  json context = body;
  context.erase("shell");
  ExecRequest checked = command_of(context, json{{"argv", json::array({"sh"})}});
  o.env = std::move(checked.env);
  o.cwd = std::move(checked.cwd);
  o.user = std::move(checked.user);
  return o;
}

SessionRunRequest decode_session_run(const json& j) {
  const json body = known_fields(j, {"command", "timeout", "max_output", "stream", "request_id"});
  SessionRunRequest r;
  auto it = body.find("command");
  if (it == body.end() || !it->is_string()) bad("command", "must be a string of shell text");
  r.command = it->get<std::string>();
  if (r.command.find('\0') != std::string::npos) bad("command", "must not contain NUL");
  r.timeout_seconds = number_field<double>(body, "timeout", 600, 0, kMaxExecTimeoutSeconds);
  if (!(r.timeout_seconds > 0)) bad("timeout", fmt::format("must be in (0, {}] seconds", kMaxExecTimeoutSeconds));
  r.max_output_bytes = number_field<std::size_t>(body, "max_output", 16u << 20, 0, kMaxOutputBytes);
  r.request_id = string_field(body, "request_id", kMaxRequestIdBytes);
  r.stream = bool_field(body, "stream");
  return r;
}

SignalRequest decode_signal_request(const json& j) {
  const json body = known_fields(j, {"signal", "group", "request_id"});
  if (!body.contains("signal")) bad("signal", "missing");
  SignalRequest r;
  r.signal = signal_number(body.at("signal"));
  r.request_id = string_field(body, "request_id", kMaxRequestIdBytes);
  r.group = bool_field(body, "group");
  return r;
}

TerminalSize decode_resize_request(const json& j) {
  const json body = known_fields(j, {"rows", "cols"});
  if (!body.contains("rows") || !body.contains("cols")) bad("rows", "give rows and cols");
  TerminalSize size;
  size.rows = number_field<unsigned>(body, "rows", 24, 1, kMaxTerminalSide);
  size.cols = number_field<unsigned>(body, "cols", 80, 1, kMaxTerminalSide);
  return size;
}

json encode(const ProcessInfo& p, std::optional<TerminalSize> terminal) {
  if (p.pid == 0) return encode_never_started(p);
  json j{{"pid", p.pid},
         {"argv", p.argv},
         {"tag", p.tag},
         {"pty", p.pty},
         {"reason", p.reason},
         {"started_at", p.started_at},
         {"ended_at", p.ended_at},
         {"stdout_bytes", p.stdout_bytes},
         {"stderr_bytes", p.stderr_bytes},
         {"stdin_open", p.stdin_open},
         {"running", p.running},
         {"exit_code", p.exit_code},
         {"signal", p.signal}};
  if (terminal) {
    j["rows"] = terminal->rows;
    j["cols"] = terminal->cols;
  }
  return j;
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

json encode_process_list(json encoded_processes) { return json{{"processes", std::move(encoded_processes)}}; }

std::vector<ProcessInfo> decode_process_list(const json& j) {
  return list_of<ProcessInfo>(j, "processes", "process list", decode_process_info);
}

json encode(const ProcessOutput& o) {
  return json{{"stdout", base64_encode(o.stdout_data)},
              {"stdout_offset", o.stdout_offset},
              {"stderr", base64_encode(o.stderr_data)},
              {"stderr_offset", o.stderr_offset},
              {"stdout_end", o.stdout_end},
              {"stderr_end", o.stderr_end},
              {"running", o.running},
              {"exit_code", o.exit_code},
              {"signal", o.signal}};
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

json encode(const SessionInfo& s) {
  json j{{"name", s.name}, {"shell", s.shell}, {"pid", s.pid}, {"alive", s.alive}, {"busy", s.busy}};
  if (!s.alive) {
    j["exit_code"] = s.exit_code;
    j["signal"] = s.signal;
  }
  return j;
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

json encode(const std::vector<SessionInfo>& sessions) {
  json list = json::array();
  for (const auto& s : sessions) list.push_back(encode(s));
  return json{{"sessions", std::move(list)}};
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

}  // namespace dsec::protocol
