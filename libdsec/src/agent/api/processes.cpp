// The router's room for processes and shell sessions (docs/protocol.md, "Processes" and "Shell sessions"):
// decoding their requests into calls on the sandbox's Processes and the node's ShellSessions, and encoding what
// those answer.
#include <signal.h>
#include <sys/wait.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>

#include "agent/api/router.hpp"
#include "agent/api/router_internal.hpp"
#include "image/store/digest.hpp"

namespace dsec::agent {
namespace http = boost::beast::http;
using protocol::json;

namespace {

using process_protocol::kSkip;

[[noreturn]] void bad(std::string_view field, std::string_view what) {
  throw Error(Code::kInvalidArgument, fmt::format("{}: {}", field, what));
}

json body_object(const HttpRequest& request, std::initializer_list<std::string_view> known) {
  json body = protocol::parse_body(request.body());
  if (body.is_null()) body = json::object();
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

bool bool_param(const Query& query, std::string_view key) {
  auto v = query.get(key);
  if (!v) return false;
  if (*v == "true" || *v == "1" || v->empty()) return true;
  if (*v == "false" || *v == "0") return false;
  bad(key, "must be true or false");
}

std::uint64_t offset_param(const Query& query, std::string_view key) {
  auto v = query.get(key);
  if (!v) return kSkip;
  std::uint64_t n = 0;
  auto [ptr, ec] = std::from_chars(v->data(), v->data() + v->size(), n);
  if (ec != std::errc() || ptr != v->data() + v->size() || n == kSkip) bad(key, "must be a byte offset (0, 1, ...)");
  return n;
}

std::chrono::milliseconds wait_param(const Query& query) {
  auto v = query.get("wait");
  if (!v) return {};
  double seconds = -1;
  try {
    std::size_t used = 0;
    seconds = std::stod(*v, &used);
    if (used != v->size()) seconds = -1;
  } catch (const std::exception&) {
  }
  if (!(seconds >= 0 && seconds <= 300)) bad("wait", "must be 0 to 300 seconds");
  return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
}

int pid_of(const Target& target) {
  int pid = 0;
  auto [ptr, ec] = std::from_chars(target.item.data(), target.item.data() + target.item.size(), pid);
  if (ec != std::errc() || ptr != target.item.data() + target.item.size() || pid <= 0)
    throw Error(Code::kNotFound, fmt::format("sandbox {} has no process '{}' (a process's id is its pid, a number)",
                                             target.sandbox_id, target.item.substr(0, 64)));
  return pid;
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

void put_exit(json& j, bool running, int wait_status) {
  int exit_code = -1, sig = 0;
  if (!running) {
    if (WIFEXITED(wait_status)) exit_code = WEXITSTATUS(wait_status);
    else if (WIFSIGNALED(wait_status)) sig = WTERMSIG(wait_status);
  }
  j["running"] = running;
  j["exit_code"] = exit_code;
  j["signal"] = sig;
}

json encode_process(const ProcessEntry& e) {
  json j{{"pid", e.pid},
         {"argv", e.argv},
         {"tag", e.meta},
         {"pty", e.pty},
         {"reason", ""},
         {"started_at", static_cast<double>(e.started_ms) / 1000},
         {"ended_at", static_cast<double>(e.ended_ms) / 1000},
         {"stdout_bytes", e.stdout_end},
         {"stderr_bytes", e.stderr_end},
         {"stdin_open", e.stdin_open}};
  put_exit(j, e.running, e.wait_status);
  if (e.pty) {
    j["rows"] = e.rows;
    j["cols"] = e.cols;
  }
  return j;
}

// A command that could not start for what it names: a process that ended at once, kept nowhere.
json encode_failed_start(const ExecRequest& command, const ExecResult& r) {
  json j{{"pid", 0},
         {"argv", command.argv.empty() ? std::vector<std::string>{"/bin/sh", "-c", command.shell} : command.argv},
         {"tag", ""},
         {"pty", false},
         {"running", false},
         {"exit_code", r.exit_code},
         {"signal", 0},
         {"reason", r.reason},
         {"message", r.stderr_data},
         {"started_at", 0},
         {"ended_at", 0},
         {"stdout_bytes", 0},
         {"stderr_bytes", 0},
         {"stdin_open", false}};
  return j;
}

json encode_session(const SessionInfo& s) {
  json j{{"name", s.name}, {"shell", s.shell}, {"pid", s.pid}, {"alive", s.alive}, {"busy", s.busy}};
  if (!s.alive) {
    j["exit_code"] = s.exit_code;
    j["signal"] = s.signal;
  }
  return j;
}

}  // namespace

Processes& Router::processes_of(const SandboxHandle& handle, const std::string& id) {
  Processes* p = handle.sandbox->processes();
  if (!p)
    throw Error(
        Code::kUnimplemented,
        fmt::format("sandbox {} is a {} sandbox, whose backend keeps no processes or sessions", id, handle.kind));
  return *p;
}

HttpResponse Router::processes(HttpRequest& request, const Target& target) {
  allow(request, "/v1/sandboxes/{id}/processes", {http::verb::get, http::verb::post});
  only_params(target.query, {});
  SandboxHandle handle = registry_.acquire(target.sandbox_id);
  Processes& procs = processes_of(handle, target.sandbox_id);
  if (request.method() == http::verb::get) {
    json list = json::array();
    for (const auto& e : procs.list())
      if (e.kind == process_protocol::Kind::kProcess) list.push_back(encode_process(e));
    return json_response(http::status::ok, json{{"processes", std::move(list)}});
  }
  json body = body_object(request, {"argv", "shell", "env", "cwd", "user", "pty", "rows", "cols", "tag", "request_id"});
  const std::string request_id = string_field(body, "request_id", 128);
  body.erase("request_id");
  SpawnOptions options;
  options.pty = bool_field(body, "pty");
  options.rows = number_field<unsigned>(body, "rows", 24, 1, process_protocol::kMaxTerminalSide);
  options.cols = number_field<unsigned>(body, "cols", 80, 1, process_protocol::kMaxTerminalSide);
  options.meta = string_field(body, "tag", 128);
  json command_fields = json::object();
  for (const char* k : {"argv", "shell", "env", "cwd", "user"})
    if (body.contains(k)) command_fields[k] = body[k];
  ExecRequest command = protocol::decode_exec_request(command_fields);
  // A retried spawn with the first one's id gets the first one's answer (its pid) and starts nothing.
  return json_response(http::status::ok, once(target.sandbox_id, "spawn/", request_id, body.dump(), [&] {
                         auto started = procs.spawn(command, options);
                         if (auto* failed = std::get_if<ExecResult>(&started))
                           return encode_failed_start(command, *failed);
                         return encode_process(std::get<ProcessEntry>(started));
                       }));
}

json Router::once(const std::string& sandbox_id, std::string_view kind, const std::string& request_id,
                  const std::string& request, const std::function<json()>& answer) {
  if (request_id.empty()) return answer();
  return registry_.exec_journal().run_once_json(sandbox_id, std::string(kind) + request_id,
                                                image::sha256_digest(request), answer);
}

HttpResponse Router::process(HttpRequest& request, const Target& target) {
  SandboxHandle handle = registry_.acquire(target.sandbox_id);
  Processes& procs = processes_of(handle, target.sandbox_id);
  const int pid = pid_of(target);
  auto check_kind = [&](const ProcessEntry& e) {
    // A session's shell is reached through its session.
    if (e.kind != process_protocol::Kind::kProcess)
      throw Error(Code::kNotFound, fmt::format("sandbox {} has no process {}", target.sandbox_id, pid));
    return e;
  };
  switch (target.route) {
    case Route::kSandboxProcess: {
      allow(request, "/v1/sandboxes/{id}/processes/{pid}", {http::verb::get, http::verb::delete_});
      if (request.method() == http::verb::delete_) {
        only_params(target.query, {});
        check_kind(procs.read(pid, kSkip, kSkip, 0, {}).entry);
        return json_response(http::status::ok, encode_process(procs.forget(pid)));
      }
      only_params(target.query, {"wait"});
      // With no output asked for, a read that waits answers once the process ends (or the wait passes).
      return json_response(
          http::status::ok,
          encode_process(check_kind(procs.read(pid, kSkip, kSkip, 0, wait_param(target.query)).entry)));
    }
    case Route::kSandboxProcessOutput: {
      allow(request, "/v1/sandboxes/{id}/processes/{pid}/output", {http::verb::get});
      only_params(target.query, {"stdout", "stderr", "wait", "max"});
      std::uint32_t max = process_protocol::kMaxReadBytes;
      if (auto m = target.query.get("max")) {
        std::uint64_t v = offset_param(target.query, "max");
        if (v == 0 || v > max) bad("max", fmt::format("must be 1 to {} bytes", max));
        max = static_cast<std::uint32_t>(v);
      }
      ProcessOutput got = procs.read(pid, offset_param(target.query, "stdout"), offset_param(target.query, "stderr"),
                                     max, wait_param(target.query));
      check_kind(got.entry);
      json j{{"stdout", protocol::base64_encode(got.stdout_data)},
             {"stdout_offset", got.stdout_offset},
             {"stderr", protocol::base64_encode(got.stderr_data)},
             {"stderr_offset", got.stderr_offset},
             {"stdout_end", got.entry.stdout_end},
             {"stderr_end", got.entry.stderr_end}};
      put_exit(j, got.entry.running, got.entry.wait_status);
      return json_response(http::status::ok, j);
    }
    case Route::kSandboxProcessStdin: {
      allow(request, "/v1/sandboxes/{id}/processes/{pid}/stdin", {http::verb::post});
      only_params(target.query, {"close", "request_id"});
      const std::string request_id = std::string(target.query.get("request_id").value_or(""));
      if (request_id.size() > 128) bad("request_id", "at most 128 bytes");
      if (request.body().size() > process_protocol::kStdinBuffer)
        bad("body", fmt::format("at most {} bytes per write", process_protocol::kStdinBuffer));
      const bool close = bool_param(target.query, "close");
      // A retried write with the first one's id writes nothing more: the bytes reach the process once.
      return json_response(http::status::ok, once(target.sandbox_id, fmt::format("stdin/{}/", pid), request_id,
                                                  fmt::format("{}\n{}", close, request.body()), [&] {
                                                    check_kind(procs.read(pid, kSkip, kSkip, 0, {}).entry);
                                                    procs.write_stdin(pid, request.body(), close);
                                                    return json{{"written", request.body().size()}};
                                                  }));
    }
    case Route::kSandboxProcessSignal: {
      allow(request, "/v1/sandboxes/{id}/processes/{pid}/signal", {http::verb::post});
      only_params(target.query, {});
      json body = body_object(request, {"signal", "group", "request_id"});
      if (!body.contains("signal")) bad("signal", "missing");
      int sig = signal_number(body["signal"]);
      const std::string request_id = string_field(body, "request_id", 128);
      body.erase("request_id");
      // A retried signal with the first one's id is not sent again (a second SIGINT can end what one would not).
      once(target.sandbox_id, fmt::format("signal/{}/", pid), request_id, body.dump(), [&] {
        check_kind(procs.read(pid, kSkip, kSkip, 0, {}).entry);
        procs.signal(pid, sig,
                     bool_field(body, "group") ? process_protocol::Scope::kGroup : process_protocol::Scope::kProcess);
        return json{{"signal", sig}};
      });
      return json_response(http::status::ok, encode_process(check_kind(procs.read(pid, kSkip, kSkip, 0, {}).entry)));
    }
    case Route::kSandboxProcessResize: {
      allow(request, "/v1/sandboxes/{id}/processes/{pid}/resize", {http::verb::post});
      only_params(target.query, {});
      json body = body_object(request, {"rows", "cols"});
      if (!body.contains("rows") || !body.contains("cols")) bad("rows", "give rows and cols");
      unsigned rows = number_field<unsigned>(body, "rows", 24, 1, process_protocol::kMaxTerminalSide);
      unsigned cols = number_field<unsigned>(body, "cols", 80, 1, process_protocol::kMaxTerminalSide);
      check_kind(procs.read(pid, kSkip, kSkip, 0, {}).entry);
      procs.resize(pid, rows, cols);
      return json_response(http::status::ok, encode_process(procs.read(pid, kSkip, kSkip, 0, {}).entry));
    }
    default:
      break;
  }
  throw Error(Code::kInternal, "unrouted process request");
}

HttpResponse Router::sessions(HttpRequest& request, const Target& target) {
  allow(request, "/v1/sandboxes/{id}/sessions", {http::verb::get, http::verb::post});
  only_params(target.query, {});
  SandboxHandle handle = registry_.acquire(target.sandbox_id);
  Processes& procs = processes_of(handle, target.sandbox_id);
  if (request.method() == http::verb::get) {
    json list = json::array();
    for (const auto& s : sessions_.list(target.sandbox_id, procs)) list.push_back(encode_session(s));
    return json_response(http::status::ok, json{{"sessions", std::move(list)}});
  }
  json body = body_object(request, {"name", "shell", "env", "cwd", "user"});
  SessionOptions options;
  options.name = string_field(body, "name", 64);
  if (!options.name.empty()) ShellSessions::check_name(options.name);
  options.shell = string_field(body, "shell", 4096);
  if (!options.shell.empty() && options.shell.front() != '/') bad("shell", "must be an absolute path");
  // env, cwd and user are checked as an exec's are.
  json command_fields{{"argv", json::array({"sh"})}};
  for (const char* k : {"env", "cwd", "user"})
    if (body.contains(k)) command_fields[k] = body[k];
  ExecRequest checked = protocol::decode_exec_request(command_fields);
  options.env = checked.env;
  options.cwd = checked.cwd;
  options.user = checked.user;
  return json_response(http::status::ok, encode_session(sessions_.open(target.sandbox_id, procs, options)));
}

HttpResponse Router::session(HttpRequest& request, const Target& target, ResponseStream* stream) {
  SandboxHandle handle = registry_.acquire(target.sandbox_id);
  Processes& procs = processes_of(handle, target.sandbox_id);
  const std::string& name = target.item;
  ShellSessions::check_name(name);
  switch (target.route) {
    case Route::kSandboxSession:
      allow(request, "/v1/sandboxes/{id}/sessions/{name}", {http::verb::get, http::verb::delete_});
      only_params(target.query, {});
      if (request.method() == http::verb::delete_)
        return json_response(http::status::ok, encode_session(sessions_.close(target.sandbox_id, procs, name)));
      return json_response(http::status::ok, encode_session(sessions_.get(target.sandbox_id, procs, name)));
    case Route::kSandboxSessionRestart:
      allow(request, "/v1/sandboxes/{id}/sessions/{name}/restart", {http::verb::post});
      only_params(target.query, {});
      return json_response(http::status::ok, encode_session(sessions_.restart(target.sandbox_id, procs, name)));
    case Route::kSandboxSessionRun: {
      allow(request, "/v1/sandboxes/{id}/sessions/{name}/run", {http::verb::post});
      only_params(target.query, {});
      json body = body_object(request, {"command", "timeout", "max_output", "stream", "request_id"});
      SessionRun run;
      auto it = body.find("command");
      if (it == body.end() || !it->is_string()) bad("command", "must be a string of shell text");
      run.command = it->get<std::string>();
      if (run.command.find('\0') != std::string::npos) bad("command", "must not contain NUL");
      run.timeout_seconds = number_field<double>(body, "timeout", 600, 0, 604800);
      if (!(run.timeout_seconds > 0)) bad("timeout", "must be in (0, 604800] seconds");
      run.max_output_bytes = number_field<std::size_t>(body, "max_output", 16u << 20, 0, 1ull << 30);
      const std::string request_id = string_field(body, "request_id", 128);
      // A session's runs share the sandbox's request ids with its execs, under a name of their own.
      const std::string journal_id = request_id.empty() ? "" : "session/" + name + "/" + request_id;
      ExecRequest as_exec;  // what identifies the run for its request id
      as_exec.shell = run.command;
      as_exec.timeout_seconds = run.timeout_seconds;
      as_exec.max_output_bytes = run.max_output_bytes;
      const std::string fingerprint = ExecJournal::fingerprint(as_exec);
      return exec_answer(request, stream, bool_field(body, "stream"), run.timeout_seconds, [&](const OutputSink& sink) {
        return run_exactly_once(
            registry_.exec_journal(), target.sandbox_id, journal_id, fingerprint, sink, [&](const OutputSink& to) {
              auto started = std::chrono::steady_clock::now();
              ExecResult r = sessions_.run(target.sandbox_id, procs, name, run, to);
              metrics_.exec_done(handle.kind,
                                 std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
              return r;
            });
      });
    }
    default:
      break;
  }
  throw Error(Code::kInternal, "unrouted session request");
}

}  // namespace dsec::agent
