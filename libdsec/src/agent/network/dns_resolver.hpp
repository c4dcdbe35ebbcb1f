// The agent's DNS resolver for sandboxes (docs/networking.md): every UDP query a sandbox sends to port 53, whatever
// the address, is redirected here. It answers only the names the sandbox's rules allow, asks the node's upstream
// resolver for their IPv4 addresses, and pins each answer into the sandbox's allowed set before the answer leaves,
// so a name rule admits exactly the addresses handed out for that name and a connection to any other address is
// refused unless an address rule allows it. Queries are parsed and answers built with ldns; the packets come from
// code the agent does not trust, so each is checked whole and anything odd is dropped or refused.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace dsec::agent::network {

struct ResolvedAddress {
  std::uint32_t address = 0;  // IPv4, host byte order
  std::uint32_t ttl = 0;      // seconds, as the upstream resolver gave it
};

// What the resolver asks the node's network, from its own thread.
struct DnsDecisions {
  // Whether the sandbox at `source` may resolve `name` (normalized); nullopt when `source` is no sandbox's address
  // (the query is dropped unanswered).
  std::function<std::optional<bool>(std::uint32_t source, const std::string& name)> may_resolve;
  // Admits the addresses answered for `name` to the sandbox at `source`, before the answer is sent; false when the
  // name is no longer allowed (its rules changed meanwhile) or the pins could not be made.
  std::function<bool(std::uint32_t source, const std::string& name, const std::vector<ResolvedAddress>&)> pin;
  // Called every few seconds: pins past their time go.
  std::function<void()> expire;
};

struct DnsUpstream {
  std::uint32_t address = 0;  // 0: none known; allowed names then answer SERVFAIL
  std::uint16_t port = 53;
};
// "192.0.2.53" or "192.0.2.53:5353"; INVALID_ARGUMENT naming --dns-upstream otherwise.
DnsUpstream parse_dns_upstream(const std::string& text);
// The first IPv4 nameserver of a resolv.conf, if any.
std::optional<DnsUpstream> upstream_from_resolv_conf(const std::string& path = "/etc/resolv.conf");

class DnsResolver {
 public:
  // Binds a UDP port of its own on every address of the node (the redirect's target) and starts its thread.
  DnsResolver(DnsUpstream upstream, DnsDecisions decisions);
  ~DnsResolver();
  DnsResolver(const DnsResolver&) = delete;
  DnsResolver& operator=(const DnsResolver&) = delete;

  std::uint16_t port() const;

  // Limits on what one sandbox can make the resolver hold.
  static constexpr std::size_t kPendingPerSource = 32;
  static constexpr std::size_t kPendingInAll = 4096;
  static constexpr std::uint32_t kMaxAnswerTtl = 600;  // seconds the sandbox may cache an answer

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsec::agent::network
