#include "agent/backends/microvm/vm_template.hpp"

#include <fcntl.h>
#include <sys/stat.h>

#include <fmt/format.h>

#include "agent/backends/microvm/writable_disk.hpp"
#include "agent/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::microvm {
namespace fs = std::filesystem;

VmTemplate::~VmTemplate() {
  std::error_code ec;
  if (!dir.empty()) fs::remove_all(dir, ec);
}

void seal_memory(int memfd) {
  if (::fcntl(memfd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    throw_errno(errno, "seal the template's guest RAM");
}

TemplatePtr freeze_vm(VmInstance& vm, std::string key, const fs::path& dir, const fs::path& disk,
                      std::uint64_t memory_bytes) {
  if (!vm.memory()) throw Error(Code::kFailedPrecondition, "a clone of a template cannot itself be frozen");
  const auto started = Clock::now();
  fs::create_directories(dir);
  ::chmod(dir.c_str(), 0700);
  auto t = std::make_shared<VmTemplate>();
  t->key = std::move(key);
  t->dir = dir;
  t->state = dir / "state";
  t->disk = dir / "disk";
  t->memory_bytes = memory_bytes;
  vm.save(t->state, /*ignore_shared=*/true, std::chrono::seconds(60));
  GuestMemory memory = vm.memory();
  vm.kill();
  // The disk as the stopped guest left it: it and the RAM are one consistent machine.
  if (disk != t->disk) copy_sparse(disk, t->disk);
  // Every page of the template exists before it is sealed: a clone's fault on a page the template never touched
  // (a read of never-written memory, a migration save reading all of it) would otherwise add the page to the
  // template's memfd, charged to that clone and kept until the template goes. Allocated, the template costs its
  // size once, and clones only ever copy the pages they write.
  if (::fallocate(memory->get(), 0, 0, static_cast<off_t>(memory_bytes)) != 0)
    throw_errno(errno, "allocate the template's guest RAM");
  seal_memory(memory->get());
  t->memory = std::move(memory);
  t->build_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return t;
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
    log_info("microvm: template {} dropped ({} MiB of templates over the budget of {} MiB; the least recently used "
             "goes)",
             oldest->current->dir.filename().string(), total >> 20, budget_ >> 20);
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

}  // namespace dsec::agent::microvm
