// The node's cold-memory reclaimer (docs/qos.md): memory of sandboxes nobody has used for a while goes to the
// node's swap (zram or a swap file, dsecd --zram-size / --swap-file), so that idle sandboxes cost the host little
// while they wait for the trainer's next step; what they touch again comes back as it is touched.
//
// Which memory is cold comes from the agent's own idle tracking: a sandbox with no exec, files or other call for
// its class's age (dsecd --reclaim-age; batch after a quarter of it; latency never; a spec with reclaim=false
// never) is reclaimed, and again each time the age passes with no use. Its processes stop for the moment of the
// reclaim (at most a second each; an exec that comes meanwhile waits for it), the kernel takes the least recently
// used pages first (v2 memory.reclaim; v1 a limit lowered in steps and put back), and they run on.
//
// DAMON (whose physical-address monitor the kernel may have) is detected and reported, not driven yet: it would
// tell cold pages from warm ones inside a sandbox that is in use, where idle tracking sees the sandbox whole. Its
// sysfs interface belongs to whoever set up kdamonds first; one that is in use (busy) is left alone and said so.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include "agent/registry/registry.hpp"

namespace dsec::agent::qos {

struct ReclaimerOptions {
  std::string mode = "auto";              // auto | idle | off (dsecd --reclaim)
  std::chrono::seconds age{120};          // a standard sandbox's; batch a quarter of it
  std::chrono::milliseconds interval{0};  // between rounds; 0: a quarter of the batch age, 1 to 10 s
  bool have_swap = false;                 // the node has swap (else only page cache can go)
};

struct ReclaimerStatus {
  std::string mode;    // "idle" or "off"
  std::string reason;  // why this mode, and what it can reach
  std::uint64_t reclaimed_bytes = 0;
  std::uint64_t sandboxes_reclaimed = 0;  // reclaims, all rounds
  std::uint64_t rounds = 0;
};

class ColdReclaimer {
 public:
  // Throws INVALID_ARGUMENT for a mode it does not know.
  ColdReclaimer(Registry& registry, ReclaimerOptions options);
  ~ColdReclaimer();
  ColdReclaimer(const ColdReclaimer&) = delete;
  ColdReclaimer& operator=(const ColdReclaimer&) = delete;

  void start();
  void stop();
  ReclaimerStatus status() const;
  // One round now (tests, benchmarks): what it did.
  Registry::ColdReclaimRound run_round();

 private:
  void loop();

  Registry& registry_;
  ReclaimerOptions options_;
  Registry::ColdReclaimPolicy policy_;
  std::string mode_, reason_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
  std::uint64_t reclaimed_bytes_ = 0, sandboxes_ = 0, rounds_ = 0;
};

}  // namespace dsec::agent::qos
