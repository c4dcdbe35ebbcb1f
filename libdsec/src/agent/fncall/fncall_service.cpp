#include "agent/fncall/fncall_service.hpp"

#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/log.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"
#include "image/store/manifest.hpp"

namespace dsec::agent::fncall {
namespace {

namespace fs = std::filesystem;

// How long an image name is taken to mean the digest it last resolved to (a tag that moves is followed after this).
constexpr auto kNameFresh = std::chrono::seconds(5);
// A retried call (same request_id) gets the first one's result for this long; at most this many are kept.
constexpr auto kIdMemory = std::chrono::minutes(10);
constexpr std::size_t kMaxIds = 10000;
constexpr auto kMaintenanceInterval = std::chrono::milliseconds(250);
// Threads that run one batch's calls (each waits for a server of its pool in turn).
constexpr std::size_t kBatchThreads = 64;
constexpr const char* kPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

bool known_language(std::string_view l) {
  for (const char* k : protocol::kFnCallLanguages)
    if (l == k) return true;
  return false;
}

int read_cap_last_cap() {
  std::ifstream in("/proc/sys/kernel/cap_last_cap");
  int v = 40;
  in >> v;
  return v;
}

// The host's device nodes for the configured GPUs, and the driver's shared nodes; those the host lacks (a fake
// device list, a node without the driver) are left out: such calls get CUDA_VISIBLE_DEVICES alone.
std::vector<DeviceNode> find_gpu_nodes(const std::vector<std::string>& gpus) {
  std::vector<DeviceNode> out;
  if (gpus.empty()) return out;
  auto add = [&](const std::string& name) {
    struct stat st {};
    if (::stat(("/dev/" + name).c_str(), &st) == 0 && S_ISCHR(st.st_mode)) out.push_back({name, st.st_rdev});
  };
  for (const auto& g : gpus)
    if (!g.empty() && std::all_of(g.begin(), g.end(), ::isdigit)) add("nvidia" + g);
  for (const char* shared : {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"}) add(shared);
  return out;
}

bool has_node(const std::vector<DeviceNode>& nodes, const std::string& name) {
  return std::any_of(nodes.begin(), nodes.end(), [&](const DeviceNode& n) { return n.name == name; });
}

}  // namespace

FnCallService::FnCallService(FnCallServiceOptions options, ImageSource& images)
    : options_(std::move(options)), images_(images) {
  const FnCallConfig& c = options_.config;
  for (const auto& [language, b] : c.pools) {
    if (!known_language(language))
      throw Error(Code::kInvalidArgument,
                  fmt::format("fncall pools: '{}' is not a language (python, shell, c, cpp)", language));
    if (b.min > b.max)
      throw Error(Code::kInvalidArgument,
                  fmt::format("fncall pools: {}: min {} is above max {}", language, b.min, b.max));
  }
  for (const auto& language : c.warm) {
    auto it = c.pools.find(language);
    if (it == c.pools.end() || it->second.max == 0)
      throw Error(Code::kInvalidArgument,
                  fmt::format("fncall warm: '{}' is not a language this node serves", language));
  }
  if (!c.warm.empty() && c.default_image.empty())
    throw Error(Code::kInvalidArgument, "fncall warm: warm pools are of the default image; give --fncall-image");
  if (!c.default_image.empty()) {
    SandboxSpec probe;
    probe.image = c.default_image;
    try {
      protocol::validate(probe);
    } catch (const Error& e) {
      throw Error(Code::kInvalidArgument, fmt::format("fncall image: {}", e.what()));
    }
  }
  if (c.uid == 0 || c.gid == 0)
    throw Error(Code::kInvalidArgument, "fncall uid: calls must not run as root (uid and gid must not be 0)");
  gpus_ = GpuAllocator::make(c.gpus, c.gpu_shares);
}

FnCallService::~FnCallService() { shutdown(); }

Runtime& FnCallService::runtime() {
  std::lock_guard lock(runtime_mu_);
  if (runtime_) return *runtime_;
  auto rt = std::make_unique<Runtime>();
  rt->config = options_.config;
  rt->node_id = options_.node_id;
  rt->run_dir = options_.run_dir / "fncall";
  rt->cores = std::max(1u, options_.cores);
  rt->cap_last_cap = read_cap_last_cap();
  std::error_code ec;
  fs::create_directories(options_.run_dir, ec);
  // What an earlier run left (its servers died with it: their zygotes exit when the agent's end of their control
  // socket closes) goes first.
  fs::remove_all(rt->run_dir, ec);
  if (::mkdir(rt->run_dir.c_str(), 0700) != 0 && errno != EEXIST)
    throw_errno_fmt(errno, "mkdir {}", rt->run_dir.string());
  rt->cgroups = container::make_cgroup_driver(options_.cgroup_name + "-fncall", true);
  rt->cgroups->remove_empty_groups();
  rt->netns = std::make_unique<container::NetnsPool>(2);
  rt->server_filter = container::build_seccomp_program(false, true);
  container::SeccompProgram strict = container::build_seccomp_program(false);
  rt->call_filter_base64 = protocol::base64_encode(std::string_view(
      reinterpret_cast<const char*>(strict.instructions.data()), strict.instructions.size() * sizeof(sock_filter)));
  rt->gpu_nodes = find_gpu_nodes(options_.config.gpus);
  rt->userns = options_.userns;
  starts_ = std::make_unique<Workers>("server starts", 2);
  arms_ = std::make_unique<Workers>("arming", 4);
  cleanup_ = std::make_unique<Workers>("clean-up", 1);
  runtime_ = std::move(rt);
  return *runtime_;
}

void FnCallService::start() {
  // What an earlier run that crashed left (empty cgroups, run directories; its servers died with it) is removed now,
  // not at the first call.
  std::error_code ec;
  bool leftovers = fs::exists(options_.run_dir / "fncall", ec);
  const std::string subtree = options_.cgroup_name + "-fncall";
  for (const char* root : {"", "/pids", "/memory", "/cpu", "/cpuacct", "/freezer"})
    leftovers = leftovers || fs::exists(fs::path(std::string("/sys/fs/cgroup") + root) / subtree, ec);
  if (leftovers) {
    try {
      runtime();
    } catch (const std::exception& e) {
      log_warn("fncall: removing what an earlier run left: {}", e.what());
    }
  }
  maintenance_ = std::thread([this] { maintenance_loop(); });
  const FnCallConfig& c = options_.config;
  if (c.warm.empty()) return;
  // Resolving the image and starting the pools happens in the background: a slow store must not hold up the agent.
  warm_ = std::thread([this, warm = c.warm] {
    for (const auto& language : warm) {
      try {
        pool_for({}, {}, language)->warm();
      } catch (const std::exception& e) {
        log_warn("fncall: the warm {} pool of {} did not start: {}", language, options_.config.default_image, e.what());
      }
    }
  });
}

std::shared_ptr<Pool> FnCallService::pool_for(const std::string& requested, std::string_view manifest,
                                              const std::string& language) {
  const FnCallConfig& c = options_.config;
  const bool is_default = requested.empty() || requested == c.default_image;
  const std::string reference = requested.empty() ? c.default_image : requested;
  if (reference.empty())
    throw Error(Code::kFailedPrecondition,
                fmt::format("function call: no image given, and node {} has no default fncall image (dsecd "
                            "--fncall-image)",
                            options_.node_id));
  image::ImageReference ref = image::parse_reference(reference);
  auto now = Clock::now();
  std::string digest = ref.digest;
  {
    std::lock_guard lock(pools_mu_);
    if (shut_) throw Error(Code::kUnavailable, "function calls: the node is shutting down");
    if (digest.empty())
      if (auto it = names_.find(ref.tagged()); it != names_.end() && it->second.until > now) digest = it->second.digest;
    if (!digest.empty())
      if (auto it = pools_.find(PoolKey{ref.tagged() + "@" + digest, language}); it != pools_.end()) return it->second;
  }
  ResolvedImage image = images_.resolve(reference, manifest);
  digest = image::parse_reference(image.name).digest;
  Runtime& rt = runtime();
  std::lock_guard lock(pools_mu_);
  if (shut_) throw Error(Code::kUnavailable, "function calls: the node is shutting down");
  if (ref.digest.empty()) names_[ref.tagged()] = Named{digest, now + kNameFresh};
  PoolKey key{image.name, language};
  if (auto it = pools_.find(key); it != pools_.end()) return it->second;
  const FnCallConfig::Bounds bounds = c.pools.at(language);
  auto pool = std::make_shared<Pool>(rt, PoolWorkers{*starts_, *arms_, *cleanup_}, language, std::move(image),
                                     is_default ? bounds.min : 0, bounds.max);
  pools_.emplace(key, pool);
  if (is_default) default_pools_.insert(key);
  return pool;
}

FnCallResult FnCallService::run(const FnCallRequest& request, std::string_view image_manifest) {
  if (request.request_id.empty()) return run_uncached(request, image_manifest);
  std::shared_ptr<Pending> pending;
  bool first = false;
  {
    std::lock_guard lock(ids_mu_);
    auto now = Clock::now();
    prune_ids_locked(now);
    auto [it, inserted] = ids_.try_emplace(request.request_id);
    if (inserted) {
      it->second = std::make_shared<Pending>();
      id_order_.emplace_back(request.request_id, now);
      first = true;
    }
    pending = it->second;
  }
  if (!first) {
    std::unique_lock lock(pending->mu);
    pending->cv.wait(lock, [&] { return pending->done; });
    if (pending->result) return *pending->result;
    throw *pending->error;
  }
  std::optional<FnCallResult> result;
  std::optional<Error> error;
  try {
    result = run_uncached(request, image_manifest);
  } catch (const Error& e) {
    error = e;
  } catch (const std::exception& e) {
    error = Error(Code::kInternal, e.what());
  }
  if (error) {
    // A call that could not run is not remembered: its retry runs it.
    std::lock_guard lock(ids_mu_);
    if (auto it = ids_.find(request.request_id); it != ids_.end() && it->second == pending) ids_.erase(it);
  }
  {
    std::lock_guard lock(pending->mu);
    pending->done = true;
    pending->result = result;
    pending->error = error;
  }
  pending->cv.notify_all();
  if (error) throw *error;
  return std::move(*result);
}

void FnCallService::prune_ids_locked(Clock::time_point now) {
  while (!id_order_.empty() && (id_order_.size() > kMaxIds || now - id_order_.front().second > kIdMemory)) {
    auto it = ids_.find(id_order_.front().first);
    if (it != ids_.end()) {
      bool done;
      {
        std::lock_guard lock(it->second->mu);
        done = it->second->done;
      }
      if (!done && id_order_.size() <= kMaxIds) break;  // still running: keep it (and what came after)
      ids_.erase(it);
    }
    id_order_.pop_front();
  }
}

FnCallResult FnCallService::run_uncached(const FnCallRequest& request, std::string_view image_manifest) {
  const FnCallConfig& c = options_.config;
  auto bounds = c.pools.find(request.language);
  if (bounds == c.pools.end() || bounds->second.max == 0)
    throw Error(Code::kFailedPrecondition,
                fmt::format("language: node {} does not serve '{}' function calls (it serves: {})", options_.node_id,
                            request.language, fmt::join(status().languages, ", ")));
  auto started = Clock::now();
  auto timeout = std::chrono::microseconds(static_cast<std::int64_t>(request.timeout_seconds * 1e6));
  GpuGrant grant = gpus_->acquire(request.gpu_mode, request.gpus, started + timeout);
  std::shared_ptr<Pool> pool = pool_for(request.image, image_manifest, request.language);

  CallSettings settings;
  settings.language = request.language;
  settings.env = {{"PATH", kPath}, {"HOME", "/tmp"}, {"TMPDIR", "/tmp"}, {"LANG", "C.UTF-8"}};
  // A registry image's Env (a PATH into its conda environment, say) over those, the call's own over both.
  if (const auto& config = pool->image_config())
    for (const auto& entry : config->env)
      if (auto eq = entry.find('='); eq != std::string::npos && eq > 0)
        settings.env[entry.substr(0, eq)] = entry.substr(eq + 1);
  for (const auto& [k, v] : request.env) settings.env[k] = v;
  if (!grant.empty()) {
    settings.env["CUDA_VISIBLE_DEVICES"] = fmt::format("{}", fmt::join(grant.devices(), ","));
    const auto& nodes = runtime().gpu_nodes;
    for (const auto& d : grant.devices())
      if (has_node(nodes, "nvidia" + d)) settings.device_nodes.push_back("nvidia" + d);
    if (!settings.device_nodes.empty())
      for (const char* shared : {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"})
        if (has_node(nodes, shared)) settings.device_nodes.push_back(shared);
  }
  settings.compile_timeout_seconds = static_cast<double>(c.compile_timeout.count());
  settings.compile_memory_bytes = c.compile_memory_bytes;
  FnCallResult result = pool->call(request, settings, Clock::now() + c.queue_wait);
  result.gpus = grant.devices();
  result.node = options_.node_id;
  return result;
}

std::vector<BatchOutcome> FnCallService::run_batch(std::vector<BatchCall> calls) {
  std::vector<BatchOutcome> out(calls.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i = next.fetch_add(1); i < calls.size(); i = next.fetch_add(1)) {
      BatchCall& call = calls[i];
      if (call.error) {
        out[i].error = std::move(call.error);
        continue;
      }
      try {
        out[i].result = run(*call.request, call.image_manifest);
      } catch (const Error& e) {
        out[i].error = e;
      } catch (const std::exception& e) {
        out[i].error = Error(Code::kInternal, e.what());
      }
    }
  };
  std::size_t threads = std::min(calls.size(), kBatchThreads);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (std::size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  return out;
}

FnCallStatus FnCallService::status() const {
  FnCallStatus st;
  for (const auto& [language, b] : options_.config.pools)
    if (b.max > 0) st.languages.push_back(language);
  st.default_image = options_.config.default_image;
  {
    std::lock_guard lock(pools_mu_);
    for (const auto& [key, pool] : pools_) st.pools.push_back(pool->status());
  }
  st.gpus = gpus_->usage();
  st.gpu_shares = gpus_->shares_per_gpu();
  st.gpus_free = gpus_->free_gpus();
  return st;
}

void FnCallService::maintenance_loop() {
  std::unique_lock lock(maintenance_mu_);
  while (!stopping_) {
    maintenance_cv_.wait_for(lock, kMaintenanceInterval, [&] { return stopping_; });
    if (stopping_) break;
    lock.unlock();
    std::vector<std::shared_ptr<Pool>> pools, unused;
    {
      std::lock_guard pl(pools_mu_);
      auto idle_before = Clock::now() - options_.config.idle_timeout;
      for (auto it = pools_.begin(); it != pools_.end();) {
        if (!default_pools_.count(it->first) && it->second->unused_since(idle_before)) {
          unused.push_back(it->second);
          it = pools_.erase(it);
        } else {
          pools.push_back(it->second);
          ++it;
        }
      }
    }
    for (auto& p : pools) {
      try {
        p->maintain();
      } catch (const std::exception& e) {
        log_warn("fncall: pool of {} ({}): {}", p->image(), p->language(), e.what());
      }
    }
    for (auto& p : unused) p->shutdown();  // releases the image's layers with the pool
    unused.clear();
    {
      std::lock_guard ids(ids_mu_);
      prune_ids_locked(Clock::now());
    }
    lock.lock();
  }
}

void FnCallService::shutdown() {
  {
    std::lock_guard lock(maintenance_mu_);
    stopping_ = true;
  }
  maintenance_cv_.notify_all();
  if (maintenance_.joinable()) maintenance_.join();
  if (warm_.joinable()) warm_.join();
  std::map<PoolKey, std::shared_ptr<Pool>> pools;
  {
    std::lock_guard lock(pools_mu_);
    if (shut_) return;
    shut_ = true;
    pools.swap(pools_);
  }
  for (auto& [key, pool] : pools) pool->shutdown();
  std::lock_guard lock(runtime_mu_);
  if (!runtime_) return;
  starts_->stop();
  arms_->stop();
  cleanup_->stop();
  pools.clear();
  runtime_->netns.reset();
  try {
    runtime_->cgroups->remove_empty_groups();
    runtime_->cgroups->remove_subtree_if_empty();
  } catch (const std::exception& e) {
    log_warn("fncall: removing cgroups at shutdown: {}", e.what());
  }
  std::error_code ec;
  fs::remove_all(runtime_->run_dir, ec);
}

}  // namespace dsec::agent::fncall
