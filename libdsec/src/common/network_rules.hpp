// Checking a network policy (dsec/network.hpp) and compiling its first-match rules into disjoint boxes of what is
// allowed: the client checks before it sends, the agent before it applies, and the agent's nftables sets hold the
// boxes (agent/network/).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/network.hpp"

namespace dsec::network {

inline constexpr std::size_t kMaxRules = 64;
// The port dimension: 0..65535 are ports, kNoPort stands for packets without ports (icmp): a rule without ports
// covers it, one with ports does not.
inline constexpr std::uint32_t kNoPort = 65536;

struct Cidr {
  std::uint32_t address = 0;  // host byte order, the network's first address
  int prefix = 32;
  std::uint32_t first() const { return address; }
  std::uint32_t last() const {
    if (prefix >= 32) return address;  // (a shift by 32 would be undefined)
    return address | (0xFFFFFFFFu >> prefix);
  }
  bool contains(std::uint32_t a) const { return a >= first() && a <= last(); }
};

// "10.0.0.0/8", "192.0.2.7" (a /32). Host bits must be zero ("10.0.0.1/8" is refused: it is ambiguous).
std::optional<Cidr> parse_cidr(std::string_view text);
std::string to_string(const Cidr& c);
std::string ipv4_to_string(std::uint32_t address);

// Throws Error(INVALID_ARGUMENT) naming the field ("network.rules[2].cidr") when the policy is malformed.
void validate(const NetworkPolicy& policy);

// A box of (destination address, protocol, destination port) that is allowed; ranges inclusive.
struct AllowedBox {
  std::uint32_t addr_lo = 0, addr_hi = 0;
  std::uint32_t proto_lo = 0, proto_hi = 255;
  std::uint32_t port_lo = 0, port_hi = kNoPort;
  bool operator==(const AllowedBox&) const = default;
};

// What an egress policy's address rules allow, as disjoint boxes: each allow rule minus every address rule before
// it (name rules allow what their pins add, compile_pin). A policy that would
// need more than kMaxBoxes is INVALID_ARGUMENT.
inline constexpr std::size_t kMaxBoxes = 4096;
std::vector<AllowedBox> compile_egress(const NetworkPolicy& policy);

// Host names (NetworkRule::host): labels of letters, digits, '-' and '_' (1-63 each, 253 in all), optionally
// "*." first for every subdomain of what follows (not the name itself). Case does not matter.
bool valid_host_pattern(std::string_view pattern);
// A name as asked in DNS, lower-cased and without its final dot; "" when it cannot be a host name.
std::string normalize_name(std::string_view name);
bool host_matches(std::string_view pattern, std::string_view normalized_name);
// The first name rule that matches a (normalized) name, if any: the resolver answers the name only when it is an
// allow rule.
std::optional<std::size_t> name_rule_for(const NetworkPolicy& policy, std::string_view normalized_name);
// What rule `index` (a name rule) allows to `address`, one of the answers for its name: its protocol and ports at
// that address, minus what earlier address rules already decided.
std::vector<AllowedBox> compile_pin(const NetworkPolicy& policy, std::size_t index, std::uint32_t address);
// The union of boxes as disjoint boxes (the sandbox's pins for several names may overlap).
std::vector<AllowedBox> make_disjoint(const std::vector<AllowedBox>& boxes);

// Whether the compiled boxes allow a connection (for tests and the agent's own checks); port kNoPort: no port.
bool allows(const std::vector<AllowedBox>& boxes, std::uint32_t address, std::uint32_t protocol, std::uint32_t port);

// Protocol numbers: "tcp" 6, "udp" 17, "icmp" 1, "any" (nullopt).
std::optional<std::uint32_t> protocol_number(std::string_view name);

}  // namespace dsec::network
