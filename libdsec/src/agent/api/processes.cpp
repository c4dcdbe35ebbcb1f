// The router's room for processes and shell sessions (docs/protocol.md, "Processes" and "Shell sessions"): their
// requests decoded by common/protocol/process into calls on the sandbox's Processes and the node's ShellSessions,
// and what those answer encoded by it.
#include <sys/wait.h>

#include <fmt/format.h>

#include <charconv>
#include <chrono>

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

// ?max=: the bytes of each stream one read answers, 1 to the most a read may.
std::uint32_t max_param(const Query& query) {
  std::uint32_t max = process_protocol::kMaxReadBytes;
  if (query.get("max")) {
    std::uint64_t v = offset_param(query, "max");
    if (v == 0 || v > max) bad("max", fmt::format("must be 1 to {} bytes", max));
    max = static_cast<std::uint32_t>(v);
  }
  return max;
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
  if (!(seconds >= 0 && seconds <= protocol::kMaxProcessWait))
    bad("wait", fmt::format("must be 0 to {} seconds", protocol::kMaxProcessWait));
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

// A wait status as the wire has it: an exit code, or -1 and the signal that ended it.
void put_exit(bool running, int wait_status, int& exit_code, int& sig) {
  exit_code = -1;
  sig = 0;
  if (running) return;
  if (WIFEXITED(wait_status)) exit_code = WEXITSTATUS(wait_status);
  else if (WIFSIGNALED(wait_status)) sig = WTERMSIG(wait_status);
}

json encode_process(const ProcessEntry& e) {
  ProcessInfo p;
  p.pid = e.pid;
  p.argv = e.argv;
  p.tag = e.meta;
  p.pty = e.pty;
  p.running = e.running;
  put_exit(e.running, e.wait_status, p.exit_code, p.signal);
  p.started_at = static_cast<double>(e.started_ms) / 1000;
  p.ended_at = static_cast<double>(e.ended_ms) / 1000;
  p.stdout_bytes = e.stdout_end;
  p.stderr_bytes = e.stderr_end;
  p.stdin_open = e.stdin_open;
  if (!e.pty) return protocol::encode(p);
  return protocol::encode(p, protocol::TerminalSize{e.rows, e.cols});
}

json encode_output(ProcessOutput got) {
  dsec::ProcessOutput out;
  out.stdout_data = std::move(got.stdout_data);
  out.stderr_data = std::move(got.stderr_data);
  out.stdout_offset = got.stdout_offset;
  out.stderr_offset = got.stderr_offset;
  out.stdout_end = got.entry.stdout_end;
  out.stderr_end = got.entry.stderr_end;
  out.running = got.entry.running;
  put_exit(got.entry.running, got.entry.wait_status, out.exit_code, out.signal);
  return protocol::encode(out);
}

// A command that could not start for what it names: a process that ended at once, kept nowhere.
json encode_failed_start(const ExecRequest& command, const ExecResult& r) {
  ProcessInfo p;
  p.pid = 0;
  p.argv = command.argv.empty() ? std::vector<std::string>{"/bin/sh", "-c", command.shell} : command.argv;
  p.exit_code = r.exit_code;
  p.reason = r.reason;
  p.message = r.stderr_data;
  return protocol::encode(p);
}

dsec::SessionInfo public_info(const SessionInfo& s) {
  return dsec::SessionInfo{s.name, s.shell, s.pid, s.alive, s.busy, s.exit_code, s.signal};
}

json encode_session(const SessionInfo& s) { return protocol::encode(public_info(s)); }

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
    return json_response(http::status::ok, protocol::encode_process_list(std::move(list)));
  }
  json body = protocol::parse_body(request.body());
  const ProcessRequest spawn = protocol::decode_process_request(body);
  body.erase("request_id");
  SpawnOptions options;
  options.pty = spawn.pty;
  options.rows = spawn.rows;
  options.cols = spawn.cols;
  options.meta = spawn.tag;
  ExecRequest command;
  command.argv = spawn.argv;
  command.shell = spawn.shell;
  command.env = spawn.env;
  command.cwd = spawn.cwd;
  command.user = spawn.user;
  // A retried spawn with the first one's id gets the first one's answer (its pid) and starts nothing.
  return json_response(http::status::ok, once(target.sandbox_id, "spawn/", spawn.request_id, body.dump(), [&] {
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
      ProcessOutput got = procs.read(pid, offset_param(target.query, "stdout"), offset_param(target.query, "stderr"),
                                     max_param(target.query), wait_param(target.query));
      check_kind(got.entry);
      return json_response(http::status::ok, encode_output(std::move(got)));
    }
    case Route::kSandboxProcessStdin: {
      allow(request, "/v1/sandboxes/{id}/processes/{pid}/stdin", {http::verb::post});
      only_params(target.query, {"close", "request_id"});
      const std::string request_id = std::string(target.query.get("request_id").value_or(""));
      if (request_id.size() > protocol::kMaxRequestIdBytes)
        bad("request_id", fmt::format("at most {} bytes", protocol::kMaxRequestIdBytes));
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
      json body = protocol::parse_body(request.body());
      const protocol::SignalRequest asked = protocol::decode_signal_request(body);
      body.erase("request_id");
      // A retried signal with the first one's id is not sent again (a second SIGINT can end what one would not).
      once(target.sandbox_id, fmt::format("signal/{}/", pid), asked.request_id, body.dump(), [&] {
        check_kind(procs.read(pid, kSkip, kSkip, 0, {}).entry);
        procs.signal(pid, asked.signal,
                     asked.group ? process_protocol::Scope::kGroup : process_protocol::Scope::kProcess);
        return json{{"signal", asked.signal}};
      });
      return json_response(http::status::ok, encode_process(check_kind(procs.read(pid, kSkip, kSkip, 0, {}).entry)));
    }
    case Route::kSandboxProcessResize: {
      allow(request, "/v1/sandboxes/{id}/processes/{pid}/resize", {http::verb::post});
      only_params(target.query, {});
      const protocol::TerminalSize size = protocol::decode_resize_request(protocol::parse_body(request.body()));
      check_kind(procs.read(pid, kSkip, kSkip, 0, {}).entry);
      procs.resize(pid, size.rows, size.cols);
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
    std::vector<dsec::SessionInfo> list;
    for (const auto& s : sessions_.list(target.sandbox_id, procs)) list.push_back(public_info(s));
    return json_response(http::status::ok, protocol::encode(list));
  }
  const dsec::SessionOptions asked = protocol::decode_session_options(protocol::parse_body(request.body()));
  SessionOptions options{asked.name, asked.shell, asked.env, asked.cwd, asked.user};
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
      const protocol::SessionRunRequest decoded = protocol::decode_session_run(protocol::parse_body(request.body()));
      SessionRun run{decoded.command, decoded.timeout_seconds, decoded.max_output_bytes};
      const std::string& request_id = decoded.request_id;
      // A session's runs share the sandbox's request ids with its execs, under a name of their own.
      const std::string journal_id = request_id.empty() ? "" : "session/" + name + "/" + request_id;
      ExecRequest as_exec;  // what identifies the run for its request id
      as_exec.shell = run.command;
      as_exec.timeout_seconds = run.timeout_seconds;
      as_exec.max_output_bytes = run.max_output_bytes;
      const std::string fingerprint = ExecJournal::fingerprint(as_exec);
      return exec_answer(request, stream, decoded.stream, run.timeout_seconds, [&](const OutputSink& sink) {
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
