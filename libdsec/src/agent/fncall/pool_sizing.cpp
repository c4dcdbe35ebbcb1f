#include "agent/fncall/pool_sizing.hpp"

#include <algorithm>

namespace dsec::agent::fncall {

std::size_t pool_target(const PoolLoad& load) {
  std::size_t work = load.busy + load.waiting;
  std::size_t want = work + (work > 0 ? 1 : 0);
  return std::clamp(want, load.min, std::max(load.min, load.max));
}

PoolDecision decide_pool_size(const PoolLoad& load) {
  PoolDecision d;
  std::size_t target = pool_target(load);
  if (load.servers < target) {
    d.start = target - load.servers;
  } else if (load.servers > target) {
    d.stop = std::min(load.idle_expired, load.servers - target);
  }
  return d;
}

}  // namespace dsec::agent::fncall
