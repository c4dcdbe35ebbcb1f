// What every backend that runs processes makes of an exec request before it starts the command: the argv (a shell
// string runs as /bin/sh -c), the environment (PATH, HOME and HOSTNAME by default, USER and LOGNAME too for a named
// user with a passwd entry, then the sandbox's env, then the request's), the working directory (the sandbox's
// workdir unless the request names one), and who it runs as (exec_user.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "agent/backends/command/exec_user.hpp"
#include "dsec/exec.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent {

struct ExecCommand {
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;
  std::string cwd;
  // Who it runs as. `named` false: root as always (the init wires then carry no user, so an older dsec-init still
  // starts it); true: uid, gid and the supplementary groups (the primary gid first) are set before the exec.
  bool named_user = false;
  std::uint32_t uid = 0;
  std::uint32_t gid = 0;
  std::vector<std::uint32_t> groups;

  // env as "K=V" strings.
  std::vector<std::string> env_strings() const;
  // The command as dsec-init's start payload (init_protocol.hpp); INVALID_ARGUMENT over its size limit.
  std::string start_payload() const;
};

ExecCommand exec_command(const SandboxSpec& spec, const ExecRequest& request, const std::string& hostname,
                         const ExecUser& user = {});

}  // namespace dsec::agent
