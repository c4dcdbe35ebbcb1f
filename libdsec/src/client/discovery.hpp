// Which agents exist, learned from etcd: agents register under <prefix>nodes/<node id> with a lease (see
// agent/node/registration.hpp); EtcdDiscovery lists that prefix, then watches it, and tells its callback about every
// node that appears, changes (its load, images, ...) or goes away. A node whose agent died goes away when its lease
// expires (etcd deletes the key), one that shut down cleanly at once (it revokes its lease).
//
// The client's node table is fed from the callback; snapshot() gives the table as it is now, for a first create
// that cannot wait for events.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "dsec/sandbox_info.hpp"

namespace dsec::cluster {
class EtcdClient;
class EtcdWatch;
struct KeyValue;
}  // namespace dsec::cluster

namespace dsec::detail {

struct NodeEvent {
  enum class Kind { kUp, kDown };
  // kUp: the node is new or its record changed (endpoint, capacity, load). kDown: its key is gone (lease expired or
  // revoked, or deleted); endpoint and info are the last ones known.
  Kind kind = Kind::kUp;
  std::string node_id;
  std::string endpoint;  // "http://10.0.0.7:7070": what the agent advertised
  NodeInfo info;         // the node's GET /v1/node, as of its last renewal
  std::string fncall;    // its "fncall" object (function-call pools) as JSON text; empty: it serves none
};

struct DiscoveryOptions {
  std::chrono::milliseconds request_timeout{5'000};  // one etcd request
  std::chrono::milliseconds max_backoff{2'000};      // between attempts while etcd cannot be reached
  std::string ca_file, client_cert, client_key;      // TLS to https:// etcd members
};

class EtcdDiscovery {
 public:
  using Callback = std::function<void(const NodeEvent&)>;

  // `etcd_endpoints`: client URLs of the etcd members; `prefix`: the agents' --etcd-prefix ("/dsec/"). The
  // callback runs on the discovery's own thread, one event at a time in etcd's order, and never after stop()
  // returns; it may call snapshot(). Throws INVALID_ARGUMENT for a bad endpoint or an empty prefix. Contacts etcd
  // only from start().
  EtcdDiscovery(std::vector<std::string> etcd_endpoints, const std::string& prefix, Callback callback,
                DiscoveryOptions options = {});
  ~EtcdDiscovery();
  EtcdDiscovery(const EtcdDiscovery&) = delete;
  EtcdDiscovery& operator=(const EtcdDiscovery&) = delete;

  // Lists the nodes (a kUp for each), then follows changes, on a thread of its own; while etcd cannot be reached
  // it retries with backoff. A broken stream resumes from the last revision seen, so nothing is missed; when that
  // history was compacted away it re-lists and reports only the differences.
  void start();
  // Stops following etcd. Idempotent; must not be called from the callback.
  void stop();

  // The nodes known now (kind kUp, sorted by node id). Before the first listing has arrived it waits up to `wait`
  // for it (and for the callback to have been told about each of its nodes), then throws UNAVAILABLE with why etcd
  // could not be read; FAILED_PRECONDITION before start().
  std::vector<NodeEvent> snapshot(std::chrono::milliseconds wait = std::chrono::milliseconds(5'000));

  // Whether the watch stream is open now.
  bool watching() const;
  // The last problem seen: etcd unreachable, a record that could not be decoded. Empty when none.
  std::string last_error() const;
  // The key prefix watched: "<prefix>nodes/".
  const std::string& nodes_prefix() const noexcept { return nodes_prefix_; }

 private:
  void on_listing(const std::vector<cluster::KeyValue>& kvs);
  void on_put(const std::string& key, const std::string& value);
  void on_delete(const std::string& key);
  // Decodes one record into a kUp event; false (with last_error set) when it is not a valid record.
  bool decode(const std::string& key, const std::string& value, NodeEvent& out);
  void emit(const std::vector<NodeEvent>& events);

  std::string nodes_prefix_;
  Callback callback_;
  DiscoveryOptions options_;
  std::unique_ptr<cluster::EtcdClient> etcd_;
  std::unique_ptr<cluster::EtcdWatch> watch_;

  mutable std::mutex mu_;
  std::condition_variable loaded_cv_;
  bool started_ = false;
  bool loaded_ = false;     // the first listing is in nodes_
  bool delivered_ = false;  // ... and its events went to the callback
  std::thread::id callback_thread_;
  std::map<std::string, NodeEvent> nodes_;  // by node id
  std::map<std::string, std::string> raw_;  // node id -> its record as stored, to report only real changes
  std::string last_error_;
};

}  // namespace dsec::detail
