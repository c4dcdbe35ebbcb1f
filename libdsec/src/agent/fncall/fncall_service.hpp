// The fncall backend (docs/fncall.md): function calls served from warm pools of fork servers. The agent's router
// hands it decoded requests (POST /v1/fncall, /v1/fncall/batch) and encodes what it returns or throws; it never
// sees HTTP or JSON.
//
// Pools are per (image, language): those of the node's default image keep their minimum of servers (and those named
// in `warm` start with the agent); pools of other images start on a call's first use and go once idle. GPUs are
// handed out by a FIFO allocator, exclusive or in shares.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "agent/config.hpp"
#include "agent/fncall/gpu_allocator.hpp"
#include "agent/fncall/pool.hpp"
#include "agent/images/image_source.hpp"
#include "dsec/error.hpp"
#include "dsec/fncall.hpp"

namespace dsec::agent::fncall {

struct FnCallStatus {
  std::vector<std::string> languages;  // served by this node
  std::string default_image;
  std::vector<PoolStatus> pools;
  std::vector<GpuUsage> gpus;
  std::uint32_t gpu_shares = 0;
  std::size_t gpus_free = 0;
};

struct FnCallServiceOptions {
  FnCallConfig config;
  std::string node_id;
  std::string cgroup_name;        // the agent's; fncall's groups live under "<cgroup_name>-fncall"
  std::filesystem::path run_dir;  // the agent's; fncall's servers live under <run_dir>/fncall
  unsigned cores = 1;
  // The node's user namespaces: each fork server gets one of its own when they are enabled.
  std::shared_ptr<container::UserNamespaces> userns;
};

// One element of a batch: a request, or why its element could not be decoded.
struct BatchCall {
  std::optional<FnCallRequest> request;
  std::string image_manifest;
  std::optional<Error> error;
};

struct BatchOutcome {
  std::optional<FnCallResult> result;
  std::optional<Error> error;
};

class FnCallService {
 public:
  using Clock = std::chrono::steady_clock;

  // Checks the configuration (INVALID_ARGUMENT naming the flag's setting); starts nothing yet.
  FnCallService(FnCallServiceOptions options, ImageSource& images);
  ~FnCallService();
  FnCallService(const FnCallService&) = delete;
  FnCallService& operator=(const FnCallService&) = delete;

  // Starts the maintenance thread and the warm pools (in the background: the agent does not wait for them).
  void start();
  // Runs one call. `image_manifest` is the manifest of a pinned image as the client resolved it (optional).
  FnCallResult run(const FnCallRequest& request, std::string_view image_manifest = {});
  // Runs a batch concurrently; outcomes in the order of the calls.
  std::vector<BatchOutcome> run_batch(std::vector<BatchCall> calls);
  FnCallStatus status() const;
  // Kills every fork server and removes what they used (cgroups, run directories). Idempotent.
  void shutdown();

 private:
  // Pools are per pinned name, not per digest alone: a digest pinned to another name is resolved (and refused)
  // rather than answered with the pool of the image it belongs to.
  struct PoolKey {
    std::string image;  // "name:tag@sha256:..."
    std::string language;
    bool operator<(const PoolKey& o) const { return std::tie(image, language) < std::tie(o.image, o.language); }
  };
  struct Named {
    std::string digest;
    Clock::time_point until;
  };
  struct Pending {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::optional<FnCallResult> result;
    std::optional<Error> error;
  };

  Runtime& runtime();  // made on first use
  std::shared_ptr<Pool> pool_for(const std::string& image, std::string_view manifest, const std::string& language);
  FnCallResult run_uncached(const FnCallRequest& request, std::string_view image_manifest);
  void maintenance_loop();
  void prune_ids_locked(Clock::time_point now);

  FnCallServiceOptions options_;
  ImageSource& images_;
  std::shared_ptr<GpuAllocator> gpus_;

  std::mutex runtime_mu_;
  std::unique_ptr<Runtime> runtime_;
  std::unique_ptr<Workers> starts_, arms_, cleanup_;

  mutable std::mutex pools_mu_;
  std::map<PoolKey, std::shared_ptr<Pool>> pools_;
  std::set<PoolKey> default_pools_;     // pools of the default image: kept at their minimum
  std::map<std::string, Named> names_;  // image name -> the digest it resolved to, for a few seconds
  bool shut_ = false;

  std::mutex ids_mu_;
  std::unordered_map<std::string, std::shared_ptr<Pending>> ids_;
  std::deque<std::pair<std::string, Clock::time_point>> id_order_;

  std::mutex maintenance_mu_;
  std::condition_variable maintenance_cv_;
  bool stopping_ = false;
  std::thread maintenance_;
  std::thread warm_;  // starts the warm pools
};

}  // namespace dsec::agent::fncall
