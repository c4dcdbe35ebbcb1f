// Function calls: short, stateless runs of code served from a node's warm pools (the fncall backend). A call gets
// a fresh child of a pre-initialised fork server over a read-only image root, with its own limits and a private
// writable /tmp, and is gone when it ends: nothing of one call is visible to the next.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "dsec/spec.hpp"

namespace dsec {

// How a call uses the node's GPUs.
enum class GpuMode {
  kNone,       // no GPU (the default)
  kExclusive,  // whole GPUs, one call each
  kShared,     // a share of a GPU (the node cuts each GPU into a configured number of shares)
};

struct FnCallRequest {
  // "python" (python3), "shell" (/bin/sh), "c" (gcc, then run), "cpp" (g++, then run).
  std::string language = "python";
  std::string code;
  std::string stdin_data;                    // fed to stdin, then EOF
  std::vector<std::string> args;             // the program's arguments (sys.argv[1:], "$@", argv[1..])
  std::map<std::string, std::string> files;  // path (relative: under the call's working dir in /tmp) -> bytes
  Env env;                                   // added to the runtime's clean environment
  // The image whose root the call runs over; empty: the node's default fncall image. Pools are per image and
  // language; a node warms the pools it was told to at start and makes others on first use.
  std::string image;
  double timeout_seconds = 10;                // wall clock; past it the call's processes are killed
  double cpu_seconds = 0;                     // CPU time limit (0: the wall timeout alone)
  std::uint64_t memory_bytes = 256ull << 20;  // memory limit of the call's processes together
  std::uint32_t pids = 64;                    // processes and threads the call may have at once
  std::size_t max_output_bytes = 1u << 20;    // cap for each of stdout and stderr; the rest is dropped
  GpuMode gpu_mode = GpuMode::kNone;
  std::uint32_t gpus = 0;  // GPUs (exclusive) or shares (shared) wanted; queued until free
  std::string request_id;  // a retried call with the same id is answered once
};

struct FnCallResult {
  int exit_code = -1;       // exit status, or -1 when killed by a signal
  int signal = 0;           // the signal that ended it, 0 if it exited
  std::string stdout_data;  // bytes, not text
  std::string stderr_data;
  bool stdout_truncated = false;
  bool stderr_truncated = false;
  bool timed_out = false;       // the wall or CPU time limit ended it
  bool oom_killed = false;      // the memory limit ended it
  double duration_seconds = 0;  // wall time of the run (compiling excluded)
  double cpu_seconds = 0;       // user + system time of the call's processes
  std::uint64_t peak_memory_bytes = 0;
  // C and C++: the compiler's exit code and messages (a failed compile leaves the run's fields at their defaults
  // and exit_code -1 with compile_exit_code != 0).
  int compile_exit_code = 0;
  std::string compile_output;
  double compile_seconds = 0;
  std::vector<std::string> gpus;  // the devices the call was given (CUDA_VISIBLE_DEVICES)
  std::string node;               // the node that ran it
  // run_code_many only (run_code throws instead): non-empty when this call could not run at all, with the error's
  // code name ("UNAVAILABLE", "INVALID_ARGUMENT", ...) in error_code and its message here.
  std::string error;
  std::string error_code;
};

}  // namespace dsec
