// A sandbox's small requests on the wire (TTL, exposed ports, group renewals): what the client writes, the agent
// reads back, and what the agent refuses, with the messages callers see.
#include <gtest/gtest.h>

#include <chrono>
#include <string>

#include "common/protocol/sandbox.hpp"
#include "dsec/error.hpp"

namespace dsec::protocol {
namespace {

std::string message_of(void (*f)()) {
  try {
    f();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    return e.what();
  }
  return "(no error)";
}

TEST(ProtocolSandbox, SmallRequestsRoundTrip) {
  EXPECT_EQ(decode_ttl_request(encode_ttl_request(std::chrono::seconds(300))), std::chrono::seconds(300));
  EXPECT_EQ(decode_ttl_request(encode_ttl_request(std::chrono::seconds(0))), std::chrono::seconds(0));
  EXPECT_EQ(decode_expose_request(encode_expose_request(8000)), 8000u);
  EXPECT_EQ(decode_group_renew(encode_group_renew(std::chrono::seconds(30))), 30);
  EXPECT_EQ(decode_group_renew(json::object()), 0);
}

TEST(ProtocolSandbox, SmallRequestsAreRefusedByName) {
  EXPECT_EQ(message_of([] {
              decode_ttl_request(json{{"ttl", -1}});
            }),
            "ttl: -1 is not a whole number of seconds from 0 to 31536000");
  EXPECT_EQ(message_of([] { decode_ttl_request(json{{"ttl", 1}, {"x", 1}}); }), "ttl: unknown field 'x' (known: ttl)");
  EXPECT_EQ(message_of([] { decode_expose_request(json{{"port", 70000}}); }), "port: a TCP port (1-65535) is required");
  EXPECT_EQ(message_of([] {
              decode_group_renew(json{{"ttl", 86401}});
            }),
            "ttl: must be a number of seconds from 1 to 86400");
  EXPECT_EQ(message_of([] { decode_group_renew(json::array()); }),
            "renew: the body must be a JSON object such as {\"ttl\": 30}");
}

TEST(ProtocolSandbox, ForkRequestsRoundTripAndAreRefusedByName) {
  ForkRequest r = decode_fork_request(encode(ForkRequest{.count = 3, .labels = {{"run", "7"}}}));
  EXPECT_EQ(r.count, 3u);
  EXPECT_EQ(r.labels, (Labels{{"run", "7"}}));
  EXPECT_EQ(encode(ForkRequest{.count = 2, .labels = {}}), (json{{"count", 2}}));
  EXPECT_EQ(message_of([] { decode_fork_request(json::array()); }),
            "fork: the body must be a JSON object such as {\"count\": 4}");
  EXPECT_EQ(message_of([] { decode_fork_request(json{{"count", -1}}); }), "count: must be a positive integer");
  EXPECT_EQ(message_of([] {
              decode_fork_request(json{{"count", 1u}, {"labels", json{{"a", 1}}}});
            }),
            "labels.a: must be a string");
  EXPECT_EQ(message_of([] {
              decode_fork_request(json{{"count", 1u}, {"keep", true}});
            }),
            "fork: unknown field 'keep' (known: count, labels)");
}

TEST(ProtocolSandbox, SleepAndSnapshotRequestsRoundTripAndAreRefusedByName) {
  EXPECT_EQ(decode_sleep_request(encode_sleep_request("r1"), "sleep"), "r1");
  EXPECT_EQ(decode_sleep_request(json::object(), "wake"), "");
  EXPECT_EQ(message_of([] {
              decode_sleep_request(json{{"id", "r1"}}, "wake");
            }),
            "wake: unknown field 'id' (known: request_id)");
  EXPECT_EQ(message_of([] {
              decode_sleep_request(json{{"request_id", std::string(129, 'x')}}, "sleep");
            }),
            "request_id: a string of at most 128 bytes");
  SnapshotCall call = decode_snapshot_call(encode(SnapshotCall{.name = "repo:tag", .request_id = "r2"}));
  EXPECT_EQ(call.name, "repo:tag");
  EXPECT_EQ(call.request_id, "r2");
  EXPECT_EQ(message_of([] {
              decode_snapshot_call(json{{"request_id", "r"}});
            }),
            "name: missing (the new image's repo[:tag])");
  EXPECT_EQ(message_of([] {
              decode_snapshot_call(json{{"name", "a"}, {"keep", 1}});
            }),
            "snapshot: unknown field 'keep' (known: name, request_id)");
}

// The limits spelled in messages read as they always did.
// A tenant's group inside the agent is "<tenant>:<id>": one colon, both sides group-id words; a spec (a record's
// too) may carry one, and nothing else with a colon.
TEST(ProtocolSandbox, ScopedGroupIdsHaveOneTenantPrefix) {
  EXPECT_TRUE(valid_group_id("g-1.x_y"));
  EXPECT_FALSE(valid_group_id("team-a:g"));
  EXPECT_TRUE(valid_scoped_group_id("g-1"));
  EXPECT_TRUE(valid_scoped_group_id("team-a:g-1"));
  for (const char* bad : {":g", "team-a:", "a:b:c", "team a:g", "team-a:g/h", ""})
    EXPECT_FALSE(valid_scoped_group_id(bad)) << bad;
  EXPECT_FALSE(valid_scoped_group_id(std::string(kMaxTenantBytes + 1, 't') + ":g"));
  EXPECT_TRUE(valid_scoped_group_id("t:" + std::string(kMaxGroupIdBytes, 'g')));
  SandboxSpec spec;
  spec.image = "busybox";
  spec.group = "team-a:g";
  spec.group_ttl = std::chrono::seconds{60};
  EXPECT_NO_THROW(validate(spec));
  spec.group = "a:b:c";
  EXPECT_THROW(validate(spec), Error);
}

TEST(ProtocolSandbox, LimitsInMessages) {
  EXPECT_EQ(message_of([] {
              SandboxSpec t;
              t.group = "g";
              t.group_ttl = std::chrono::seconds(90000);
              validate(t);
            }),
            "group_ttl: required with a group: from 1 to 86400 seconds");
  EXPECT_EQ(message_of([] {
              decode_spec(json{{"queue_timeout", 4000}});
            }),
            "queue_timeout: must be from 0 to 3600 seconds");
  EXPECT_EQ(message_of([] {
              decode_spec(json{{"resources", {{"pids", 1u << 23}}}});
            }),
            "resources.pids: at most 4194304");
  EXPECT_EQ(message_of([] {
              decode_spec(json{{"resources", {{"cpu", 2000}}}});
            }),
            "resources.cpu: must be in (0, 1024] cores");
}

}  // namespace
}  // namespace dsec::protocol
