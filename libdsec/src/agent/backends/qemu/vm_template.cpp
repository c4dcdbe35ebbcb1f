#include "agent/backends/qemu/vm_template.hpp"

#include <fcntl.h>

#include "common/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::qemu {
namespace fs = std::filesystem;

VmTemplate::~VmTemplate() {
  std::error_code ec;
  if (!dir.empty()) fs::remove_all(dir, ec);
}

void seal_memory(int memfd) {
  if (::fcntl(memfd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    throw_errno(errno, "seal the template's guest RAM");
}

void TemplateCache::set_budget(std::uint64_t bytes) {
  std::lock_guard lock(mu_);
  budget_ = bytes;
  evict_over_budget(nullptr);
}

TemplatePtr TemplateCache::get(const std::string& key, const std::function<TemplatePtr()>& make) {
  std::shared_ptr<Slot> slot;
  {
    std::lock_guard lock(mu_);
    auto& s = slots_[key];
    if (!s) s = std::make_shared<Slot>();
    slot = s;
    slot->last_used = ++use_clock_;
    if (slot->current) return slot->current;
  }
  std::lock_guard making(slot->making);
  {
    std::lock_guard lock(mu_);
    if (slot->current) return slot->current;
  }
  TemplatePtr made = make();
  std::lock_guard lock(mu_);
  slot->current = made;
  slot->last_used = ++use_clock_;
  evict_over_budget(slot.get());
  return made;
}

void TemplateCache::evict_over_budget(const Slot* keep) {
  if (budget_ == 0) return;
  for (;;) {
    std::uint64_t total = 0;
    Slot* oldest = nullptr;
    std::string oldest_key;
    for (const auto& [key, slot] : slots_) {
      if (!slot->current) continue;
      total += slot->current->memory_bytes;
      if (slot.get() != keep && (!oldest || slot->last_used < oldest->last_used)) {
        oldest = slot.get();
        oldest_key = key;
      }
    }
    if (total <= budget_ || !oldest) return;
    log_info("{}: template {} dropped ({} MiB of templates over the budget of {} MiB; the least recently used goes)",
             kind_, oldest->current->dir.filename().string(), total >> 20, budget_ >> 20);
    oldest->current.reset();
    ++evictions_;
  }
}

void TemplateCache::invalidate(const std::string& key, const TemplatePtr& which) {
  std::lock_guard lock(mu_);
  auto it = slots_.find(key);
  if (it != slots_.end() && it->second->current == which) it->second->current.reset();
}

void TemplateCache::clear() {
  std::lock_guard lock(mu_);
  slots_.clear();
}

std::size_t TemplateCache::size() const {
  std::lock_guard lock(mu_);
  std::size_t n = 0;
  for (const auto& [key, slot] : slots_)
    if (slot->current) ++n;
  return n;
}

std::uint64_t TemplateCache::bytes() const {
  std::lock_guard lock(mu_);
  std::uint64_t n = 0;
  for (const auto& [key, slot] : slots_)
    if (slot->current) n += slot->current->memory_bytes;
  return n;
}

std::uint64_t TemplateCache::evictions() const {
  std::lock_guard lock(mu_);
  return evictions_;
}

}  // namespace dsec::agent::qemu
