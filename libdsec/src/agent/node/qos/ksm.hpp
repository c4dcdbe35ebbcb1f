// The kernel's same-page merging (KSM) for sandboxes that ask for it (spec "ksm": true, docs/qos.md): their
// processes are marked mergeable (PR_SET_MEMORY_MERGE on the sandbox's first process, which every process it
// starts inherits, across exec too), and the kernel's ksmd runs while at least one such sandbox lives. The agent
// turns ksmd on when the first one comes and puts back the setting it found when the last one goes (or the agent
// stops), so a host that never sees a KSM sandbox never scans.
#pragma once

#include <cstdint>
#include <memory>

namespace dsec::agent::qos {

// Held by each sandbox that asked for KSM while it lives. Throws FAILED_PRECONDITION when the kernel's ksmd cannot
// be started (no CONFIG_KSM, no root).
std::shared_ptr<void> hold_ksm();

struct KsmStatus {
  std::uint32_t holders = 0;      // live sandboxes that asked
  std::uint64_t saved_bytes = 0;  // pages_sharing: memory the merging saves now, host-wide
};
KsmStatus ksm_status();

}  // namespace dsec::agent::qos
