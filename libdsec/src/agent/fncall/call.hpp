// Running one function call on an armed child (fork_server.hpp): its limits on the call's cgroup, the request to
// the child, its output read and capped, the compile step of C and C++, the wall and CPU time limits, and the result.
#pragma once

#include <string>
#include <vector>

#include "agent/fncall/fork_server.hpp"
#include "dsec/fncall.hpp"

namespace dsec::agent::fncall {

struct CallSettings {
  std::string language;
  std::vector<std::string> device_nodes;  // GPU device nodes to bind into the call's /dev
  Env env;                                // the call's whole environment
  double compile_timeout_seconds = 60;
  std::uint64_t compile_memory_bytes = 1ull << 30;
  std::size_t compile_output_cap = 64u << 10;
};

// Runs the call and returns what it did. A program that fails, crashes, times out or runs out of memory is a result.
// Throws dsec::Error when the call could not run; `server_fault` then says whether the slot was at fault (its child
// was gone before it took the request), in which case the call may run again on another slot. The slot is used up
// either way.
FnCallResult run_call(Slot& slot, const FnCallRequest& request, const CallSettings& settings, bool* server_fault);

}  // namespace dsec::agent::fncall
