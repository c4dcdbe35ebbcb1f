// Memory overcommit that follows real use (dsecd --memory-overcommit-ceiling, docs/qos.md). A node admits memory
// limits up to RAM x memory_overcommit; most sandboxes use a small part of their limit, so while the memory really
// in use stays low the node may admit more, up to RAM x ceiling. The limit is where the node would stand at 80% of
// its RAM in use if new sandboxes used as much per granted byte as the live ones do now:
//
//   per_granted = in_use / granted          (host memory in use, the live sandboxes' limits added up)
//   ratio       = clamp(0.8 x RAM / per_granted / RAM, memory_overcommit, ceiling)
//
// With little granted yet (under a tenth of RAM) the measure means nothing and the base ratio holds. Memory in use
// counts the whole host (the agent, page cache the kernel will not give back), so the estimate errs on the safe side.
#pragma once

#include <cstdint>

namespace dsec::agent::qos {

struct UsageOvercommitInputs {
  std::uint64_t memory_bytes = 0;   // the node's RAM
  double base = 1.0;                // memory_overcommit
  double ceiling = 0;               // 0 or <= base: off
  std::uint64_t in_use_bytes = 0;   // MemTotal - MemAvailable
  std::uint64_t granted_bytes = 0;  // live sandboxes' memory limits
};

// The memory overcommit ratio admission uses now.
double usage_overcommit(const UsageOvercommitInputs& in);

}  // namespace dsec::agent::qos
