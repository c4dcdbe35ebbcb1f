// A warm pool: the fork servers of one (image, language), each with a child armed for the next call, sized to load
// within [min, max] (pool_sizing.hpp). A call takes a server whose child is armed, runs on that child, and the
// server arms its next child at once, while the call runs. A server runs one call at a time, so calls that run at
// the same time are in different servers' sandboxes (their network namespaces, too).
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "agent/fncall/call.hpp"
#include "agent/fncall/fork_server.hpp"
#include "agent/fncall/workers.hpp"
#include "agent/images/image_source.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::fncall {

// The background threads pools hand their work to.
struct PoolWorkers {
  Workers& starts;   // starting fork servers (slow: a zygote imports its modules)
  Workers& arms;     // arming children (fast)
  Workers& cleanup;  // killing servers, removing calls' cgroups
};

struct PoolStatus {
  std::string image;  // pinned reference
  std::string language;
  std::size_t idle = 0;      // servers with a child armed and no call
  std::size_t busy = 0;      // servers running a call
  std::size_t starting = 0;  // servers starting or arming
  std::size_t waiting = 0;   // calls waiting for a server
  std::size_t min = 0, max = 0;
  std::uint64_t calls = 0;  // calls run so far
  std::string last_error;   // why the last server failed to start or arm, if one did
};

class Pool : public std::enable_shared_from_this<Pool> {
 public:
  using Clock = std::chrono::steady_clock;

  Pool(Runtime& runtime, PoolWorkers workers, std::string language, ResolvedImage image, std::size_t min,
       std::size_t max);
  ~Pool();

  // Runs one call: waits (until `queue_deadline`) for a server with an armed child, growing the pool up to its max.
  // RESOURCE_EXHAUSTED when the wait ends first or too many calls wait; the error of the servers' start when none
  // can start (e.g. FAILED_PRECONDITION for an image without python3).
  FnCallResult call(const FnCallRequest& request, const CallSettings& settings, Clock::time_point queue_deadline);

  // Starts and stops servers to fit the load, replaces dead ones. Called often (the service's maintenance thread).
  void maintain();
  // Starts servers up to the pool's minimum (or one, for a pool with no minimum).
  void warm();
  // Kills every server; later calls fail. Idempotent.
  void shutdown();

  PoolStatus status() const;
  const std::string& image() const noexcept { return image_.name; }
  // The image's configuration (registry images): its Env is every call's.
  const std::optional<image::ImageConfig>& image_config() const noexcept { return image_.config; }
  const std::string& language() const noexcept { return language_; }
  // No server, no call waiting or running, and idle since `since`: the service may drop a pool of a non-default
  // image then.
  bool unused_since(Clock::time_point since) const;

 private:
  struct Server {
    std::string id;
    std::unique_ptr<ForkServer> process;  // null while starting
    std::optional<Slot> armed;
    bool starting = true;
    bool arming = false;
    bool busy = false;
    bool dead = false;
    Clock::time_point idle_since = Clock::now();
  };
  using ServerPtr = std::shared_ptr<Server>;

  void adjust_locked();
  void start_server_locked();
  void arm_locked(const ServerPtr& server);
  void retire_locked(const ServerPtr& server);  // out of the list; killed in the background
  void on_started(const ServerPtr& server, std::unique_ptr<ForkServer> process);
  void on_start_failed(const ServerPtr& server, const Error& error);
  void arm_job(const ServerPtr& server);
  // The slot's child is ended and its cgroups removed, in the background; with its server, the groups are kept for
  // the server's next calls.
  void release_slot(Slot slot, const ServerPtr& server = nullptr);
  std::size_t live_locked() const;

  Runtime& rt_;
  PoolWorkers workers_;
  std::string language_;
  ResolvedImage image_;  // holds the layers mounted while the pool lives
  std::size_t min_, max_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<ServerPtr> servers_;
  std::size_t waiting_ = 0;
  std::size_t running_ = 0;
  std::uint64_t calls_ = 0;
  bool shut_ = false;
  // Starts that failed one after another (reset by a start that works); past a few, new starts back off.
  std::size_t start_failures_ = 0;
  Clock::time_point next_start_ = Clock::now();
  std::optional<Error> start_error_;
  std::string last_error_;
  Clock::time_point last_used_ = Clock::now();
};

}  // namespace dsec::agent::fncall
