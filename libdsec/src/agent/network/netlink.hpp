// The few rtnetlink requests a sandbox's network needs (veth pairs, addresses, links up, a default route), over a
// netlink socket of the agent's network namespace or of a sandbox's.
#pragma once

#include <linux/netlink.h>

#include <cstdint>
#include <functional>
#include <string>

#include "common/unique_fd.hpp"

namespace dsec::agent::network {

class Netlink {
 public:
  // A socket in the agent's own network namespace.
  Netlink();
  // A socket in the network namespace `netns_fd` (the calling thread enters it for the socket() call only).
  explicit Netlink(int netns_fd);

  // A veth pair: `name` here, `peer` created straight in the namespace `peer_netns_fd`.
  void create_veth(const std::string& name, const std::string& peer, int peer_netns_fd);
  void delete_link(const std::string& name);  // a missing link is fine
  int index_of(const std::string& name);      // 0 when there is no such link
  void set_up(int index);
  void add_address(int index, std::uint32_t address, int prefix);  // IPv4, host byte order
  void add_default_route(std::uint32_t gateway);
  // Shapes what the link sends to `bytes_per_second` (a token bucket filter as its root queueing discipline).
  void set_rate_limit(int index, std::uint64_t bytes_per_second);

 private:
  // Sends one request and reads the answers to it: each non-error message goes to `on_answer` until it says done
  // (true); answers 0 then, or the errno of the kernel's error or acknowledgement message (0: acknowledged).
  int exchange(void* message, std::size_t size, const char* what,
               const std::function<bool(const nlmsghdr&)>& on_answer);
  // Sends one request and waits for its acknowledgement; throws on an error answer (naming `what`).
  void request(void* message, std::size_t size, const char* what, bool missing_ok = false);

  UniqueFd fd_;
  std::uint32_t seq_ = 0;
};

}  // namespace dsec::agent::network
