// A sandbox's network, the same for every backend: none (loopback only, the default), egress through an
// allowlist, or open egress. See docs/networking.md.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace dsec {

// One rule of an egress allowlist. Rules are tried in order; the first that matches a connection decides (allow
// or deny); a connection no rule matches is refused. A rule names either addresses (cidr) or a host name (host):
// a name rule matches connections to the addresses the agent's DNS resolver answered for that name, and decides
// which names the resolver answers at all (the first name rule that matches a name: allow answers it, deny and no
// match answer NXDOMAIN).
struct NetworkRule {
  bool allow = true;
  std::string cidr;              // "10.20.0.0/16", "192.0.2.7" (a /32); IPv4
  std::string host;              // or a name: "pypi.mirror.internal", "*.example.org" (its subdomains, any depth)
  std::string protocol = "any";  // "tcp", "udp", "icmp" or "any"
  std::uint16_t port_min = 0;    // destination ports port_min..port_max (tcp, udp); 0..0: every port
  std::uint16_t port_max = 0;
  bool operator==(const NetworkRule&) const = default;
};

struct NetworkPolicy {
  std::string mode = "none";       // "none", "egress" (rules), "open" (all egress an agent allows)
  std::vector<NetworkRule> rules;  // egress only; at most 64
  bool operator==(const NetworkPolicy&) const = default;
};

// What a sandbox's network carried (Sandbox::network_usage, GET /v1/sandboxes/{id}/network/usage).
struct NetworkUsage {
  std::uint64_t bytes_out = 0, packets_out = 0;  // sent by the sandbox, since its link was made
  std::uint64_t bytes_in = 0, packets_in = 0;    // received by it
  std::uint64_t refused = 0;  // packets of new connections its rules (or what is always blocked) refused
  // Names the agent's resolver answered for it and the addresses they admit now.
  std::map<std::string, std::vector<std::string>> resolved;
  bool operator==(const NetworkUsage&) const = default;
};

}  // namespace dsec
