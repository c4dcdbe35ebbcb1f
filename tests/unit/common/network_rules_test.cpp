// Network policies: CIDRs parsed strictly, malformed rules named, and first-match rules compiled into disjoint
// boxes of what is allowed (the agent's nftables interval sets need them disjoint).
#include <gtest/gtest.h>

#include "common/network_rules.hpp"
#include "dsec/error.hpp"

namespace dsec::network {
namespace {

std::uint32_t ip(const char* text) { return parse_cidr(text).value().address; }

NetworkRule rule(const char* cidr, bool allow = true, const char* protocol = "any", std::uint16_t lo = 0,
                 std::uint16_t hi = 0) {
  NetworkRule r;
  r.cidr = cidr;
  r.allow = allow;
  r.protocol = protocol;
  r.port_min = lo;
  r.port_max = hi;
  return r;
}

TEST(NetworkRules, ParsesCidrsStrictly) {
  auto c = parse_cidr("10.20.0.0/16").value();
  EXPECT_EQ(c.first(), ip("10.20.0.0"));
  EXPECT_EQ(c.last(), ip("10.20.255.255"));
  EXPECT_EQ(parse_cidr("192.0.2.7")->prefix, 32);
  EXPECT_EQ(parse_cidr("0.0.0.0/0")->last(), 0xFFFFFFFFu);
  for (const char* bad : {"10.0.0.1/8", "10.0.0.0/33", "256.0.0.0", "10.0.0", "10.0.0.0.0", "a.b.c.d", "10.0.0.0/", "",
                          "10.0.0.0/-1", "1000.0.0.0", "10..0.0"})
    EXPECT_FALSE(parse_cidr(bad).has_value()) << bad;
}

TEST(NetworkRules, NamesTheBadField) {
  auto field_of = [](const NetworkPolicy& p) -> std::string {
    try {
      validate(p);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument);
      std::string m = e.what();
      return m.substr(0, m.find(':'));
    }
    return "";
  };
  NetworkPolicy p{"egress", {rule("10.0.0.0/8"), rule("10.0.0.1/8")}};
  EXPECT_EQ(field_of(p), "network.rules[1].cidr");
  p = {"egress", {rule("10.0.0.0/8", true, "tcp", 90, 80)}};
  EXPECT_EQ(field_of(p), "network.rules[0].ports");
  p = {"egress", {rule("10.0.0.0/8", true, "any", 80, 80)}};
  EXPECT_EQ(field_of(p), "network.rules[0].ports");
  p = {"egress", {rule("10.0.0.0/8", true, "gre")}};
  EXPECT_EQ(field_of(p), "network.rules[0].protocol");
  p = {"closed", {}};
  EXPECT_EQ(field_of(p), "network.mode");
  p = {"open", {rule("10.0.0.0/8")}};
  EXPECT_EQ(field_of(p), "network.rules");
  p = {"egress", std::vector<NetworkRule>(kMaxRules + 1, rule("10.0.0.0/8"))};
  EXPECT_EQ(field_of(p), "network.rules");
  EXPECT_EQ(field_of({"egress", {rule("10.0.0.0/8", false), rule("0.0.0.0/0", true, "udp", 53, 53)}}), "");
}

TEST(NetworkRules, FirstMatchWinsAndNothingElseIsAllowed) {
  NetworkPolicy p{"egress",
                  {rule("10.20.9.0/24", false), rule("10.20.0.0/16", true, "tcp", 80, 443), rule("10.20.9.9"),
                   rule("192.0.2.0/24", true, "udp", 53, 53), rule("198.51.100.7")}};
  auto boxes = compile_egress(p);
  EXPECT_TRUE(allows(boxes, ip("10.20.1.1"), 6, 80));
  EXPECT_TRUE(allows(boxes, ip("10.20.1.1"), 6, 443));
  EXPECT_FALSE(allows(boxes, ip("10.20.1.1"), 6, 444));
  EXPECT_FALSE(allows(boxes, ip("10.20.1.1"), 17, 80));  // tcp only
  EXPECT_FALSE(allows(boxes, ip("10.20.9.9"), 6, 80));   // the earlier deny decides
  EXPECT_FALSE(allows(boxes, ip("10.20.9.9"), 1, kNoPort));
  EXPECT_TRUE(allows(boxes, ip("192.0.2.4"), 17, 53));
  EXPECT_FALSE(allows(boxes, ip("192.0.2.4"), 6, 53));
  EXPECT_TRUE(allows(boxes, ip("198.51.100.7"), 1, kNoPort));  // any protocol, icmp too
  EXPECT_TRUE(allows(boxes, ip("198.51.100.7"), 6, 22));
  EXPECT_FALSE(allows(boxes, ip("198.51.100.8"), 6, 22));  // default deny
  // Disjoint: no point is in two boxes.
  for (std::size_t i = 0; i < boxes.size(); ++i)
    for (std::size_t j = i + 1; j < boxes.size(); ++j) {
      const auto& a = boxes[i];
      const auto& b = boxes[j];
      bool overlap = a.addr_lo <= b.addr_hi && b.addr_lo <= a.addr_hi && a.proto_lo <= b.proto_hi &&
                     b.proto_lo <= a.proto_hi && a.port_lo <= b.port_hi && b.port_lo <= a.port_hi;
      EXPECT_FALSE(overlap) << i << " and " << j;
    }
}

TEST(NetworkRules, ADenyCutsAHoleOutOfALaterAllow) {
  NetworkPolicy p{"egress", {rule("0.0.0.0/0", false, "tcp", 25, 25), rule("0.0.0.0/0")}};
  auto boxes = compile_egress(p);
  EXPECT_FALSE(allows(boxes, ip("203.0.113.5"), 6, 25));
  EXPECT_TRUE(allows(boxes, ip("203.0.113.5"), 6, 24));
  EXPECT_TRUE(allows(boxes, ip("203.0.113.5"), 6, 26));
  EXPECT_TRUE(allows(boxes, ip("203.0.113.5"), 17, 25));
  EXPECT_TRUE(allows(boxes, ip("203.0.113.5"), 1, kNoPort));
  EXPECT_TRUE(compile_egress({"egress", {}}).empty());  // egress without rules: nothing at all
}

NetworkRule name(const char* host, bool allow = true, const char* protocol = "any", std::uint16_t lo = 0,
                 std::uint16_t hi = 0) {
  NetworkRule r = rule("", allow, protocol, lo, hi);
  r.cidr.clear();
  r.host = host;
  return r;
}

TEST(NetworkRules, HostNamesAndWildcards) {
  for (const char* good : {"pypi.mirror.internal", "*.example.org", "a", "x-1.b_2.c", "UPPER.Case"})
    EXPECT_TRUE(valid_host_pattern(good)) << good;
  for (const char* bad :
       {"", "*", "*.", "a.*.b", "**.a", "-a.b", "a-.b", "a..b", ".a", "a b", "a/b", "\\032.a", "*example.org"})
    EXPECT_FALSE(valid_host_pattern(bad)) << bad;
  EXPECT_FALSE(valid_host_pattern(std::string(64, 'a') + ".b"));
  EXPECT_EQ(normalize_name("WWW.Example.ORG."), "www.example.org");
  EXPECT_EQ(normalize_name("*.example.org"), "");  // a question is never a wildcard
  EXPECT_EQ(normalize_name("a\\.b.c"), "");
  EXPECT_TRUE(host_matches("*.example.org", "a.example.org"));
  EXPECT_TRUE(host_matches("*.example.org", "a.b.example.org"));
  EXPECT_FALSE(host_matches("*.example.org", "example.org"));
  EXPECT_FALSE(host_matches("*.example.org", "badexample.org"));
  EXPECT_TRUE(host_matches("Pypi.Internal", "pypi.internal"));
  EXPECT_FALSE(host_matches("pypi.internal", "x.pypi.internal"));
}

TEST(NetworkRules, NameRulesAreCheckedAndTheFirstMatchDecides) {
  auto code_and_field = [](const NetworkPolicy& p) -> std::string {
    try {
      validate(p);
    } catch (const Error& e) {
      std::string m = e.what();
      return m.substr(0, m.find(':'));
    }
    return "";
  };
  EXPECT_EQ(code_and_field({"egress", {name("a..b")}}), "network.rules[0].host");
  EXPECT_EQ(code_and_field({"egress", {rule("10.0.0.0/8"), name("10.1.2.3")}}), "network.rules[1].host");
  NetworkRule both = name("a.b");
  both.cidr = "10.0.0.0/8";
  EXPECT_EQ(code_and_field({"egress", {both}}), "network.rules[0]");
  NetworkPolicy p{
      "egress", {name("bad.example.org", false), name("*.example.org", true, "tcp", 443, 443), name("pypi.internal")}};
  EXPECT_EQ(code_and_field(p), "");
  EXPECT_EQ(name_rule_for(p, "bad.example.org"), 0u);
  EXPECT_EQ(name_rule_for(p, "a.example.org"), 1u);
  EXPECT_EQ(name_rule_for(p, "pypi.internal"), 2u);
  EXPECT_EQ(name_rule_for(p, "other.org"), std::nullopt);
  EXPECT_EQ(name_rule_for({"open", {}}, "pypi.internal"), std::nullopt);
  EXPECT_TRUE(compile_egress(p).empty());  // names admit nothing until they are answered
}

TEST(NetworkRules, APinIsTheNameRulesPortsMinusEarlierAddressRules) {
  NetworkPolicy p{"egress",
                  {rule("10.0.0.0/8", false, "tcp", 22, 22), name("*.example.org", true, "tcp", 1, 1024),
                   rule("192.0.2.0/24", false), name("late.example.net")}};
  auto pin = compile_pin(p, 1, ip("10.1.2.3"));
  EXPECT_TRUE(allows(pin, ip("10.1.2.3"), 6, 443));
  EXPECT_FALSE(allows(pin, ip("10.1.2.3"), 6, 22));    // the earlier deny decides
  EXPECT_FALSE(allows(pin, ip("10.1.2.3"), 6, 2000));  // not the rule's ports
  EXPECT_FALSE(allows(pin, ip("10.1.2.4"), 6, 443));   // only the address answered
  auto late = compile_pin(p, 3, ip("192.0.2.9"));
  EXPECT_TRUE(late.empty());  // an earlier address deny covers it whole
  // Overlapping pins become disjoint boxes covering the same points.
  auto a = compile_pin(p, 1, ip("10.1.2.3"));
  auto b = compile_pin(p, 3, ip("10.1.2.3"));
  std::vector<AllowedBox> all = a;
  all.insert(all.end(), b.begin(), b.end());
  auto disjoint = make_disjoint(all);
  for (std::uint32_t port : {22u, 443u, 5000u})
    EXPECT_EQ(allows(disjoint, ip("10.1.2.3"), 6, port), allows(all, ip("10.1.2.3"), 6, port)) << port;
  for (std::size_t i = 0; i < disjoint.size(); ++i)
    for (std::size_t j = i + 1; j < disjoint.size(); ++j) {
      const auto& x = disjoint[i];
      const auto& y = disjoint[j];
      EXPECT_FALSE(x.addr_lo <= y.addr_hi && y.addr_lo <= x.addr_hi && x.proto_lo <= y.proto_hi &&
                   y.proto_lo <= x.proto_hi && x.port_lo <= y.port_hi && y.port_lo <= x.port_hi);
    }
}

}  // namespace
}  // namespace dsec::network
