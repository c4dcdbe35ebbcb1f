// How many fork servers a pool should run: pure arithmetic over what the pool sees, so it is unit-tested alone.
//
// A pool wants one server per running call and per waiting call, plus one spare while it has work, so that the
// next call finds a child armed while the last one's server arms its next; never fewer than its minimum nor more
// than its maximum. A pool with no minimum and no work wants none.
// Servers above that only stop once they have been idle longer than the idle timeout (so a burst that ends does not
// tear down what the next burst needs), and never below the minimum.
#pragma once

#include <cstddef>

namespace dsec::agent::fncall {

struct PoolLoad {
  std::size_t servers = 0;       // running or starting, not dead
  std::size_t busy = 0;          // running a call
  std::size_t waiting = 0;       // calls waiting for a server
  std::size_t idle_expired = 0;  // idle longer than the idle timeout
  std::size_t min = 0;
  std::size_t max = 0;
};

struct PoolDecision {
  std::size_t start = 0;  // servers to start
  std::size_t stop = 0;   // idle-expired servers to stop
};

// The number of servers the pool's load calls for, within [min, max].
std::size_t pool_target(const PoolLoad& load);
PoolDecision decide_pool_size(const PoolLoad& load);

}  // namespace dsec::agent::fncall
