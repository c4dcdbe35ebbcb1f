// The agent's end of a container sandbox's init.sock (init/init_protocol.hpp for execs, init/process_protocol.hpp
// for the processes init keeps): one connection per request.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "common/unique_fd.hpp"
#include "common/wire/process_protocol.hpp"

namespace dsec::agent {

// Connects to the init.sock at `path`; throws the errno error naming `sandbox_id`.
UniqueFd connect_init(const std::string& path, const std::string& sandbox_id);

// Sends a whole request, `fds` (SCM_RIGHTS) with its first bytes.
void send_init_request(int conn, const std::string& message, const std::vector<int>& fds);

// Reads exactly n bytes before `deadline`; false when the peer closed, the deadline passed, or `give_up` (asked
// between waits of at most 200 ms) says so.
bool read_init_reply(int conn, void* into, std::size_t n, std::chrono::steady_clock::time_point deadline,
                     const std::function<bool()>& give_up = {});

// One process request and its reply's payload. Throws UNAVAILABLE when init does not answer by `deadline`, and
// what `give_up` throws.
std::string exchange_process_request(const std::string& socket_path, const std::string& sandbox_id,
                                     process_protocol::Op op, const std::string& payload, const std::vector<int>& fds,
                                     std::chrono::steady_clock::time_point deadline,
                                     const std::function<bool()>& give_up = {});

}  // namespace dsec::agent
