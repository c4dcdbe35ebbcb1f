// Per-tenant quotas (agent/tenant_quota): the flag's grammar and its refusals.
#include <cmath>

#include <gtest/gtest.h>

#include "agent/registry/tenant_quota.hpp"
#include "dsec/error.hpp"

namespace dsec::agent {
namespace {

TEST(TenantQuota, ParsesAnyOfTheThreeLimits) {
  auto [tenant, q] = parse_tenant_quota("team-a=sandboxes:100,cpu:6.5,memory:2Gi");
  EXPECT_EQ(tenant, "team-a");
  EXPECT_EQ(q.sandboxes, 100u);
  EXPECT_DOUBLE_EQ(q.cpu, 6.5);
  EXPECT_EQ(q.memory_bytes, 2ull << 30);
  auto only = parse_tenant_quota("b=memory:512Mi").second;
  EXPECT_EQ(only.memory_bytes, 512ull << 20);
  EXPECT_GT(only.sandboxes, 1ull << 40);  // unlimited
  EXPECT_TRUE(std::isinf(only.cpu));
  EXPECT_EQ(parse_tenant_quota("c=sandboxes:0").second.sandboxes, 0u);  // a tenant that may run nothing here
}

TEST(TenantQuota, RefusesWhatItCannotRead) {
  for (const char* bad : {"", "team-a", "team-a=", "=sandboxes:1", "bad/tenant=sandboxes:1", "a=sandboxes",
                          "a=sandboxes:-1", "a=sandboxes:1e3", "a=sandboxes:9999999999", "a=cpu:nan", "a=cpu:-1",
                          "a=cpu:inf", "a=cpu:2x", "a=memory:lots", "a=disk:1Gi", "a=cpu:1,cpu:2", "a=sandboxes:1,"}) {
    try {
      (void)parse_tenant_quota(bad);
      ADD_FAILURE() << "accepted: " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument) << bad;
      EXPECT_NE(std::string(e.what()).find("--tenant-quota"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace dsec::agent
