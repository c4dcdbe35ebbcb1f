#include "client/discovery.hpp"

#include <algorithm>
#include <thread>

#include <fmt/format.h>

#include "cluster/etcd_client.hpp"
#include "cluster/node_record.hpp"
#include "dsec/error.hpp"

namespace dsec::detail {

EtcdDiscovery::EtcdDiscovery(std::vector<std::string> etcd_endpoints, const std::string& prefix, Callback callback,
                             DiscoveryOptions options)
    : nodes_prefix_(cluster::nodes_prefix(prefix)), callback_(std::move(callback)), options_(std::move(options)) {
  cluster::EtcdOptions etcd;
  etcd.endpoints = std::move(etcd_endpoints);
  etcd.request_timeout = options_.request_timeout;
  etcd.connect_timeout = std::min(options_.request_timeout, std::chrono::milliseconds(1'000));
  etcd.ca_file = options_.ca_file;
  etcd.client_cert = options_.client_cert;
  etcd.client_key = options_.client_key;
  etcd_ = std::make_unique<cluster::EtcdClient>(std::move(etcd));
}

EtcdDiscovery::~EtcdDiscovery() { stop(); }

void EtcdDiscovery::start() {
  {
    std::lock_guard lock(mu_);
    if (started_) return;
    started_ = true;
  }
  cluster::WatchCallbacks callbacks;
  callbacks.on_event = [this](const cluster::WatchEvent& e) {
    if (e.type == cluster::WatchEvent::Type::kPut) on_put(e.key, e.value);
    else on_delete(e.key);
  };
  callbacks.on_resync = [this](const std::vector<cluster::KeyValue>& kvs, std::int64_t) { on_listing(kvs); };
  callbacks.on_error = [this](const Error& e) {
    std::lock_guard lock(mu_);
    last_error_ = e.what();
  };
  cluster::WatchOptions watch;
  watch.list_first = true;
  watch.max_backoff = options_.max_backoff;
  watch_ = etcd_->watch_prefix(nodes_prefix_, 0, std::move(callbacks), watch);
}

void EtcdDiscovery::stop() {
  if (watch_) watch_->stop();
  loaded_cv_.notify_all();
}

bool EtcdDiscovery::watching() const { return watch_ && watch_->connected(); }

std::string EtcdDiscovery::last_error() const {
  std::lock_guard lock(mu_);
  return last_error_;
}

std::vector<NodeEvent> EtcdDiscovery::snapshot(std::chrono::milliseconds wait) {
  std::unique_lock lock(mu_);
  if (!started_) throw Error(Code::kFailedPrecondition, "etcd discovery: snapshot() before start()");
  // Once the first listing's events have been handed to the callback, so that a caller who feeds a table from
  // both sees every node of the snapshot there too; the callback itself (on the discovery's thread) need not wait.
  const bool on_callback_thread = std::this_thread::get_id() == callback_thread_;
  if (!loaded_cv_.wait_for(lock, wait, [&] { return delivered_ || (loaded_ && on_callback_thread); }))
    throw Error(Code::kUnavailable,
                fmt::format("etcd discovery: no node list from etcd ({}) within {} ms{}{}", etcd_->current_endpoint(),
                            wait.count(), last_error_.empty() ? "" : ": ", last_error_));
  std::vector<NodeEvent> out;
  out.reserve(nodes_.size());
  for (const auto& [id, n] : nodes_) out.push_back(n);
  return out;
}

bool EtcdDiscovery::decode(const std::string& key, const std::string& value, NodeEvent& out) {
  std::string id = key.substr(nodes_prefix_.size());
  try {
    if (id.empty() || id.find('/') != std::string::npos)
      throw Error(Code::kInvalidArgument, "the key does not name a node");
    cluster::NodeRecord record = cluster::decode_node_record(value);
    if (record.node.id != id)
      throw Error(Code::kInvalidArgument, fmt::format("the record is of node '{}'", record.node.id));
    out.kind = NodeEvent::Kind::kUp;
    out.node_id = std::move(id);
    out.endpoint = std::move(record.endpoint);
    out.info = std::move(record.node);
    out.fncall = std::move(record.fncall);
    return true;
  } catch (const Error& e) {
    std::lock_guard lock(mu_);
    last_error_ = fmt::format("etcd discovery: ignoring {}: {}", key, e.what());
    return false;
  }
}

void EtcdDiscovery::emit(const std::vector<NodeEvent>& events) {
  if (!callback_) return;
  for (const auto& e : events) {
    try {
      callback_(e);
    } catch (const std::exception& x) {
      std::lock_guard lock(mu_);
      last_error_ = fmt::format("etcd discovery: the node callback threw: {}", x.what());
    }
  }
}

void EtcdDiscovery::on_listing(const std::vector<cluster::KeyValue>& kvs) {
  std::map<std::string, NodeEvent> fresh;
  std::map<std::string, std::string> fresh_raw;
  for (const auto& kv : kvs) {
    NodeEvent e;
    if (!decode(kv.key, kv.value, e)) continue;
    fresh_raw[e.node_id] = kv.value;
    std::string id = e.node_id;
    fresh.emplace(std::move(id), std::move(e));
  }
  std::vector<NodeEvent> events;
  {
    std::lock_guard lock(mu_);
    for (const auto& [id, old] : nodes_) {
      if (fresh.count(id)) continue;
      NodeEvent down = old;
      down.kind = NodeEvent::Kind::kDown;
      events.push_back(std::move(down));
    }
    for (const auto& [id, e] : fresh) {
      auto it = raw_.find(id);
      if (it == raw_.end() || it->second != fresh_raw[id]) events.push_back(e);
    }
    nodes_ = std::move(fresh);
    raw_ = std::move(fresh_raw);
    loaded_ = true;
    callback_thread_ = std::this_thread::get_id();
  }
  emit(events);
  {
    std::lock_guard lock(mu_);
    delivered_ = true;
  }
  loaded_cv_.notify_all();
}

void EtcdDiscovery::on_put(const std::string& key, const std::string& value) {
  NodeEvent e;
  if (!decode(key, value, e)) {
    // A record that cannot be read says nothing about where the node is: it leaves the table.
    on_delete(key);
    return;
  }
  {
    std::lock_guard lock(mu_);
    nodes_[e.node_id] = e;
    raw_[e.node_id] = value;
  }
  emit({e});
}

void EtcdDiscovery::on_delete(const std::string& key) {
  std::string id = key.substr(std::min(key.size(), nodes_prefix_.size()));
  NodeEvent down;
  {
    std::lock_guard lock(mu_);
    auto it = nodes_.find(id);
    if (it == nodes_.end()) return;
    down = std::move(it->second);
    nodes_.erase(it);
    raw_.erase(id);
  }
  down.kind = NodeEvent::Kind::kDown;
  emit({down});
}

}  // namespace dsec::detail
