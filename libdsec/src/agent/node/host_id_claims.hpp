// Claims on blocks of host ids that every dsec agent on a host honours, so that two agents (each with its own home
// and run directory) never map two live sandboxes onto the same ids.
//
// A claim is a file <dir>/<first id> (dir: /run/dsec-userns by default) that names its holder: the agent's pid, its
// start time and its run directory. It is made whole in one step (written aside, then link(2)ed into place, which
// fails if the name exists). A claim is stale, and may be taken over, when its holder has exited and its run
// directory is gone: a holder that died but whose run directory remains may still have sandboxes running on its
// blocks (they outlive their agent), and an agent restarted on that run directory takes its own claims back.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dsec::agent {

class HostIdClaims {
 public:
  // `run_dir` identifies this agent's claims (with its pid and start time).
  HostIdClaims(std::filesystem::path dir, const std::filesystem::path& run_dir);

  // Claims the block starting at `first`: true if this agent holds it now (newly, or it held it already), false if
  // a live holder or one whose run directory remains has it.
  bool claim(std::uint32_t first);
  // Takes the claim over for a sandbox this agent adopted after a restart: also from a dead holder with this
  // agent's run directory (the agent before the restart). False only when another agent, alive or not, holds it.
  bool take_over(std::uint32_t first);
  // Gives up this agent's claim (a claim another holds is left alone).
  void release(std::uint32_t first);
  // Removes the claims the agent before a restart on this run directory left, except those `keep` says are in use
  // again (their sandboxes were taken over); the rest ran sandboxes that are gone. Called once, after recovery.
  template <typename Keep>
  void release_previous(Keep keep) {
    for (std::uint32_t first : previous_claims())
      if (!keep(first)) release_previous(first);
  }

  const std::filesystem::path& dir() const { return dir_; }

 private:
  struct Holder {
    pid_t pid = 0;
    std::uint64_t start_time = 0;
    std::string run_dir;
  };
  enum class Verdict { kOurs, kOursBeforeRestart, kStale, kHeld };
  Verdict judge(const Holder& h) const;
  bool read_holder(const std::filesystem::path& path, Holder& out) const;
  bool claim(std::uint32_t first, bool after_restart);
  std::vector<std::uint32_t> previous_claims() const;
  void release_previous(std::uint32_t first);

  std::filesystem::path dir_;
  std::string run_dir_;
  Holder self_;
  std::string self_text_;
};

}  // namespace dsec::agent
