// The interface every sandbox backend implements. Backends never see HTTP or JSON: the agent's router decodes
// requests into these typed calls and encodes what they return or throw (dsec::Error).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "agent/images/layers/layer_image.hpp"
#include "agent/processes/processes.hpp"
#include "dsec/error.hpp"
#include "dsec/exec.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/screen.hpp"
#include "dsec/spec.hpp"
#include "image/upper_tree.hpp"

namespace dsec::agent {

// A running sandbox frozen so that copies of it, processes and all, can start from it (BackendSandbox::
// fork_source). Only the backend that made it reads it.
class ForkSource {
 public:
  virtual ~ForkSource() = default;
};

// What a backend needs to start one sandbox.
struct CreateParams {
  std::string id;                                   // unique on this node, also the default hostname
  SandboxSpec spec;                                 // validated
  std::vector<std::filesystem::path> image_layers;  // read-only root layers, lowest first
  // The same layers as EROFS images (virtual machines attach them as disks); empty where the node has none.
  std::vector<layers::LayerImage> layer_images;
  // A copy of a running sandbox of this backend (its fork_source()), not a new one from the image.
  std::shared_ptr<const ForkSource> fork_of;
};

// What a backend needs to take one of its sandboxes over after an agent restart: a few named values (pids, start
// times, cgroup paths, namespace identities), kept in the sandbox's record on disk. The registry stores them and
// hands them back; only the backend reads them.
using BackendState = std::map<std::string, std::string, std::less<>>;

// A sandbox an earlier run of the agent made, as its record on disk describes it.
struct AdoptParams {
  std::string id;
  SandboxSpec spec;
  std::vector<std::filesystem::path> image_layers;  // as they were at create
  BackendState state;                               // BackendSandbox::recovery_state() at create
  bool sleeping = false;                            // the record says "sleeping": it stays asleep
};

// Receives an exec's output as it is read: fd 1 (stdout) or 2 (stderr) and the bytes. Called on the exec's thread;
// what it throws ends the exec's wait (the command is killed) and propagates to the caller.
using OutputSink = std::function<void(int fd, std::string_view data)>;

// What a sleep or a wake did: memory charged to the sandbox before and after, and how long it took.
struct SleepReport {
  std::uint64_t memory_before_bytes = 0;
  std::uint64_t memory_after_bytes = 0;
  double seconds = 0;
  std::uint64_t swap_bytes = 0;    // the sandbox's memory in swap after the call
  bool reclaim_timed_out = false;  // sleep: releasing memory stopped at its time limit with some left
};

// What one cold-memory reclaim of an awake sandbox did (BackendSandbox::reclaim_cold, qos/reclaimer.hpp).
struct ColdReclaim {
  std::uint64_t memory_before_bytes = 0;
  std::uint64_t memory_after_bytes = 0;
  std::uint64_t swap_bytes = 0;  // its memory in swap after
  double seconds = 0;            // how long its processes were stopped for it
  // Its charge has not grown since its last reclaim took it to its floor: nothing to take, nothing was stopped.
  bool at_floor = false;
};

// What a capture of a sandbox's files did (BackendSandbox::capture_files).
struct FilesCapture {
  image::UpperTreeStats stats;
  std::vector<std::string> notes;  // what was left out (sockets, ...)
  double frozen_seconds = 0;       // how long the sandbox's processes were stopped for it (0 if it was asleep)
};

// A sandbox's screen (full VMs): what a computer-use agent sees and does. Errors: FAILED_PRECONDITION while the
// sandbox sleeps or its VM stopped; INVALID_ARGUMENT for a key, character or pixel the screen does not have.
class Screen {
 public:
  virtual ~Screen() = default;
  virtual std::string screenshot_png() = 0;
  // Runs the actions in order (a failing one ends the request; those before it took effect).
  virtual ScreenState input(const std::vector<InputAction>& actions) = 0;
  virtual ScreenState state() = 0;
  // A VNC endpoint for a person to watch (and drive) the screen: "host:port" on the node and its password, the
  // same while it lasts; stop_vnc ends it (connections made stay until they close). FAILED_PRECONDITION where the
  // node has no ports to give, RESOURCE_EXHAUSTED when its range is used up.
  virtual VncEndpoint vnc() = 0;
  virtual void stop_vnc() = 0;
};

// One live sandbox. Every method may be called from several threads at once; all of them throw dsec::Error.
class BackendSandbox {
 public:
  virtual ~BackendSandbox() = default;

  // Blocks until the command ends or its timeout passes. With a sink, output goes to the sink as it is read
  // (max_output_bytes still caps what is delivered, per stream) and the result's stdout/stderr stay empty; the
  // truncation flags say whether anything was dropped.
  virtual ExecResult exec(const ExecRequest& request, const OutputSink& sink = {}) = 0;

  // The processes the sandbox keeps for its callers, shell sessions among them (agent/processes/); null when the
  // backend keeps none. Lives as long as the sandbox.
  virtual Processes* processes() { return nullptr; }

  // Its screen; null for a sandbox without one (every kind but a full VM, or a VM made with display "none").
  virtual Screen* screen() { return nullptr; }

  // Paths are absolute paths inside the sandbox; they are resolved inside its root, never outside.
  virtual void write_file(std::string_view path, std::string_view data, unsigned mode) = 0;
  virtual std::string read_file(std::string_view path) = 0;
  virtual void put_archive(std::string_view dir, std::string_view tar_bytes) = 0;
  virtual std::string get_archive(std::string_view dir) = 0;
  // Whether the path is a directory (the files API answers a directory with a tar stream).
  virtual bool is_directory(std::string_view path) = 0;

  // Sleep freezes every process of the sandbox and releases what memory it can; wake restores its limits and lets
  // its processes run on. The caller (the registry) calls them one at a time per sandbox, sleep only on an awake
  // sandbox and wake only on a sleeping one. Files stay readable and writable while it sleeps; exec is refused.
  virtual SleepReport sleep() { throw Error(Code::kUnimplemented, "this backend's sandboxes cannot sleep"); }
  virtual SleepReport wake() { throw Error(Code::kUnimplemented, "this backend's sandboxes cannot sleep"); }
  // Cold-memory reclaim of an idle, awake sandbox (qos/reclaimer.hpp): its processes stop for a moment while what
  // memory the kernel can take goes to the node's swap (page cache is dropped), then run on; what they touch again
  // comes back as it is touched (a refault). nullopt when it is busy (an exec runs, it sleeps) and nothing was
  // done; UNIMPLEMENTED where the backend cannot. Never called during a sleep or a wake.
  virtual std::optional<ColdReclaim> reclaim_cold(std::chrono::steady_clock::time_point deadline) {
    throw Error(Code::kUnimplemented, "this backend's sandboxes have no cold-memory reclaim");
  }
  // Pages of the sandbox read back in after they were reclaimed (the kernel's workingset refaults), since it was
  // made; 0 where unknown.
  virtual std::uint64_t refaults() { return 0; }

  // Puts a new network policy in force (docs/networking.md), running or asleep; a failure leaves the old one.
  virtual void set_network(const NetworkPolicy&) {
    throw Error(Code::kUnimplemented, "this backend's sandboxes have no network to change yet");
  }
  // Exposed TCP ports (docs/networking.md): expose answers the address ("host:port") others reach it at.
  virtual std::string expose(std::uint32_t) {
    throw Error(Code::kUnimplemented, "this backend's sandboxes cannot expose ports yet");
  }
  virtual void unexpose(std::uint32_t) {
    throw Error(Code::kUnimplemented, "this backend's sandboxes cannot expose ports yet");
  }
  // Its port -> the address it is exposed at.
  virtual std::map<std::uint32_t, std::string> exposed() { return {}; }
  // What its network carried (nothing for a sandbox without a link).
  virtual NetworkUsage network_usage() { return {}; }

  // Copies what the sandbox changed in its file system, as an image layer's tree (image/upper_tree.hpp: new and
  // changed files, whiteouts and opaque directories for what it deleted or replaced), into `dest`, which must not
  // exist. Its processes are frozen for the copy so that nothing changes under it, and run on afterwards (a running
  // exec only pauses); a sleeping sandbox stays frozen. Files only: processes, memory and open descriptors are not
  // part of it. Captures of one sandbox run one at a time, and never during a sleep or a wake.
  virtual FilesCapture capture_files(const std::filesystem::path& dest, const image::UpperTreeLimits& limits) {
    throw Error(Code::kUnimplemented, "this backend's sandboxes cannot be snapshotted");
  }
  // Freezes the sandbox, processes and memory, into a source that Backend::create starts copies from
  // (CreateParams::fork_of): each copy runs on from this instant with the same processes, files and memory, and so
  // does this sandbox. Refused while execs run (their callers would lose them) or while it sleeps.
  virtual std::shared_ptr<const ForkSource> fork_source() {
    throw Error(Code::kUnimplemented,
                "this backend cannot fork a running sandbox (fork copies its files through a snapshot instead)");
  }
  // What Backend::adopt needs to take this sandbox over after an agent restart; the registry writes it into the
  // sandbox's record once create returned. Empty for backends that need nothing.
  virtual BackendState recovery_state() { return {}; }
  // What its class of service and memory policies got on this node (docs/qos.md); the registry puts it in the
  // sandbox's info. Empty for backends without classes.
  virtual QosGrant qos_grant() { return {}; }

  // False once the sandbox's processes are gone (its init died, it was OOM-killed as a whole, ...).
  virtual bool alive() = 0;
  // The reaper's call on each pass (about once a second) while the sandbox runs: keeps what its code can grow on
  // the host within bounds (a VM's console log). Quick; never throws for a sandbox that is going away.
  virtual void upkeep() {}
  // Once alive() said false: what the backend knows of why (a VM's console's last lines), or "" when it knows
  // nothing more than that the processes are gone.
  virtual std::string stopped_reason() { return {}; }
  // Kills everything inside and releases every host resource (cgroups, namespaces, mounts, directories).
  // Idempotent and safe to call concurrently with other methods, which then fail with NOT_FOUND or UNAVAILABLE.
  virtual void destroy() = 0;
};

// A backend's pool of sandboxes started ahead of creates (GET /v1/node "warm_pool" for containers).
struct PoolStats {
  std::uint32_t size = 0;      // kept ready, all shapes
  std::uint32_t ready = 0;     // ready now
  std::uint64_t claims = 0;    // creates served from it
  std::uint64_t misses = 0;    // creates of a pooled shape that found it empty
  std::uint64_t failures = 0;  // starts that failed
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view kind() const = 0;
  virtual PoolStats pool_stats() { return {}; }
  // Starts a sandbox and returns once it can take an exec.
  virtual std::unique_ptr<BackendSandbox> create(const CreateParams& params) = 0;
  // Takes over a sandbox that an earlier run of this agent made and left running (the agent was killed or crashed):
  // checks that it is alive and verifiably the same sandbox, ends what the old agent left half done inside it
  // (execs whose callers are gone; a freeze its recorded state does not explain) and returns it working. Throws
  // NOT_FOUND when the sandbox is gone (its processes died while no agent watched them), another code when it cannot
  // be taken over; the registry then marks it failed and calls remove_leftovers(id).
  virtual std::unique_ptr<BackendSandbox> adopt(const AdoptParams& params) {
    throw Error(Code::kUnimplemented,
                "sandbox " + params.id + ": this backend cannot take sandboxes over after an agent restart");
  }
  // Releases what sandbox `id` of an earlier run of this agent left behind (its processes, cgroups, run
  // directory). The agent calls it at start-up for each sandbox of its on-disk records that it does not take over
  // (a create or destroy the old agent left half done, a sandbox that died or could not be adopted). Idempotent.
  virtual void remove_leftovers(const std::string& id) {}
  // Called once at start-up after the earlier run's sandboxes were taken over (or found gone): what a backend does
  // on its own from then on (pools that fill) starts here, so it cannot take what a sandbox still to be adopted holds.
  virtual void start_background() {}
  // Called once at agent shutdown, after every sandbox was destroyed: release pools and pre-made resources.
  virtual void shutdown() {}
};

}  // namespace dsec::agent
