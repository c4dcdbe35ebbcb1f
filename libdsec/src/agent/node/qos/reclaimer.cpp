#include "agent/node/qos/reclaimer.hpp"

#include <algorithm>
#include <fstream>

#include <fmt/format.h>

#include "common/log.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::qos {
namespace {

constexpr const char* kKdamonds = "/sys/kernel/mm/damon/admin/kdamonds";

std::string read_word(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  in >> word;
  return word;
}

// Why DAMON does not drive the reclaim on this node. Its sysfs interface belongs to whoever set up kdamonds
// first: while one runs, nr_kdamonds cannot change, and rewriting another's kdamond would take its reclaim away.
std::string damon_note() {
  const std::string count = read_word(fmt::format("{}/nr_kdamonds", kKdamonds));
  if (count.empty()) return "the kernel has no DAMON sysfs interface";
  if (count != "0") {
    const std::string state = read_word(fmt::format("{}/0/state", kKdamonds));
    const std::string pid = read_word(fmt::format("{}/0/pid", kKdamonds));
    return fmt::format("DAMON is busy: {} kdamond{} set up by another user (kdamond 0 {}{}), left alone", count,
                       count == "1" ? "" : "s", state.empty() ? "?" : state,
                       pid.empty() || pid == "-1" ? "" : fmt::format(", pid {}", pid));
  }
  return "DAMON (sysfs) is free, not driven by dsec yet";
}

}  // namespace

ColdReclaimer::ColdReclaimer(Registry& registry, ReclaimerOptions options)
    : registry_(registry), options_(std::move(options)) {
  if (options_.mode != "auto" && options_.mode != "idle" && options_.mode != "off")
    throw Error(Code::kInvalidArgument, fmt::format("reclaim mode '{}': use auto, idle or off", options_.mode));
  policy_.standard_age = options_.age;
  policy_.batch_age = std::max<std::chrono::milliseconds>(options_.age / 4, std::chrono::seconds(1));
  if (options_.interval.count() == 0)
    options_.interval =
        std::clamp<std::chrono::milliseconds>(policy_.batch_age / 4, std::chrono::seconds(1), std::chrono::seconds(10));
  if (options_.mode == "off") {
    mode_ = "off";
    reason_ = "turned off (dsecd --reclaim off)";
    return;
  }
  mode_ = "idle";
  reason_ = fmt::format(
      "the agent's idle tracking: standard sandboxes after {} s unused, batch after {} s, latency "
      "never; {}",
      policy_.standard_age.count() / 1000, policy_.batch_age.count() / 1000, damon_note());
  if (!options_.have_swap)
    reason_ += "; the node has no swap, so only page cache is released (dsecd --zram-size or --swap-file)";
}

ColdReclaimer::~ColdReclaimer() { stop(); }

void ColdReclaimer::start() {
  if (mode_ == "off" || thread_.joinable()) return;
  thread_ = std::thread([this] { loop(); });
}

void ColdReclaimer::stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

Registry::ColdReclaimRound ColdReclaimer::run_round() {
  Registry::ColdReclaimRound round = registry_.reclaim_cold(policy_);
  std::lock_guard lock(mu_);
  ++rounds_;
  reclaimed_bytes_ += round.released_bytes;
  sandboxes_ += round.sandboxes;
  return round;
}

void ColdReclaimer::loop() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    wake_.wait_for(lock, options_.interval, [&] { return stopping_; });
    if (stopping_) break;
    lock.unlock();
    try {
      Registry::ColdReclaimRound round = run_round();
      if (round.sandboxes > 0)
        log_info("cold-memory reclaim: {} sandboxes gave back {} MiB", round.sandboxes, round.released_bytes >> 20);
    } catch (const std::exception& e) {
      log_warn("cold-memory reclaim: {}", e.what());
    }
    lock.lock();
  }
}

ReclaimerStatus ColdReclaimer::status() const {
  std::lock_guard lock(mu_);
  return ReclaimerStatus{mode_, reason_, reclaimed_bytes_, sandboxes_, rounds_};
}

}  // namespace dsec::agent::qos
