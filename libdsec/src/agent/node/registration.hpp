// An agent's entry in etcd: with --etcd, dsecd writes its endpoint and node info (the JSON of GET /v1/node) under
// <prefix>nodes/<node id>, attached to a lease of --etcd-lease-ttl seconds. Every TTL/3 it renews the lease and
// writes the value again with its current load, so clients watching the prefix see current capacity and load. A node
// that dies stops renewing and its key goes when the lease expires; a clean shutdown revokes the lease, which
// removes the key at once.
//
// etcd being away never stops the agent: registration retries with backoff (logging the first failure, the
// recovery, and a reminder every 30 s), and grants a new lease when the old one expired meanwhile.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cluster/etcd_client.hpp"
#include "dsec/sandbox_info.hpp"

namespace dsec::agent {

struct RegistrationOptions {
  std::vector<std::string> etcd_endpoints;
  std::string prefix = "/dsec/";
  std::string node_id;
  std::string endpoint;  // advertised: where clients reach this agent
  std::chrono::seconds lease_ttl{10};
  // Tests only: stop renewing (the lease then expires) this long after start(). 0: never.
  std::chrono::milliseconds stop_renewing_after{0};
  std::chrono::milliseconds request_timeout{3'000};
  std::chrono::milliseconds max_backoff{2'000};
  // TLS to etcd (cluster::EtcdOptions).
  std::string etcd_ca_file, etcd_client_cert, etcd_client_key;
};

class Registration {
 public:
  // Throws INVALID_ARGUMENT for a bad endpoint list, prefix, or TTL. Contacts nobody until start().
  // `fncall_status`, when given, is the "fncall" object of GET /v1/node as JSON text (empty: none), written into
  // the record beside the node's info.
  Registration(RegistrationOptions options, std::function<NodeInfo()> node_info,
               std::function<std::string()> fncall_status = {});
  ~Registration();
  Registration(const Registration&) = delete;
  Registration& operator=(const Registration&) = delete;

  void start();
  // Stops renewing and revokes the lease (the key goes at once); while etcd cannot be reached it leaves the lease
  // to expire instead. Bounded by the request timeout; idempotent.
  void stop();

  const std::string& key() const noexcept { return key_; }
  // Whether the last attempt to register or renew succeeded.
  bool registered() const;

 private:
  void loop();
  void wait(std::chrono::milliseconds d);

  RegistrationOptions options_;
  std::function<NodeInfo()> node_info_;
  std::function<std::string()> fncall_status_;
  std::string key_;
  std::unique_ptr<cluster::EtcdClient> etcd_;

  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  bool registered_ = false;
  std::int64_t lease_ = 0;
  std::thread thread_;
};

}  // namespace dsec::agent
