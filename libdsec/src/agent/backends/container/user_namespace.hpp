// User namespaces for container sandboxes and fncall fork servers: root inside is not root outside.
//
// Each sandbox runs in a user namespace of its own whose ids 0..65535 map onto a block of 65,536 host ids that no
// other live sandbox on the host has (HostIdPool, HostIdClaims). Its image layers and its writable layer are stacked
// through idmapped mounts (mount_setattr with MOUNT_ATTR_IDMAP), so files are stored on disk with the ids the sandbox
// sees: snapshots, forks and sleeps copy them as they are, and nothing is ever chowned. The root is built by the
// host's root (spawn.cpp), which joins the namespace last, after pivot_root.
//
// Making a namespace costs a clone and two writes to /proc; a background thread keeps a few ready.
#pragma once

#include <sys/types.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "agent/node/host_id_claims.hpp"
#include "agent/node/host_id_pool.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::container {

inline constexpr std::uint32_t kUsernsIds = 65536;  // ids per sandbox: 0..65535 inside

// A new user namespace mapping uids and gids 0..count-1 onto first..first+count-1; an O_RDONLY descriptor of it.
UniqueFd make_user_namespace(std::uint32_t first, std::uint32_t count);

// The uid map of process `pid` as "inside first count" triples, e.g. "0 268435456 65536"; empty when unreadable.
std::string uid_map_of(pid_t pid);

// While it lives, the calling thread's file-system ids are `first` (root inside a sandbox whose block starts
// there), with every capability it had still effective: files it makes through the sandbox's root are root's
// inside. Nothing when `first` is empty (a sandbox with host ids).
class ScopedFsIds {
 public:
  explicit ScopedFsIds(std::optional<std::uint32_t> first);
  ~ScopedFsIds();
  ScopedFsIds(const ScopedFsIds&) = delete;
  ScopedFsIds& operator=(const ScopedFsIds&) = delete;

 private:
  bool active_ = false;
};

struct UsernsOptions {
  std::string mode = "auto";        // auto: when the kernel can; on: the agent refuses to start without; off
  std::uint32_t first = 268435456;  // the first host id of the first block (2^28)
  std::uint32_t blocks = 16384;     // blocks of 65,536 ids
  std::filesystem::path claims_dir = "/run/dsec-userns";
  std::filesystem::path run_dir;  // the agent's: names its claims
  std::size_t ready = 4;          // namespaces kept made ahead
};

// The node's user namespaces: the block pool, the host-wide claims, the probe of what the kernel can, and the
// namespaces made ahead.
class UserNamespaces {
 public:
  // Probes the kernel (unless mode is off); throws FAILED_PRECONDITION when mode is on and it cannot.
  explicit UserNamespaces(UsernsOptions options);
  ~UserNamespaces();

  // Whether sandboxes get user namespaces, and what node info says: "idmapped (ids from F, N blocks of 65536)" or
  // "off (why)".
  bool enabled() const { return enabled_; }
  std::string describe() const;

  struct Namespace {
    std::uint32_t first = 0;
    UniqueFd fd;
  };
  // A namespace of a block of its own: made ahead, or made now. RESOURCE_EXHAUSTED when every block is in use.
  Namespace take();
  // The block is free again: every process of the sandbox that had it has exited.
  void give_back(std::uint32_t first);
  // A sandbox taken over after a restart has the block starting at `first`: false if it is not a block of this
  // pool or another agent holds it.
  bool adopt(std::uint32_t first);
  // Whether the file system under `dir` (an image layer) can be idmapped; probed once per file system.
  bool can_idmap(const std::filesystem::path& dir);
  std::size_t in_use() const { return ids_.in_use(); }

 private:
  Namespace make_one();
  void fill();
  void sweep_previous_claims();

  UsernsOptions options_;
  bool enabled_ = false;
  std::string why_off_;
  HostIdPool ids_;
  std::optional<HostIdClaims> claims_;
  UniqueFd probe_ns_;  // of the probe: idmaps layers to test their file systems

  std::mutex mu_;
  std::condition_variable wake_filler_;
  std::deque<Namespace> ready_;
  std::map<dev_t, bool> idmappable_;
  bool started_ = false;
  bool stopping_ = false;
  std::thread filler_;
};

}  // namespace dsec::agent::container
