// Warm pools of container sandboxes without a kernel in the way: the --warm-pool syntax and its errors, which
// creates match a shape, and the pools' claims, misses, refill and stop with a stand-in for the sandboxes.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "agent/backends/container/warm_pool.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::container {
namespace {

using namespace std::chrono_literals;

std::string error_of(std::string_view value) {
  try {
    parse_warm_pool(value);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    return e.what();
  }
  return "";
}

TEST(WarmPoolFlag, ParsesAShape) {
  WarmPoolConfig p =
      parse_warm_pool("swe/task:latest,size=8,cpu=0.5,memory=128Mi,disk=2Gi,pids=64,priority=batch,ksm=true");
  EXPECT_EQ(p.image, "swe/task:latest");
  EXPECT_EQ(p.size, 8u);
  EXPECT_DOUBLE_EQ(p.resources.cpu, 0.5);
  EXPECT_EQ(p.resources.memory_bytes, 128u << 20);
  EXPECT_EQ(p.resources.disk_bytes, 2ull << 30);
  EXPECT_EQ(p.resources.pids, 64u);
  EXPECT_EQ(p.resources.priority, Priority::kBatch);
  EXPECT_TRUE(p.resources.ksm);
  // The rest as a create's defaults.
  WarmPoolConfig d = parse_warm_pool("busybox,size=1");
  EXPECT_EQ(d.resources.memory_bytes, Resources{}.memory_bytes);
  EXPECT_EQ(d.resources.open_files, Resources{}.open_files);
}

TEST(WarmPoolFlag, SaysWhatIsWrong) {
  EXPECT_NE(error_of("busybox").find("needs size=N"), std::string::npos);
  EXPECT_NE(error_of("busybox,size=0").find("needs size=N"), std::string::npos);
  EXPECT_NE(error_of("busybox,size=5000").find("size=5000 is not a whole number up to 4096"), std::string::npos);
  EXPECT_NE(error_of("size=3").find("starts with the image"), std::string::npos);
  EXPECT_NE(error_of("busybox,size=1,cpu=0").find("cpu=0"), std::string::npos);
  EXPECT_NE(error_of("busybox,size=1,memory=12").find("memory=12 is not a size of at least 1Mi"), std::string::npos);
  EXPECT_NE(error_of("busybox,size=1,gpus=1").find("unknown key 'gpus'"), std::string::npos);
  EXPECT_NE(error_of("busybox,size=1,ksm=yes").find("ksm=yes"), std::string::npos);
  EXPECT_NE(error_of("busybox,size=1,fast").find("'fast' is not key=value"), std::string::npos);
}

WarmShape shape_of(std::string_view flag, std::vector<std::filesystem::path> layers = {"/layers/a", "/layers/b"}) {
  return WarmShape{parse_warm_pool(flag), std::move(layers), nullptr};
}

SandboxSpec spec_for(const WarmShape& s) {
  SandboxSpec spec;
  spec.image = s.config.image;
  spec.resources = s.config.resources;
  return spec;
}

TEST(WarmPoolShape, WhatACreateMayAndMayNotChange) {
  WarmShape s = shape_of("busybox,size=2,cpu=0.5,memory=64Mi");
  SandboxSpec spec = spec_for(s);
  spec.env = {{"TASK", "17"}};
  spec.hostname = "box";
  spec.labels = {{"run", "a"}};
  spec.network.mode = "egress";
  EXPECT_TRUE(matches(s, spec, s.layers));
  EXPECT_FALSE(matches(s, spec, {"/layers/a"}));  // another image
  SandboxSpec other = spec;
  other.resources.memory_bytes += 1;
  EXPECT_FALSE(matches(s, other, s.layers));
  other = spec;
  other.resources.priority = Priority::kLatency;
  EXPECT_FALSE(matches(s, other, s.layers));
  other = spec;
  other.allow_ptrace = true;
  EXPECT_FALSE(matches(s, other, s.layers));
  other = spec;
  other.kind = "microvm";
  EXPECT_FALSE(matches(s, other, s.layers));
}

struct Fake final : PreMade {
  explicit Fake(std::atomic<int>& alive) : alive(alive) { ++alive; }
  ~Fake() override { --alive; }
  std::atomic<int>& alive;
};

TEST(WarmPools, ClaimsMissesRefillsAndStops) {
  std::atomic<int> alive{0};
  std::atomic<int> made{0};
  WarmShape s = shape_of("busybox,size=2");
  {
    WarmPools pools({s}, [&](const WarmShape&) {
      ++made;
      return std::make_unique<Fake>(alive);
    });
    pools.start();
    auto wait_ready = [&](std::uint32_t n) {
      for (int i = 0; i < 500 && pools.stats().ready < n; ++i) std::this_thread::sleep_for(2ms);
      return pools.stats().ready;
    };
    ASSERT_EQ(wait_ready(2), 2u);
    EXPECT_EQ(pools.stats().size, 2u);
    SandboxSpec spec = spec_for(s);
    auto a = pools.take(spec, s.layers);
    auto b = pools.take(spec, s.layers);
    ASSERT_TRUE(a && b);
    // Not one of its shape: nothing taken, no miss.
    SandboxSpec bigger = spec;
    bigger.resources.memory_bytes *= 2;
    EXPECT_FALSE(pools.take(bigger, s.layers));
    EXPECT_EQ(pools.stats().misses, 0u);
    // Refilled behind the claims.
    ASSERT_EQ(wait_ready(2), 2u);
    EXPECT_EQ(pools.stats().claims, 2u);
    EXPECT_EQ(alive.load(), 4);  // two claimed (held here), two waiting
    a.reset();
    b.reset();
    pools.stop();
    EXPECT_EQ(alive.load(), 0);  // stop destroys the waiting ones
  }
  EXPECT_GE(made.load(), 4);
}

TEST(WarmPools, AnEmptyPoolIsAMissAndAFailingShapeIsCounted) {
  std::atomic<int> alive{0};
  std::atomic<int> tries{0};
  WarmShape s = shape_of("busybox,size=1");
  WarmPools pools({s}, [&](const WarmShape&) -> std::unique_ptr<PreMade> {
    ++tries;
    throw Error(Code::kNotFound, "image layers gone");
  });
  pools.start();
  for (int i = 0; i < 500 && pools.stats().failures == 0; ++i) std::this_thread::sleep_for(2ms);
  EXPECT_GE(pools.stats().failures, 1u);
  EXPECT_FALSE(pools.take(spec_for(s), s.layers));
  EXPECT_EQ(pools.stats().misses, 1u);
  pools.stop();
  // Retried with a pause, not in a tight loop.
  EXPECT_LE(tries.load(), 8);  // the refill's four workers tried once each, at most
}

}  // namespace
}  // namespace dsec::agent::container
