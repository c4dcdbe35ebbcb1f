// Placement policies: spread and pack, overcommit limits, locality, filters (backend, health, node labels, GPUs),
// anti-affinity, accounting across calls, the refusal message, and the cost of a 32,000-sandbox pulse.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <set>

#include "common/protocol.hpp"
#include "dsec/error.hpp"
#include "dsec/placement.hpp"

namespace dsec {
namespace {

constexpr std::uint64_t kGi = 1ull << 30;
constexpr std::uint64_t kMi = 1ull << 20;

NodeCandidate node(std::string id, std::uint32_t cores = 16, std::uint64_t memory = 64 * kGi) {
  NodeCandidate c;
  c.id = id;
  c.info.id = std::move(id);
  c.info.backends = {"container", "null"};
  c.info.cores = cores;
  c.info.memory_bytes = memory;
  c.info.cpu_overcommit = 8.0;
  c.info.memory_overcommit = 1.0;
  return c;
}

SandboxSpec small_spec() {
  SandboxSpec s;
  s.resources.cpu = 1;
  s.resources.memory_bytes = 512 * kMi;
  return s;
}

PlacementRequest request(const SandboxSpec& spec, std::size_t count) {
  PlacementRequest r;
  r.spec = &spec;
  r.count = count;
  return r;
}

std::map<std::size_t, std::size_t> histogram(const std::vector<std::size_t>& chosen) {
  std::map<std::size_t, std::size_t> h;
  for (auto i : chosen) ++h[i];
  return h;
}

Error error_of(PlacementPolicy& policy, const PlacementRequest& r, const std::vector<NodeCandidate>& nodes) {
  try {
    policy.place(r, nodes);
  } catch (const Error& e) {
    return e;
  }
  return Error(Code::kOk, "placed");
}

TEST(Placement, FactoryKnowsSpreadAndPack) {
  EXPECT_EQ(make_placement_policy("spread")->name(), "spread");
  EXPECT_EQ(make_placement_policy("pack")->name(), "pack");
  try {
    make_placement_policy("random");
    FAIL() << "an unknown policy was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("spread, pack"), std::string::npos) << e.what();
  }
}

TEST(Placement, SpreadSpreadsEvenlyOverEqualNodes) {
  std::vector<NodeCandidate> nodes{node("a"), node("b"), node("c"), node("d")};
  auto spec = small_spec();
  auto chosen = make_placement_policy("spread")->place(request(spec, 40), nodes);
  ASSERT_EQ(chosen.size(), 40u);
  auto h = histogram(chosen);
  ASSERT_EQ(h.size(), 4u);
  for (auto [i, n] : h) EXPECT_EQ(n, 10u) << "node " << i;
}

TEST(Placement, SpreadFollowsCapacityAndExistingLoad) {
  // b is twice a's size; c is half full already. Spread keeps their free fractions level.
  std::vector<NodeCandidate> nodes{node("a", 8, 32 * kGi), node("b", 16, 64 * kGi), node("c", 16, 64 * kGi)};
  nodes[2].info.cpu_requested = 64;
  nodes[2].info.memory_requested = 32 * kGi;
  auto spec = small_spec();
  auto h = histogram(make_placement_policy("spread")->place(request(spec, 160), nodes));
  // Used fractions end level at L: a 64L, b 128L, c 128(L - 0.5); 320L - 64 = 160 gives L = 0.7.
  EXPECT_NEAR(static_cast<double>(h[0]), 44.8, 1);
  EXPECT_NEAR(static_cast<double>(h[1]), 89.6, 1);
  EXPECT_NEAR(static_cast<double>(h[2]), 25.6, 1);
  // A smaller batch does not reach c's level at all.
  h = histogram(make_placement_policy("spread")->place(request(spec, 96), nodes));
  EXPECT_EQ(h.count(2), 0u);
}

TEST(Placement, PackFillsOneNodeBeforeTheNext) {
  std::vector<NodeCandidate> nodes{node("a", 2, 4 * kGi), node("b", 2, 4 * kGi), node("c", 2, 4 * kGi)};
  auto spec = small_spec();  // memory decides: 8 per node (4Gi / 512Mi); cpu would allow 16
  auto chosen = make_placement_policy("pack")->place(request(spec, 12), nodes);
  auto h = histogram(chosen);
  ASSERT_EQ(h.size(), 2u);
  EXPECT_EQ(h[0], 8u);
  EXPECT_EQ(h[1], 4u);
  // Pack starts on the fullest node that still fits.
  nodes[2].info.memory_requested = 3 * kGi;
  chosen = make_placement_policy("pack")->place(request(spec, 3), nodes);
  EXPECT_EQ(chosen, (std::vector<std::size_t>{2, 2, 0}));
}

TEST(Placement, TrainersWithDifferentRequestIdsStartOnDifferentEqualNodes) {
  std::vector<NodeCandidate> nodes{node("a"), node("b"), node("c"), node("d")};
  SandboxSpec spec = small_spec();
  std::set<std::size_t> first_choices;
  for (int i = 0; i < 32; ++i) {
    spec.request_id = "trainer-" + std::to_string(i);
    for (const char* name : {"spread", "pack"}) {
      auto chosen = make_placement_policy(name)->place(request(spec, 1), nodes);
      first_choices.insert(chosen[0]);
      // The same request always starts at the same node.
      EXPECT_EQ(make_placement_policy(name)->place(request(spec, 1), nodes), chosen);
    }
  }
  EXPECT_GE(first_choices.size(), 3u);
  // A tie never beats capacity: a freer node still wins whatever the request id.
  nodes[2].info.cpu_requested = 0;
  for (auto& n : nodes) n.info.memory_requested = 8ull << 30;
  nodes[2].info.memory_requested = 0;
  spec.request_id = "trainer-x";
  EXPECT_EQ(make_placement_policy("spread")->place(request(spec, 1), nodes), (std::vector<std::size_t>{2}));
}

TEST(Placement, CpuOvercommitIsTheLimit) {
  std::vector<NodeCandidate> nodes{node("a", 2, 1024 * kGi)};
  nodes[0].info.cpu_overcommit = 32;
  auto spec = small_spec();
  auto policy = make_placement_policy("spread");
  EXPECT_EQ(policy->place(request(spec, 64), nodes).size(), 64u);  // 2 cores x 32
  Error e = error_of(*policy, request(spec, 65), nodes);
  EXPECT_EQ(e.code(), Code::kResourceExhausted);
  EXPECT_NE(std::string(e.what()).find("cpu_overcommit 32"), std::string::npos) << e.what();
  // What the node reports as requested and what this client placed since both count.
  nodes[0].info.cpu_requested = 30;
  nodes[0].cpu_placed = 30;
  EXPECT_EQ(policy->place(request(spec, 4), nodes).size(), 4u);
  EXPECT_EQ(error_of(*policy, request(spec, 5), nodes).code(), Code::kResourceExhausted);
}

TEST(Placement, MemoryNearOneIsEnforced) {
  std::vector<NodeCandidate> nodes{node("a", 64, 8 * kGi)};
  nodes[0].info.cpu_overcommit = 32;
  nodes[0].info.memory_overcommit = 1.0;
  SandboxSpec spec = small_spec();
  spec.resources.cpu = 0.1;
  spec.resources.memory_bytes = 1 * kGi;
  auto policy = make_placement_policy("pack");
  EXPECT_EQ(policy->place(request(spec, 8), nodes).size(), 8u);
  Error e = error_of(*policy, request(spec, 9), nodes);
  EXPECT_EQ(e.code(), Code::kResourceExhausted);
  EXPECT_NE(std::string(e.what()).find("memory: 8.0Gi + 1.0Gi requested would pass 8.0Gi"), std::string::npos)
      << e.what();
  // A ratio of 1.25 admits a quarter more, and no further.
  nodes[0].info.memory_overcommit = 1.25;
  EXPECT_EQ(policy->place(request(spec, 10), nodes).size(), 10u);
  EXPECT_EQ(error_of(*policy, request(spec, 11), nodes).code(), Code::kResourceExhausted);
  // Memory this client placed since the report counts too.
  nodes[0].memory_placed = 2 * kGi;
  EXPECT_EQ(error_of(*policy, request(spec, 9), nodes).code(), Code::kResourceExhausted);
  EXPECT_EQ(policy->place(request(spec, 8), nodes).size(), 8u);
}

TEST(Placement, LocalityWinsBetweenEqualNodesAndYieldsToCapacity) {
  std::vector<NodeCandidate> nodes{node("a"), node("b"), node("c")};
  nodes[1].cached_image_bytes = 900 * kMi;
  auto spec = small_spec();
  PlacementRequest r = request(spec, 1);
  r.image_layers = {"sha256:aa", "sha256:bb"};
  r.image_bytes = 1 * kGi;
  for (const char* name : {"spread", "pack"})
    EXPECT_EQ(make_placement_policy(name)->place(r, nodes), (std::vector<std::size_t>{1})) << name;
  // A nearly full cached node loses to empty ones under spread: capacity outweighs the bonus.
  nodes[1].info.cpu_requested = 120;
  EXPECT_NE(make_placement_policy("spread")->place(r, nodes)[0], 1u);
  // A larger batch under spread still starts on the cached node and moves on once it is fuller than the rest by the
  // weight of the bonus.
  nodes[1].info.cpu_requested = 0;
  r.count = 60;
  auto h = histogram(make_placement_policy("spread")->place(r, nodes));
  EXPECT_GT(h[1], h[0]);
  EXPECT_GT(h[1], h[2]);
  EXPECT_GT(h[0], 0u);
  EXPECT_GT(h[2], 0u);
  // Without image bytes there is no bonus.
  r.count = 1;
  r.image_bytes = 0;
  EXPECT_EQ(make_placement_policy("spread")->place(r, nodes), (std::vector<std::size_t>{0}));
}

TEST(Placement, BackendHealthLabelAndGpuFilters) {
  std::vector<NodeCandidate> nodes{node("plain"), node("vm-only"), node("down"), node("gpu"), node("labelled")};
  nodes[1].info.backends = {"microvm"};
  nodes[2].healthy = false;
  nodes[3].info.gpus = 8;
  nodes[3].info.gpus_free = 2;
  nodes[3].info.labels = {{"zone", "b"}};
  nodes[4].info.labels = {{"zone", "a"}, {"disk", "ssd"}};
  auto policy = make_placement_policy("spread");

  SandboxSpec spec = small_spec();
  spec.kind = "microvm";
  EXPECT_EQ(histogram(policy->place(request(spec, 5), nodes)), (std::map<std::size_t, std::size_t>{{1, 5}}));

  spec = small_spec();
  spec.resources.gpus = 1;
  EXPECT_EQ(policy->place(request(spec, 2), nodes), (std::vector<std::size_t>{3, 3}));
  Error e = error_of(*policy, request(spec, 3), nodes);
  EXPECT_EQ(e.code(), Code::kResourceExhausted);
  EXPECT_NE(std::string(e.what()).find("node gpu: gpus: 0 free of 8, 1 wanted"), std::string::npos) << e.what();
  nodes[3].gpus_placed = 2;  // this client took the last two since the report
  EXPECT_EQ(error_of(*policy, request(spec, 1), nodes).code(), Code::kResourceExhausted);

  spec = small_spec();
  spec.node_selector = {{"zone", "a"}};
  EXPECT_EQ(histogram(policy->place(request(spec, 3), nodes)), (std::map<std::size_t, std::size_t>{{4, 3}}));
  spec.node_selector = {{"zone", "a"}, {"disk", "hdd"}};
  e = error_of(*policy, request(spec, 1), nodes);
  EXPECT_EQ(e.code(), Code::kResourceExhausted);
  std::string m = e.what();
  EXPECT_NE(m.find("node labelled: node_selector: label disk=ssd, not disk=hdd"), std::string::npos) << m;
  EXPECT_NE(m.find("node plain: node_selector: no label 'disk'"), std::string::npos) << m;
  EXPECT_NE(m.find("node down: unhealthy"), std::string::npos) << m;
}

TEST(Placement, AntiAffinitySpreadsPeersFirstThenRepeats) {
  std::vector<NodeCandidate> nodes{node("a"), node("b"), node("c"), node("d")};
  nodes[0].info.memory_requested = 10 * kGi;  // a is the one pack prefers
  SandboxSpec spec = small_spec();
  spec.labels = {{"task", "django-1234"}};
  spec.anti_affinity = "task";
  for (const char* name : {"pack", "spread"}) {
    auto policy = make_placement_policy(name);
    auto chosen = policy->place(request(spec, 4), nodes);
    EXPECT_EQ(std::set<std::size_t>(chosen.begin(), chosen.end()).size(), 4u) << name;  // one per node
    // Soft: more sandboxes than nodes still place, two per node.
    auto h = histogram(policy->place(request(spec, 8), nodes));
    for (auto [i, n] : h) EXPECT_EQ(n, 2u) << name << " node " << i;
  }
  // Without anti-affinity, pack puts all four on one node.
  spec.anti_affinity.clear();
  EXPECT_EQ(histogram(make_placement_policy("pack")->place(request(spec, 4), nodes)).size(), 1u);
  // Peers the caller knows of count: the node already holding one of the value comes last.
  spec.anti_affinity = "task";
  nodes[0].anti_affinity_peers = 1;
  nodes[1].anti_affinity_peers = 1;
  auto chosen = make_placement_policy("pack")->place(request(spec, 2), nodes);
  EXPECT_EQ(std::set<std::size_t>(chosen.begin(), chosen.end()), (std::set<std::size_t>{2, 3}));
  // A node that cannot fit is skipped, not waited for.
  nodes[2].info.backends = {"microvm"};
  chosen = make_placement_policy("spread")->place(request(spec, 3), nodes);
  EXPECT_EQ(chosen[0], 3u);
  // An anti-affinity key the labels do not carry is a malformed request.
  spec.labels.clear();
  EXPECT_EQ(error_of(*make_placement_policy("spread"), request(spec, 1), nodes).code(), Code::kInvalidArgument);
}

TEST(Placement, AccountingCarriesAcrossCalls) {
  // The client records each answer in the candidates, so successive single creates (a pulse of create() calls)
  // spread instead of piling onto the node that looked freest when the nodes last reported.
  std::vector<NodeCandidate> nodes{node("a"), node("b"), node("c")};
  nodes[0].info.cpu_requested = 0;
  nodes[1].info.cpu_requested = 8;
  nodes[2].info.cpu_requested = 16;
  auto spec = small_spec();
  auto policy = make_placement_policy("spread");
  std::map<std::size_t, std::size_t> h;
  for (int k = 0; k < 30; ++k) {
    PlacementRequest r = request(spec, 1);
    auto chosen = policy->place(r, nodes);
    record_placement(r, chosen, nodes);
    ++h[chosen[0]];
  }
  // 30 more on top of 0/8/16 evens out at 18 each: a takes 18, b 10, c 2.
  EXPECT_EQ(h[0], 18u);
  EXPECT_EQ(h[1], 10u);
  EXPECT_EQ(h[2], 2u);
  EXPECT_EQ(nodes[0].sandboxes_placed, 18u);
  EXPECT_DOUBLE_EQ(nodes[0].cpu_placed, 18);
  EXPECT_EQ(nodes[1].memory_placed, 10 * 512 * kMi);
  // And the same limits hold across calls: the nodes fill up.
  PlacementRequest rest = request(spec, 3 * 128 - 24 - 30);
  record_placement(rest, policy->place(rest, nodes), nodes);
  EXPECT_EQ(error_of(*policy, request(spec, 1), nodes).code(), Code::kResourceExhausted);
  EXPECT_EQ(placement_refusal(spec, nodes[0]).substr(0, 4), "cpu:");
  EXPECT_THROW(record_placement(request(spec, 1), {7}, nodes), Error);
}

TEST(Placement, TheRefusalNamesEveryNodeAndSummarisesMany) {
  auto spec = small_spec();
  auto policy = make_placement_policy("spread");
  std::vector<NodeCandidate> few{node("n0", 1, 1 * kGi), node("n1"), node("n2")};
  few[1].info.backends = {"fncall"};
  few[2].healthy = false;
  Error e = error_of(*policy, request(spec, 20), few);
  EXPECT_EQ(e.code(), Code::kResourceExhausted);
  EXPECT_TRUE(e.retryable());
  std::string m = e.what();
  EXPECT_NE(m.find("cannot place 18 of 20 sandboxes (kind container, cpu 1, memory 512Mi) on 3 nodes (2 fit"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("node n0: memory: 1.0Gi + 512Mi requested would pass 1.0Gi (1.0Gi x memory_overcommit 1)"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("node n1: kind: does not serve 'container' (serves: fncall)"), std::string::npos) << m;
  EXPECT_NE(m.find("node n2: unhealthy"), std::string::npos) << m;

  std::vector<NodeCandidate> many;
  for (int i = 0; i < 40; ++i) many.push_back(node("m" + std::to_string(i), 1, 1 * kGi));
  for (int i = 30; i < 40; ++i) many[i].healthy = false;
  m = error_of(*policy, request(spec, 100), many).what();
  EXPECT_NE(m.find("node m15: memory"), std::string::npos) << m;
  EXPECT_EQ(m.find("node m16:"), std::string::npos) << m;
  EXPECT_NE(m.find("and 24 more nodes (memory: 14, unhealthy: 10)"), std::string::npos) << m;

  EXPECT_EQ(error_of(*policy, request(spec, 1), {}).code(), Code::kResourceExhausted);
  PlacementRequest no_spec;
  EXPECT_EQ(error_of(*policy, no_spec, few).code(), Code::kInvalidArgument);
  EXPECT_TRUE(policy->place(request(spec, 0), few).empty());
}

TEST(Placement, APulseOf32000Over160NodesIsFastAndSpreadsByCapacity) {
  // DSec's production unit: ~160 nodes, ~30,000 cores; sizes vary so the spread must follow capacity.
  std::vector<NodeCandidate> nodes;
  for (int i = 0; i < 160; ++i) {
    auto n = node("node" + std::to_string(i), i % 2 ? 256 : 128, i % 2 ? 2048 * kGi : 1024 * kGi);
    n.info.cpu_overcommit = 32;
    n.info.memory_overcommit = 1.0;
    nodes.push_back(std::move(n));
  }
  SandboxSpec spec = small_spec();
  spec.resources.cpu = 2;
  spec.resources.memory_bytes = 4 * kGi;
  for (const char* name : {"spread", "pack"}) {
    auto policy = make_placement_policy(name);
    auto start = std::chrono::steady_clock::now();
    auto chosen = policy->place(request(spec, 32'000), nodes);
    double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_EQ(chosen.size(), 32'000u);
    EXPECT_LT(seconds, 0.25) << name;
    std::vector<std::size_t> per_node(nodes.size());
    for (auto i : chosen) ++per_node[i];
    if (std::string(name) == "spread") {
      // Memory decides (32,000 x 4Gi of 245,760Gi): big nodes get twice the small ones', within one.
      for (std::size_t i = 0; i < nodes.size(); ++i) {
        double expected = 32'000.0 * (i % 2 ? 2.0 : 1.0) / 240.0;
        EXPECT_NEAR(static_cast<double>(per_node[i]), expected, 1.0) << "node " << i;
      }
    } else {
      // Pack fills nodes completely: at most one node is partly used.
      std::size_t partial = 0;
      for (std::size_t i = 0; i < nodes.size(); ++i) {
        std::size_t full = i % 2 ? 512 : 256;  // memory / 4Gi
        EXPECT_LE(per_node[i], full);
        if (per_node[i] != 0 && per_node[i] != full) ++partial;
      }
      EXPECT_LE(partial, 1u);
    }
  }
}

TEST(PlacementProtocol, SpecAndNodeFieldsRoundTrip) {
  SandboxSpec spec = small_spec();
  spec.resources.gpus = 2;
  spec.labels = {{"task", "t1"}};
  spec.node_selector = {{"zone", "a"}};
  spec.anti_affinity = "task";
  spec.group = "job-7.pulse_3";
  spec.group_ttl = std::chrono::seconds{30};
  SandboxSpec back = protocol::decode_spec(protocol::encode(spec));
  EXPECT_EQ(back.resources.gpus, 2u);
  EXPECT_EQ(back.node_selector, spec.node_selector);
  EXPECT_EQ(back.anti_affinity, "task");
  EXPECT_EQ(back.group, "job-7.pulse_3");
  EXPECT_EQ(back.group_ttl.count(), 30);

  NodeInfo n;
  n.gpus = 8;
  n.gpus_free = 3;
  n.labels = {{"zone", "a"}, {"rack", "r7"}};
  NodeInfo nb = protocol::decode_node_info(protocol::encode(n));
  EXPECT_EQ(nb.gpus, 8u);
  EXPECT_EQ(nb.gpus_free, 3u);
  EXPECT_EQ(nb.labels, n.labels);

  SandboxInfo info;
  info.group = "g1";
  info.resources.gpus = 1;
  SandboxInfo ib = protocol::decode_sandbox_info(protocol::encode(info));
  EXPECT_EQ(ib.group, "g1");
  EXPECT_EQ(ib.resources.gpus, 1u);
}

TEST(PlacementProtocol, NewSpecFieldsAreValidated) {
  auto message_of = [](const char* body) -> std::string {
    try {
      protocol::decode_spec(protocol::parse_body(body));
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument);
      return e.what();
    }
    return "accepted";
  };
  EXPECT_EQ(message_of(R"({"resources": {"gpus": 257}})").substr(0, 15), "resources.gpus:");
  EXPECT_EQ(message_of(R"({"resources": {"gpus": -1}})").substr(0, 15), "resources.gpus:");
  EXPECT_EQ(message_of(R"({"node_selector": {"zone": 1}})").substr(0, 19), "node_selector.zone:");
  EXPECT_EQ(message_of(R"({"node_selector": {"": "x"}})").substr(0, 14), "node_selector.");
  EXPECT_EQ(message_of(R"({"anti_affinity": "task"})").substr(0, 14), "anti_affinity:");
  EXPECT_EQ(message_of(R"({"anti_affinity": "task", "labels": {"task": "t"}})"), "accepted");
  EXPECT_EQ(message_of(R"({"group": "g"})").substr(0, 10), "group_ttl:");
  EXPECT_EQ(message_of(R"({"group_ttl": 5})").substr(0, 10), "group_ttl:");
  EXPECT_EQ(message_of(R"({"group": "g", "group_ttl": 0.5})").substr(0, 10), "group_ttl:");
  EXPECT_EQ(message_of(R"({"group": "g", "group_ttl": 86401})").substr(0, 10), "group_ttl:");
  EXPECT_EQ(message_of(R"({"group": "g/1", "group_ttl": 5})").substr(0, 6), "group:");
  EXPECT_EQ(message_of(R"({"group": 7, "group_ttl": 5})").substr(0, 6), "group:");
  std::string long_id(129, 'a');
  EXPECT_EQ(message_of((R"({"group_ttl": 5, "group": ")" + long_id + "\"}").c_str()).substr(0, 6), "group:");
  long_id.pop_back();
  EXPECT_EQ(message_of((R"({"group_ttl": 5, "group": ")" + long_id + "\"}").c_str()), "accepted");
  EXPECT_EQ(message_of(R"({"group": "A-z_0.9", "group_ttl": 86400})"), "accepted");
}

}  // namespace
}  // namespace dsec

namespace dsec {
namespace {

TEST(Placement, SpreadAvoidsPressuredNodes) {
  auto policy = make_placement_policy("spread");
  std::vector<NodeCandidate> nodes{node("calm"), node("busy")};
  // The busy node is emptier by requests, but its tasks waited on CPU half the time.
  nodes[0].info.cpu_requested = 16;
  nodes[1].info.pressure.psi = true;
  nodes[1].info.pressure.cpu_some = 50;
  SandboxSpec spec = small_spec();
  auto chosen = policy->place(request(spec, 1), nodes);
  EXPECT_EQ(chosen, std::vector<std::size_t>{0});
  // Without PSI the same figures mean nothing.
  nodes[1].info.pressure.psi = false;
  chosen = policy->place(request(spec, 1), nodes);
  EXPECT_EQ(chosen, std::vector<std::size_t>{1});
}

TEST(Placement, ANodeThrashingOnMemoryIsRefusedWithWhy) {
  auto policy = make_placement_policy("pack");
  std::vector<NodeCandidate> nodes{node("thrash")};
  nodes[0].info.pressure.psi = true;
  nodes[0].info.pressure.memory_full = 35.5;
  SandboxSpec spec = small_spec();
  Error e = error_of(*policy, request(spec, 1), nodes);
  EXPECT_EQ(e.code(), Code::kResourceExhausted);
  EXPECT_NE(std::string(e.what()).find("memory pressure: every task stalled on memory 35.5%"), std::string::npos)
      << e.what();
  nodes[0].info.pressure.memory_full = kMemoryFullRefusal - 1;
  EXPECT_EQ(policy->place(request(spec, 1), nodes), std::vector<std::size_t>{0});
}

TEST(Placement, NodeUsageAndQosSurviveTheWire) {
  NodeInfo n;
  n.memory_used_bytes = 123456789;
  n.pressure = {true, 1.5, 2.5, 0.5, 3.25, 0.75};
  n.qos.core_scheduling_reason = "the kernel has none (CONFIG_SCHED_CORE)";
  n.qos.latency_cpus = "7";
  n.qos.reclaim = "idle";
  n.qos.reclaimed_bytes = 99;
  n.qos.ksm = true;
  n.qos.ksm_sandboxes = 2;
  NodeInfo back = protocol::decode_node_info(protocol::encode(n));
  EXPECT_EQ(back.memory_used_bytes, 123456789u);
  EXPECT_TRUE(back.pressure.psi);
  EXPECT_DOUBLE_EQ(back.pressure.memory_some, 2.5);
  EXPECT_DOUBLE_EQ(back.pressure.io_some, 3.25);
  EXPECT_EQ(back.qos.core_scheduling_reason, n.qos.core_scheduling_reason);
  EXPECT_EQ(back.qos.latency_cpus, "7");
  EXPECT_EQ(back.qos.reclaim, "idle");
  EXPECT_EQ(back.qos.reclaimed_bytes, 99u);
  EXPECT_TRUE(back.qos.ksm);
  EXPECT_EQ(back.qos.ksm_sandboxes, 2u);

  SandboxSpec spec = small_spec();
  spec.resources.ksm = true;
  spec.resources.reclaim = false;
  SandboxSpec spec_back = protocol::decode_spec(protocol::encode(spec));
  EXPECT_TRUE(spec_back.resources.ksm);
  EXPECT_FALSE(spec_back.resources.reclaim);
  // Written only when not the default: a spec without them fingerprints as before.
  EXPECT_FALSE(protocol::encode(small_spec()).contains("ksm"));
  EXPECT_FALSE(protocol::encode(small_spec()).contains("reclaim"));

  SandboxInfo info;
  info.qos.granted = {"cpu.shares 4096"};
  info.qos.missing = {"core scheduling: none"};
  info.cold_memory.reclaimed_bytes = 5 << 20;
  info.cold_memory.reclaims = 3;
  info.cold_memory.refaults = 17;
  SandboxInfo info_back = protocol::decode_sandbox_info(protocol::encode(info));
  EXPECT_EQ(info_back.qos.granted, info.qos.granted);
  EXPECT_EQ(info_back.qos.missing, info.qos.missing);
  EXPECT_EQ(info_back.cold_memory.reclaimed_bytes, 5u << 20);
  EXPECT_EQ(info_back.cold_memory.reclaims, 3u);
  EXPECT_EQ(info_back.cold_memory.refaults, 17u);
}

}  // namespace
}  // namespace dsec
