// The agent's side of dsec-layer-keeper (layer_keeper/main.cpp), the small process that holds the layer file system's
// FUSE connection open while no agent does, so that a killed agent's layer mounts (and the sandboxes stacked on
// them) keep working once the next agent serves the same connection again.
//
// The keeper is started with posix_spawn (vfork + exec: safe in the multi-threaded agent, and it shares nothing
// with the agent after the exec) in a session of its own, with a duplicate of the /dev/fuse descriptor as its fd 3.
// A record file, <run dir>/.layers/keeper, names it by pid, start time (/proc/<pid>/stat field 22), boot id and
// the FUSE connection's number; a restarted agent trusts a keeper only when all of them match and the process is
// still dsec-layer-keeper, then takes the descriptor back with pidfd_open + pidfd_getfd (root, CAP_SYS_PTRACE). A
// pid alone is never trusted, and a process that does not match is never signalled.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "common/unique_fd.hpp"

namespace dsec::agent::layers {

struct KeeperRecord {
  pid_t pid = 0;
  std::uint64_t start_time = 0;  // clock ticks after boot (/proc/<pid>/stat field 22)
  std::string boot_id;           // /proc/sys/kernel/random/boot_id
  unsigned connection = 0;       // the FUSE connection: its number in fusectl, the FUSE mount's device minor
};

// The record at `path`, or nullopt when there is none or it cannot be parsed.
std::optional<KeeperRecord> read_keeper_record(const std::filesystem::path& path);
// Start time of a process (field 22 of /proc/<pid>/stat), 0 when there is no such process.
std::uint64_t process_start_time(pid_t pid);
// This boot's id.
std::string current_boot_id();
// dsec-layer-keeper beside the running program (build/bin, an installed bin/, the Python package's bin/).
std::filesystem::path default_keeper_binary();

class LayerKeeper {
 public:
  // Starts `binary` holding a duplicate of `fuse_fd` and writes the record (replacing one that is there). Errors:
  // NOT_FOUND when the binary is missing, INTERNAL (with errno) when it cannot be started.
  static std::unique_ptr<LayerKeeper> start(const std::filesystem::path& binary, int fuse_fd, unsigned connection,
                                            const std::filesystem::path& record);
  // The keeper the record names when it is still that process: same boot, pid, start time, and the program is
  // dsec-layer-keeper. Otherwise null, with the reason in `why` (empty when there is no record at all).
  static std::unique_ptr<LayerKeeper> find(const std::filesystem::path& record, std::string& why);

  LayerKeeper(const LayerKeeper&) = delete;
  LayerKeeper& operator=(const LayerKeeper&) = delete;
  // Leaves the keeper running (it is meant to outlive the agent); reaps it if it was this process's child and ended.
  ~LayerKeeper();

  pid_t pid() const noexcept { return record_.pid; }
  const KeeperRecord& record() const noexcept { return record_; }
  const std::filesystem::path& record_path() const noexcept { return record_path_; }

  // A duplicate of the keeper's /dev/fuse descriptor (close-on-exec). Errors name the keeper and the errno.
  UniqueFd take_connection();
  // True once the keeper has ended (it is reaped when it was this process's child).
  bool exited();
  // Ends the keeper (SIGTERM through its pidfd; SIGKILL if it is still there after 2 s), reaps it when it is this
  // process's child, and removes the record. Idempotent.
  void stop();

 private:
  LayerKeeper(UniqueFd pidfd, KeeperRecord record, std::filesystem::path record_path, bool child);
  void reap();

  UniqueFd pidfd_;
  KeeperRecord record_;
  std::filesystem::path record_path_;
  bool child_ = false;  // started by this process (it must reap it)
  bool stopped_ = false;
  bool reaped_ = false;
};

}  // namespace dsec::agent::layers
