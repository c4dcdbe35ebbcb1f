// The QEMU tiers' template cache (agent/backends/qemu/vm_template): one template per key, made once, and
// kept within a memory budget by dropping the least recently used. Templates here are bookkeeping only (no RAM, no
// files); freezing real VMs into templates is covered by tests/integration/test_microvm.py.
#include <atomic>
#include <map>
#include <string>

#include <gtest/gtest.h>

#include "agent/backends/qemu/vm_template.hpp"

namespace dsec::agent::qemu {
namespace {

constexpr std::uint64_t kMiB = 1ull << 20;

struct Makers {
  std::map<std::string, int> made;
  std::function<TemplatePtr()> of(const std::string& key, std::uint64_t bytes) {
    return [this, key, bytes] {
      ++made[key];
      auto t = std::make_shared<VmTemplate>();
      t->key = key;
      t->memory_bytes = bytes;
      return TemplatePtr(t);
    };
  }
};

TEST(QemuTemplateCache, AKeyIsMadeOnceAndThenServed) {
  TemplateCache cache("test");
  Makers m;
  TemplatePtr a = cache.get("a", m.of("a", 128 * kMiB));
  EXPECT_EQ(cache.get("a", m.of("a", 128 * kMiB)), a);
  EXPECT_EQ(m.made["a"], 1);
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.bytes(), 128 * kMiB);
}

TEST(QemuTemplateCache, OverTheBudgetTheLeastRecentlyUsedGoes) {
  TemplateCache cache("test", 300 * kMiB);
  Makers m;
  TemplatePtr a = cache.get("a", m.of("a", 128 * kMiB));
  (void)cache.get("b", m.of("b", 128 * kMiB));
  (void)cache.get("a", m.of("a", 128 * kMiB));  // a is used again: b is now the least recent
  (void)cache.get("c", m.of("c", 128 * kMiB));
  EXPECT_EQ(cache.size(), 2u);
  EXPECT_EQ(cache.bytes(), 256 * kMiB);
  EXPECT_EQ(cache.evictions(), 1u);
  EXPECT_EQ(cache.get("a", m.of("a", 128 * kMiB)), a);
  EXPECT_EQ(m.made["a"], 1);
  (void)cache.get("b", m.of("b", 128 * kMiB));  // dropped: made again
  EXPECT_EQ(m.made["b"], 2);
  EXPECT_EQ(cache.evictions(), 2u);
}

TEST(QemuTemplateCache, ADroppedTemplateLivesOnForWhoeverHoldsIt) {
  TemplateCache cache("test", 100 * kMiB);
  Makers m;
  TemplatePtr a = cache.get("a", m.of("a", 64 * kMiB));
  (void)cache.get("b", m.of("b", 64 * kMiB));
  EXPECT_EQ(cache.size(), 1u);  // a went for b
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->memory_bytes, 64 * kMiB);  // a VM starting from it still has it
}

TEST(QemuTemplateCache, TheTemplateJustMadeIsKeptEvenAloneOverTheBudget) {
  TemplateCache cache("test", 100 * kMiB);
  Makers m;
  TemplatePtr big = cache.get("big", m.of("big", 512 * kMiB));
  EXPECT_EQ(cache.size(), 1u);
  EXPECT_EQ(cache.get("big", m.of("big", 512 * kMiB)), big);
  EXPECT_EQ(m.made["big"], 1);
  cache.set_budget(0);  // no budget
  (void)cache.get("more", m.of("more", 512 * kMiB));
  EXPECT_EQ(cache.size(), 2u);
  cache.set_budget(600 * kMiB);  // a lower budget drops at once
  EXPECT_EQ(cache.size(), 1u);
}

TEST(QemuTemplateCache, InvalidateDropsOnlyTheTemplateNamed) {
  TemplateCache cache("test");
  Makers m;
  TemplatePtr a = cache.get("a", m.of("a", kMiB));
  auto stale = std::make_shared<VmTemplate>();
  cache.invalidate("a", stale);  // not the one kept: nothing happens
  EXPECT_EQ(cache.get("a", m.of("a", kMiB)), a);
  cache.invalidate("a", a);
  EXPECT_NE(cache.get("a", m.of("a", kMiB)), a);
  EXPECT_EQ(m.made["a"], 2);
}

}  // namespace
}  // namespace dsec::agent::qemu
