// The uids QEMU processes run as: one per VM (a sandbox's, a template's, a pooled VM's or a probe's), never two VMs
// at once, so one VM's QEMU can reach no file or process of another's.
#pragma once

#include <cstdint>
#include <mutex>
#include <set>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::agent::microvm {

class UidPool {
 public:
  UidPool(std::uint32_t base, std::uint32_t count) : base_(base), count_(count) {}
  std::uint32_t take() {
    std::lock_guard lock(mu_);
    for (std::uint32_t i = 0; i < count_; ++i) {
      std::uint32_t n = (next_ + i) % count_;
      if (!used_.count(n)) {
        used_.insert(n);
        next_ = n + 1;
        return base_ + n;
      }
    }
    throw Error(Code::kResourceExhausted, fmt::format("all {} microVM uids are in use", count_));
  }
  // A uid a VM taken over after a restart has.
  void claim(std::uint32_t uid) {
    std::lock_guard lock(mu_);
    if (uid >= base_ && uid - base_ < count_) used_.insert(uid - base_);
  }
  void give_back(std::uint32_t uid) {
    std::lock_guard lock(mu_);
    used_.erase(uid - base_);
  }
  std::size_t in_use() const {
    std::lock_guard lock(mu_);
    return used_.size();
  }
  // A uid held for as long as the lease lives (a probe's or a template's QEMU).
  struct Lease {
    UidPool& pool;
    std::uint32_t uid;
    ~Lease() { pool.give_back(uid); }
  };

 private:
  std::uint32_t base_, count_;
  mutable std::mutex mu_;
  std::set<std::uint32_t> used_;
  std::uint32_t next_ = 0;
};

}  // namespace dsec::agent::microvm
