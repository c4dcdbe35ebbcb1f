// Admission: whether more sandboxes fit on the node beside the live ones and the creates in flight (cpu and memory
// with their overcommit, whole GPUs), and the node's load as the registry counts it.
#include "agent/registry/registry.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "agent/registry/registry_internal.hpp"

namespace dsec::agent {
namespace {

std::string mib(std::uint64_t bytes) { return fmt::format("{:.0f}Mi", static_cast<double>(bytes) / (1 << 20)); }

}  // namespace

void Registry::reserve(const SandboxSpec& spec, int sign) {
  const Resources& r = spec.resources;
  if (sign < 0) room_.notify_all();
  reserved_cpu_ += sign * r.cpu;
  if (sign > 0) {
    reserved_memory_ += r.memory_bytes;
    reserved_gpus_ += r.gpus;
  } else {
    reserved_memory_ -= r.memory_bytes;
    reserved_gpus_ -= r.gpus;
  }
  if (spec.tenant.empty() || !options_.tenant_quotas.count(spec.tenant)) return;
  TenantReservation& t = reserved_by_tenant_[spec.tenant];
  if (sign > 0) {
    ++t.sandboxes;
    t.cpu += r.cpu;
    t.memory_bytes += r.memory_bytes;
  } else {
    --t.sandboxes;
    t.cpu -= r.cpu;
    t.memory_bytes -= r.memory_bytes;
    if (t.sandboxes == 0) reserved_by_tenant_.erase(spec.tenant);
  }
}

void Registry::set_memory_overcommit(double ratio) {
  std::lock_guard lock(mutex_);
  if (ratio > memory_overcommit_now_) room_.notify_all();
  memory_overcommit_now_ = ratio;
}

void Registry::admit_or_wait(const SandboxSpec& spec, std::unique_lock<std::mutex>& lock,
                             const ClientGone& client_gone) {
  if (spec.queue_timeout.count() <= 0) {
    admit(spec.resources, 1, spec.tenant);
    return;
  }
  // Nobody ahead and room now: no queue at all.
  if (waiting_.empty()) {
    try {
      admit(spec.resources, 1, spec.tenant);
      return;
    } catch (const Error& e) {
      if (!e.retryable()) throw;  // could never fit: waiting cannot help
    }
  }
  const auto started = std::chrono::steady_clock::now();
  const auto deadline = started + spec.queue_timeout;
  const std::uint64_t ticket = next_ticket_++;
  waiting_.push_back(ticket);
  auto leave = [&] {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), ticket));
    room_.notify_all();  // the next one may be at the head now
  };
  std::optional<Error> refused;
  for (;;) {
    if (waiting_.front() == ticket) {
      try {
        admit(spec.resources, 1, spec.tenant);
        leave();
        return;
      } catch (const Error& e) {
        if (!e.retryable()) {
          leave();
          throw;
        }
        refused = e;
      }
    }
    if (client_gone && client_gone()) {
      leave();
      throw Error(Code::kCancelled, "create: the client went away while the create waited for room; nothing was made",
                  /*retryable=*/false);
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      const auto ahead = std::find(waiting_.begin(), waiting_.end(), ticket) - waiting_.begin();
      leave();
      const double waited = std::chrono::duration<double>(now - started).count();
      throw Error(Code::kResourceExhausted,
                  refused ? fmt::format("{} (waited {:.1f} s for room, the queue_timeout)", refused->what(), waited)
                          : fmt::format("admission: no room on node '{}' within the queue_timeout of {:.1f} s ({} "
                                        "creates still ahead)",
                                        options_.node_id, waited, ahead));
    }
    // Room frees with a destroy or a sleep; the caller is looked at every 100 ms.
    room_.wait_until(lock, std::min(deadline, now + std::chrono::milliseconds(100)));
  }
}

double Registry::memory_overcommit() const {
  std::lock_guard lock(mutex_);
  return memory_overcommit_now_ > 0 ? memory_overcommit_now_ : options_.memory_overcommit;
}

void Registry::admit(const Resources& r, std::size_t count, const std::string& tenant) const {
  const double n = static_cast<double>(count);
  if (r.gpus > 0) {
    const std::uint64_t wanted = static_cast<std::uint64_t>(r.gpus) * count;
    const std::uint64_t held = static_cast<std::uint64_t>(live_gpus_) + reserved_gpus_;
    const std::uint64_t free = options_.gpus > held ? options_.gpus - held : 0;
    if (wanted > free)
      throw Error(Code::kResourceExhausted, fmt::format("admission: {} gpus wanted, node '{}' has {} free of {}",
                                                        wanted, options_.node_id, free, options_.gpus));
  }
  const double cpu_limit = options_.cores * options_.cpu_overcommit;
  const double memory_ratio = memory_overcommit_now_ > 0 ? memory_overcommit_now_ : options_.memory_overcommit;
  const double memory_limit = static_cast<double>(options_.memory_bytes) * memory_ratio;
  // More than the node could ever grant, empty: no retry can help (the client's placement tries another node).
  if (r.cpu * n > cpu_limit + kEpsilon || static_cast<double>(r.memory_bytes) * n > memory_limit + 0.5)
    throw Error(Code::kResourceExhausted,
                fmt::format("admission: {} sandbox{} of {:.2f} cpu and {} memory could never fit node '{}' ({:.2f} "
                            "cores and {} at most, with overcommit)",
                            count, count == 1 ? "" : "es", r.cpu, mib(r.memory_bytes), options_.node_id, cpu_limit,
                            mib(static_cast<std::uint64_t>(memory_limit))),
                /*retryable=*/false);
  const double cpu_after = live_cpu_ + reserved_cpu_ + r.cpu * n;
  if (cpu_after > cpu_limit + kEpsilon)
    throw Error(
        Code::kResourceExhausted,
        fmt::format("admission: {} more cpu would bring node '{}' to {:.2f} cores requested, above its "
                    "limit of {:.2f} ({} cores x cpu_overcommit {})",
                    r.cpu * n, options_.node_id, cpu_after, cpu_limit, options_.cores, options_.cpu_overcommit));
  const double memory_after =
      static_cast<double>(live_memory_ + reserved_memory_) + static_cast<double>(r.memory_bytes) * n;
  if (memory_after > memory_limit + 0.5)
    throw Error(Code::kResourceExhausted,
                fmt::format("admission: {} more memory would bring node '{}' to {} requested, above its limit of {} "
                            "({} x memory_overcommit {})",
                            mib(static_cast<std::uint64_t>(static_cast<double>(r.memory_bytes) * n)), options_.node_id,
                            mib(static_cast<std::uint64_t>(memory_after)),
                            mib(static_cast<std::uint64_t>(memory_limit)), mib(options_.memory_bytes), memory_ratio));
  if (tenant.empty()) return;
  auto quota = options_.tenant_quotas.find(tenant);
  if (quota == options_.tenant_quotas.end()) return;
  // The tenant's sandboxes on this node (awake, asleep or failed: until destroyed they hold their place) and its
  // creates in flight. Sums in doubles and in 64 bits of at most 2^32 values: nothing here can wrap.
  std::uint64_t sandboxes = 0;
  double cpu = 0, memory = 0;
  for (const auto& [id, record] : records_) {
    if (record->spec.tenant != tenant) continue;
    ++sandboxes;
    cpu += record->spec.resources.cpu;
    memory += static_cast<double>(record->spec.resources.memory_bytes);
  }
  if (auto it = reserved_by_tenant_.find(tenant); it != reserved_by_tenant_.end()) {
    sandboxes += it->second.sandboxes;
    cpu += it->second.cpu;
    memory += static_cast<double>(it->second.memory_bytes);
  }
  const TenantQuota& q = quota->second;
  if (sandboxes + count > q.sandboxes)
    throw Error(Code::kResourceExhausted,
                fmt::format("quota of tenant '{}' on node '{}': {} more sandboxes beside its {} would pass its limit "
                            "of {}",
                            tenant, options_.node_id, count, sandboxes, q.sandboxes),
                /*retryable=*/false);
  if (cpu + r.cpu * n > q.cpu + kEpsilon)
    throw Error(Code::kResourceExhausted,
                fmt::format("quota of tenant '{}' on node '{}': {:.2f} more cpu beside its {:.2f} would pass its "
                            "limit of {:.2f} cores",
                            tenant, options_.node_id, r.cpu * n, cpu, q.cpu),
                /*retryable=*/false);
  if (memory + static_cast<double>(r.memory_bytes) * n > static_cast<double>(q.memory_bytes) + 0.5)
    throw Error(
        Code::kResourceExhausted,
        fmt::format("quota of tenant '{}' on node '{}': {} more memory beside its {} would pass its limit "
                    "of {}",
                    tenant, options_.node_id, mib(static_cast<std::uint64_t>(static_cast<double>(r.memory_bytes) * n)),
                    mib(static_cast<std::uint64_t>(memory)), mib(q.memory_bytes)),
        /*retryable=*/false);
}

NodeLoad Registry::load() const {
  NodeLoad out;
  std::lock_guard lock(mutex_);
  out.sandboxes = static_cast<std::uint32_t>(records_.size());
  out.cpu_requested = live_cpu_;
  out.memory_requested = live_memory_;
  out.gpus_requested = live_gpus_;
  for (const auto& kind : kinds()) out.by_kind[kind] = 0;
  for (const auto& [id, record] : records_) ++out.by_kind[record->info.kind];
  return out;
}

}  // namespace dsec::agent
