// What the files of ClientCore (client_core.cpp and the files named for its concerns: create, groups, sandbox calls,
// exec, snapshots, fncall) share: content types, the labels creates carry, the retry loops and worker threads.
#pragma once

#include <chrono>
#include <cstddef>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include "client/client_core.hpp"
#include "dsec/retry.hpp"

namespace dsec::detail {

// Asking a node for its id while routing is quick or not at all.
inline constexpr std::chrono::milliseconds kDiscoveryTimeout{5'000};
// Labels every create carries: its request id, and for create_many the pulse's base request id. They find the
// copies a node made of a create that timed out there and was then made elsewhere.
inline constexpr std::string_view kRequestLabel = "dsec.request";
inline constexpr std::string_view kPulseLabel = "dsec.pulse";

inline std::mt19937_64& thread_rng() {
  thread_local std::mt19937_64 rng = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd()};
    return std::mt19937_64(seq);
  }();
  return rng;
}

// Runs fn(worker) on `workers` threads and waits for all of them.
template <typename Fn>
void run_workers(std::size_t workers, Fn&& fn) {
  std::vector<std::thread> threads;
  threads.reserve(workers);
  try {
    for (std::size_t w = 0; w < workers; ++w) threads.emplace_back(fn);
  } catch (...) {
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
}

template <typename Op>
auto ClientCore::retrying(SteadyClock::time_point deadline, Op&& op) -> decltype(op()) {
  auto sleep = [](std::chrono::milliseconds d) { std::this_thread::sleep_for(d); };
  return retry_call<SteadyClock>(options_.retry, deadline, sleep, thread_rng(), [&] {
    check_open();
    return op();
  });
}

template <typename Op>
auto ClientCore::exactly_once(const std::string& id, const std::string& request_id, const bool& maybe_sent, Op&& op)
    -> decltype(op()) {
  try {
    return op();
  } catch (const OutcomeUnknown&) {
    throw;
  } catch (const Error& e) {
    if (auto unknown = outcome_unknown(e, id, request_id, maybe_sent)) throw *unknown;
    throw;
  }
}

}  // namespace dsec::detail
