// The error a caller gets when dsec-init could not start its command, by the stage that failed: the same words for
// a container and a VM (a missing binary is NOT_FOUND, a missing working directory too, a full pids limit
// RESOURCE_EXHAUSTED).
#pragma once

#include <optional>
#include <string>

#include "common/wire/init_protocol.hpp"
#include "dsec/error.hpp"
#include "dsec/exec.hpp"

namespace dsec::init {

// `user` says who the command was to run as ("uid 1000, gid 1000"), for a failure to become that user.
Error start_error(int err, init_protocol::FailStage stage, const std::string& argv0, const std::string& cwd,
                  const std::string& user = "uid 0");

// When the command could not start because of what it names, its executable (missing, or not one it may run) or
// its working directory (missing, or not one it may enter), the exec's answer is a result as a shell gives it: exit
// code 127 (not found) or 126 (not usable), ExecResult::reason, and a line on stderr. nullopt for every other
// failure (start_error's).
std::optional<ExecResult> start_failure_result(int err, init_protocol::FailStage stage, const std::string& argv0,
                                               const std::string& cwd);

}  // namespace dsec::init
