// An agent's registration in a real etcd: the key and its record, refreshed with the node's load, revoked at stop,
// left to expire when renewal stops, and written again after etcd lost everything.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <string>

#include "agent/node/registration.hpp"
#include "cluster/etcd_client.hpp"
#include "cluster/etcd_test_util.hpp"
#include "cluster/node_record.hpp"

namespace dsec::agent {
namespace {

using dsec::testing::EtcdServer;
using dsec::testing::wait_until;
using std::chrono::milliseconds;
using std::chrono::seconds;

class RegistrationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = dsec::testing::etcd_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    server_ = std::make_unique<EtcdServer>();
    server_->start();
    cluster::EtcdOptions o;
    o.endpoints = {server_->url()};
    etcd_ = std::make_unique<cluster::EtcdClient>(o);
  }

  RegistrationOptions options(std::string node = "n1") {
    RegistrationOptions r;
    r.etcd_endpoints = {server_->url()};
    r.prefix = "/dsec-test/";
    r.node_id = node;
    r.endpoint = "http://10.9.0.1:7070";
    r.lease_ttl = seconds(2);
    r.max_backoff = milliseconds(200);
    return r;
  }

  std::function<NodeInfo()> node_info(std::string id) {
    return [this, id] {
      NodeInfo n;
      n.id = id;
      n.cores = 4;
      n.sandboxes = sandboxes_.load();
      return n;
    };
  }

  // The record under the node's key, or nullopt.
  std::optional<cluster::NodeRecord> stored(const std::string& node = "n1") {
    auto r = etcd_->get("/dsec-test/nodes/" + node);
    if (r.kvs.empty()) return std::nullopt;
    return cluster::decode_node_record(r.kvs[0].value);
  }

  std::unique_ptr<EtcdServer> server_;
  std::unique_ptr<cluster::EtcdClient> etcd_;
  std::atomic<unsigned> sandboxes_{0};
};

TEST(Registration, RefusesBadOptions) {
  RegistrationOptions r;
  r.etcd_endpoints = {"http://127.0.0.1:1"};
  r.node_id = "n";
  r.endpoint = "http://10.0.0.1:7070";
  r.lease_ttl = seconds(1);
  EXPECT_THROW(Registration(r, [] { return NodeInfo{}; }), Error);
  r.lease_ttl = seconds(10);
  r.endpoint.clear();
  EXPECT_THROW(Registration(r, [] { return NodeInfo{}; }), Error);
  r.endpoint = "http://10.0.0.1:7070";
  r.etcd_endpoints = {"10.0.0.2:2379"};
  EXPECT_THROW(Registration(r, [] { return NodeInfo{}; }), Error);
}

// The function-call pools go into the record with the node's info, and follow their changes.
TEST_F(RegistrationTest, TheRecordCarriesTheFunctionCallPools) {
  std::atomic<int> idle{1};
  Registration reg(options(), node_info("n1"), [&] {
    return R"({"languages":["python"],"pools":[{"image":"py","language":"python","idle":)" +
           std::to_string(idle.load()) + "}]}";
  });
  reg.start();
  auto idle_in_etcd = [&]() -> int {
    auto rec = stored();
    if (!rec || rec->fncall.empty()) return -1;
    return nlohmann::json::parse(rec->fncall)["pools"][0]["idle"].get<int>();
  };
  ASSERT_TRUE(wait_until([&] { return idle_in_etcd() == 1; }, seconds(5)));
  idle = 4;
  ASSERT_TRUE(wait_until([&] { return idle_in_etcd() == 4; }, seconds(3)));
  reg.stop();

  Registration plain(options("n2"), node_info("n2"));
  plain.start();
  ASSERT_TRUE(wait_until([&] { return stored("n2").has_value(); }, seconds(5)));
  EXPECT_EQ(stored("n2")->fncall, "");
  plain.stop();
}

TEST_F(RegistrationTest, RegistersRefreshesAndRevokesAtStop) {
  Registration reg(options(), node_info("n1"));
  EXPECT_EQ(reg.key(), "/dsec-test/nodes/n1");
  reg.start();
  ASSERT_TRUE(wait_until([&] { return stored().has_value(); }, seconds(5)));
  auto rec = *stored();
  EXPECT_EQ(rec.endpoint, "http://10.9.0.1:7070");
  EXPECT_EQ(rec.node.id, "n1");
  EXPECT_EQ(rec.node.cores, 4u);
  EXPECT_EQ(rec.node.sandboxes, 0u);
  EXPECT_TRUE(reg.registered());
  EXPECT_NE(etcd_->get("/dsec-test/nodes/n1").kvs.at(0).lease, 0);

  // Load changes reach etcd within a renewal period (TTL/3).
  sandboxes_ = 5;
  ASSERT_TRUE(wait_until([&] { return stored() && stored()->node.sandboxes == 5u; }, seconds(3)));

  // The key outlives several TTLs while renewed.
  std::this_thread::sleep_for(seconds(5));
  ASSERT_TRUE(stored().has_value());

  // A key deleted by hand is written again at the next renewal.
  etcd_->delete_key("/dsec-test/nodes/n1");
  ASSERT_TRUE(wait_until([&] { return stored().has_value(); }, seconds(2)));

  reg.stop();
  EXPECT_FALSE(stored().has_value()) << "a clean stop removes the key at once";
  EXPECT_FALSE(reg.registered());
}

TEST_F(RegistrationTest, StopRenewingLetsTheLeaseExpire) {
  auto o = options("n2");
  o.stop_renewing_after = milliseconds(500);
  Registration reg(o, node_info("n2"));
  reg.start();
  ASSERT_TRUE(wait_until([&] { return stored("n2").has_value(); }, seconds(5)));
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(wait_until([&] { return !stored("n2").has_value(); }, seconds(10)));
  EXPECT_GE(std::chrono::steady_clock::now() - start, milliseconds(1'000));
  reg.stop();
}

TEST_F(RegistrationTest, RegistersAgainAfterEtcdLostEverything) {
  Registration reg(options("n3"), node_info("n3"));
  reg.start();
  ASSERT_TRUE(wait_until([&] { return stored("n3").has_value(); }, seconds(5)));
  const std::int64_t old_lease = etcd_->get("/dsec-test/nodes/n3").kvs.at(0).lease;
  server_->kill();
  ASSERT_TRUE(wait_until([&] { return !reg.registered(); }, seconds(5)));
  server_->start(/*wipe=*/true);
  // The old lease is unknown to the new etcd: the agent notices and registers under a new one.
  ASSERT_TRUE(wait_until([&] { return stored("n3").has_value(); }, seconds(10)));
  EXPECT_TRUE(wait_until([&] { return reg.registered(); }, seconds(5)));
  const std::int64_t new_lease = etcd_->get("/dsec-test/nodes/n3").kvs.at(0).lease;
  EXPECT_NE(new_lease, 0);
  EXPECT_NE(new_lease, old_lease);
  reg.stop();
  EXPECT_FALSE(stored("n3").has_value());
}

}  // namespace
}  // namespace dsec::agent
