// What the HTTP server tells its owner about connections and about the requests it answers itself (refusals, bodies
// it could not parse): the agent's and the gateway's metrics count them.
#pragma once

#include <atomic>
#include <cstddef>
#include <string_view>

namespace dsec::agent {

class ServerEvents {
 public:
  virtual ~ServerEvents() = default;
  virtual void connection_opened() = 0;
  virtual void connection_closed() = 0;
  virtual void connection_refused() = 0;
  virtual void tls_handshake_failed() = 0;
  virtual void count_request(std::string_view route, std::string_view method, int status) = 0;
};

// The least a server's owner keeps: how many connections are open. For a program that serves no metrics of its own
// (the gateway).
class ConnectionCount final : public ServerEvents {
 public:
  void connection_opened() override { open_.fetch_add(1, std::memory_order_relaxed); }
  void connection_closed() override { open_.fetch_sub(1, std::memory_order_relaxed); }
  void connection_refused() override {}
  void tls_handshake_failed() override {}
  void count_request(std::string_view, std::string_view, int) override {}
  std::size_t open() const noexcept { return open_.load(std::memory_order_relaxed); }

 private:
  std::atomic<std::size_t> open_{0};
};

}  // namespace dsec::agent
