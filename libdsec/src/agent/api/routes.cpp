#include "agent/api/routes.hpp"

#include <fmt/format.h>

#include "common/hex.hpp"
#include "dsec/error.hpp"

namespace dsec::agent {
namespace {

std::vector<std::string_view> split_path(std::string_view path) {
  std::vector<std::string_view> parts;
  std::size_t start = 1;  // past the leading '/'
  while (start <= path.size()) {
    std::size_t end = path.find('/', start);
    if (end == std::string_view::npos) end = path.size();
    parts.push_back(path.substr(start, end - start));
    start = end + 1;
  }
  return parts;
}

}  // namespace

std::string_view route_template(Route route) noexcept {
  switch (route) {
    case Route::kHealthz:
      return "/healthz";
    case Route::kMetrics:
      return "/metrics";
    case Route::kNode:
      return "/v1/node";
    case Route::kSandboxes:
      return "/v1/sandboxes";
    case Route::kSandbox:
      return "/v1/sandboxes/{id}";
    case Route::kSandboxExec:
      return "/v1/sandboxes/{id}/exec";
    case Route::kSandboxFiles:
      return "/v1/sandboxes/{id}/files";
    case Route::kSandboxSleep:
      return "/v1/sandboxes/{id}/sleep";
    case Route::kSandboxWake:
      return "/v1/sandboxes/{id}/wake";
    case Route::kSandboxSnapshot:
      return "/v1/sandboxes/{id}/snapshot";
    case Route::kSandboxFork:
      return "/v1/sandboxes/{id}/fork";
    case Route::kSandboxNetwork:
      return "/v1/sandboxes/{id}/network";
    case Route::kSandboxTtl:
      return "/v1/sandboxes/{id}/ttl";
    case Route::kSandboxPorts:
      return "/v1/sandboxes/{id}/ports";
    case Route::kSandboxNetworkUsage:
      return "/v1/sandboxes/{id}/network/usage";
    case Route::kSandboxScreen:
      return "/v1/sandboxes/{id}/screen";
    case Route::kSandboxScreenState:
      return "/v1/sandboxes/{id}/screen/state";
    case Route::kSandboxScreenInput:
      return "/v1/sandboxes/{id}/screen/input";
    case Route::kSandboxScreenVnc:
      return "/v1/sandboxes/{id}/screen/vnc";
    case Route::kSandboxProcesses:
      return "/v1/sandboxes/{id}/processes";
    case Route::kSandboxProcess:
      return "/v1/sandboxes/{id}/processes/{pid}";
    case Route::kSandboxProcessOutput:
      return "/v1/sandboxes/{id}/processes/{pid}/output";
    case Route::kSandboxProcessStdin:
      return "/v1/sandboxes/{id}/processes/{pid}/stdin";
    case Route::kSandboxProcessSignal:
      return "/v1/sandboxes/{id}/processes/{pid}/signal";
    case Route::kSandboxProcessResize:
      return "/v1/sandboxes/{id}/processes/{pid}/resize";
    case Route::kSandboxSessions:
      return "/v1/sandboxes/{id}/sessions";
    case Route::kSandboxSession:
      return "/v1/sandboxes/{id}/sessions/{name}";
    case Route::kSandboxSessionRun:
      return "/v1/sandboxes/{id}/sessions/{name}/run";
    case Route::kSandboxSessionRestart:
      return "/v1/sandboxes/{id}/sessions/{name}/restart";
    case Route::kGroups:
      return "/v1/groups";
    case Route::kGroup:
      return "/v1/groups/{id}";
    case Route::kGroupRenew:
      return "/v1/groups/{id}/renew";
    case Route::kFnCall:
      return "/v1/fncall";
    case Route::kFnCallBatch:
      return "/v1/fncall/batch";
    case Route::kUnknown:
      break;
  }
  return "unknown";
}

Target parse_target(std::string_view target) {
  if (target.empty() || target.front() != '/')
    throw Error(Code::kInvalidArgument,
                fmt::format("request target '{}' is not an absolute path such as /v1/node", target.substr(0, 200)));
  Target out;
  std::size_t q = target.find('?');
  std::string_view raw_path = target.substr(0, q);
  if (q != std::string_view::npos) out.query = parse_query(target.substr(q + 1));
  out.path = percent_decode(raw_path, "path");
  if (raw_path.size() > 1 && raw_path.back() == '/') raw_path.remove_suffix(1);

  // Segments are matched raw and the id is decoded on its own, so an escaped '/' inside an id cannot forge a route.
  std::vector<std::string_view> parts = split_path(raw_path);
  auto is = [&](std::size_t i, std::string_view s) { return parts.size() > i && parts[i] == s; };
  if (parts.size() == 1 && is(0, "healthz")) {
    out.route = Route::kHealthz;
  } else if (parts.size() == 1 && is(0, "metrics")) {
    out.route = Route::kMetrics;
  } else if (is(0, "v1")) {
    if (parts.size() == 2 && is(1, "node")) {
      out.route = Route::kNode;
    } else if (parts.size() == 2 && is(1, "fncall")) {
      out.route = Route::kFnCall;
    } else if (parts.size() == 3 && is(1, "fncall") && is(2, "batch")) {
      out.route = Route::kFnCallBatch;
    } else if (parts.size() >= 2 && is(1, "sandboxes")) {
      if (parts.size() == 2) {
        out.route = Route::kSandboxes;
      } else if (!parts[2].empty()) {
        std::string id = percent_decode(parts[2], "sandbox id");
        if (parts.size() == 3) out.route = Route::kSandbox;
        else if (parts.size() == 4 && parts[3] == "exec") out.route = Route::kSandboxExec;
        else if (parts.size() == 4 && parts[3] == "files") out.route = Route::kSandboxFiles;
        else if (parts.size() == 4 && parts[3] == "sleep") out.route = Route::kSandboxSleep;
        else if (parts.size() == 4 && parts[3] == "wake") out.route = Route::kSandboxWake;
        else if (parts.size() == 4 && parts[3] == "snapshot") out.route = Route::kSandboxSnapshot;
        else if (parts.size() == 4 && parts[3] == "fork") out.route = Route::kSandboxFork;
        else if (parts.size() == 4 && parts[3] == "network") out.route = Route::kSandboxNetwork;
        else if (parts.size() == 4 && parts[3] == "ttl") out.route = Route::kSandboxTtl;
        else if (parts.size() == 4 && parts[3] == "ports") out.route = Route::kSandboxPorts;
        else if (parts.size() == 5 && parts[3] == "network" && parts[4] == "usage")
          out.route = Route::kSandboxNetworkUsage;
        else if (parts.size() == 4 && parts[3] == "screen") out.route = Route::kSandboxScreen;
        else if (parts.size() == 5 && parts[3] == "screen" && parts[4] == "state")
          out.route = Route::kSandboxScreenState;
        else if (parts.size() == 5 && parts[3] == "screen" && parts[4] == "input")
          out.route = Route::kSandboxScreenInput;
        else if (parts.size() == 5 && parts[3] == "screen" && parts[4] == "vnc") out.route = Route::kSandboxScreenVnc;
        else if (parts.size() == 4 && parts[3] == "processes") out.route = Route::kSandboxProcesses;
        else if (parts.size() == 4 && parts[3] == "sessions") out.route = Route::kSandboxSessions;
        else if (parts.size() >= 5 && parts.size() <= 6 && !parts[4].empty() &&
                 (parts[3] == "processes" || parts[3] == "sessions")) {
          const bool process = parts[3] == "processes";
          std::string_view sub = parts.size() == 6 ? parts[5] : std::string_view();
          if (parts.size() == 5) out.route = process ? Route::kSandboxProcess : Route::kSandboxSession;
          else if (process && sub == "output") out.route = Route::kSandboxProcessOutput;
          else if (process && sub == "stdin") out.route = Route::kSandboxProcessStdin;
          else if (process && sub == "signal") out.route = Route::kSandboxProcessSignal;
          else if (process && sub == "resize") out.route = Route::kSandboxProcessResize;
          else if (!process && sub == "run") out.route = Route::kSandboxSessionRun;
          else if (!process && sub == "restart") out.route = Route::kSandboxSessionRestart;
          if (out.route != Route::kUnknown) out.item = percent_decode(parts[4], process ? "pid" : "session name");
        }
        if (out.route != Route::kUnknown) out.sandbox_id = std::move(id);
      }
    } else if (parts.size() >= 2 && is(1, "groups")) {
      if (parts.size() == 2) {
        out.route = Route::kGroups;
      } else if (!parts[2].empty()) {
        std::string id = percent_decode(parts[2], "group id");
        if (parts.size() == 3) out.route = Route::kGroup;
        else if (parts.size() == 4 && parts[3] == "renew") out.route = Route::kGroupRenew;
        if (out.route != Route::kUnknown) out.group_id = std::move(id);
      }
    }
  }
  return out;
}

Labels parse_label_filters(const std::vector<std::string>& values) {
  Labels labels;
  for (const auto& v : values) {
    std::size_t eq = v.find('=');
    if (eq == std::string::npos || eq == 0)
      throw Error(Code::kInvalidArgument, fmt::format("label: '{}' is not key=value", v));
    labels[v.substr(0, eq)] = v.substr(eq + 1);
  }
  return labels;
}

void check_sandbox_path(std::string_view path, std::string_view param) {
  if (path.empty()) throw Error(Code::kInvalidArgument, fmt::format("{}: missing (give an absolute path)", param));
  if (path.find('\0') != std::string_view::npos)
    throw Error(Code::kInvalidArgument, fmt::format("{}: must not contain NUL", param));
  if (path.front() != '/')
    throw Error(Code::kInvalidArgument, fmt::format("{}: '{}' is not an absolute path", param, path));
  if (path.size() > 4096) throw Error(Code::kInvalidArgument, fmt::format("{}: longer than 4096 bytes", param));
}

unsigned parse_file_mode(std::string_view text) {
  unsigned mode = 0;
  if (text.empty() || text.size() > 6)
    throw Error(Code::kInvalidArgument, fmt::format("mode: '{}' is not an octal file mode such as 0644", text));
  for (char c : text) {
    if (c < '0' || c > '7')
      throw Error(Code::kInvalidArgument, fmt::format("mode: '{}' is not an octal file mode such as 0644", text));
    mode = mode * 8 + static_cast<unsigned>(c - '0');
  }
  if (mode > 07777) throw Error(Code::kInvalidArgument, fmt::format("mode: '{}' is above 07777", text));
  return mode;
}

}  // namespace dsec::agent
