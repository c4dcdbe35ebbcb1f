// Which endpoint serves which node. A sandbox id is "<node>-<hex>", so the node that made a sandbox, and the
// endpoint to call for it, follow from the id alone.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::detail {

class NodeTable {
 public:
  explicit NodeTable(std::size_t endpoints = 0) : node_ids_(endpoints) {}

  std::size_t size() const noexcept { return node_ids_.size(); }
  // Records the node id an endpoint answered GET /v1/node with.
  void set(std::size_t endpoint, std::string node_id);
  bool known(std::size_t endpoint) const { return !node_ids_.at(endpoint).empty(); }
  const std::string& node_id(std::size_t endpoint) const { return node_ids_.at(endpoint); }
  bool all_known() const;

  // The endpoint whose node made `sandbox_id`: the longest known node id that, followed by '-', prefixes it
  // (node ids may contain '-' themselves). nullopt when no known node matches.
  std::optional<std::size_t> route(std::string_view sandbox_id) const;

 private:
  std::vector<std::string> node_ids_;  // by endpoint index; empty = not learned yet
};

// Whether `id` is shaped like a sandbox id: 1..256 bytes of letters, digits, '-', '_' and '.', not starting
// with '.'. Ids travel in URL paths, so anything else is refused before a call is made.
bool valid_sandbox_id(std::string_view id);

}  // namespace dsec::detail
