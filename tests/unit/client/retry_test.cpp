// dsec::retry_call under a fake clock: backoff caps, full-jitter bounds, the overall deadline, and which errors
// are retried.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <vector>

#include "dsec/retry.hpp"

namespace dsec {
namespace {

using std::chrono::milliseconds;

struct FakeClock {
  using duration = milliseconds;
  using rep = duration::rep;
  using period = duration::period;
  using time_point = std::chrono::time_point<FakeClock, duration>;
  static constexpr bool is_steady = true;
  static inline time_point current{};
  static time_point now() { return current; }
};

class RetryTest : public ::testing::Test {
 protected:
  void SetUp() override { FakeClock::current = FakeClock::time_point{milliseconds{1'000'000}}; }

  // Sleeping moves the fake clock; each wait is recorded.
  auto sleeper() {
    return [this](milliseconds d) {
      waits.push_back(d);
      FakeClock::current += d;
    };
  }

  std::vector<milliseconds> waits;
  std::mt19937_64 rng{12345};
};

TEST_F(RetryTest, BackoffCapGrowsExponentiallyThenStaysAtMax) {
  RetryPolicy p;
  p.initial_backoff = milliseconds{100};
  p.max_backoff = milliseconds{300};
  p.multiplier = 2.0;
  EXPECT_EQ(p.backoff_cap(1), milliseconds{0});  // the first attempt never waits
  EXPECT_EQ(p.backoff_cap(2), milliseconds{100});
  EXPECT_EQ(p.backoff_cap(3), milliseconds{200});
  EXPECT_EQ(p.backoff_cap(4), milliseconds{300});
  EXPECT_EQ(p.backoff_cap(5), milliseconds{300});
  EXPECT_EQ(p.backoff_cap(1000), milliseconds{300});  // no overflow however long it runs
}

TEST_F(RetryTest, FirstSuccessDoesNotWait) {
  int calls = 0;
  int v = retry_call<FakeClock>(RetryPolicy{}, FakeClock::now() + milliseconds{1000}, sleeper(), rng, [&] {
    ++calls;
    return 7;
  });
  EXPECT_EQ(v, 7);
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(waits.empty());
}

TEST_F(RetryTest, RetryableErrorsAreRetriedWithinTheCaps) {
  RetryPolicy p;  // 20 ms initial, x2
  int calls = 0;
  int v = retry_call<FakeClock>(p, FakeClock::now() + milliseconds{60'000}, sleeper(), rng, [&] {
    if (++calls <= 3) throw Error(Code::kUnavailable, "connection refused");
    return 42;
  });
  EXPECT_EQ(v, 42);
  EXPECT_EQ(calls, 4);
  ASSERT_EQ(waits.size(), 3u);
  EXPECT_LE(waits[0], milliseconds{20});
  EXPECT_LE(waits[1], milliseconds{40});
  EXPECT_LE(waits[2], milliseconds{80});
}

TEST_F(RetryTest, FullJitterSpansZeroToTheCap) {
  // Over many retry sequences every wait lies in [0, cap], and the waits reach both ends of that range: jitter is
  // "full" (uniform from zero), not a fixed or half-jittered backoff.
  RetryPolicy p;
  p.max_attempts = 5;
  p.initial_backoff = milliseconds{100};
  p.max_backoff = milliseconds{400};
  std::vector<milliseconds> by_attempt_min(6, milliseconds::max()), by_attempt_max(6, milliseconds{0});
  for (int run = 0; run < 2000; ++run) {
    waits.clear();
    EXPECT_THROW(retry_call<FakeClock>(p, FakeClock::now() + milliseconds{3'600'000}, sleeper(), rng,
                                       [&]() -> int { throw Error(Code::kUnavailable, "down"); }),
                 Error);
    ASSERT_EQ(waits.size(), 4u);  // 5 attempts, 4 waits
    for (std::size_t i = 0; i < waits.size(); ++i) {
      int next_attempt = static_cast<int>(i) + 2;
      EXPECT_GE(waits[i], milliseconds{0});
      EXPECT_LE(waits[i], p.backoff_cap(next_attempt));
      by_attempt_min[i] = std::min(by_attempt_min[i], waits[i]);
      by_attempt_max[i] = std::max(by_attempt_max[i], waits[i]);
    }
  }
  for (std::size_t i = 0; i < 4; ++i) {
    auto cap = p.backoff_cap(static_cast<int>(i) + 2);
    EXPECT_LE(by_attempt_min[i].count(), cap.count() / 20) << "wait before attempt " << i + 2;
    EXPECT_GE(by_attempt_max[i].count(), cap.count() * 19 / 20) << "wait before attempt " << i + 2;
  }
}

TEST_F(RetryTest, DeadlineStopsRetries) {
  RetryPolicy p;
  p.max_attempts = 1'000'000;
  p.initial_backoff = milliseconds{50};
  p.max_backoff = milliseconds{50};
  auto start = FakeClock::now();
  auto deadline = start + milliseconds{500};
  int calls = 0;
  try {
    retry_call<FakeClock>(p, deadline, sleeper(), rng, [&]() -> int {
      ++calls;
      throw Error(Code::kUnavailable, "agent unreachable");
    });
    FAIL() << "retry_call returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kDeadlineExceeded);
    EXPECT_FALSE(e.retryable());
    EXPECT_NE(std::string(e.what()).find("UNAVAILABLE: agent unreachable"), std::string::npos) << e.what();
  }
  // It never slept past the deadline, and it did retry until close to it.
  EXPECT_LE(FakeClock::now(), deadline);
  EXPECT_GT(calls, 1);
  EXPECT_GE(FakeClock::now() + milliseconds{50}, deadline - milliseconds{50});
}

TEST_F(RetryTest, NonRetryableErrorIsThrownAtOnce) {
  int calls = 0;
  try {
    retry_call<FakeClock>(RetryPolicy{}, FakeClock::now() + milliseconds{60'000}, sleeper(), rng, [&]() -> int {
      ++calls;
      throw Error(Code::kNotFound, "sandbox x not found");
    });
    FAIL() << "retry_call returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
  }
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(waits.empty());
}

TEST_F(RetryTest, AnErrorMarkedNotRetryableIsNotRetriedWhateverItsCode) {
  // How the client stops an exec that may have reached the agent from running twice.
  int calls = 0;
  EXPECT_THROW(retry_call<FakeClock>(RetryPolicy{}, FakeClock::now() + milliseconds{60'000}, sleeper(), rng,
                                     [&]() -> int {
                                       ++calls;
                                       throw Error(Code::kUnavailable, "connection reset", false);
                                     }),
               Error);
  EXPECT_EQ(calls, 1);
}

TEST_F(RetryTest, AttemptsRunOutWithTheLastError) {
  RetryPolicy p;
  p.max_attempts = 3;
  int calls = 0;
  try {
    retry_call<FakeClock>(p, FakeClock::now() + milliseconds{60'000}, sleeper(), rng, [&]() -> int {
      ++calls;
      throw Error(Code::kResourceExhausted, "node full");
    });
    FAIL() << "retry_call returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kResourceExhausted);
  }
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(waits.size(), 2u);
}

TEST_F(RetryTest, OnlyTheTransientCodesAreRetryableByDefault) {
  EXPECT_TRUE(Error(Code::kUnavailable, "").retryable());
  EXPECT_TRUE(Error(Code::kAborted, "").retryable());
  EXPECT_TRUE(Error(Code::kResourceExhausted, "").retryable());
  for (Code c : {Code::kInvalidArgument, Code::kNotFound, Code::kFailedPrecondition, Code::kDeadlineExceeded,
                 Code::kPermissionDenied, Code::kInternal, Code::kUnimplemented, Code::kAlreadyExists})
    EXPECT_FALSE(Error(c, "").retryable()) << code_name(c);
}

}  // namespace
}  // namespace dsec
