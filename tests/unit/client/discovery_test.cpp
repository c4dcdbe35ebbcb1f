// EtcdDiscovery against a real etcd: the first listing, nodes that come, change and go (deleted, lease expired),
// records that cannot be read, a snapshot while etcd is away, and a watch that comes back after a compaction and
// reports only what changed meanwhile.
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "client/discovery.hpp"
#include "cluster/etcd_client.hpp"
#include "cluster/etcd_test_util.hpp"
#include "cluster/node_record.hpp"

namespace dsec::detail {
namespace {

using dsec::testing::EtcdServer;
using dsec::testing::TcpProxy;
using dsec::testing::wait_until;
using std::chrono::milliseconds;
using std::chrono::seconds;

std::string record(const std::string& id, const std::string& endpoint, unsigned sandboxes = 0) {
  cluster::NodeRecord r;
  r.endpoint = endpoint;
  r.node.id = id;
  r.node.cores = 2;
  r.node.memory_bytes = 1ull << 30;
  r.node.backends = {"container"};
  r.node.sandboxes = sandboxes;
  return cluster::encode_node_record(r);
}

struct Events {
  std::mutex mu;
  std::vector<NodeEvent> all;
  EtcdDiscovery::Callback callback() {
    return [this](const NodeEvent& e) {
      std::lock_guard lock(mu);
      all.push_back(e);
    };
  }
  std::size_t size() {
    std::lock_guard lock(mu);
    return all.size();
  }
  std::vector<NodeEvent> get() {
    std::lock_guard lock(mu);
    return all;
  }
};

class DiscoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = dsec::testing::etcd_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    server_ = std::make_unique<EtcdServer>();
    server_->start();
    cluster::EtcdOptions o;
    o.endpoints = {server_->url()};
    etcd_ = std::make_unique<cluster::EtcdClient>(o);
  }
  std::unique_ptr<EtcdServer> server_;
  std::unique_ptr<cluster::EtcdClient> etcd_;
};

TEST(Discovery, RefusesBadArguments) {
  EXPECT_THROW(EtcdDiscovery({"localhost:2379"}, "/dsec/", nullptr), Error);
  EXPECT_THROW(EtcdDiscovery({"http://127.0.0.1:1"}, "", nullptr), Error);
  EtcdDiscovery d({"http://127.0.0.1:1"}, "/dsec", nullptr);
  EXPECT_EQ(d.nodes_prefix(), "/dsec/nodes/");
  try {
    d.snapshot(milliseconds(10));
    FAIL() << "snapshot before start";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
  }
}

TEST(Discovery, SnapshotIsUnavailableWhileEtcdCannotBeReached) {
  std::string dead = fmt::format("http://127.0.0.1:{}", dsec::testing::free_port());
  EtcdDiscovery d({dead}, "/dsec/", nullptr);
  d.start();
  auto start = std::chrono::steady_clock::now();
  try {
    d.snapshot(milliseconds(700));
    FAIL() << "snapshot without etcd";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnavailable);
    EXPECT_NE(std::string(e.what()).find(dead), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(3));
  EXPECT_FALSE(d.watching());
}

TEST_F(DiscoveryTest, ListsThenFollowsNodesThatComeChangeAndGo) {
  etcd_->put("/dsec/nodes/a", record("a", "http://10.1.0.1:7070"));
  etcd_->put("/dsec/other", "not a node");
  Events ev;
  EtcdDiscovery d({server_->url()}, "/dsec/", ev.callback());
  d.start();
  auto first = d.snapshot();
  ASSERT_EQ(first.size(), 1u);
  EXPECT_EQ(first[0].node_id, "a");
  EXPECT_EQ(first[0].endpoint, "http://10.1.0.1:7070");
  EXPECT_EQ(first[0].info.cores, 2u);
  EXPECT_EQ(first[0].info.backends, std::vector<std::string>{"container"});
  ASSERT_TRUE(wait_until([&] { return d.watching(); }, seconds(5)));

  cluster::Lease lease = etcd_->grant_lease(seconds(2));
  etcd_->put("/dsec/nodes/b", record("b", "http://10.1.0.2:7070"), lease.id);
  etcd_->put("/dsec/nodes/a", record("a", "http://10.1.0.1:7070", 7));
  ASSERT_TRUE(wait_until([&] { return ev.size() >= 3; }, seconds(5)));
  auto e = ev.get();
  EXPECT_EQ(e[0].kind, NodeEvent::Kind::kUp);
  EXPECT_EQ(e[0].node_id, "a");
  EXPECT_EQ(e[1].kind, NodeEvent::Kind::kUp);
  EXPECT_EQ(e[1].node_id, "b");
  EXPECT_EQ(e[2].node_id, "a");
  EXPECT_EQ(e[2].info.sandboxes, 7u);
  EXPECT_EQ(d.snapshot().size(), 2u);

  // A record that is not a node's (or of another node than its key says) is ignored, with a reason.
  etcd_->put("/dsec/nodes/x", "{not json");
  etcd_->put("/dsec/nodes/y", record("z", "http://10.1.0.3:7070"));
  ASSERT_TRUE(wait_until([&] { return d.last_error().find("/dsec/nodes/y") != std::string::npos; }, seconds(5)));
  EXPECT_EQ(d.snapshot().size(), 2u);

  // b's lease is not renewed: it expires and b goes down; a is deleted outright.
  ASSERT_TRUE(wait_until([&] { return ev.size() >= 4; }, seconds(10)));
  etcd_->delete_key("/dsec/nodes/a");
  ASSERT_TRUE(wait_until([&] { return ev.size() >= 5; }, seconds(5)));
  e = ev.get();
  EXPECT_EQ(e[3].kind, NodeEvent::Kind::kDown);
  EXPECT_EQ(e[3].node_id, "b");
  EXPECT_EQ(e[3].endpoint, "http://10.1.0.2:7070");
  EXPECT_EQ(e[4].kind, NodeEvent::Kind::kDown);
  EXPECT_EQ(e[4].node_id, "a");
  EXPECT_TRUE(d.snapshot().empty());
  d.stop();
  std::size_t after_stop = ev.size();
  etcd_->put("/dsec/nodes/c", record("c", "http://10.1.0.4:7070"));
  std::this_thread::sleep_for(milliseconds(300));
  EXPECT_EQ(ev.size(), after_stop);
}

TEST_F(DiscoveryTest, WaitsForEtcdThenLists) {
  etcd_->put("/dsec/nodes/a", record("a", "http://10.1.0.1:7070"));
  server_->kill();
  Events ev;
  DiscoveryOptions o;
  o.max_backoff = milliseconds(200);
  EtcdDiscovery d({server_->url()}, "/dsec/", ev.callback(), o);
  d.start();
  EXPECT_THROW(d.snapshot(milliseconds(300)), Error);
  EXPECT_FALSE(d.last_error().empty());
  server_->start();
  auto nodes = d.snapshot(seconds(10));
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0].node_id, "a");
  EXPECT_EQ(ev.size(), 1u);
}

// A node's function-call pools travel in its record, so clients see warm pools without asking each node.
TEST(NodeRecordCodec, CarriesTheFunctionCallPools) {
  cluster::NodeRecord r;
  r.endpoint = "http://10.1.0.1:7070";
  r.node.id = "a";
  r.fncall = R"({"languages":["python","shell"],"pools":[{"image":"py","language":"python","idle":2,"busy":1}]})";
  cluster::NodeRecord back = cluster::decode_node_record(cluster::encode_node_record(r));
  EXPECT_EQ(nlohmann::json::parse(back.fncall), nlohmann::json::parse(r.fncall));
  EXPECT_EQ(back.node.id, "a");

  r.fncall.clear();
  EXPECT_EQ(cluster::decode_node_record(cluster::encode_node_record(r)).fncall, "");
  try {
    cluster::decode_node_record(R"({"endpoint":"http://x:1","node":{"id":"a","fncall":[1]}})");
    FAIL() << "a fncall that is not an object was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("fncall"), std::string::npos) << e.what();
  }
  r.fncall = "not json";
  EXPECT_THROW(cluster::encode_node_record(r), Error);
}

TEST_F(DiscoveryTest, ReportsTheFunctionCallPoolsOfARecord) {
  cluster::NodeRecord r;
  r.endpoint = "http://10.1.0.2:7070";
  r.node.id = "b";
  r.fncall = R"({"languages":["python"],"pools":[{"image":"py","language":"python","idle":3,"busy":0}]})";
  etcd_->put("/dsec/nodes/b", cluster::encode_node_record(r));
  etcd_->put("/dsec/nodes/c", record("c", "http://10.1.0.3:7070"));
  Events ev;
  EtcdDiscovery d({server_->url()}, "/dsec/", ev.callback());
  d.start();
  auto nodes = d.snapshot(seconds(10));
  ASSERT_EQ(nodes.size(), 2u);
  for (const auto& n : nodes) {
    if (n.node_id == "b") EXPECT_EQ(nlohmann::json::parse(n.fncall)["pools"][0]["idle"], 3);
    else EXPECT_EQ(n.fncall, "") << n.node_id;
  }
}

// The callback may look at the table: for the first listing's events too, without waiting for itself.
TEST_F(DiscoveryTest, CallbackMaySnapshot) {
  etcd_->put("/dsec/nodes/a", record("a", "http://10.1.0.1:7070"));
  etcd_->put("/dsec/nodes/b", record("b", "http://10.1.0.2:7070"));
  std::mutex mu;
  std::vector<std::size_t> seen;
  EtcdDiscovery* self = nullptr;
  EtcdDiscovery d({server_->url()}, "/dsec/", [&](const NodeEvent&) {
    std::size_t n = self->snapshot(milliseconds(2'000)).size();
    std::lock_guard lock(mu);
    seen.push_back(n);
  });
  self = &d;
  d.start();
  auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(d.snapshot().size(), 2u);
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(2));
  std::lock_guard lock(mu);
  EXPECT_EQ(seen, (std::vector<std::size_t>{2, 2}));
}

// While the watch is cut off, a node goes, one comes, one changes, and the history is compacted: on reconnect the
// discovery re-lists and reports exactly those three differences (the unchanged node is not reported again).
TEST_F(DiscoveryTest, AfterACompactionReportsOnlyTheDifferences) {
  TcpProxy proxy(server_->client_port());
  etcd_->put("/dsec/nodes/a", record("a", "http://10.1.0.1:7070"));
  etcd_->put("/dsec/nodes/b", record("b", "http://10.1.0.2:7070"));
  etcd_->put("/dsec/nodes/same", record("same", "http://10.1.0.9:7070"));
  Events ev;
  DiscoveryOptions o;
  o.max_backoff = milliseconds(200);
  EtcdDiscovery d({proxy.url()}, "/dsec/", ev.callback(), o);
  d.start();
  ASSERT_EQ(d.snapshot().size(), 3u);
  ASSERT_TRUE(wait_until([&] { return d.watching(); }, seconds(5)));
  ASSERT_EQ(ev.size(), 3u);

  proxy.refuse(true);
  proxy.break_connections();
  ASSERT_TRUE(wait_until([&] { return !d.watching(); }, seconds(5)));
  etcd_->delete_key("/dsec/nodes/a");
  etcd_->put("/dsec/nodes/c", record("c", "http://10.1.0.3:7070"));
  std::int64_t now = etcd_->put("/dsec/nodes/b", record("b", "http://10.1.0.2:7070", 3));
  etcd_->compact(now);
  proxy.refuse(false);

  ASSERT_TRUE(wait_until([&] { return ev.size() >= 6; }, seconds(10)));
  ASSERT_TRUE(wait_until([&] { return d.watching(); }, seconds(5)));
  auto e = ev.get();
  ASSERT_EQ(e.size(), 6u);
  EXPECT_EQ(e[3].kind, NodeEvent::Kind::kDown);
  EXPECT_EQ(e[3].node_id, "a");
  EXPECT_EQ(e[4].kind, NodeEvent::Kind::kUp);
  EXPECT_EQ(e[4].node_id, "b");
  EXPECT_EQ(e[4].info.sandboxes, 3u);
  EXPECT_EQ(e[5].kind, NodeEvent::Kind::kUp);
  EXPECT_EQ(e[5].node_id, "c");
  auto nodes = d.snapshot();
  ASSERT_EQ(nodes.size(), 3u);
  EXPECT_EQ(nodes[0].node_id, "b");
  EXPECT_EQ(nodes[1].node_id, "c");
  EXPECT_EQ(nodes[2].node_id, "same");

  // And it keeps following from there.
  etcd_->delete_key("/dsec/nodes/same");
  ASSERT_TRUE(wait_until([&] { return ev.size() >= 7; }, seconds(5)));
  EXPECT_EQ(ev.get()[6].kind, NodeEvent::Kind::kDown);
}

}  // namespace
}  // namespace dsec::detail
