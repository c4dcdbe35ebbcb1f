#include "agent/backends/command/exec_command.hpp"

#include <fmt/format.h>

#include "common/wire/init_protocol.hpp"
#include "dsec/error.hpp"

namespace dsec::agent {

std::vector<std::string> ExecCommand::env_strings() const {
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [k, v] : env) out.push_back(fmt::format("{}={}", k, v));
  return out;
}

ExecCommand exec_command(const SandboxSpec& spec, const ExecRequest& request, const std::string& hostname,
                         const ExecUser& user) {
  ExecCommand c;
  c.argv = request.shell.empty() ? request.argv : std::vector<std::string>{"/bin/sh", "-c", request.shell};
  // UTF-8 unless the spec or the exec says otherwise: Python, git and compilers then read and print non-ASCII as
  // a user's terminal would (C.UTF-8 needs no locale files).
  c.env = {{"PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
           {"HOME", "/root"},
           {"HOSTNAME", hostname},
           {"LANG", "C.UTF-8"}};
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
  c.cwd = !request.cwd.empty() ? request.cwd : !spec.workdir.empty() ? spec.workdir : "/";
  return c;
}

std::string ExecCommand::start_payload() const {
  std::string payload;
  auto u32 = [&](std::uint32_t v) { payload.append(reinterpret_cast<const char*>(&v), 4); };
  auto str = [&](std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    payload.append(s);
  };
  u32(static_cast<std::uint32_t>(argv.size()));
  for (const auto& a : argv) str(a);
  u32(static_cast<std::uint32_t>(env.size()));
  for (const auto& kv : env_strings()) str(kv);
  str(cwd);
  if (named_user) {  // the user part; root by default goes without (an older dsec-init knows none)
    u32(uid);
    u32(gid);
    u32(static_cast<std::uint32_t>(groups.size()));
    for (std::uint32_t g : groups) u32(g);
  }
  if (payload.size() > init_protocol::kMaxRequestBytes)
    throw Error(Code::kInvalidArgument, "argv and env together exceed 4 MiB");
  return payload;
}

}  // namespace dsec::agent
