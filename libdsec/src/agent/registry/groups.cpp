// Lease groups: sandboxes created into a group live while its lease is renewed and are destroyed together when it
// expires or the group is deleted; <state>/groups/<id>.json keeps each lease's deadline across an agent restart.
#include "agent/registry/registry.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include <fmt/format.h>

#include "agent/registry/registry_internal.hpp"
#include "common/log.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"

namespace dsec::agent {

double Registry::join_group(const SandboxSpec& spec, double t, bool& persist) {
  auto it = groups_.find(spec.group);
  if (it != groups_.end() && t >= it->second.expires_at) {
    retire_group(it);
    it = groups_.end();
  }
  const double ttl = static_cast<double>(spec.group_ttl.count());
  if (it == groups_.end()) it = groups_.emplace(spec.group, Group{}).first;
  Group& group = it->second;
  group.ttl = ttl;
  group.expires_at = std::max(group.expires_at, t + ttl);
  persist = group.expires_at >= group.persisted_expires_at + 1.0;
  return group.expires_at;
}

void Registry::retire_group(std::unordered_map<std::string, Group>::iterator it) {
  for (const auto& id : it->second.members) doomed_.emplace_back(id, it->first);
  groups_.erase(it);
}

GroupInfo Registry::group_info(const std::string& id, const Group& group) const {
  GroupInfo info;
  info.id = id;
  info.node = options_.node_id;
  info.ttl = group.ttl;
  info.expires_at = group.expires_at;
  info.sandbox_count = group.members.size();
  return info;
}

namespace {

Error no_group(const std::string& group, const std::string& node) {
  return Error(Code::kNotFound, fmt::format("group '{}' not found on node '{}' (it has no sandboxes here, was "
                                            "deleted, or its lease expired)",
                                            group, node));
}

Error expired_group(const std::string& group, const std::string& node, double ago) {
  return Error(Code::kNotFound, fmt::format("group '{}' on node '{}': its lease expired {:.1f} s ago; its sandboxes "
                                            "are being destroyed",
                                            group, node, ago));
}

}  // namespace

GroupInfo Registry::renew_group(const std::string& group, double ttl) {
  if (!protocol::valid_scoped_group_id(group))
    throw Error(Code::kInvalidArgument, fmt::format("group: '{}' is not a group id", group));
  if (ttl != 0 && (ttl < 1 || ttl > protocol::kMaxGroupTtlSeconds))
    throw Error(Code::kInvalidArgument,
                fmt::format("ttl: must be from 1 to {} seconds", protocol::kMaxGroupTtlSeconds));
  GroupInfo info;
  bool persist = false;
  {
    std::lock_guard lock(mutex_);
    const double t = now();
    auto it = groups_.find(group);
    if (it == groups_.end()) throw no_group(group, options_.node_id);
    if (t >= it->second.expires_at) {
      double ago = t - it->second.expires_at;
      retire_group(it);
      throw expired_group(group, options_.node_id, ago);
    }
    Group& g = it->second;
    if (ttl != 0) g.ttl = ttl;
    g.expires_at = std::max(g.expires_at, t + g.ttl);
    persist = g.expires_at != g.persisted_expires_at;
    info = group_info(group, g);
  }
  if (persist) persist_group(group);
  return info;
}

GroupInfo Registry::get_group(const std::string& group) const {
  std::vector<std::shared_ptr<Record>> members;
  GroupInfo info;
  {
    std::lock_guard lock(mutex_);
    const double t = now();
    auto it = groups_.find(group);
    if (it == groups_.end()) throw no_group(group, options_.node_id);
    if (t >= it->second.expires_at) throw expired_group(group, options_.node_id, t - it->second.expires_at);
    info = group_info(group, it->second);
    for (const auto& id : it->second.members)
      if (auto r = records_.find(id); r != records_.end()) members.push_back(r->second);
  }
  for (const auto& record : members) info.sandboxes.push_back(record->snapshot());
  std::sort(info.sandboxes.begin(), info.sandboxes.end(), [](const SandboxInfo& a, const SandboxInfo& b) {
    return a.created_at != b.created_at ? a.created_at < b.created_at : a.id < b.id;
  });
  return info;
}

std::vector<GroupInfo> Registry::list_groups() const {
  std::vector<GroupInfo> out;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [id, group] : groups_) out.push_back(group_info(id, group));
  }
  std::sort(out.begin(), out.end(), [](const GroupInfo& a, const GroupInfo& b) { return a.id < b.id; });
  return out;
}

GroupInfo Registry::destroy_group(const std::string& group) {
  GroupInfo info;
  std::vector<std::string> ids;
  {
    std::lock_guard lock(mutex_);
    auto it = groups_.find(group);
    if (it == groups_.end()) throw no_group(group, options_.node_id);
    info = group_info(group, it->second);
    ids.assign(it->second.members.begin(), it->second.members.end());
    groups_.erase(it);
  }
  destroy_ids(ids, fmt::format("group '{}' deleted", group));
  persist_group(group);
  return info;
}

void Registry::persist_group(const std::string& group) {
  if (options_.state_dir.empty()) return;
  std::lock_guard file_lock(group_file_mutex_);
  std::optional<protocol::json> lease;
  {
    std::lock_guard lock(mutex_);
    if (auto it = groups_.find(group); it != groups_.end()) {
      lease =
          protocol::json{{"version", 1}, {"id", group}, {"ttl", it->second.ttl}, {"expires_at", it->second.expires_at}};
      it->second.persisted_expires_at = it->second.expires_at;
    }
  }
  const auto path = groups_dir() / (group + ".json");
  if (!lease) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
      log_warn("remove group lease {}: {}", path.string(), std::strerror(errno));
    ::rmdir(groups_dir().c_str());  // only when it is empty: no directory stays behind a node without groups
    return;
  }
  std::error_code ec;
  std::filesystem::create_directories(groups_dir(), ec);
  if (ec) throw Error(code_for_errno(ec.value()), fmt::format("create {}: {}", groups_dir().string(), ec.message()));
  write_file_replacing(path, lease->dump() + "\n", "group lease");
}

}  // namespace dsec::agent
