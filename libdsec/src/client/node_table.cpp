#include "client/node_table.hpp"

#include <cctype>

namespace dsec::detail {

void NodeTable::set(std::size_t endpoint, std::string node_id) { node_ids_.at(endpoint) = std::move(node_id); }

bool NodeTable::all_known() const {
  for (const auto& id : node_ids_)
    if (id.empty()) return false;
  return true;
}

std::optional<std::size_t> NodeTable::route(std::string_view sandbox_id) const {
  std::optional<std::size_t> best;
  std::size_t best_len = 0;
  for (std::size_t i = 0; i < node_ids_.size(); ++i) {
    const std::string& node = node_ids_[i];
    if (node.empty() || sandbox_id.size() <= node.size() + 1) continue;
    if (sandbox_id.starts_with(node) && sandbox_id[node.size()] == '-' && node.size() >= best_len) {
      if (!best || node.size() > best_len) {
        best = i;
        best_len = node.size();
      }
    }
  }
  return best;
}

bool valid_sandbox_id(std::string_view id) {
  if (id.empty() || id.size() > 256 || id.front() == '.') return false;
  for (char c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

}  // namespace dsec::detail
