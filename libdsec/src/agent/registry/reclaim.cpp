// Registry::reclaim_cold: the registry's part of the node's cold-memory reclaimer (qos/reclaimer.hpp). It picks the
// sandboxes that have been idle for their class's age and asks each backend to give back what it can.
#include <algorithm>

#include <fmt/format.h>

#include "agent/registry/registry_internal.hpp"
#include "common/log.hpp"

namespace dsec::agent {

Registry::ColdReclaimRound Registry::reclaim_cold(const ColdReclaimPolicy& policy) {
  ColdReclaimRound round;
  const std::int64_t now_ms = steady_ms();
  struct Candidate {
    std::shared_ptr<Record> record;
    std::int64_t idle_since;
  };
  std::vector<Candidate> candidates;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [id, record] : records_) {
      const Resources& r = record->spec.resources;
      if (!r.reclaim || r.priority == Priority::kLatency || record->destroying.load() || !record->sandbox) continue;
      const auto age = r.priority == Priority::kBatch ? policy.batch_age : policy.standard_age;
      // last_reclaim_ms is written under power_mutex; a stale read only delays or hastens one round.
      const std::int64_t since =
          std::max(record->last_used_ms.load(std::memory_order_relaxed), record->last_reclaim_ms);
      if (now_ms - since >= age.count()) candidates.push_back({record, since});
    }
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const Candidate& a, const Candidate& b) { return a.idle_since < b.idle_since; });
  if (candidates.size() > policy.max_sandboxes) candidates.resize(policy.max_sandboxes);

  for (const Candidate& c : candidates) {
    Record& record = *c.record;
    // A sleep, a wake or a capture under way: its turn comes in a later round.
    std::unique_lock power(record.power_mutex, std::try_to_lock);
    if (!power.owns_lock() || record.destroying.load() || record.snapshot().state != "running") {
      ++round.busy;
      continue;
    }
    const std::int64_t used = record.last_used_ms.load(std::memory_order_relaxed);
    if (used > c.idle_since) continue;  // used since it was picked
    std::optional<ColdReclaim> done;
    try {
      done = record.sandbox->reclaim_cold(std::chrono::steady_clock::now() + policy.per_sandbox);
    } catch (const Error& e) {
      if (e.code() != Code::kUnimplemented && e.code() != Code::kNotFound)
        log_warn("cold-memory reclaim of {}: {}", record.info.id, e.what());
      record.last_reclaim_ms = steady_ms();  // not again before its age has passed once more
      ++round.busy;
      continue;
    } catch (const std::exception& e) {
      log_warn("cold-memory reclaim of {}: {}", record.info.id, e.what());
      record.last_reclaim_ms = steady_ms();
      ++round.busy;
      continue;
    }
    record.last_reclaim_ms = steady_ms();
    if (!done) {
      ++round.busy;
      continue;
    }
    if (done->at_floor) continue;  // nothing new to take since its last reclaim
    const std::uint64_t released =
        done->memory_before_bytes > done->memory_after_bytes ? done->memory_before_bytes - done->memory_after_bytes : 0;
    {
      std::lock_guard lock(record.mutex);
      record.info.cold_memory.reclaimed_bytes += released;
      ++record.info.cold_memory.reclaims;
      record.info.cold_memory.last_reclaim_at = now();
    }
    ++round.sandboxes;
    round.released_bytes += released;
  }
  return round;
}

std::vector<Registry::ColdMemoryUsage> Registry::cold_memory_usage() const {
  std::vector<std::pair<std::shared_ptr<Record>, ColdMemoryUsage>> touched;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [id, record] : records_) {
      SandboxInfo info = record->snapshot();
      if (info.cold_memory.reclaims == 0 || !record->sandbox || record->destroying.load()) continue;
      touched.push_back({record, {id, info.cold_memory.reclaimed_bytes, 0}});
    }
  }
  std::vector<ColdMemoryUsage> out;
  for (auto& [record, usage] : touched) {
    try {
      usage.refaults = record->sandbox->refaults();
    } catch (const std::exception&) {
      continue;  // destroyed meanwhile
    }
    out.push_back(std::move(usage));
  }
  std::sort(out.begin(), out.end(), [](const ColdMemoryUsage& a, const ColdMemoryUsage& b) { return a.id < b.id; });
  return out;
}

}  // namespace dsec::agent
