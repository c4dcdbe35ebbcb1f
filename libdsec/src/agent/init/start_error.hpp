// The error a caller gets when dsec-init could not start its command, by the stage that failed: the same words for
// a container and a VM (a missing binary is NOT_FOUND, a missing working directory too, a full pids limit
// RESOURCE_EXHAUSTED).
#pragma once

#include <string>

#include "agent/init/init_protocol.hpp"
#include "dsec/error.hpp"

namespace dsec::init {

// `user` says who the command was to run as ("uid 1000, gid 1000"), for a failure to become that user.
Error start_error(int err, init_protocol::FailStage stage, const std::string& argv0, const std::string& cwd,
                  const std::string& user = "uid 0");

}  // namespace dsec::init
