#include "gateway/e2b/envd_process.hpp"

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>

#include <fmt/format.h>

#include "common/protocol.hpp"
#include "dsec/exec.hpp"
#include "dsec/process.hpp"
#include "gateway/e2b/connect_rpc.hpp"

namespace dsec::e2b {
namespace {

using agent::HttpRequest;
using agent::HttpResponse;
using Clock = std::chrono::steady_clock;

std::string string_field(const json& message, const char* field) {
  auto it = message.find(field);
  if (it == message.end() || it->is_null()) return {};
  if (!it->is_string()) throw RpcError("invalid_argument", fmt::format("{}: must be a string", field));
  return it->get<std::string>();
}

// A ProcessSelector: {"pid": N} or {"tag": "..."}.
Process select_process(EnvdTarget& t, const json& message) {
  auto it = message.find("process");
  if (it == message.end() || !it->is_object()) throw RpcError("invalid_argument", "process: a selector is required");
  if (auto pid = it->find("pid"); pid != it->end() && !pid->is_null()) {
    if (!pid->is_number_integer() || pid->get<std::int64_t>() <= 0 || pid->get<std::int64_t>() > 4194304)
      throw RpcError("invalid_argument", "process.pid: must be a process id");
    return t.sandbox.process(pid->get<int>());
  }
  const std::string tag = string_field(*it, "tag");
  if (tag.empty()) throw RpcError("invalid_argument", "process: give its pid or its tag");
  for (const auto& p : t.sandbox.processes())
    if (p.tag == tag && p.running) return t.sandbox.process(p.pid);
  throw RpcError("not_found", fmt::format("no running process is tagged '{}'", tag));
}

json end_event(const ProcessInfo& info) {
  json end{{"exitCode", info.exit_code}, {"exited", info.signal == 0}};
  if (info.signal != 0) {
    const char* name = ::sigabbrev_np(info.signal);
    end["status"] = info.signal == SIGKILL ? std::string("signal: killed")
                                           : fmt::format("signal: {}", name ? name : std::to_string(info.signal));
  } else {
    end["status"] = fmt::format("exit status {}", info.exit_code);
  }
  // As envd: a failed command's error is its status ("exit status 3"), which the SDKs' CommandExitError shows.
  if (!info.message.empty()) end["error"] = info.message;
  else if (info.exit_code != 0) end["error"] = end["status"];
  return json{{"event", json{{"end", std::move(end)}}}};
}

json data_event(const char* stream, std::string_view bytes) {
  return json{{"event", json{{"data", json{{stream, protocol::base64_encode(bytes)}}}}}};
}

struct FollowOptions {
  std::uint64_t stdout_from = 0, stderr_from = 0;
  bool pty = false;
  std::optional<Clock::time_point> deadline;  // the process's lifetime (Start's Connect-Timeout-Ms)
  std::optional<Clock::time_point> stop_at;   // the stream's own end (Connect's timeout): the process runs on
  std::chrono::milliseconds keepalive{90'000};
  bool forget_at_end = false;  // Start forgets the process (and its kept output) once its end was delivered
};

// Streams a process's events until its end, the deadline (then it is killed), or the caller going away.
void follow(Process& proc, ServerStream& out, const FollowOptions& o) {
  std::uint64_t so = o.stdout_from, se = o.stderr_from;
  auto last_sent = Clock::now();
  out.send(json{{"event", json{{"start", json{{"pid", proc.pid()}}}}}});
  for (;;) {
    const auto now = Clock::now();
    if (o.deadline && now >= *o.deadline) {
      ProcessInfo last = proc.kill();
      out.finish(RpcError("deadline_exceeded", fmt::format("process {} ran past its timeout and was killed (exit "
                                                           "code {})",
                                                           proc.pid(), last.exit_code)));
      return;
    }
    if (o.stop_at && now >= *o.stop_at) {
      out.finish(RpcError("deadline_exceeded", "the stream's timeout passed (the process runs on)"));
      return;
    }
    if (out.gone() && !o.deadline) return;  // no lifetime to enforce: it runs on, as envd leaves it
    auto wait = o.keepalive - std::chrono::duration_cast<std::chrono::milliseconds>(now - last_sent);
    for (const auto& until : {o.deadline, o.stop_at})
      if (until) wait = std::min(wait, std::chrono::duration_cast<std::chrono::milliseconds>(*until - now));
    wait = std::clamp(wait, std::chrono::milliseconds(0), std::chrono::milliseconds(60'000));
    const bool reading = !out.gone();
    ProcessOutput got =
        proc.read(reading ? std::optional(so) : std::nullopt, reading && !o.pty ? std::optional(se) : std::nullopt,
                  static_cast<double>(wait.count()) / 1000.0);
    if (reading) {
      if (!got.stdout_data.empty()) {
        out.send(data_event(o.pty ? "pty" : "stdout", got.stdout_data));
        so = got.stdout_offset + got.stdout_data.size();
        last_sent = Clock::now();
      }
      if (!got.stderr_data.empty()) {
        out.send(data_event("stderr", got.stderr_data));
        se = got.stderr_offset + got.stderr_data.size();
        last_sent = Clock::now();
      }
    }
    const bool drained = !reading || (so >= got.stdout_end && (o.pty || se >= got.stderr_end));
    if (!got.running && drained) {
      ProcessInfo info = proc.info();
      out.send(end_event(info));
      out.finish();
      if (o.forget_at_end) {
        try {
          proc.kill();
        } catch (const Error&) {
        }
      }
      return;
    }
    if (reading && Clock::now() - last_sent >= o.keepalive) {
      out.send(json{{"event", json{{"keepalive", json::object()}}}});
      last_sent = Clock::now();
    }
  }
}

HttpResponse start(EnvdTarget& t, HttpRequest& request, agent::ResponseStream& stream) {
  return serve_stream(request, stream, [&](const json& message, ServerStream& out) {
    const auto timeout = connect_timeout(request);
    auto p = message.find("process");
    if (p == message.end() || !p->is_object()) throw RpcError("invalid_argument", "process: required");
    ProcessRequest pr;
    const std::string cmd = string_field(*p, "cmd");
    if (cmd.empty()) throw RpcError("invalid_argument", "process.cmd: required");
    pr.argv.push_back(cmd);
    if (auto args = p->find("args"); args != p->end() && !args->is_null()) {
      if (!args->is_array()) throw RpcError("invalid_argument", "process.args: must be a list of strings");
      for (const auto& a : *args) {
        if (!a.is_string()) throw RpcError("invalid_argument", "process.args: must be a list of strings");
        pr.argv.push_back(a.get<std::string>());
      }
    }
    if (auto envs = p->find("envs"); envs != p->end() && !envs->is_null()) {
      if (!envs->is_object()) throw RpcError("invalid_argument", "process.envs: must be an object of strings");
      for (const auto& [k, v] : envs->items()) {
        if (!v.is_string()) throw RpcError("invalid_argument", fmt::format("process.envs.{}: must be a string", k));
        pr.env[k] = v.get<std::string>();
      }
    }
    const std::string cwd = string_field(*p, "cwd");
    pr.cwd = cwd.empty() ? t.home : resolve_path(cwd, t.home);
    pr.user = t.user;
    pr.tag = string_field(message, "tag");
    if (auto pty = message.find("pty"); pty != message.end() && pty->is_object()) {
      pr.pty = true;
      const json size = pty->value("size", json::object());
      pr.cols = std::clamp(size.value("cols", 80u), 1u, 1000u);
      pr.rows = std::clamp(size.value("rows", 24u), 1u, 1000u);
    }
    const bool keep_stdin = pr.pty || message.value("stdin", false);
    Process proc = t.sandbox.spawn(pr);
    if (proc.pid() == 0) {  // what it names is not there: as bash would say, with its exit code
      ProcessInfo info = proc.info();
      out.send(json{{"event", json{{"start", json{{"pid", 0}}}}}});
      if (!info.message.empty()) out.send(data_event("stderr", info.message + "\n"));
      info.message.clear();
      out.send(end_event(info));
      out.finish();
      return;
    }
    if (!keep_stdin) {
      try {
        proc.close_stdin();
      } catch (const Error& e) {
        if (e.code() != Code::kFailedPrecondition) throw;  // it ended already: nothing to close
      }
    }
    FollowOptions o;
    o.pty = pr.pty;
    o.keepalive = keepalive_interval(request);
    if (timeout && timeout->count() > 0) o.deadline = Clock::now() + *timeout;
    o.forget_at_end = true;
    follow(proc, out, o);
  });
}

HttpResponse connect(EnvdTarget& t, HttpRequest& request, agent::ResponseStream& stream) {
  return serve_stream(request, stream, [&](const json& message, ServerStream& out) {
    const auto timeout = connect_timeout(request);
    Process proc = select_process(t, message);
    ProcessInfo info = proc.info();
    FollowOptions o;
    o.stdout_from = info.stdout_bytes;
    o.stderr_from = info.stderr_bytes;
    o.pty = info.pty;
    o.keepalive = keepalive_interval(request);
    // A Connect's timeout bounds the stream, not the process.
    if (timeout && timeout->count() > 0) o.stop_at = Clock::now() + *timeout;
    follow(proc, out, o);
  });
}

// Each process's working directory and environment, read inside the sandbox from /proc (one exec as the caller's
// user, who may read its own processes'): dsec keeps neither. Per pid: "pid\ncwd\nsize\n" and `size` bytes of
// NUL-separated environment. A process in the middle of an execve (bash -c handing over to its command) reads as
// an empty environment for a moment: an empty one is read again, a few times, 50 ms apart.
struct ProcessPlace {
  std::string cwd;
  json envs = json::object();
};

std::map<int, ProcessPlace> process_places(EnvdTarget& t, const std::vector<int>& pids) {
  std::map<int, ProcessPlace> out;
  if (pids.empty()) return out;
  ExecRequest r;
  r.argv = {
      "/bin/sh", "-c",
      R"sh(for p; do c=$(readlink "/proc/$p/cwd") || continue; e=$(wc -c < "/proc/$p/environ") || continue; )sh"
      R"sh(for i in 1 2 3; do [ "$e" = 0 ] || break; sleep 0.05; e=$(wc -c < "/proc/$p/environ") || e=0; done; )sh"
      R"sh(printf '%s\n%s\n%s\n' "$p" "$c" "$e"; cat "/proc/$p/environ"; done)sh",
      "e2b"};
  for (int pid : pids) r.argv.push_back(std::to_string(pid));
  r.user = t.user;
  r.timeout_seconds = 30;
  ExecResult res = t.sandbox.exec(r);
  const std::string& text = res.stdout_data;
  std::size_t at = 0;
  auto line = [&]() -> std::optional<std::string> {
    auto nl = text.find('\n', at);
    if (nl == std::string::npos) return std::nullopt;
    std::string l = text.substr(at, nl - at);
    at = nl + 1;
    return l;
  };
  for (;;) {
    auto pid = line(), cwd = line(), size = line();
    if (!pid || !cwd || !size) break;
    std::size_t n = 0;
    try {
      n = std::stoul(*size);
    } catch (const std::exception&) {
      break;
    }
    if (n > text.size() - at) break;
    ProcessPlace place{*cwd, json::object()};
    std::string_view env(text.data() + at, n);
    at += n;
    for (std::size_t s = 0; s < env.size();) {
      std::size_t e = env.find('\0', s);
      if (e == std::string_view::npos) e = env.size();
      std::string_view kv = env.substr(s, e - s);
      if (auto eq = kv.find('='); eq != std::string_view::npos && eq > 0)
        place.envs[std::string(kv.substr(0, eq))] = std::string(kv.substr(eq + 1));
      s = e + 1;
    }
    try {
      out[std::stoi(*pid)] = std::move(place);
    } catch (const std::exception&) {
    }
  }
  return out;
}

json process_list(EnvdTarget& t) {
  std::vector<ProcessInfo> running;
  for (auto& p : t.sandbox.processes())
    if (p.running) running.push_back(std::move(p));
  std::vector<int> pids;
  pids.reserve(running.size());
  for (const auto& p : running) pids.push_back(p.pid);
  const auto places = process_places(t, pids);
  json list = json::array();
  for (const auto& p : running) {
    json args = json::array();
    for (std::size_t i = 1; i < p.argv.size(); ++i) args.push_back(p.argv[i]);
    json config{{"cmd", p.argv.empty() ? std::string() : p.argv[0]}, {"args", args}, {"envs", json::object()}};
    if (auto place = places.find(p.pid); place != places.end()) {
      config["envs"] = place->second.envs;
      config["cwd"] = place->second.cwd;
    }
    json entry{{"pid", p.pid}, {"config", std::move(config)}};
    if (!p.tag.empty()) entry["tag"] = p.tag;
    list.push_back(std::move(entry));
  }
  return json{{"processes", std::move(list)}};
}

// An ended process is as good as gone to E2B's callers (envd forgets it at its end).
template <typename F>
void on_running(Process& proc, F&& act) {
  try {
    act();
  } catch (const Error& e) {
    if (e.code() == Code::kFailedPrecondition && !proc.info().running)
      throw RpcError("not_found", fmt::format("process {} is not running", proc.pid()));
    throw;
  }
}

// A client stream (start {process}, then data {input} and keepalives), as envd takes it: the gateway's server reads a
// body whole, so the input reaches the process once the caller ends its stream (E2B's SDKs send stdin with
// SendInput, one call a piece, and never use this).
HttpResponse stream_input(EnvdTarget& t, HttpRequest& request, agent::ResponseStream& stream) {
  return serve_client_stream(request, stream, [&](const std::vector<json>& messages, ServerStream& out) {
    if (messages.empty() || !messages.front().contains("start"))
      throw RpcError("invalid_argument", "StreamInput: the first message must be start {process}");
    Process proc = select_process(t, messages.front()["start"]);
    for (std::size_t i = 1; i < messages.size(); ++i) {
      const json& m = messages[i];
      if (m.contains("keepalive")) continue;
      if (!m.contains("data")) throw RpcError("invalid_argument", "StreamInput: after start, data or keepalive");
      const json input = m["data"].value("input", json::object());
      const std::string data = protocol::base64_decode(string_field(input, input.contains("pty") ? "pty" : "stdin"));
      on_running(proc, [&] { proc.write_stdin(data); });
    }
    out.send(json::object());
    out.finish();
  });
}

json unary(EnvdTarget& t, std::string_view method, const json& message) {
  if (method == "List") return process_list(t);
  if (method != "SendInput" && method != "CloseStdin" && method != "SendSignal" && method != "Update")
    throw RpcError("unimplemented", fmt::format("process.Process/{} is not served", method));
  Process proc = select_process(t, message);
  if (method == "SendInput") {
    const json input = message.value("input", json::object());
    std::string data;
    if (input.contains("stdin")) data = protocol::base64_decode(string_field(input, "stdin"));
    else if (input.contains("pty")) data = protocol::base64_decode(string_field(input, "pty"));
    else throw RpcError("invalid_argument", "input: stdin or pty bytes are required");
    on_running(proc, [&] { proc.write_stdin(data); });
  } else if (method == "CloseStdin") {
    on_running(proc, [&] { proc.close_stdin(); });
  } else if (method == "SendSignal") {
    const json s = message.value("signal", json());
    int sig = 0;
    if (s == "SIGNAL_SIGKILL" || s == 9) sig = SIGKILL;
    else if (s == "SIGNAL_SIGTERM" || s == 15) sig = SIGTERM;
    else throw RpcError("invalid_argument", "signal: SIGNAL_SIGKILL or SIGNAL_SIGTERM");
    on_running(proc, [&] { proc.signal(sig, /*group=*/true); });
  } else {  // Update
    const json size = message.value("pty", json::object()).value("size", json::object());
    if (size.empty()) throw RpcError("invalid_argument", "pty.size: required");
    on_running(proc, [&] {
      proc.resize(std::clamp(size.value("rows", 24u), 1u, 1000u), std::clamp(size.value("cols", 80u), 1u, 1000u));
    });
  }
  return json::object();
}

}  // namespace

HttpResponse process_service(EnvdTarget& target, std::string_view method, HttpRequest& request,
                             agent::ResponseStream& stream) {
  if (method == "Start") return start(target, request, stream);
  if (method == "Connect") return connect(target, request, stream);
  if (method == "StreamInput") return stream_input(target, request, stream);
  return serve_unary(request, [&](const json& message) { return unary(target, method, message); });
}

}  // namespace dsec::e2b
