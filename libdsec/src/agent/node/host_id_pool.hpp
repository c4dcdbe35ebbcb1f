// Blocks of host uids and gids handed out one per user of them, never to two at once: the uid a microVM's QEMU runs
// as (blocks of one), and the 65,536 ids a container sandbox's user namespace maps its 0..65535 onto.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::agent {

class HostIdPool {
 public:
  // Blocks start at base, base + block, ...; `blocks` of them. `what` names a block in errors ("microVM uids").
  HostIdPool(std::uint32_t base, std::uint32_t blocks, std::uint32_t block = 1, std::string what = "host ids")
      : base_(base), blocks_(blocks), block_(block), what_(std::move(what)) {}

  // The first id of a free block. `accept` may refuse a block (another agent on the host holds it): it is then
  // skipped for now and the next one tried. RESOURCE_EXHAUSTED when none is left.
  std::uint32_t take(const std::function<bool(std::uint32_t)>& accept = {}) {
    std::lock_guard lock(mu_);
    for (std::uint32_t i = 0; i < blocks_; ++i) {
      std::uint32_t n = (next_ + i) % blocks_;
      if (used_.count(n)) continue;
      std::uint32_t first = base_ + n * block_;
      if (accept && !accept(first)) continue;
      used_.insert(n);
      next_ = n + 1;
      return first;
    }
    throw Error(Code::kResourceExhausted,
                fmt::format("all {} blocks of {} are in use (blocks of {} from {})", blocks_, what_, block_, base_));
  }
  // The block starting at `first` is in use (a sandbox taken over after a restart). False if `first` is not the
  // start of one of this pool's blocks, or the block is already in use.
  bool claim(std::uint32_t first) {
    std::lock_guard lock(mu_);
    std::optional<std::uint32_t> n = index_of(first);
    if (!n) return false;
    return used_.insert(*n).second;
  }
  void give_back(std::uint32_t first) {
    std::lock_guard lock(mu_);
    if (std::optional<std::uint32_t> n = index_of(first)) used_.erase(*n);
  }
  std::size_t in_use() const {
    std::lock_guard lock(mu_);
    return used_.size();
  }
  std::uint32_t blocks() const { return blocks_; }
  std::uint32_t block_size() const { return block_; }

  // A block held for as long as the lease lives (a probe's or a template's QEMU).
  struct Lease {
    HostIdPool& pool;
    std::uint32_t first;
    ~Lease() { pool.give_back(first); }
  };

 private:
  std::optional<std::uint32_t> index_of(std::uint32_t first) const {
    if (first < base_ || (first - base_) % block_ != 0) return std::nullopt;
    std::uint32_t n = (first - base_) / block_;
    if (n >= blocks_) return std::nullopt;
    return n;
  }

  std::uint32_t base_, blocks_, block_;
  std::string what_;
  mutable std::mutex mu_;
  std::set<std::uint32_t> used_;
  std::uint32_t next_ = 0;
};

}  // namespace dsec::agent
