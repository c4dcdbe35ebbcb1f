#include "common/wire/start_error.hpp"

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

namespace dsec::init {

Error start_error(int err, init_protocol::FailStage stage, const std::string& argv0, const std::string& cwd,
                  const std::string& user) {
  using init_protocol::FailStage;
  switch (stage) {
    case FailStage::kExec:
      if (err == ENOENT) return Error(Code::kNotFound, fmt::format("executable not found in the sandbox: {}", argv0));
      if (err == EACCES)
        return Error(Code::kPermissionDenied, fmt::format("cannot execute {}: permission denied", argv0));
      return Error(Code::kInvalidArgument, fmt::format("cannot execute {}: {}", argv0, std::strerror(err)));
    case FailStage::kChdir:
      if (err == ENOENT) return Error(Code::kNotFound, fmt::format("working directory {} does not exist", cwd));
      if (err == EACCES)
        return Error(Code::kPermissionDenied,
                     fmt::format("cannot enter working directory {}: permission denied for {}", cwd, user));
      return Error(Code::kInvalidArgument,
                   fmt::format("cannot enter working directory {}: {}", cwd, std::strerror(err)));
    case FailStage::kUser:
      if (err == EINVAL)
        return Error(Code::kInvalidArgument,
                     fmt::format("user: cannot run the command as {}: the id is not valid in this sandbox", user));
      return Error(Code::kInternal, fmt::format("sandbox init could not switch to {} (capabilities, groups or ids): {}",
                                                user, std::strerror(err)));
    case FailStage::kFork:
      return Error(Code::kResourceExhausted,
                   fmt::format("cannot start a process in the sandbox: {} (pids limit reached?)", std::strerror(err)));
    default:
      return Error(Code::kInternal, fmt::format("sandbox init could not start the command: {}", std::strerror(err)));
  }
}

std::optional<ExecResult> start_failure_result(int err, init_protocol::FailStage stage, const std::string& argv0,
                                               const std::string& cwd) {
  using init_protocol::FailStage;
  const bool exec = stage == FailStage::kExec;
  if (!exec && stage != FailStage::kChdir) return std::nullopt;
  const bool missing = err == ENOENT || err == ENOTDIR;
  ExecResult r;
  r.exit_code = missing ? 127 : 126;
  if (exec) {
    r.reason = missing ? "executable_not_found" : "not_executable";
    r.stderr_data = missing ? fmt::format("dsec: {}: command not found\n", argv0)
                            : fmt::format("dsec: {}: cannot execute: {}\n", argv0, std::strerror(err));
  } else {
    r.reason = missing ? "cwd_not_found" : "cwd_not_accessible";
    r.stderr_data = missing ? fmt::format("dsec: working directory {}: no such directory\n", cwd)
                            : fmt::format("dsec: working directory {}: {}\n", cwd, std::strerror(err));
  }
  return r;
}

}  // namespace dsec::init
