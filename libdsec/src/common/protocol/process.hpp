// The client's JSON for spawned processes and shell sessions (protocol v1: /v1/sandboxes/{id}/processes and
// /sessions): request bodies checked before they leave, answers decoded. Pure functions, tested without an agent.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "common/protocol/body.hpp"
#include "dsec/process.hpp"
#include "dsec/session.hpp"

namespace dsec::detail {

// Limits the agent holds requests to; the client refuses what passes them before a round trip.
inline constexpr unsigned kMaxTerminalSide = 1000;       // rows and cols
inline constexpr std::size_t kMaxProcessTag = 128;       // bytes
inline constexpr std::size_t kMaxOutputRead = 1u << 20;  // bytes of each stream per read
inline constexpr double kMaxProcessWait = 300;           // seconds one long poll may wait

// A pty's size: INVALID_ARGUMENT naming rows or cols outside 1 to kMaxTerminalSide.
void check_terminal_size(unsigned rows, unsigned cols);

// Request bodies. INVALID_ARGUMENT naming the field for what the agent would refuse.
protocol::json encode(const ProcessRequest& request);
protocol::json encode(const SessionOptions& options);
protocol::json encode_session_run(std::string_view command, double timeout_seconds, std::size_t max_output,
                                  bool stream);

// Answers. A malformed answer is DATA_LOSS naming the field.
ProcessInfo decode_process_info(const protocol::json& j);
std::vector<ProcessInfo> decode_process_list(const protocol::json& j);  // {"processes": [...]}
ProcessOutput decode_process_output(const protocol::json& j);
SessionInfo decode_session_info(const protocol::json& j);
std::vector<SessionInfo> decode_session_list(const protocol::json& j);  // {"sessions": [...]}

// A number of seconds as a query value: at most millisecond precision, no exponent ("60", "0.25").
std::string query_seconds(double seconds);

}  // namespace dsec::detail
