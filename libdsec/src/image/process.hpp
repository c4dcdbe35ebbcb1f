// Running the host tools that image builders rely on (debootstrap, busybox --list): posix_spawn, stdin from
// /dev/null, stdout and stderr read through pipes and handed on line by line.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::image {

struct ProcessOptions {
  // "NAME=value" entries; empty: the caller's environment.
  std::vector<std::string> env;
  // Every complete line of stdout and stderr as it arrives (without the newline).
  std::function<void(std::string_view line)> on_line;
  // How much of each stream is kept in the result: the last keep_bytes.
  std::size_t keep_bytes = 1u << 20;
};

struct ProcessResult {
  int exit_code = -1;  // exit status, -1 when killed by a signal
  int signal = 0;
  std::string out;  // the tail of stdout
  std::string err;  // the tail of stderr
  bool ok() const noexcept { return exit_code == 0; }
  // "exited with status 1" / "killed by signal 9"
  std::string status_text() const;
  // The last `lines` lines of stderr (or of stdout when stderr is empty), for error messages.
  std::string tail(std::size_t lines = 15) const;
};

// The executable `name` resolves to through PATH (from `env` when it sets PATH, else the caller's, plus the sbin
// directories), or an empty string when there is none. A name with a '/' is returned as it is if executable.
std::string find_executable(std::string_view name, const std::vector<std::string>& env = {});

// Runs argv[0] (looked up with find_executable) and waits for it. FAILED_PRECONDITION when the program does not
// exist; a program that runs and fails is a result, not an error.
ProcessResult run_process(const std::vector<std::string>& argv, const ProcessOptions& options = {});

}  // namespace dsec::image
