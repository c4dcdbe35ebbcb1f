// What every backend that runs processes makes of an exec request before it starts the command: the argv (a shell
// string runs as /bin/sh -c), the environment (PATH, HOME and HOSTNAME by default, then the sandbox's env, then the
// request's), and the working directory (the sandbox's workdir unless the request names one).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "dsec/exec.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent {

struct ExecCommand {
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;
  std::string cwd;

  // env as "K=V" strings.
  std::vector<std::string> env_strings() const;
};

ExecCommand exec_command(const SandboxSpec& spec, const ExecRequest& request, const std::string& hostname);

}  // namespace dsec::agent
