#include "client/node_table.hpp"

#include <algorithm>
#include <cctype>

#include "client/endpoint.hpp"

namespace dsec::detail {

Node::Node(std::string endpoint_text, std::shared_ptr<const Credentials> credentials)
    : endpoint(std::move(endpoint_text)), transport(parse_endpoint(endpoint), std::move(credentials)) {}

NodePtr NodeTable::add(const std::string& endpoint) {
  std::lock_guard lock(mu_);
  for (auto& n : nodes_)
    if (n->endpoint == endpoint) {
      n->gone = false;
      return n;
    }
  nodes_.push_back(std::make_shared<Node>(endpoint, credentials_));
  return nodes_.back();
}

NodePtr NodeTable::up(const std::string& id, const std::string& endpoint, const NodeInfo& info) {
  std::lock_guard lock(mu_);
  NodePtr node;
  for (auto& n : nodes_)
    if (n->endpoint == endpoint || (!id.empty() && n->id == id && !n->gone)) node = n;
  if (node && node->endpoint != endpoint) {
    node->gone = true;  // the node moved: a fresh entry for its new address
    node = nullptr;
  }
  if (!node) {
    nodes_.push_back(std::make_shared<Node>(endpoint, credentials_));
    node = nodes_.back();
  }
  node->gone = false;
  node->id = id;
  node->info = info;
  node->info_at = SteadyClock::now();
  node->cpu_placed = 0;
  node->memory_placed = 0;
  node->sandboxes_placed = 0;
  return node;
}

void NodeTable::down(const std::string& id) {
  std::lock_guard lock(mu_);
  for (auto& n : nodes_)
    if (n->id == id) n->gone = true;
}

NodeView NodeTable::view_locked(const NodePtr& n, SteadyClock::time_point now) const {
  return NodeView{
      n,       n->id,         n->info,          n->info_at,          n->failures, n->ejected_until > now,
      n->gone, n->cpu_placed, n->memory_placed, n->sandboxes_placed, n->fncall,   n->calls_in_flight.load()};
}

std::vector<NodeView> NodeTable::view() const {
  std::lock_guard lock(mu_);
  auto now = SteadyClock::now();
  std::vector<NodeView> out;
  out.reserve(nodes_.size());
  for (const auto& n : nodes_)
    if (!n->gone) out.push_back(view_locked(n, now));
  return out;
}

std::size_t NodeTable::live_count() const {
  std::lock_guard lock(mu_);
  return static_cast<std::size_t>(
      std::count_if(nodes_.begin(), nodes_.end(), [](const NodePtr& n) { return !n->gone; }));
}

NodeView NodeTable::view(const NodePtr& node) const {
  std::lock_guard lock(mu_);
  return view_locked(node, SteadyClock::now());
}

void NodeTable::learn(const NodePtr& node, const std::string& id) {
  if (id.empty()) return;
  std::lock_guard lock(mu_);
  node->id = id;
}

void NodeTable::set_info(const NodePtr& node, NodeInfo info) {
  std::lock_guard lock(mu_);
  if (!info.id.empty()) node->id = info.id;
  node->info = std::move(info);
  node->info_at = SteadyClock::now();
  node->cpu_placed = 0;
  node->memory_placed = 0;
  node->sandboxes_placed = 0;
}

void NodeTable::set_fncall(const NodePtr& node, std::optional<FnCallNodeState> state) {
  std::lock_guard lock(mu_);
  node->fncall = std::move(state);
}

void NodeTable::placed(const NodePtr& node, double cpu, std::uint64_t memory, std::size_t count) {
  std::lock_guard lock(mu_);
  node->cpu_placed += cpu;
  node->memory_placed += memory;
  node->sandboxes_placed += count;
}

void NodeTable::succeeded(const NodePtr& node) {
  std::lock_guard lock(mu_);
  node->failures = 0;
  node->ejected_until = {};
}

bool NodeTable::failed(const NodePtr& node) {
  std::lock_guard lock(mu_);
  ++node->failures;
  if (node->failures < kEjectAfter) return false;
  const int doublings = std::min(node->failures - kEjectAfter, 16);
  auto pause = std::min<std::chrono::milliseconds>(kEjectBase * (1 << doublings), kEjectMax);
  node->ejected_until = SteadyClock::now() + pause;
  return true;
}

NodePtr NodeTable::route(std::string_view sandbox_id) const {
  std::lock_guard lock(mu_);
  NodePtr best;
  std::size_t best_len = 0;
  for (const auto& n : nodes_) {
    const std::string& id = n->id;
    if (id.empty() || sandbox_id.size() <= id.size() + 1) continue;
    if (!sandbox_id.starts_with(id) || sandbox_id[id.size()] != '-') continue;
    // Longest id wins; among equals, a live node over one that has gone.
    if (!best || id.size() > best_len || (id.size() == best_len && best->gone && !n->gone)) {
      best = n;
      best_len = id.size();
    }
  }
  return best;
}

std::vector<NodePtr> NodeTable::unidentified() const {
  std::lock_guard lock(mu_);
  std::vector<NodePtr> out;
  for (const auto& n : nodes_)
    if (n->id.empty() && !n->gone) out.push_back(n);
  return out;
}

bool valid_sandbox_id(std::string_view id) {
  if (id.empty() || id.size() > 256 || id.front() == '.') return false;
  for (char c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

}  // namespace dsec::detail
