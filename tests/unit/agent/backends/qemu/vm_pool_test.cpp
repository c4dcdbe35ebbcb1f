// The microvm backend's pre-booted pools (agent/backends/qemu/vm_pool): what fills a shape's pool, what a create
// takes, how misses, failures and idle shapes are handled. The VMs here are empty PooledVm objects (no QEMU): the
// pool's bookkeeping is what is tested; claiming a real VM is in tests/integration/test_microvm_pool.py.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <gtest/gtest.h>

#include "agent/backends/qemu/vm_pool.hpp"

namespace dsec::agent::qemu {
namespace {

using namespace std::chrono_literals;

AgentConfig test_config() {
  AgentConfig c;
  c.home = "/nonexistent/dsec-pool-test";
  return c;
}

template <typename F>
bool eventually(F&& done, std::chrono::milliseconds limit = 5000ms) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (done()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return done();
}

struct Counter {
  BackendContext ctx{test_config(), Tier::kMicrovm};
  std::atomic<int> made{0};
  VmPool::Maker maker(const std::string& label) {
    return [this, label] {
      auto vm = std::make_unique<PooledVm>(ctx);
      vm->name = label + "-" + std::to_string(++made);
      return vm;
    };
  }
};

TEST(MicrovmPool, TheFirstCreateOfAShapeFindsNothingAndStartsItsPool) {
  Counter c;
  VmPool pool(2, 60s);
  EXPECT_EQ(pool.take("a", c.maker("a")), nullptr);
  ASSERT_TRUE(eventually([&] { return pool.status().ready == 2; })) << pool.status().ready;
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(c.made.load(), 2);  // filled up to the size, no further
  VmPoolStatus s = pool.status();
  EXPECT_EQ(s.shapes, 1u);
  EXPECT_EQ(s.claims, 0u);
  EXPECT_EQ(s.misses, 0u);  // a shape's first create is not a miss: there was no pool yet
}

TEST(MicrovmPool, ATakeClaimsTheOldestAndThePoolIsRefilled) {
  Counter c;
  VmPool pool(2, 60s);
  (void)pool.take("a", c.maker("a"));
  ASSERT_TRUE(eventually([&] { return pool.status().ready == 2; }));
  auto first = pool.take("a", c.maker("a"));
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->name, "a-1");
  EXPECT_EQ(pool.status().claims, 1u);
  ASSERT_TRUE(eventually([&] { return pool.status().ready == 2; }));
  EXPECT_EQ(c.made.load(), 3);
  // Another shape has a pool of its own: what it takes was made by its own maker.
  EXPECT_EQ(pool.take("b", c.maker("b")), nullptr);
  ASSERT_TRUE(eventually([&] { return pool.status().ready == 4; }));
  auto b = pool.take("b", c.maker("b"));
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->name.rfind("b-", 0), 0u) << b->name;
  EXPECT_EQ(pool.status().shapes, 2u);
}

TEST(MicrovmPool, ATakeFromAnEmptyPoolOfAKnownShapeIsAMiss) {
  BackendContext ctx{test_config(), Tier::kMicrovm};
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> calls{0};
  VmPool::Maker slow = [&] {
    ++calls;
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return release; });
    return std::make_unique<PooledVm>(ctx);
  };
  VmPool pool(1, 60s);
  EXPECT_EQ(pool.take("a", slow), nullptr);
  ASSERT_TRUE(eventually([&] { return calls.load() == 1; }));
  EXPECT_EQ(pool.take("a", slow), nullptr);  // the one being made is not ready yet
  EXPECT_EQ(pool.status().misses, 1u);
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  ASSERT_TRUE(eventually([&] { return pool.status().ready == 1; }));
  EXPECT_NE(pool.take("a", slow), nullptr);
}

TEST(MicrovmPool, AMakerThatFailsIsTriedAgainOnlyAfterABackoff) {
  std::atomic<int> calls{0};
  VmPool::Maker failing = [&]() -> std::unique_ptr<PooledVm> {
    ++calls;
    throw Error(Code::kUnavailable, "the guest did not come up");
  };
  VmPool pool(3, 60s);
  EXPECT_EQ(pool.take("a", failing), nullptr);
  ASSERT_TRUE(eventually([&] { return pool.status().failures == 1; }));
  std::this_thread::sleep_for(1000ms);
  EXPECT_EQ(calls.load(), 1);  // the next try waits 2 s: a broken shape does not spin the node's CPUs
  EXPECT_EQ(pool.status().ready, 0u);
  ASSERT_TRUE(eventually([&] { return calls.load() == 2; }, 3000ms));
}

TEST(MicrovmPool, AShapeNobodyCreatesGoesAfterTheIdleTime) {
  Counter c;
  VmPool pool(2, 300ms);
  (void)pool.take("a", c.maker("a"));
  ASSERT_TRUE(eventually([&] { return pool.status().ready == 2; }, 2000ms));
  ASSERT_TRUE(eventually([&] { return pool.status().shapes == 0; }, 3000ms));
  EXPECT_EQ(pool.status().ready, 0u);
  // Used again, it starts over.
  EXPECT_EQ(pool.take("a", c.maker("a")), nullptr);
  ASSERT_TRUE(eventually([&] { return pool.status().ready >= 1; }, 2000ms));
}

TEST(MicrovmPool, SizeZeroKeepsNothing) {
  Counter c;
  VmPool pool(0, 60s);
  EXPECT_EQ(pool.take("a", c.maker("a")), nullptr);
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(c.made.load(), 0);
  EXPECT_EQ(pool.status().shapes, 0u);
}

TEST(MicrovmPool, StopWaitsForAVmBeingMadeAndDropsTheRest) {
  BackendContext ctx{test_config(), Tier::kMicrovm};
  std::atomic<int> calls{0};
  VmPool::Maker slowish = [&] {
    ++calls;
    std::this_thread::sleep_for(200ms);
    return std::make_unique<PooledVm>(ctx);
  };
  auto pool = std::make_unique<VmPool>(5, 60s);
  (void)pool->take("a", slowish);
  ASSERT_TRUE(eventually([&] { return calls.load() >= 1; }));
  pool->stop();
  EXPECT_EQ(pool->status().ready, 0u);
  EXPECT_EQ(pool->take("a", slowish), nullptr);  // stopped: nothing is taken or made any more
  const int after_stop = calls.load();
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(calls.load(), after_stop);
  pool.reset();
}

}  // namespace
}  // namespace dsec::agent::qemu
