// Endpoint strings, URL escaping, sizes, and routing a sandbox id to the node that made it.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "client/endpoint.hpp"
#include "client/node_table.hpp"
#include "dsec/error.hpp"
#include "dsec/spec.hpp"

namespace dsec::detail {
namespace {

Code code_of(std::string_view endpoint) {
  try {
    parse_endpoint(endpoint);
  } catch (const Error& e) {
    return e.code();
  }
  return Code::kOk;
}

TEST(Endpoint, UnixSocket) {
  auto ep = parse_endpoint("unix:/run/dsec/dsecd.sock");
  EXPECT_EQ(ep.unix_path, "/run/dsec/dsecd.sock");
  EXPECT_EQ(ep.base_url, "http://localhost");
  EXPECT_EQ(ep.text, "unix:/run/dsec/dsecd.sock");
  EXPECT_EQ(parse_endpoint("unix:///run/x.sock").unix_path, "/run/x.sock");
}

TEST(Endpoint, Http) {
  auto ep = parse_endpoint("http://10.0.0.7:7070");
  EXPECT_TRUE(ep.unix_path.empty());
  EXPECT_EQ(ep.base_url, "http://10.0.0.7:7070");
  EXPECT_EQ(parse_endpoint("http://node-3.cluster:80/").base_url, "http://node-3.cluster:80");
  EXPECT_EQ(parse_endpoint("https://agent.example").base_url, "https://agent.example");
  EXPECT_EQ(parse_endpoint("http://[::1]:7070").base_url, "http://[::1]:7070");
}

TEST(Endpoint, RejectsWhatIsNotAnAgentAddress) {
  for (const char* bad : {"", "unix:", "unix:relative.sock", "localhost:7070", "ftp://x", "http://", "http://:80",
                          "http://host:0", "http://host:65536", "http://host:port", "http://host:", "http://h/v1",
                          "http://user@host:1", "http://bad host:1", "http://[::1", "http://[zz]:1"})
    EXPECT_EQ(code_of(bad), Code::kInvalidArgument) << bad;
  std::string long_path = "unix:/" + std::string(120, 'a');
  EXPECT_EQ(code_of(long_path), Code::kInvalidArgument);
}

TEST(Endpoint, ErrorNamesTheEndpoint) {
  try {
    parse_endpoint("tcp://x:1");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tcp://x:1"), std::string::npos) << e.what();
  }
}

TEST(UrlEscape, KeepsUnreservedAndEscapesTheRest) {
  EXPECT_EQ(url_escape("abc-XYZ_0.9~"), "abc-XYZ_0.9~");
  EXPECT_EQ(url_escape("/tmp/a b"), "%2Ftmp%2Fa%20b");
  EXPECT_EQ(url_escape("k=v&x"), "k%3Dv%26x");
  EXPECT_EQ(url_escape(std::string_view("\xff\x00", 2)), "%FF%00");
}

TEST(ParseSize, Units) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("512Mi"), 512ull << 20);
  EXPECT_EQ(parse_size("512MiB"), 512ull << 20);
  EXPECT_EQ(parse_size("2G"), 2'000'000'000ull);
  EXPECT_EQ(parse_size("1.5GiB"), 3ull << 29);
  EXPECT_EQ(parse_size("100k"), 100'000u);
  EXPECT_EQ(parse_size("1Ki"), 1024u);
  EXPECT_EQ(parse_size(" 1Ti "), 1ull << 40);
  EXPECT_EQ(parse_size("0"), 0u);
}

TEST(ParseSize, WholeNumbersAreExactAndNothingWraps) {
  EXPECT_EQ(parse_size("9007199254740993"), 9007199254740993ull);  // 2^53 + 1: a double would round it
  EXPECT_EQ(parse_size("18446744073709551615"), 18446744073709551615ull);
  EXPECT_EQ(parse_size("16777215Ti"), 16777215ull << 40);
  for (const char* too_big : {"18446744073709551616", "16777216Ti", "18446744073709551615K", "9.3e18", "9300000000.5G"})
    EXPECT_FALSE(parse_size(too_big).has_value()) << too_big;
}

TEST(ParseSize, RejectsNonsense) {
  for (const char* bad : {"", "Mi", "-1", "1X", "1Mx", "1.2.3", "abc", "1 Mi Mi", "1e3", "99999999999T"})
    EXPECT_FALSE(parse_size(bad).has_value()) << bad;
}

// Nodes with known ids, added in order; endpoints are never contacted here.
std::vector<NodePtr> nodes_with_ids(NodeTable& t, const std::vector<std::string>& ids) {
  std::vector<NodePtr> out;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    out.push_back(t.add(fmt::format("http://127.0.0.1:{}", 40000 + i)));
    t.learn(out.back(), ids[i]);
  }
  return out;
}

TEST(NodeTable, RoutesAnIdToTheNodeThatMadeIt) {
  NodeTable t;
  auto n = nodes_with_ids(t, {"alpha", "beta", "gamma"});
  EXPECT_EQ(t.route("beta-0123abcd"), n[1]);
  EXPECT_EQ(t.route("alpha-ff"), n[0]);
  EXPECT_EQ(t.route("gamma-1"), n[2]);
  EXPECT_FALSE(t.route("delta-00"));
  EXPECT_FALSE(t.route("beta"));  // a node id is not a sandbox id
  EXPECT_FALSE(t.route("beta-"));
  EXPECT_FALSE(t.route("betax-00"));
}

TEST(NodeTable, NodeIdsWithDashesTakeTheLongestMatch) {
  NodeTable t;
  auto n = nodes_with_ids(t, {"rack1", "rack1-node2"});
  EXPECT_EQ(t.route("rack1-node2-9f3a"), n[1]);
  EXPECT_EQ(t.route("rack1-9f3a"), n[0]);
  NodeTable reversed;  // the order nodes were added in does not matter
  auto r = nodes_with_ids(reversed, {"rack1-node2", "rack1"});
  EXPECT_EQ(reversed.route("rack1-node2-9f3a"), r[0]);
  EXPECT_EQ(reversed.route("rack1-9f3a"), r[1]);
}

TEST(NodeTable, UnidentifiedNodesAreListedUntilLearned) {
  NodeTable t;
  NodePtr a = t.add("http://127.0.0.1:40100");
  NodePtr b = t.add("http://127.0.0.1:40101");
  EXPECT_EQ(t.add("http://127.0.0.1:40100"), a);  // same endpoint, same node
  EXPECT_EQ(t.unidentified().size(), 2u);
  t.learn(b, "n1");
  EXPECT_EQ(t.unidentified(), std::vector<NodePtr>{a});
  EXPECT_EQ(t.route("n1-abc"), b);
}

TEST(NodeTable, DiscoveryAddsMovesAndRemovesNodes) {
  NodeTable t;
  NodeInfo info;
  info.id = "n1";
  NodePtr first = t.up("n1", "http://127.0.0.1:40200", info);
  EXPECT_EQ(t.live_count(), 1u);
  EXPECT_EQ(t.route("n1-00"), first);
  // The same node at a new address: a fresh entry; the old one is gone.
  NodePtr moved = t.up("n1", "http://127.0.0.1:40201", info);
  EXPECT_NE(moved, first);
  EXPECT_EQ(t.live_count(), 1u);
  EXPECT_EQ(t.route("n1-00"), moved);
  t.down("n1");
  EXPECT_EQ(t.live_count(), 0u);
  // A gone node still routes its sandboxes (so calls can say NodeLost), and is marked gone.
  NodePtr routed = t.route("n1-00");
  ASSERT_TRUE(routed);
  EXPECT_TRUE(t.view(routed).gone);
}

TEST(NodeTable, RepeatedFailuresEjectForAGrowingTime) {
  NodeTable t;
  NodePtr n = t.add("http://127.0.0.1:40300");
  for (int i = 1; i < NodeTable::kEjectAfter; ++i) EXPECT_FALSE(t.failed(n)) << i;
  EXPECT_TRUE(t.failed(n));
  EXPECT_TRUE(t.view(n).ejected);
  auto first_until = n->ejected_until;
  EXPECT_TRUE(t.failed(n));
  EXPECT_GT(n->ejected_until - SteadyClock::now(), first_until - SteadyClock::now() + std::chrono::milliseconds(500))
      << "each further failure doubles the ejection";
  t.succeeded(n);
  EXPECT_FALSE(t.view(n).ejected);
  EXPECT_EQ(t.view(n).failures, 0);
}

TEST(NodeTable, PlacementTallyStartsOverWithFreshInfo) {
  NodeTable t;
  NodePtr n = t.add("http://127.0.0.1:40400");
  t.placed(n, 2.0, 1u << 20, 2);
  EXPECT_EQ(t.view(n).sandboxes_placed, 2u);
  NodeInfo info;
  info.id = "x";
  t.set_info(n, info);
  EXPECT_EQ(t.view(n).sandboxes_placed, 0u);
  EXPECT_EQ(t.view(n).id, "x");
}

TEST(SandboxId, Shape) {
  EXPECT_TRUE(valid_sandbox_id("node-1-0123abcd"));
  EXPECT_TRUE(valid_sandbox_id("host.example_2-ff"));
  for (const char* bad : {"", ".hidden", "a/b", "a b", "../x", "x?y", "a%2F"})
    EXPECT_FALSE(valid_sandbox_id(bad)) << bad;
  EXPECT_FALSE(valid_sandbox_id(std::string(257, 'a')));
}

}  // namespace
}  // namespace dsec::detail
