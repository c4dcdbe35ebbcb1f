// Retries with exponential backoff and full jitter under one overall deadline. Header-only so that tests drive it
// with a fake clock and sleeper.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <random>

#include "dsec/error.hpp"

namespace dsec {

struct RetryPolicy {
  int max_attempts = 6;
  std::chrono::milliseconds initial_backoff{20};
  std::chrono::milliseconds max_backoff{2'000};
  double multiplier = 2.0;

  // The cap of the wait before attempt `attempt` (1-based; attempt 1 never waits): initial * multiplier^(attempt-2),
  // at most max_backoff. The actual wait is uniform in [0, cap] ("full jitter").
  std::chrono::milliseconds backoff_cap(int attempt) const {
    if (attempt <= 1) return std::chrono::milliseconds{0};
    double cap = static_cast<double>(initial_backoff.count());
    for (int i = 2; i < attempt && cap < static_cast<double>(max_backoff.count()); ++i) cap *= multiplier;
    return std::chrono::milliseconds{
        static_cast<std::int64_t>(std::min(cap, static_cast<double>(max_backoff.count())))};
  }
};

// Runs op() until it succeeds, fails with a non-retryable error, runs out of attempts, or the deadline would pass
// before the next attempt. Clock provides now(); Sleep(duration) waits; Rng is a uniform random bit generator.
template <typename Clock, typename Sleep, typename Rng, typename Op>
auto retry_call(const RetryPolicy& policy, typename Clock::time_point deadline, Sleep&& sleep, Rng& rng, Op&& op)
    -> decltype(op()) {
  for (int attempt = 1;; ++attempt) {
    try {
      return op();
    } catch (const Error& e) {
      if (!e.retryable() || attempt >= policy.max_attempts) throw;
      auto cap = policy.backoff_cap(attempt + 1);
      std::uniform_int_distribution<std::int64_t> dist(0, cap.count());
      auto wait = std::chrono::milliseconds{dist(rng)};
      if (Clock::now() + wait >= deadline) {
        throw Error(Code::kDeadlineExceeded,
                    std::string("deadline exceeded after ") + std::to_string(attempt) +
                        " attempts; last error: " + std::string(e.code_name()) + ": " + e.what(),
                    false);
      }
      sleep(wait);
    }
  }
}

}  // namespace dsec
