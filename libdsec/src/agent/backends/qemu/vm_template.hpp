// Frozen VMs that new ones start from instead of booting: a template is a guest booted once (its root made from an
// image's layers) and stopped, kept as QEMU's device state in a file, its RAM in a sealed memfd and its writable disk
// in a file. A VM started from it maps that RAM privately (copy-on-write: pages it never writes stay shared with
// every other VM of the template, in host memory once), gets a copy of the disk, and runs on from the instant the
// template stopped, under its own hostname, clock and entropy (the hello after a restore renews them). The
// template's RAM is allocated whole before it is sealed (a template costs its guest's RAM once), so clones never add
// pages to it.
//
// Sealing (F_SEAL_WRITE, SHRINK, GROW, SEAL) makes the RAM immutable for everyone, QEMU processes and the agent
// alike: a VM whose QEMU the guest took over still cannot change what its siblings map.
//
// Templates serve creates (a template per image, memory, vCPUs and disk size, made by the first create of that
// shape) and forks (a template made from a running sandbox, which then runs on as one of its own clones).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "common/unique_fd.hpp"

namespace dsec::agent::qemu {

// Guest RAM: a memfd, shared by a frozen template with the clones that map it copy-on-write.
using GuestMemory = std::shared_ptr<const UniqueFd>;

struct VmTemplate {
  std::string key;
  std::filesystem::path dir;    // holds `state` and `disk`; removed when the last user of the template goes
  std::filesystem::path state;  // QEMU's device state (no RAM: saved with x-ignore-shared)
  std::filesystem::path disk;   // the writable disk as it was when the template stopped
  GuestMemory memory;           // sealed
  std::uint64_t memory_bytes = 0;
  double build_seconds = 0;  // boot (or the running VM's save) to frozen

  ~VmTemplate();
};
using TemplatePtr = std::shared_ptr<const VmTemplate>;

// Seals a memfd against every write, resize and further seal (F_SEAL_WRITE needs no writable shared mapping of it to
// exist: the QEMU that had one must have exited).
void seal_memory(int memfd);

// Templates for creates, by key. get() returns the template for `key`, making it with `make` the first time (one
// maker per key at a time; other callers of the key wait for it). invalidate() drops one that could not start a VM
// (its layers left the node, say) so the next create makes it anew.
//
// Each template holds its guest's RAM whole, so the cache keeps them within a memory budget: once a new template
// takes the total past it, the least recently used others are dropped (their files go once no VM started from them
// still needs them; VMs running from one keep its RAM mapped). A node serving many images (a task per image) thus
// keeps templates of the shapes in use, not of every image it ever ran.
class TemplateCache {
 public:
  // `kind` names the tier in the log ("microvm: template ... dropped"); `budget_bytes` 0: no budget (every template
  // is kept).
  explicit TemplateCache(std::string_view kind, std::uint64_t budget_bytes = 0) : kind_(kind), budget_(budget_bytes) {}
  void set_budget(std::uint64_t bytes);
  TemplatePtr get(const std::string& key, const std::function<TemplatePtr()>& make);
  void invalidate(const std::string& key, const TemplatePtr& which);
  void clear();
  std::size_t size() const;
  std::uint64_t bytes() const;      // guest RAM of the templates kept
  std::uint64_t evictions() const;  // templates dropped for the budget so far

 private:
  struct Slot {
    std::mutex making;
    TemplatePtr current;
    std::uint64_t last_used = 0;  // use_clock_ at the last get
  };
  // Drops least recently used templates but `keep` while the total is over the budget (mu_ held).
  void evict_over_budget(const Slot* keep);

  const std::string kind_;
  mutable std::mutex mu_;
  std::uint64_t budget_ = 0;
  std::uint64_t use_clock_ = 0;
  std::uint64_t evictions_ = 0;
  std::map<std::string, std::shared_ptr<Slot>, std::less<>> slots_;
};

}  // namespace dsec::agent::qemu
