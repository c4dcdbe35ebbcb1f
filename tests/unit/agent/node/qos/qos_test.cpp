// The node's classes of service: cpu lists, the CPUs reserved for latency sandboxes and what a node cannot
// reserve, what each class is granted (and what it is told is missing), and overcommit that follows real use.
#include <gtest/gtest.h>

#include <sched.h>

#include <algorithm>

#include <fmt/format.h>

#include "agent/node/qos/kernel_qos.hpp"
#include "agent/node/qos/usage_overcommit.hpp"
#include "dsec/error.hpp"
#include "error_test_util.hpp"

namespace dsec::agent::qos {
namespace {

std::size_t agent_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  sched_getaffinity(0, sizeof(set), &set);
  return static_cast<std::size_t>(CPU_COUNT(&set));
}

TEST(CpuList, ParsesAndFormatsKernelLists) {
  EXPECT_EQ(parse_cpu_list("0-3,8,10-11"), (std::vector<int>{0, 1, 2, 3, 8, 10, 11}));
  EXPECT_EQ(parse_cpu_list("5,1,1"), (std::vector<int>{1, 5}));
  EXPECT_EQ(format_cpu_list({0, 1, 2, 3, 8, 10, 11}), "0-3,8,10-11");
  EXPECT_EQ(format_cpu_list({4}), "4");
  for (const char* bad : {"", ",", "1,", "a", "3-1", "-1", "1-", "99999", "1 2"})
    EXPECT_CODE(parse_cpu_list(bad), Code::kInvalidArgument) << bad;
}

TEST(CpuReservation, NoneAndAutoOnASmallNode) {
  KernelQos k;
  EXPECT_TRUE(resolve_cpu_reservation("none", k).empty());
  if (agent_cpus() < 8) {
    EXPECT_TRUE(resolve_cpu_reservation("auto", k).empty());
  }
  k.core_scheduling = true;  // with core scheduling, auto never reserves
  EXPECT_TRUE(resolve_cpu_reservation("auto", k).empty());
}

TEST(CpuReservation, AnExplicitListSplitsTheAgentsCpus) {
  if (agent_cpus() < 2) GTEST_SKIP() << "needs two CPUs";
  KernelQos k;
  std::vector<int> all = parse_cpu_list(fmt::format("0-{}", agent_cpus() - 1));
  CpuReservation r = resolve_cpu_reservation(std::to_string(all.back()), k);
  EXPECT_EQ(r.latency, std::to_string(all.back()));
  all.pop_back();
  EXPECT_EQ(r.shared, format_cpu_list(all));
}

TEST(CpuReservation, WhatTheNodeCannotHonourIsRefusedWithTheArithmetic) {
  KernelQos k;
  try {
    resolve_cpu_reservation(fmt::format("0-{}", agent_cpus() - 1), k);
    FAIL() << "every CPU reserved";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find(fmt::format("reserves all {} CPUs", agent_cpus())), std::string::npos)
        << e.what();
  }
  EXPECT_CODE(resolve_cpu_reservation("1023", k), Code::kInvalidArgument);
  EXPECT_CODE(resolve_cpu_reservation("fast", k), Code::kInvalidArgument);
}

bool has(const std::vector<std::string>& v, std::string_view prefix) {
  return std::any_of(v.begin(), v.end(), [&](const std::string& s) { return s.rfind(prefix, 0) == 0; });
}

TEST(Grant, EachClassSaysWhatItGotAndWhatIsMissing) {
  KernelQos k;
  k.core_scheduling_reason = "the kernel has none (CONFIG_SCHED_CORE)";
  CpuReservation none;
  Resources latency;
  latency.priority = Priority::kLatency;
  QosGrant g = describe_grant(latency, {&k, &none, "v1", false, false, false});
  EXPECT_TRUE(has(g.granted, "cpu.shares 4096"));
  EXPECT_TRUE(has(g.missing, "memory protection: cgroup v1 has no memory.low"));
  EXPECT_TRUE(has(g.missing, "core scheduling: the kernel has none"));
  EXPECT_TRUE(has(g.missing, "reserved CPUs: none"));

  CpuReservation split{"3", "0-2"};
  k.core_scheduling = true;
  g = describe_grant(latency, {&k, &split, "v2", true, false, false});
  EXPECT_TRUE(has(g.granted, "cpu.weight 400"));
  EXPECT_TRUE(has(g.granted, "memory.low"));
  EXPECT_TRUE(has(g.granted, "core scheduling"));
  EXPECT_TRUE(has(g.granted, "cpuset 3 (reserved for latency)"));
  EXPECT_TRUE(g.missing.empty());

  Resources batch;
  batch.priority = Priority::kBatch;
  batch.ksm = true;
  g = describe_grant(batch, {&k, &split, "v2", true, true, true});
  EXPECT_TRUE(has(g.granted, "SCHED_IDLE (its QEMU)"));
  EXPECT_TRUE(has(g.granted, "cpu.idle"));
  EXPECT_TRUE(has(g.granted, "cpuset 0-2 (off the latency CPUs)"));
  EXPECT_TRUE(has(g.granted, "ksm"));
  k.memory_merge = false;
  k.memory_merge_reason = "the kernel has no PR_SET_MEMORY_MERGE (Linux 6.4+)";
  g = describe_grant(batch, {&k, &split, "v1", true, false, false});
  EXPECT_TRUE(has(g.granted, "memory.soft_limit_in_bytes"));
  EXPECT_TRUE(has(g.granted, "cpu.idle"));
  g = describe_grant(batch, {&k, &split, "v1", false, false, false});
  EXPECT_TRUE(has(g.missing, "cpu.idle: the kernel's cpu controller has none"));
  EXPECT_TRUE(has(g.missing, "ksm: the kernel has no PR_SET_MEMORY_MERGE"));
}

TEST(UsageOvercommit, FollowsWhatGrantedMemoryReallyUses) {
  constexpr std::uint64_t kGi = 1ull << 30;
  UsageOvercommitInputs in{64 * kGi, 2.0, 6.0, 0, 0};
  EXPECT_DOUBLE_EQ(usage_overcommit(in), 2.0);  // nothing granted yet: the base
  in.granted_bytes = 128 * kGi;
  in.in_use_bytes = 8 * kGi;  // 1/16 of each granted byte in use: room for far more, up to the ceiling
  EXPECT_DOUBLE_EQ(usage_overcommit(in), 6.0);
  in.in_use_bytes = 32 * kGi;  // a quarter: 80% of RAM is reached at 3.2 x RAM granted
  EXPECT_NEAR(usage_overcommit(in), 3.2, 1e-9);
  in.in_use_bytes = 60 * kGi;  // heavy use: never below the base
  EXPECT_DOUBLE_EQ(usage_overcommit(in), 2.0);
  in.ceiling = 0;  // off
  in.in_use_bytes = 1 * kGi;
  EXPECT_DOUBLE_EQ(usage_overcommit(in), 2.0);
}

}  // namespace
}  // namespace dsec::agent::qos
