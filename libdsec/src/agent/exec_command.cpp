#include "agent/exec_command.hpp"

namespace dsec::agent {

std::vector<std::string> ExecCommand::env_strings() const {
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(k + "=" + v);
  return out;
}

ExecCommand exec_command(const SandboxSpec& spec, const ExecRequest& request, const std::string& hostname,
                         const ExecUser& user) {
  ExecCommand c;
  c.argv = request.shell.empty() ? request.argv : std::vector<std::string>{"/bin/sh", "-c", request.shell};
  // UTF-8 unless the spec or the exec says otherwise: Python, git and compilers then read and print non-ASCII as
  // a user's terminal would (C.UTF-8 needs no locale files).
  c.env = {{"PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}, {"HOME", "/root"},
           {"HOSTNAME", hostname}, {"LANG", "C.UTF-8"}};
  if (user.named) {
    c.named_user = true;
    c.uid = user.uid;
    c.gid = user.gid;
    c.groups = user.groups;
    c.env["HOME"] = user.home.empty() ? "/" : user.home;
    if (!user.name.empty()) {
      c.env["USER"] = user.name;
      c.env["LOGNAME"] = user.name;
    }
  }
  for (const auto& [k, v] : spec.env) c.env[k] = v;
  for (const auto& [k, v] : request.env) c.env[k] = v;
  c.cwd = request.cwd.empty() ? spec.workdir : request.cwd;
  return c;
}

}  // namespace dsec::agent
