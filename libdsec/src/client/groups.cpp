// Lease groups on the nodes that hold their members: renewing a group's lease, destroying it.
#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "client/client_core.hpp"
#include "client/client_core_internal.hpp"
#include "common/protocol.hpp"

namespace dsec::detail {

std::vector<NodePtr> ClientCore::nodes_of(const std::vector<std::string>& members) {
  std::vector<NodePtr> out;
  auto deadline = deadline_after();
  for (const auto& id : members) {
    NodePtr node;
    try {
      node = route(id, deadline);
    } catch (const NodeLost&) {
      node = nodes_.route(id);  // its node is gone or ejected: still worth a try for the group as a whole
    } catch (const Error&) {
      continue;
    }
    if (node && std::find(out.begin(), out.end(), node) == out.end()) out.push_back(node);
  }
  return out;
}

void ClientCore::renew_group(const std::string& group, const std::vector<std::string>& members,
                             std::chrono::seconds ttl) {
  check_open();
  const std::string body = protocol::json{{"ttl", ttl.count()}}.dump();
  std::vector<std::string> failed;
  for (const NodePtr& node : nodes_of(members)) {
    auto deadline = deadline_after();
    try {
      retrying(deadline, [&] {
        return call(node, http_request("POST", fmt::format("/v1/groups/{}/renew", url_escape(group)), body, kJson),
                    deadline);
      });
    } catch (const Error& e) {
      failed.push_back(fmt::format("{} ({})", node->endpoint, e.what()));
    }
  }
  if (!failed.empty())
    throw Error(Code::kUnavailable, fmt::format("group {}: lease not renewed on {}", group, fmt::join(failed, "; ")));
}

void ClientCore::destroy_group(const std::string& group, const std::vector<std::string>& members) {
  std::vector<std::string> failed;
  for (const NodePtr& node : nodes_of(members)) {
    auto deadline = deadline_after();
    try {
      retrying(deadline, [&] {
        return call(node, http_request("DELETE", fmt::format("/v1/groups/{}", url_escape(group))), deadline);
      });
    } catch (const Error& e) {
      if (e.code() == Code::kNotFound) continue;
      failed.push_back(fmt::format("{} ({})", node->endpoint, e.what()));
    }
  }
  if (!failed.empty())
    throw Error(Code::kUnavailable, fmt::format("group {}: not destroyed on {}", group, fmt::join(failed, "; ")));
}

}  // namespace dsec::detail
