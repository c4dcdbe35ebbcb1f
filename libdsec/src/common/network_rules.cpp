#include "common/network_rules.hpp"

#include <array>
#include <cctype>
#include <charconv>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::network {
namespace {

[[noreturn]] void bad(const std::string& field, const std::string& why) {
  throw Error(Code::kInvalidArgument, fmt::format("{}: {}", field, why));
}

using Range = std::array<std::uint32_t, 2>;
using Box = std::array<Range, 3>;  // address, protocol, port

Box box_of(const NetworkRule& r) {
  Cidr c = *parse_cidr(r.cidr);
  Box b{Range{c.first(), c.last()}, Range{0, 255}, Range{0, kNoPort}};
  if (auto p = protocol_number(r.protocol)) b[1] = {*p, *p};
  if (r.port_min != 0 || r.port_max != 0) b[2] = {r.port_min, r.port_max};
  return b;
}

bool overlap(const Box& a, const Box& b) {
  for (int d = 0; d < 3; ++d)
    if (a[d][1] < b[d][0] || b[d][1] < a[d][0]) return false;
  return true;
}

// a minus b, as disjoint boxes: along each dimension in turn, the parts of a outside b are cut off.
void subtract(Box a, const Box& b, std::vector<Box>& out) {
  if (!overlap(a, b)) {
    out.push_back(a);
    return;
  }
  for (int d = 0; d < 3; ++d) {
    if (a[d][0] < b[d][0]) {
      Box below = a;
      below[d][1] = b[d][0] - 1;
      out.push_back(below);
      a[d][0] = b[d][0];
    }
    if (a[d][1] > b[d][1]) {
      Box above = a;
      above[d][0] = b[d][1] + 1;
      out.push_back(above);
      a[d][1] = b[d][1];
    }
  }
  // What is left of a lies inside b: gone.
}

}  // namespace

std::optional<Cidr> parse_cidr(std::string_view text) {
  Cidr c;
  std::string_view addr = text;
  if (auto slash = text.find('/'); slash != std::string_view::npos) {
    addr = text.substr(0, slash);
    std::string_view p = text.substr(slash + 1);
    int prefix = -1;
    auto [ptr, ec] = std::from_chars(p.data(), p.data() + p.size(), prefix);
    if (p.empty() || ec != std::errc() || ptr != p.data() + p.size() || prefix < 0 || prefix > 32) return std::nullopt;
    c.prefix = prefix;
  }
  std::uint32_t value = 0;
  int parts = 0;
  while (parts < 4) {
    std::size_t dot = addr.find('.');
    std::string_view part = addr.substr(0, dot);
    unsigned octet = 0;
    auto [ptr, ec] = std::from_chars(part.data(), part.data() + part.size(), octet);
    if (part.empty() || part.size() > 3 || ec != std::errc() || ptr != part.data() + part.size() || octet > 255)
      return std::nullopt;
    value = value << 8 | octet;
    ++parts;
    if (dot == std::string_view::npos) {
      addr = {};
      break;
    }
    addr.remove_prefix(dot + 1);
  }
  if (parts != 4 || !addr.empty()) return std::nullopt;
  std::uint32_t mask = c.prefix == 0 ? 0 : 0xFFFFFFFFu << (32 - c.prefix);
  if ((value & ~mask) != 0) return std::nullopt;  // host bits set
  c.address = value;
  return c;
}

std::string ipv4_to_string(std::uint32_t a) {
  return fmt::format("{}.{}.{}.{}", a >> 24, (a >> 16) & 255, (a >> 8) & 255, a & 255);
}

std::string to_string(const Cidr& c) { return fmt::format("{}/{}", ipv4_to_string(c.address), c.prefix); }

std::optional<std::uint32_t> protocol_number(std::string_view name) {
  if (name == "tcp") return 6;
  if (name == "udp") return 17;
  if (name == "icmp") return 1;
  return std::nullopt;
}

void validate(const NetworkPolicy& policy) {
  if (policy.mode != "none" && policy.mode != "egress" && policy.mode != "open")
    bad("network.mode", fmt::format("'{}' is not one of none, egress, open", policy.mode));
  if (policy.mode != "egress" && !policy.rules.empty())
    bad("network.rules", fmt::format("rules belong to mode egress, not {}", policy.mode));
  if (policy.rules.size() > kMaxRules) bad("network.rules", fmt::format("at most {} rules", kMaxRules));
  for (std::size_t i = 0; i < policy.rules.size(); ++i) {
    const NetworkRule& r = policy.rules[i];
    const std::string at = fmt::format("network.rules[{}]", i);
    if (!r.host.empty()) {
      if (!r.cidr.empty()) bad(at, "a rule names a cidr or a host, not both");
      if (parse_cidr(r.host)) bad(at + ".host", fmt::format("'{}' is an address: name it as a cidr", r.host));
      if (!valid_host_pattern(r.host))
        bad(at + ".host", fmt::format("'{}' is not a host name such as pypi.mirror.internal or *.example.org "
                                      "(letters, digits, '-', '_'; labels of 1-63; '*.' only first)",
                                      r.host.substr(0, 300)));
    } else if (!parse_cidr(r.cidr)) {
      bad(at + ".cidr",
          fmt::format("'{}' is not an IPv4 address or network such as 10.0.0.0/8 (host bits zero)", r.cidr));
    }
    if (r.protocol != "any" && !protocol_number(r.protocol))
      bad(at + ".protocol", fmt::format("'{}' is not one of tcp, udp, icmp, any", r.protocol));
    const bool ports = r.port_min != 0 || r.port_max != 0;
    if (ports && (r.port_min == 0 || r.port_max < r.port_min))
      bad(at + ".ports", fmt::format("{}-{} is not a range of ports within 1-65535", r.port_min, r.port_max));
    if (ports && r.protocol != "tcp" && r.protocol != "udp") bad(at + ".ports", "ports need protocol tcp or udp");
  }
  if (policy.mode == "egress") (void)compile_egress(policy);
}

std::vector<AllowedBox> compile_egress(const NetworkPolicy& policy) {
  std::vector<Box> allowed;
  std::vector<Box> earlier;
  for (const NetworkRule& r : policy.rules) {
    if (!r.host.empty()) continue;  // matches only its pins' addresses
    Box b = box_of(r);
    if (r.allow) {
      std::vector<Box> pieces{b};
      for (const Box& e : earlier) {
        std::vector<Box> next;
        for (const Box& p : pieces) subtract(p, e, next);
        pieces = std::move(next);
        if (pieces.size() + allowed.size() > kMaxBoxes) break;
      }
      allowed.insert(allowed.end(), pieces.begin(), pieces.end());
      if (allowed.size() > kMaxBoxes)
        bad("network.rules", fmt::format("the rules cut each other into more than {} pieces; use fewer that "
                                         "overlap",
                                         kMaxBoxes));
    }
    earlier.push_back(b);
  }
  std::vector<AllowedBox> out;
  out.reserve(allowed.size());
  for (const Box& b : allowed) out.push_back({b[0][0], b[0][1], b[1][0], b[1][1], b[2][0], b[2][1]});
  return out;
}

bool valid_host_pattern(std::string_view p) {
  if (p.starts_with("*.")) p.remove_prefix(2);
  if (p.empty() || p.size() > 253) return false;
  std::size_t label = 0;
  for (std::size_t i = 0; i <= p.size(); ++i) {
    if (i == p.size() || p[i] == '.') {
      if (label == 0 || label > 63 || p[i - 1] == '-' || p[i - label] == '-') return false;
      label = 0;
      continue;
    }
    const unsigned char c = static_cast<unsigned char>(p[i]);
    if (!std::isalnum(c) && c != '-' && c != '_') return false;
    ++label;
  }
  return true;
}

std::string normalize_name(std::string_view name) {
  if (name.ends_with('.')) name.remove_suffix(1);
  std::string out(name);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (out.starts_with("*.") || !valid_host_pattern(out)) return "";
  return out;
}

bool host_matches(std::string_view pattern, std::string_view name) {
  auto equal = [](std::string_view a, std::string_view b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (std::tolower(static_cast<unsigned char>(a[i])) != std::tolower(static_cast<unsigned char>(b[i])))
        return false;
    return true;
  };
  if (pattern.starts_with("*.")) {
    std::string_view suffix = pattern.substr(1);  // ".example.org"
    return name.size() > suffix.size() && equal(name.substr(name.size() - suffix.size()), suffix);
  }
  return equal(pattern, name);
}

std::optional<std::size_t> name_rule_for(const NetworkPolicy& policy, std::string_view name) {
  if (policy.mode != "egress" || name.empty()) return std::nullopt;
  for (std::size_t i = 0; i < policy.rules.size(); ++i)
    if (!policy.rules[i].host.empty() && host_matches(policy.rules[i].host, name)) return i;
  return std::nullopt;
}

std::vector<AllowedBox> compile_pin(const NetworkPolicy& policy, std::size_t index, std::uint32_t address) {
  // The earlier address rules, as denials (what an earlier allow covers is allowed already), then this rule as an
  // allow of the one address.
  NetworkPolicy p{"egress", {}};
  for (std::size_t i = 0; i < index && i < policy.rules.size(); ++i)
    if (policy.rules[i].host.empty()) {
      NetworkRule r = policy.rules[i];
      r.allow = false;
      p.rules.push_back(std::move(r));
    }
  if (index >= policy.rules.size()) return {};
  NetworkRule r = policy.rules[index];
  r.host.clear();
  r.allow = true;
  r.cidr = ipv4_to_string(address);
  p.rules.push_back(std::move(r));
  return compile_egress(p);
}

std::vector<AllowedBox> make_disjoint(const std::vector<AllowedBox>& boxes) {
  std::vector<Box> kept;
  for (const AllowedBox& a : boxes) {
    std::vector<Box> pieces{
        Box{Range{a.addr_lo, a.addr_hi}, Range{a.proto_lo, a.proto_hi}, Range{a.port_lo, a.port_hi}}};
    for (const Box& k : kept) {
      std::vector<Box> next;
      for (const Box& p : pieces) subtract(p, k, next);
      pieces = std::move(next);
    }
    kept.insert(kept.end(), pieces.begin(), pieces.end());
  }
  std::vector<AllowedBox> out;
  out.reserve(kept.size());
  for (const Box& b : kept) out.push_back({b[0][0], b[0][1], b[1][0], b[1][1], b[2][0], b[2][1]});
  return out;
}

bool allows(const std::vector<AllowedBox>& boxes, std::uint32_t address, std::uint32_t protocol, std::uint32_t port) {
  for (const AllowedBox& b : boxes)
    if (address >= b.addr_lo && address <= b.addr_hi && protocol >= b.proto_lo && protocol <= b.proto_hi &&
        port >= b.port_lo && port <= b.port_hi)
      return true;
  return false;
}

}  // namespace dsec::network
