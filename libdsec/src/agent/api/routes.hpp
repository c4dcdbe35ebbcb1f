// Request targets of protocol v1: splitting "/v1/sandboxes/x/files?path=%2Fetc" into a route, the sandbox id and
// the decoded query. Pure functions over strings, so they are tested without a socket.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dsec/spec.hpp"
#include "http/query.hpp"

namespace dsec::agent {

enum class Route {
  kUnknown,
  kHealthz,                // /healthz
  kMetrics,                // /metrics
  kNode,                   // /v1/node
  kSandboxes,              // /v1/sandboxes
  kSandbox,                // /v1/sandboxes/{id}
  kSandboxExec,            // /v1/sandboxes/{id}/exec
  kSandboxFiles,           // /v1/sandboxes/{id}/files
  kSandboxSleep,           // /v1/sandboxes/{id}/sleep
  kSandboxWake,            // /v1/sandboxes/{id}/wake
  kSandboxSnapshot,        // /v1/sandboxes/{id}/snapshot
  kSandboxFork,            // /v1/sandboxes/{id}/fork
  kSandboxNetwork,         // /v1/sandboxes/{id}/network
  kSandboxTtl,             // /v1/sandboxes/{id}/ttl
  kSandboxPorts,           // /v1/sandboxes/{id}/ports
  kSandboxNetworkUsage,    // /v1/sandboxes/{id}/network/usage
  kSandboxProcesses,       // /v1/sandboxes/{id}/processes
  kSandboxProcess,         // /v1/sandboxes/{id}/processes/{pid}
  kSandboxProcessOutput,   // /v1/sandboxes/{id}/processes/{pid}/output
  kSandboxProcessStdin,    // /v1/sandboxes/{id}/processes/{pid}/stdin
  kSandboxProcessSignal,   // /v1/sandboxes/{id}/processes/{pid}/signal
  kSandboxProcessResize,   // /v1/sandboxes/{id}/processes/{pid}/resize
  kSandboxSessions,        // /v1/sandboxes/{id}/sessions
  kSandboxSession,         // /v1/sandboxes/{id}/sessions/{name}
  kSandboxSessionRun,      // /v1/sandboxes/{id}/sessions/{name}/run
  kSandboxSessionRestart,  // /v1/sandboxes/{id}/sessions/{name}/restart
  kSandboxScreen,          // /v1/sandboxes/{id}/screen
  kSandboxScreenState,     // /v1/sandboxes/{id}/screen/state
  kSandboxScreenInput,     // /v1/sandboxes/{id}/screen/input
  kSandboxScreenVnc,       // /v1/sandboxes/{id}/screen/vnc
  kGroups,                 // /v1/groups
  kGroup,                  // /v1/groups/{id}
  kGroupRenew,             // /v1/groups/{id}/renew
  kFnCall,                 // /v1/fncall
  kFnCallBatch,            // /v1/fncall/batch
};

// The route's template, as used in metrics labels: "/v1/sandboxes/{id}/exec"; "unknown" for kUnknown.
std::string_view route_template(Route route) noexcept;

struct Target {
  Route route = Route::kUnknown;
  std::string path;        // decoded path, without the query
  std::string sandbox_id;  // for the per-sandbox routes
  std::string group_id;    // for the per-group routes
  std::string item;        // a process's pid or a session's name, for the routes under them (as given)
  Query query;
};

// Parses an origin-form request target. An unknown path gives Route::kUnknown, not an error; a target that is not
// an absolute path or carries malformed escapes is INVALID_ARGUMENT.
Target parse_target(std::string_view target);

// label=k=v values into a label filter; a value without '=' or with an empty key is INVALID_ARGUMENT.
Labels parse_label_filters(const std::vector<std::string>& values);

// A path given in the files API: absolute, no NUL; INVALID_ARGUMENT naming the parameter otherwise.
void check_sandbox_path(std::string_view path, std::string_view param);

// A file mode given as octal digits ("0644", "755"); at most 07777. INVALID_ARGUMENT otherwise.
unsigned parse_file_mode(std::string_view text);

}  // namespace dsec::agent
