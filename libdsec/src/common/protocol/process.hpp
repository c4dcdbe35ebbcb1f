// Spawned processes and shell sessions on the v1 wire (/v1/sandboxes/{id}/processes and /sessions, docs/protocol.md
// "Processes" and "Shell sessions"), both directions: the client encodes requests (checked before they leave) and
// decodes answers; the agent decodes requests and encodes answers. Pure functions, tested without an agent.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/protocol/body.hpp"
#include "common/protocol/limits.hpp"
#include "dsec/process.hpp"
#include "dsec/session.hpp"

namespace dsec::protocol {

// A pty's size: INVALID_ARGUMENT naming rows or cols outside 1 to kMaxTerminalSide.
void check_terminal_size(unsigned rows, unsigned cols);
// A session's name: 1 to kMaxSessionNameBytes letters, digits, '.', '_', '-'; INVALID_ARGUMENT naming `name` otherwise.
void check_session_name(std::string_view name);

struct TerminalSize {
  unsigned rows = 24, cols = 80;
};

// POST /processes {"argv" | "shell", "env", "cwd", "user", "pty", "rows", "cols", "tag", "request_id"}.
json encode(const ProcessRequest& request);  // INVALID_ARGUMENT naming the field for what the agent would refuse
ProcessRequest decode_process_request(const json& body);

// POST /sessions {"name", "shell", "env", "cwd", "user"}.
json encode(const SessionOptions& options);
SessionOptions decode_session_options(const json& body);

// POST /sessions/{name}/run {"command", "timeout", "max_output", "stream", "request_id"}.
struct SessionRunRequest {
  std::string command;
  double timeout_seconds = 600;
  std::size_t max_output_bytes = 16u << 20;
  bool stream = false;
  std::string request_id;
};
json encode_session_run(std::string_view command, double timeout_seconds, std::size_t max_output, bool stream);
SessionRunRequest decode_session_run(const json& body);

// POST /processes/{pid}/signal {"signal": a number or a name such as "SIGTERM", "group", "request_id"}.
struct SignalRequest {
  int signal = 0;
  bool group = false;  // the process's group, not the process alone
  std::string request_id;
};
SignalRequest decode_signal_request(const json& body);

// POST /processes/{pid}/resize {"rows", "cols"}.
TerminalSize decode_resize_request(const json& body);

// Answers. A malformed answer is DATA_LOSS naming the field. A process with a pty is written with its terminal's
// size; pid 0 is a command that could not start for what it names (a result, with its reason and message).
json encode(const ProcessInfo& info, std::optional<TerminalSize> terminal = std::nullopt);
ProcessInfo decode_process_info(const json& j);
json encode_process_list(json encoded_processes);             // {"processes": [...]}
std::vector<ProcessInfo> decode_process_list(const json& j);  // {"processes": [...]}
json encode(const ProcessOutput& output);
ProcessOutput decode_process_output(const json& j);
json encode(const SessionInfo& info);
SessionInfo decode_session_info(const json& j);
json encode(const std::vector<SessionInfo>& sessions);        // {"sessions": [...]}
std::vector<SessionInfo> decode_session_list(const json& j);  // {"sessions": [...]}

// A number of seconds as a query value: at most millisecond precision, no exponent ("60", "0.25").
std::string query_seconds(double seconds);

}  // namespace dsec::protocol

// The client's older names for these, which the Python binding's async engine still spells.
namespace dsec::detail {
using protocol::check_terminal_size;
using protocol::decode_process_info;
using protocol::decode_process_list;
using protocol::decode_process_output;
using protocol::decode_session_info;
using protocol::decode_session_list;
using protocol::encode;
using protocol::encode_session_run;
using protocol::kMaxOutputRead;
using protocol::kMaxProcessWait;
using protocol::query_seconds;
}  // namespace dsec::detail
