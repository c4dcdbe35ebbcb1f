#include "agent/backends/command/exec_user.hpp"

#include <algorithm>
#include <charconv>

#include <fmt/format.h>

#include "common/protocol.hpp"
#include "dsec/error.hpp"

namespace dsec::agent {
namespace {

struct PasswdEntry {
  std::string_view name;
  std::uint64_t uid = 0;
  std::uint64_t gid = 0;
  std::string_view home;
};

struct GroupEntry {
  std::uint64_t gid = 0;
  std::string_view members;  // comma-separated names
};

// Splits `line` at ':' into exactly `n` fields; false for another count.
bool split_fields(std::string_view line, std::string_view* fields, std::size_t n) {
  std::size_t i = 0;
  for (;;) {
    std::size_t colon = line.find(':');
    if (i == n) return false;
    fields[i++] = line.substr(0, colon);
    if (colon == std::string_view::npos) break;
    line.remove_prefix(colon + 1);
  }
  return i == n;
}

// A decimal id as passwd and group write it; nullopt for anything else (empty, signs, spaces, past 2^32-1).
std::optional<std::uint64_t> parse_id(std::string_view text) {
  if (text.empty() || text.size() > 10) return std::nullopt;
  std::uint64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v > 0xffffffffull) return std::nullopt;
  return v;
}

// Calls `on_line` with each line of `text` that can be an entry: not empty, not a comment, no NUL (a variable
// cannot carry one), not a NIS compat line ("+", "-").
template <typename F>
void for_each_line(std::string_view text, F&& on_line) {
  while (!text.empty()) {
    std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line.front() == '#' || line.front() == '+' || line.front() == '-') continue;
    if (line.find('\0') != std::string_view::npos) continue;
    if (!on_line(line)) return;
  }
}

std::optional<PasswdEntry> parse_passwd_line(std::string_view line) {
  std::string_view f[7];
  if (!split_fields(line, f, 7) || f[0].empty()) return std::nullopt;
  auto uid = parse_id(f[2]);
  auto gid = parse_id(f[3]);
  if (!uid || !gid) return std::nullopt;
  return PasswdEntry{f[0], *uid, *gid, f[5]};
}

std::optional<GroupEntry> parse_group_line(std::string_view line) {
  std::string_view f[4];
  if (!split_fields(line, f, 4) || f[0].empty()) return std::nullopt;
  auto gid = parse_id(f[2]);
  if (!gid) return std::nullopt;
  return GroupEntry{*gid, f[3]};
}

bool lists_member(std::string_view members, std::string_view name) {
  while (!members.empty()) {
    std::size_t comma = members.find(',');
    std::string_view m = members.substr(0, comma);
    // Some tools write "a, b": a member is compared without the spaces around it.
    while (!m.empty() && m.front() == ' ') m.remove_prefix(1);
    while (!m.empty() && m.back() == ' ') m.remove_suffix(1);
    if (m == name) return true;
    if (comma == std::string_view::npos) break;
    members.remove_prefix(comma + 1);
  }
  return false;
}

}  // namespace

ExecUser resolve_exec_user(std::string_view user, std::string_view passwd, std::string_view group,
                           std::string_view field) {
  const protocol::UserRef ref = protocol::parse_user(user, field);
  ExecUser out;
  if (user.empty()) return out;
  out.named = true;

  std::optional<PasswdEntry> entry;
  for_each_line(passwd, [&](std::string_view line) {
    auto e = parse_passwd_line(line);
    if (!e) return true;
    if (ref.uid ? e->uid == *ref.uid : e->name == ref.name) {
      entry = e;
      return false;
    }
    return true;
  });
  if (!entry && !ref.uid)
    throw Error(Code::kInvalidArgument,
                fmt::format("{}: '{}' is not a user of this sandbox (no such name in its /etc/passwd)", field, user));
  if (entry && (entry->uid > protocol::kMaxUserId || entry->gid > protocol::kMaxUserId))
    throw Error(Code::kInvalidArgument,
                fmt::format("{}: '{}' has uid {} and gid {} in the sandbox's /etc/passwd; dsec runs commands as ids "
                            "0 to {} only",
                            field, user, entry->uid, entry->gid, protocol::kMaxUserId));

  if (ref.uid) {
    out.uid = *ref.uid;
    out.gid = ref.gid ? *ref.gid : entry ? static_cast<std::uint32_t>(entry->gid) : *ref.uid;
  } else {
    out.uid = static_cast<std::uint32_t>(entry->uid);
    out.gid = static_cast<std::uint32_t>(entry->gid);
  }
  out.groups.push_back(out.gid);
  if (!entry) {
    out.home =
        std::string(1, '/');  // not `= "/"`: GCC 12 misreads that assignment here as an overlapping copy (-Wrestrict)
    return out;
  }
  out.name = std::string(entry->name);
  out.home = entry->home.empty() ? "/" : std::string(entry->home);
  for_each_line(group, [&](std::string_view line) {
    auto g = parse_group_line(line);
    if (!g || g->gid > protocol::kMaxUserId || !lists_member(g->members, entry->name)) return true;
    auto gid = static_cast<std::uint32_t>(g->gid);
    if (std::find(out.groups.begin(), out.groups.end(), gid) != out.groups.end()) return true;
    if (out.groups.size() == kMaxExecGroups)
      throw Error(Code::kInvalidArgument, fmt::format("{}: '{}' is in more than {} groups of the sandbox's /etc/group",
                                                      field, user, kMaxExecGroups));
    out.groups.push_back(gid);
    return true;
  });
  return out;
}

ExecUser resolve_exec_user(const SandboxSpec& spec, const ExecRequest& request, const SandboxFileReader& read) {
  const std::string& user = request.user.empty() ? spec.user : request.user;
  if (user.empty()) return {};
  protocol::parse_user(user, "user");  // the form first: a bad one costs no read
  auto load = [&](const std::string& path) {
    try {
      return read(path).value_or(std::string());
    } catch (const Error& e) {
      throw Error(e.code(), fmt::format("user: '{}': reading the sandbox's {}: {}", user, path, e.what()));
    }
  };
  std::string passwd = load("/etc/passwd");
  std::string group = load("/etc/group");
  return resolve_exec_user(user, passwd, group, "user");
}

}  // namespace dsec::agent
