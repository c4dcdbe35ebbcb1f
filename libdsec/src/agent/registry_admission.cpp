// Admission: whether more sandboxes fit on the node beside the live ones and the creates in flight (cpu and memory
// with their overcommit, whole GPUs), and the node's load as the registry counts it.
#include "agent/registry.hpp"

#include <cstdint>
#include <string>

#include <fmt/format.h>

#include "agent/registry_internal.hpp"

namespace dsec::agent {
namespace {

std::string mib(std::uint64_t bytes) { return fmt::format("{:.0f}Mi", static_cast<double>(bytes) / (1 << 20)); }

}  // namespace

void Registry::admit(const Resources& r, std::size_t count) const {
  const double n = static_cast<double>(count);
  if (r.gpus > 0) {
    const std::uint64_t wanted = static_cast<std::uint64_t>(r.gpus) * count;
    const std::uint64_t held = static_cast<std::uint64_t>(live_gpus_) + reserved_gpus_;
    const std::uint64_t free = options_.gpus > held ? options_.gpus - held : 0;
    if (wanted > free)
      throw Error(Code::kResourceExhausted,
                  fmt::format("admission: {} gpus wanted, node '{}' has {} free of {}", wanted, options_.node_id,
                              free, options_.gpus));
  }
  const double cpu_limit = options_.cores * options_.cpu_overcommit;
  const double cpu_after = live_cpu_ + reserved_cpu_ + r.cpu * n;
  if (cpu_after > cpu_limit + kEpsilon)
    throw Error(Code::kResourceExhausted,
                fmt::format("admission: {} more cpu would bring node '{}' to {:.2f} cores requested, above its "
                            "limit of {:.2f} ({} cores x cpu_overcommit {})",
                            r.cpu * n, options_.node_id, cpu_after, cpu_limit, options_.cores,
                            options_.cpu_overcommit));
  const double memory_limit = static_cast<double>(options_.memory_bytes) * options_.memory_overcommit;
  const double memory_after =
      static_cast<double>(live_memory_ + reserved_memory_) + static_cast<double>(r.memory_bytes) * n;
  if (memory_after > memory_limit + 0.5)
    throw Error(Code::kResourceExhausted,
                fmt::format("admission: {} more memory would bring node '{}' to {} requested, above its limit of {} "
                            "({} x memory_overcommit {})",
                            mib(static_cast<std::uint64_t>(static_cast<double>(r.memory_bytes) * n)), options_.node_id,
                            mib(static_cast<std::uint64_t>(memory_after)),
                            mib(static_cast<std::uint64_t>(memory_limit)), mib(options_.memory_bytes),
                            options_.memory_overcommit));
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
