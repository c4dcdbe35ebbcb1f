// Who an exec runs as inside its sandbox. ExecRequest::user (or, when that is empty, SandboxSpec::user) names a user
// of the sandbox's own /etc/passwd, or a numeric "uid" / "uid:gid"; the agent resolves it at every exec against the
// sandbox's files as they are then, the way login would: the primary group from the passwd entry, the supplementary
// groups from /etc/group (every group that lists the user, and the primary one), HOME, USER and LOGNAME from the
// entry. A numeric uid uses its passwd entry where it has one; without one it runs with gid = uid (unless the
// request gives a gid), HOME=/ and no other group. Empty: root, as every exec ran before users existed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/exec.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent {

// At most this many supplementary groups (the primary one included) for one exec.
inline constexpr std::size_t kMaxExecGroups = 256;
// /etc/passwd and /etc/group larger than this are refused (the sandbox writes them; the agent reads them).
inline constexpr std::size_t kMaxUserDatabaseBytes = 4u << 20;

struct ExecUser {
  // False: no user was named; the command runs as root the way it always did (no lookup, HOME=/root by default).
  bool named = false;
  std::uint32_t uid = 0;
  std::uint32_t gid = 0;
  std::vector<std::uint32_t> groups;  // supplementary groups, the primary gid first
  std::string name;                   // of the passwd entry; "" when the uid has none
  std::string home;                   // of the passwd entry; "/" when the uid has none
};

// Resolves `user` (a user field: "" for root, a name, "uid" or "uid:gid") against the text of the sandbox's
// /etc/passwd and /etc/group. Lines that are not well-formed entries (too few or too many fields, a uid or gid that
// is not a number, NIS "+"/"-" lines, bytes a variable cannot hold) are skipped; the first entry of a name or uid
// wins. Throws INVALID_ARGUMENT naming `field` and the value for an unknown name, a bad form, or an id out of range.
ExecUser resolve_exec_user(std::string_view user, std::string_view passwd, std::string_view group,
                           std::string_view field = "user");

// Reads one file of the sandbox (an absolute path inside it); nullopt when it does not exist. Any other failure
// throws dsec::Error.
using SandboxFileReader = std::function<std::optional<std::string>(const std::string& path)>;

// The user an exec runs as: request.user, else spec.user, resolved against the sandbox's /etc/passwd and /etc/group
// as `read` returns them (read only when a user is named). A missing file is an empty one.
ExecUser resolve_exec_user(const SandboxSpec& spec, const ExecRequest& request, const SandboxFileReader& read);

}  // namespace dsec::agent
