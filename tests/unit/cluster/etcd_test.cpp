// The etcd client against a real etcd: keys, prefixes, leases that expire or are revoked, and watches that see every
// change in order, resume after a broken stream without losing or repeating one, and re-list after a compaction.
#include <gtest/gtest.h>

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "cluster/etcd_client.hpp"
#include "cluster/etcd_test_util.hpp"

namespace dsec::cluster {
namespace {

using dsec::testing::EtcdServer;
using dsec::testing::TcpProxy;
using dsec::testing::wait_until;
using std::chrono::milliseconds;
using std::chrono::seconds;

class EtcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::string why = dsec::testing::etcd_skip_reason(); !why.empty()) GTEST_SKIP() << why;
    server_ = std::make_unique<EtcdServer>();
    server_->start();
  }

  EtcdOptions options(std::vector<std::string> endpoints = {}) {
    EtcdOptions o;
    o.endpoints = endpoints.empty() ? std::vector<std::string>{server_->url()} : std::move(endpoints);
    o.request_timeout = milliseconds(3'000);
    o.connect_timeout = milliseconds(500);
    return o;
  }

  std::unique_ptr<EtcdServer> server_;
};

// What a watch handed out, for the test thread to look at.
struct Recorder {
  std::mutex mu;
  std::vector<WatchEvent> events;
  std::vector<std::vector<KeyValue>> resyncs;
  std::vector<std::string> errors;
  int connected = 0;

  WatchCallbacks callbacks() {
    WatchCallbacks c;
    c.on_event = [this](const WatchEvent& e) {
      std::lock_guard lock(mu);
      events.push_back(e);
    };
    c.on_resync = [this](const std::vector<KeyValue>& kvs, std::int64_t) {
      std::lock_guard lock(mu);
      resyncs.push_back(kvs);
    };
    c.on_error = [this](const Error& e) {
      std::lock_guard lock(mu);
      errors.push_back(e.what());
    };
    c.on_connected = [this] {
      std::lock_guard lock(mu);
      ++connected;
    };
    return c;
  }
  std::size_t event_count() {
    std::lock_guard lock(mu);
    return events.size();
  }
  std::string last_error() {
    std::lock_guard lock(mu);
    return errors.empty() ? "" : errors.back();
  }
  std::vector<WatchEvent> snapshot() {
    std::lock_guard lock(mu);
    return events;
  }
};

TEST(EtcdClientOptions, RefusesBadEndpoints) {
  EtcdOptions o;
  try {
    EtcdClient c(o);
    FAIL() << "no endpoint accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
  }
  o.endpoints = {"127.0.0.1:2379"};
  try {
    EtcdClient c(o);
    FAIL() << "an endpoint without a scheme accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:2379"), std::string::npos) << e.what();
  }
}

TEST(EtcdClientOptions, PrefixEnd) {
  EXPECT_EQ(EtcdClient::prefix_end("/dsec/nodes/"), "/dsec/nodes0");
  EXPECT_EQ(EtcdClient::prefix_end("a\xff"), "b");
  EXPECT_EQ(EtcdClient::prefix_end("\xff"), std::string(1, '\0'));
}

TEST(EtcdClientOptions, UnreachableIsUnavailableWithinTheTimeout) {
  EtcdOptions o;
  o.endpoints = {fmt::format("http://127.0.0.1:{}", dsec::testing::free_port())};
  o.request_timeout = milliseconds(1'000);
  EtcdClient c(o);
  auto start = std::chrono::steady_clock::now();
  try {
    c.put("/k", "v");
    FAIL() << "put to a closed port succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnavailable) << e.what();
    EXPECT_NE(std::string(e.what()).find(o.endpoints[0]), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(3));
}

TEST_F(EtcdTest, PutGetRangeDelete) {
  EtcdClient c(options());
  std::int64_t r1 = c.put("/t/a", "1");
  std::int64_t r2 = c.put("/t/b", std::string("two\0bytes", 9));
  std::int64_t r3 = c.put("/t/c", "3");
  c.put("/u/x", "other prefix");
  EXPECT_LT(r1, r2);
  EXPECT_LT(r2, r3);

  RangeResult one = c.get("/t/b");
  ASSERT_EQ(one.kvs.size(), 1u);
  EXPECT_EQ(one.kvs[0].value, std::string("two\0bytes", 9));
  EXPECT_EQ(one.kvs[0].mod_revision, r2);
  EXPECT_EQ(one.kvs[0].version, 1);

  RangeResult all = c.range_prefix("/t/");
  ASSERT_EQ(all.kvs.size(), 3u);
  EXPECT_EQ(all.kvs[0].key, "/t/a");
  EXPECT_EQ(all.kvs[2].key, "/t/c");
  EXPECT_GE(all.revision, r3 + 1);

  // An older revision still holds what was there then.
  c.put("/t/a", "1b");
  RangeResult then = c.range_prefix("/t/", r1);
  ASSERT_EQ(then.kvs.size(), 1u);
  EXPECT_EQ(then.kvs[0].value, "1");
  EXPECT_EQ(c.get("/t/a").kvs.at(0).value, "1b");
  EXPECT_EQ(c.get("/t/a").kvs.at(0).version, 2);

  EXPECT_EQ(c.delete_key("/t/a"), 1);
  EXPECT_EQ(c.delete_key("/t/a"), 0);
  EXPECT_TRUE(c.get("/t/a").kvs.empty());
  EXPECT_EQ(c.delete_prefix("/t/"), 2);
  EXPECT_TRUE(c.range_prefix("/t/").kvs.empty());
  EXPECT_EQ(c.range_prefix("/u/").kvs.size(), 1u);
}

TEST_F(EtcdTest, CompactedRevisionIsOutOfRange) {
  EtcdClient c(options());
  std::int64_t r1 = c.put("/c/a", "1");
  std::int64_t r2 = c.put("/c/a", "2");
  c.compact(r2);
  try {
    c.range_prefix("/c/", r1);
    FAIL() << "a compacted revision was read";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kOutOfRange) << e.what();
    EXPECT_NE(std::string(e.what()).find("compacted"), std::string::npos) << e.what();
  }
}

TEST_F(EtcdTest, FailsOverToALiveMember) {
  std::string dead = fmt::format("http://127.0.0.1:{}", dsec::testing::free_port());
  EtcdClient c(options({dead, server_->url()}));
  c.put("/f/a", "1");
  EXPECT_EQ(c.current_endpoint(), server_->url());
  EXPECT_EQ(c.get("/f/a").kvs.at(0).value, "1");
}

TEST_F(EtcdTest, LeaseKeepsKeysWhileRenewedAndDropsThemWhenItExpires) {
  EtcdClient c(options());
  Lease lease = c.grant_lease(seconds(2));
  ASSERT_NE(lease.id, 0);
  EXPECT_GE(lease.ttl_seconds, 2);
  c.put("/l/renewed", "x", lease.id);
  EXPECT_EQ(c.get("/l/renewed").kvs.at(0).lease, lease.id);

  // Renewed for twice its TTL: still there.
  for (int i = 0; i < 8; ++i) {
    EXPECT_GT(c.keepalive(lease.id), 0);
    std::this_thread::sleep_for(milliseconds(500));
  }
  EXPECT_EQ(c.get("/l/renewed").kvs.size(), 1u);

  // Left alone: gone within TTL plus etcd's expiry check interval.
  EXPECT_TRUE(wait_until([&] { return c.get("/l/renewed").kvs.empty(); }, seconds(8)));
  EXPECT_EQ(c.keepalive(lease.id), 0);
  try {
    c.put("/l/late", "x", lease.id);
    FAIL() << "put with an expired lease succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound) << e.what();
  }
}

TEST_F(EtcdTest, RevokeDeletesAtOnceAndIsIdempotent) {
  EtcdClient c(options());
  Lease lease = c.grant_lease(seconds(60));
  c.put("/r/a", "1", lease.id);
  c.put("/r/b", "2", lease.id);
  c.revoke_lease(lease.id);
  EXPECT_TRUE(c.range_prefix("/r/").kvs.empty());
  c.revoke_lease(lease.id);
  EXPECT_EQ(c.keepalive(lease.id), 0);
}

TEST_F(EtcdTest, WatchSeesPutsAndDeletesInOrder) {
  EtcdClient c(options());
  c.put("/w/before", "old");
  Recorder rec;
  auto watch = c.watch_prefix("/w/", 0, rec.callbacks());
  ASSERT_TRUE(wait_until([&] { return watch->connected(); }, seconds(5)));
  std::int64_t r1 = c.put("/w/a", "1");
  std::int64_t r2 = c.put("/w/a", "2");
  c.put("/other", "not watched");
  std::int64_t r3 = c.delete_key("/w/a") ? c.get("/w/").revision : 0;
  ASSERT_TRUE(wait_until([&] { return rec.event_count() >= 3; }, seconds(5)));
  auto events = rec.snapshot();
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[0].type, WatchEvent::Type::kPut);
  EXPECT_EQ(events[0].key, "/w/a");
  EXPECT_EQ(events[0].value, "1");
  EXPECT_EQ(events[0].mod_revision, r1);
  EXPECT_EQ(events[1].value, "2");
  EXPECT_EQ(events[1].mod_revision, r2);
  EXPECT_EQ(events[2].type, WatchEvent::Type::kDelete);
  EXPECT_EQ(events[2].key, "/w/a");
  EXPECT_EQ(events[2].mod_revision, r3);
  EXPECT_EQ(watch->next_revision(), r3 + 1);

  // stop() ends an idle stream promptly.
  auto start = std::chrono::steady_clock::now();
  watch->stop();
  EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(2));
  EXPECT_FALSE(watch->connected());
}

TEST_F(EtcdTest, WatchFromARevisionReplaysHistory) {
  EtcdClient c(options());
  std::int64_t r1 = c.put("/h/a", "1");
  c.put("/h/b", "2");
  Recorder rec;
  auto watch = c.watch_prefix("/h/", r1, rec.callbacks());
  ASSERT_TRUE(wait_until([&] { return rec.event_count() >= 2; }, seconds(5)));
  auto events = rec.snapshot();
  EXPECT_EQ(events[0].key, "/h/a");
  EXPECT_EQ(events[1].key, "/h/b");
}

TEST_F(EtcdTest, LeaseExpiryIsADeleteEvent) {
  EtcdClient c(options());
  Lease lease = c.grant_lease(seconds(2));
  c.put("/e/node", "x", lease.id);
  Recorder rec;
  auto watch = c.watch_prefix("/e/", 0, rec.callbacks());
  ASSERT_TRUE(wait_until([&] { return rec.event_count() >= 1; }, seconds(10)));
  auto events = rec.snapshot();
  EXPECT_EQ(events[0].type, WatchEvent::Type::kDelete);
  EXPECT_EQ(events[0].key, "/e/node");
}

// The stream breaks (the proxy drops it, then refuses for a while) while the store changes: the watch reopens from
// the revision after the last event it handed out, so the missed changes arrive once each, in order.
TEST_F(EtcdTest, WatchResumesAfterABrokenStreamWithoutLosingOrRepeating) {
  TcpProxy proxy(server_->client_port());
  EtcdClient direct(options());
  EtcdClient through(options({proxy.url()}));
  Recorder rec;
  WatchOptions wo;
  wo.min_backoff = milliseconds(50);
  wo.max_backoff = milliseconds(200);
  auto watch = through.watch_prefix("/p/", 0, rec.callbacks(), wo);
  ASSERT_TRUE(wait_until([&] { return watch->connected(); }, seconds(5)));
  direct.put("/p/a", "1");
  ASSERT_TRUE(wait_until([&] { return rec.event_count() == 1; }, seconds(5)));

  proxy.refuse(true);
  proxy.break_connections();
  ASSERT_TRUE(wait_until([&] { return !watch->connected(); }, seconds(5)));
  direct.put("/p/b", "2");
  direct.delete_key("/p/a");
  direct.put("/p/c", "3");
  std::this_thread::sleep_for(milliseconds(500));
  EXPECT_EQ(rec.event_count(), 1u);
  {
    std::lock_guard lock(rec.mu);
    EXPECT_FALSE(rec.errors.empty());
  }
  proxy.refuse(false);
  ASSERT_TRUE(wait_until([&] { return rec.event_count() >= 4; }, seconds(10)))
      << "events: " << rec.event_count() << ", connected: " << watch->connected() << ", connects: " << watch->connects()
      << ", proxy accepted: " << proxy.accepted() << ", last error: " << rec.last_error();
  std::this_thread::sleep_for(milliseconds(200));
  auto events = rec.snapshot();
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[1].key, "/p/b");
  EXPECT_EQ(events[2].key, "/p/a");
  EXPECT_EQ(events[2].type, WatchEvent::Type::kDelete);
  EXPECT_EQ(events[3].key, "/p/c");
  for (std::size_t i = 1; i < events.size(); ++i) EXPECT_GT(events[i].mod_revision, events[i - 1].mod_revision);
  EXPECT_GE(watch->connects(), 2u);
  EXPECT_TRUE(rec.resyncs.empty());
}

// etcd itself dies and comes back on the same data: the watch finds it again and goes on.
TEST_F(EtcdTest, WatchReconnectsAfterEtcdRestarts) {
  EtcdClient c(options());
  Recorder rec;
  WatchOptions wo;
  wo.min_backoff = milliseconds(50);
  wo.max_backoff = milliseconds(300);
  auto watch = c.watch_prefix("/k/", 0, rec.callbacks(), wo);
  ASSERT_TRUE(wait_until([&] { return watch->connected(); }, seconds(5)));
  c.put("/k/a", "1");
  ASSERT_TRUE(wait_until([&] { return rec.event_count() == 1; }, seconds(5)));
  server_->kill();
  ASSERT_TRUE(wait_until([&] { return !watch->connected(); }, seconds(5)));
  try {
    c.put("/k/b", "x");
    FAIL() << "put while etcd is down succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnavailable) << e.what();
  }
  server_->start();
  c.put("/k/b", "2");
  ASSERT_TRUE(wait_until([&] { return rec.event_count() >= 2; }, seconds(10)));
  auto events = rec.snapshot();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].key, "/k/b");
  EXPECT_EQ(events[1].value, "2");
  std::lock_guard lock(rec.mu);
  EXPECT_FALSE(rec.errors.empty());
  EXPECT_GE(rec.connected, 2);
}

// The history the watch would resume from was compacted away: it re-lists the prefix (on_resync), then goes on.
TEST_F(EtcdTest, WatchRelistsAfterCompaction) {
  EtcdClient c(options());
  std::int64_t r1 = c.put("/z/a", "1");
  c.put("/z/b", "2");
  c.delete_key("/z/a");
  std::int64_t now = c.put("/z/b", "2b");
  c.compact(now);
  Recorder rec;
  auto watch = c.watch_prefix("/z/", r1, rec.callbacks());
  ASSERT_TRUE(wait_until(
      [&] {
        std::lock_guard lock(rec.mu);
        return !rec.resyncs.empty();
      },
      seconds(5)));
  {
    std::lock_guard lock(rec.mu);
    ASSERT_EQ(rec.resyncs[0].size(), 1u);
    EXPECT_EQ(rec.resyncs[0][0].key, "/z/b");
    EXPECT_EQ(rec.resyncs[0][0].value, "2b");
    EXPECT_TRUE(rec.events.empty());
  }
  ASSERT_TRUE(wait_until([&] { return watch->connected(); }, seconds(5)));
  c.put("/z/c", "3");
  ASSERT_TRUE(wait_until([&] { return rec.event_count() >= 1; }, seconds(5)));
  EXPECT_EQ(rec.snapshot()[0].key, "/z/c");
}

TEST_F(EtcdTest, ListFirstHandsTheCurrentStateThenChanges) {
  EtcdClient c(options());
  c.put("/s/a", "1");
  c.put("/s/b", "2");
  Recorder rec;
  WatchOptions wo;
  wo.list_first = true;
  auto watch = c.watch_prefix("/s/", 0, rec.callbacks(), wo);
  ASSERT_TRUE(wait_until([&] { return watch->connected(); }, seconds(5)));
  c.put("/s/c", "3");
  ASSERT_TRUE(wait_until([&] { return rec.event_count() >= 1; }, seconds(5)));
  std::lock_guard lock(rec.mu);
  ASSERT_EQ(rec.resyncs.size(), 1u);
  EXPECT_EQ(rec.resyncs[0].size(), 2u);
  ASSERT_EQ(rec.events.size(), 1u);
  EXPECT_EQ(rec.events[0].key, "/s/c");
}

}  // namespace
}  // namespace dsec::cluster
