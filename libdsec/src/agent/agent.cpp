#include "agent/agent.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>

#include <fmt/format.h>

#include "agent/backends/container/container_backend.hpp"
#include "agent/backends/container/user_namespace.hpp"
#include "agent/backends/null/null_backend.hpp"
#include "agent/backends/qemu/qemu_backend.hpp"
#include "agent/fncall/fncall_service.hpp"
#include "agent/network/node_network.hpp"
#include "agent/node/qos/ksm.hpp"
#include "agent/node/qos/usage_overcommit.hpp"
#include "common/log.hpp"
#include "common/syscall.hpp"
#include "dsec/version.hpp"

namespace dsec::agent {

bool valid_node_id(std::string_view id) noexcept {
  if (id.empty() || id.size() > 64) return false;
  for (char c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

QemuTierNodeInfo Agent::QemuTier::node_info() const {
  QemuTierNodeInfo n;
  if (!backend) {
    n.unavailable = unavailable;
    return n;
  }
  QemuTierStatus m = backend->status();
  n.offered = true;
  n.ready = m.ready;
  n.unavailable = m.unavailable;
  n.accelerator = m.accelerator;
  n.accelerator_reason = m.accelerator_reason;
  n.kernel = m.kernel;
  n.vms = m.vms;
  n.pool_size = m.pool_size;
  n.pool_ready = m.pool_ready;
  n.pool_claims = m.pool_claims;
  n.pool_misses = m.pool_misses;
  n.templates = m.templates;
  n.template_bytes = m.template_bytes;
  return n;
}

std::map<std::string, std::unique_ptr<Backend>, std::less<>> make_backends(
    const AgentConfig& config, const std::shared_ptr<container::UserNamespaces>& userns,
    const std::shared_ptr<network::NodeNetwork>& network, std::vector<container::WarmShape> warm_pools) {
  std::map<std::string, std::unique_ptr<Backend>, std::less<>> out;
  if (config.backends.empty()) throw Error(Code::kInvalidArgument, "backends: the agent needs at least one backend");
  for (const auto& name : config.backends) {
    if (out.count(name) || name == "fncall" || name == "microvm" || name == "vm") continue;
    if (name == "container")
      out.emplace(name, make_container_backend(config, userns, network, std::exchange(warm_pools, {})));
    else if (name == "null") out.emplace(name, make_null_backend());
    else
      throw Error(Code::kInvalidArgument,
                  fmt::format("backends: unknown backend '{}' (known: container, microvm, vm, null, fncall)", name));
  }
  return out;
}

namespace {

// Who may call, from the config, checked before anything starts: a TCP listener speaks TLS unless told not to, and
// one with TLS must know its callers (tokens or client certificates). Loads the TLS context into `tls`.
AccessPolicy access_policy(const AgentConfig& c, std::shared_ptr<auth::TlsServerContext>& tls) {
  const bool tls_asked = !c.tls_cert.empty() || !c.tls_key.empty() || !c.tls_client_ca.empty();
  if (tls_asked && (c.tls_cert.empty() || c.tls_key.empty()))
    throw Error(Code::kInvalidArgument, "TLS needs both --tls-cert and --tls-key");
  if (tls_asked && c.insecure_no_tls)
    throw Error(Code::kInvalidArgument, "--insecure-no-tls contradicts --tls-cert/--tls-key");
  if (tls_asked && c.tcp_listen.empty())
    throw Error(Code::kInvalidArgument, "--tls-cert/--tls-key secure the TCP listener: give --listen too");
  AccessPolicy access;
  if (!c.tokens_file.empty()) access.tokens = std::make_shared<auth::TokenTable>(auth::TokenTable::load(c.tokens_file));
  else if (c.tokens_on_unix) throw Error(Code::kInvalidArgument, "--tokens-on-unix needs --tokens FILE");
  access.tokens_on_unix = c.tokens_on_unix;
  if (!c.tcp_listen.empty()) {
    if (!tls_asked && !c.insecure_no_tls)
      throw Error(Code::kInvalidArgument,
                  "--listen on TCP needs TLS (--tls-cert FILE --tls-key FILE) and callers it knows (--tokens FILE "
                  "or --tls-client-ca FILE); --insecure-no-tls serves plain HTTP (for tests and trusted networks "
                  "only)");
    if (tls_asked) {
      tls = auth::TlsServerContext::load(c.tls_cert, c.tls_key, c.tls_client_ca);
      if (!access.tokens && !tls->requires_client_certificate())
        throw Error(Code::kInvalidArgument,
                    "TLS alone lets anyone who reaches --listen control this node: give --tokens FILE or "
                    "--tls-client-ca FILE");
    } else if (!access.tokens) {
      log_warn("--insecure-no-tls without --tokens: anyone who reaches {} controls this node", c.tcp_listen);
    }
  }
  std::filesystem::path audit = c.audit_log;
  if (audit.empty() && access.tokens) audit = c.home / "audit" / "dsecd.log";
  if (!audit.empty()) access.audit = std::make_shared<auth::AuditLog>(audit);
  if (access.tokens)
    log_info("tokens: {} from {}{}", access.tokens->size(), c.tokens_file.string(),
             c.tokens_on_unix ? " (the unix socket asks for them too)" : "");
  return access;
}

}  // namespace

namespace {

// The config's own checks, before anything is made (INVALID_ARGUMENT naming the setting). Fills in the node id from
// the host name when none is given.
void check_config(AgentConfig& config) {
  if (config.node_id.empty()) {
    char host[HOST_NAME_MAX + 1] = {};
    if (::gethostname(host, sizeof host - 1) == 0) config.node_id = host;
  }
  if (!valid_node_id(config.node_id))
    throw Error(Code::kInvalidArgument,
                fmt::format("node id '{}': use 1 to 64 letters, digits, '-', '_' or '.'", config.node_id));
  if (config.max_connections == 0) throw Error(Code::kInvalidArgument, "max_connections must be at least 1");
  if (!(config.cpu_overcommit > 0) || !(config.memory_overcommit > 0))
    throw Error(Code::kInvalidArgument, "overcommit ratios must be positive");
  if (config.memory_overcommit_ceiling != 0 && config.memory_overcommit_ceiling < config.memory_overcommit)
    throw Error(Code::kInvalidArgument,
                fmt::format("memory overcommit ceiling {} is below the memory overcommit {}: it can only go further",
                            config.memory_overcommit_ceiling, config.memory_overcommit));
  if (!config.advertise.empty() && config.advertise.rfind("http://", 0) != 0 &&
      config.advertise.rfind("https://", 0) != 0 && config.advertise.rfind("unix:", 0) != 0)
    throw Error(Code::kInvalidArgument, fmt::format("advertised endpoint '{}': use http://host:port, https://host:port "
                                                    "or unix:/path",
                                                    config.advertise));
}

// The home holds every tenant's images and snapshots (the store), the layer cache and the sandboxes' records: an
// agent running as root keeps it to root, so that a process of another uid on the node (QEMU's, after an escape
// from its guest; it reads its VM's files through descriptors the agent opened, never by path) can open nothing
// there.
void close_home(const std::filesystem::path& home) {
  struct stat st {};
  if (::geteuid() != 0 || ::stat(home.c_str(), &st) != 0 || st.st_uid != 0 || (st.st_mode & 0077) == 0) return;
  if (::chmod(home.c_str(), st.st_mode & 07700) != 0)
    throw_errno_fmt(errno, "home {}: keep it to root (chmod go-rwx)", home.string());
}

}  // namespace

Agent::Agent(AgentConfig config, AgentParts parts) : config_(std::move(config)) {
  check_config(config_);
  std::error_code ec;
  std::filesystem::create_directories(config_.home, ec);
  if (ec) throw Error(Code::kFailedPrecondition, fmt::format("home {}: {}", config_.home.string(), ec.message()));
  close_home(config_.home);
  AccessPolicy access = access_policy(config_, tls_);

  if (!config_.swap_file.empty() || config_.zram_bytes > 0) {
    SwapOptions swap;
    swap.file = config_.swap_file;
    swap.file_bytes = config_.swap_file_bytes;
    swap.zram_bytes = config_.zram_bytes;
    swap.zram_algorithm = config_.zram_algorithm;
    swap_ = std::make_unique<NodeSwap>(swap);
    for (const auto& line : swap_->summary()) log_info("{}", line);
  }

  // Classes of service: a --latency-cpus the node cannot honour stops the start, with the arithmetic.
  kernel_qos_ = qos::probe_kernel_qos();
  latency_cpus_ = qos::resolve_cpu_reservation(config_.latency_cpus, kernel_qos_);

  capacity_ = parts.capacity ? *parts.capacity : probe_host();
  set_up_images(parts);
  set_up_shared_parts();
  set_up_backends(parts);
  set_up_registry();
  set_up_api(std::move(access));
}

void Agent::set_up_images(AgentParts& parts) {
  if (parts.images) {
    images_ = std::move(parts.images);
    return;
  }
  ImageSourceOptions images;
  images.stores = config_.stores;
  if (images.stores.empty()) images.stores.push_back((config_.home / "store").string());
  images.cache_dir = config_.layer_cache_dir.empty() ? config_.home / "cache" / "layers" : config_.layer_cache_dir;
  images.cache_bytes = config_.layer_cache_bytes;
  images.layer_mode = config_.layer_mode;
  images.mount_dir = config_.run_dir / ".layers";
  RegistryImportOptions registry;
  registry.registry = image::registry::registry_options(config_.registry);
  registry.default_registry = config_.default_registry;
  registry.tag_ttl = config_.registry_tag_ttl;
  registry.wait = config_.registry_import_wait;
  registry.work_dir = config_.run_dir / ".imports";
  images.registry = std::move(registry);
  images_ = make_layered_image_source(images, metrics_.layers());
}

bool Agent::serves(std::string_view kind) const {
  return std::find(config_.backends.begin(), config_.backends.end(), kind) != config_.backends.end();
}

// What backends share: the node's user namespaces, its sandbox networks, and the function-call service.
void Agent::set_up_shared_parts() {
  if (serves("container") || serves("fncall")) {
    container::UsernsOptions u;
    u.mode = config_.userns;
    u.first = config_.userns_first;
    u.blocks = config_.userns_blocks;
    u.claims_dir = config_.userns_claims_dir;
    u.run_dir = config_.run_dir;
    userns_ = std::make_shared<container::UserNamespaces>(std::move(u));
    log_info("user namespaces: {}", userns_->describe());
  }
  if (serves("container") || serves("vm")) {  // full VMs take ports for their VNC screens
    network::NodeNetworkOptions n;
    n.range = config_.network_range;
    n.egress_deny = config_.egress_deny;
    n.allow_open = config_.allow_open_egress;
    n.dns_upstream = config_.dns_upstream;
    n.expose_first = config_.expose_first;
    n.expose_last = config_.expose_last;
    n.expose_host = config_.expose_host;
    n.table = "dsec_" + config_.cgroup_name;
    n.run_dir = config_.run_dir;
    network_ = std::make_shared<network::NodeNetwork>(std::move(n));
    metrics_.add_source(
        [network = network_](std::string& out) { Metrics::render_network_usage(out, network->usage_of_all()); });
  }
  if (serves("fncall")) {
    fncall::FnCallServiceOptions fo;
    fo.userns = userns_;
    fo.config = config_.fncall;
    fo.node_id = config_.node_id;
    fo.cgroup_name = config_.cgroup_name;
    fo.run_dir = config_.run_dir;
    fo.cores = capacity_.cores;
    fncall_ = std::make_unique<fncall::FnCallService>(std::move(fo), *images_);
  }
}

void Agent::set_up_backends(AgentParts& parts) {
  const bool backends_from_config = parts.backends.empty();
  backends_ =
      backends_from_config ? make_backends(config_, userns_, network_, warm_shapes()) : std::move(parts.backends);
  // A node without QEMU (or, for microVMs, a guest kernel) still serves its other backends; GET /v1/node says why
  // not these.
  auto add_qemu_tier = [&](const char* kind, QemuTier& tier, auto make) {
    if (!backends_from_config || !serves(kind)) return;
    try {
      auto backend = make(config_);
      tier.backend = backend.get();
      backends_.emplace(kind, std::move(backend));
    } catch (const Error& e) {
      tier.unavailable = e.what();
      log_warn("{} backend not offered: {}", kind, tier.unavailable);
    }
  };
  add_qemu_tier("microvm", microvm_, make_microvm_backend);
  add_qemu_tier("vm", vm_, [this](const AgentConfig& c) { return make_vm_backend(c, network_); });
  cgroup_version_ = "none";
  if (backends_.count("container") || fncall_) {
    cgroup_version_ = container_cgroup_version();
    cgroup_cpu_idle_ = container_cgroup_cpu_idle(config_.cgroup_name);
  }
}

// The registry over the backends, what it takes over from an earlier run, then the backends' background work and
// the cold-memory reclaimer.
void Agent::set_up_registry() {
  RegistryOptions options;
  options.node_id = config_.node_id;
  options.state_dir = config_.state_dir.empty() ? config_.home / "state" / "sandboxes" : config_.state_dir;
  options.cores = capacity_.cores;
  options.memory_bytes = capacity_.memory_bytes;
  options.cpu_overcommit = config_.cpu_overcommit;
  options.memory_overcommit = config_.memory_overcommit;
  options.node_labels = config_.labels;
  options.tenant_quotas = config_.tenant_quotas;
  options.gpus = 0;  // no GPU backend yet: the node hands out none
  options.on_fork_snapshot_unused = [this](const std::string& snapshot) {
    if (snapshots_) snapshots_->release_fork_snapshot(snapshot);
  };
  Registry::Backends backends;
  for (const auto& [kind, backend] : backends_) backends.emplace(kind, backend.get());
  registry_ = std::make_unique<Registry>(std::move(options), std::move(backends), *images_, metrics_);
  if (config_.adopt_sandboxes) recovery_ = registry_->recover_earlier_run();
  else registry_->remove_leftovers_of_earlier_run();
  for (auto& [kind, backend] : backends_) backend->start_background();
  qos::ReclaimerOptions reclaim;
  reclaim.mode = config_.reclaim;
  reclaim.age = config_.reclaim_age;
  reclaim.have_swap = read_swap_totals().total_bytes > 0;
  reclaimer_ = std::make_unique<qos::ColdReclaimer>(*registry_, std::move(reclaim));
  metrics_.add_source([this](std::string& out) { render_cold_memory_metrics(out); });
}

// Snapshots, the router and the HTTP server in front of them.
void Agent::set_up_api(AccessPolicy access) {
  SnapshotOptions snapshots;
  snapshots.node_id = config_.node_id;
  snapshots.store = config_.snapshot_store;
  if (snapshots.store.empty())
    snapshots.store = config_.stores.empty() ? (config_.home / "store").string() : config_.stores.front();
  snapshots.staging_dir = config_.snapshot_staging_dir.empty() ? default_snapshot_staging_dir(config_.run_dir)
                                                               : config_.snapshot_staging_dir;
  snapshots.limits.max_file_bytes = config_.snapshot_max_bytes;
  snapshots_ = std::make_unique<Snapshots>(std::move(snapshots), *registry_, *images_);
  router_ = std::make_unique<Router>(
      *registry_, metrics_, [this] { return node_info(); }, snapshots_.get(), fncall_.get(), std::move(access));

  ServerOptions server;
  server.unix_socket = config_.unix_socket;
  server.tcp_listen = config_.tcp_listen;
  server.max_connections = config_.max_connections;
  server.max_header_bytes = config_.max_header_bytes;
  server.max_body_bytes = config_.max_body_bytes;
  server.idle_timeout = config_.idle_timeout;
  server.tls = tls_;
  // A caller without a valid token is answered from its header: no body of its is read.
  server.admit = [this](const HttpRequest& header, const Peer& peer) { return router_->admit(header, peer); };
  server_ = std::make_unique<Server>(
      std::move(server),
      [this](HttpRequest& r, ResponseStream& s, const Peer& peer) { return router_->handle(r, &s, peer); }, metrics_);
}

Agent::~Agent() {
  if (started_) stop();
}

void Agent::start() {
  server_->start();
  started_ = true;
  reaper_ = std::thread([this] { reaper_loop(); });
  reclaimer_->start();
  if (fncall_) fncall_->start();
  if (!config_.etcd_endpoints.empty()) {
    try {
      start_registration();
    } catch (...) {
      stop();
      throw;
    }
  }
}

void Agent::start_registration() {
  RegistrationOptions r;
  r.etcd_endpoints = config_.etcd_endpoints;
  r.etcd_ca_file = config_.etcd_ca_file.string();
  r.etcd_client_cert = config_.etcd_client_cert.string();
  r.etcd_client_key = config_.etcd_client_key.string();
  r.prefix = config_.etcd_prefix;
  r.node_id = config_.node_id;
  r.lease_ttl = config_.etcd_lease_ttl;
  r.stop_renewing_after = config_.etcd_stop_renewing_after;
  r.endpoint = config_.advertise;
  if (r.endpoint.empty()) {
    const std::string& bound = server_->tcp_endpoint();
    if (bound.empty())
      throw Error(Code::kInvalidArgument,
                  "etcd registration: the agent listens on no TCP address; give --listen "
                  "or --advertise with the URL clients should use");
    if (bound.rfind("0.0.0.0:", 0) == 0 || bound.rfind("[::]:", 0) == 0)
      throw Error(Code::kInvalidArgument, fmt::format("etcd registration: the agent listens on every address ({}); "
                                                      "give --advertise with the URL clients should use",
                                                      bound));
    r.endpoint = (tls_ ? "https://" : "http://") + bound;
  }
  std::function<std::string()> fncall_status;
  if (fncall_) fncall_status = [this] { return fncall_status_json(*fncall_); };
  registration_ = std::make_unique<Registration>(
      std::move(r), [this] { return node_info(); }, std::move(fncall_status));
  registration_->start();
}

void Agent::reaper_loop() {
  std::unique_lock lock(reaper_mutex_);
  while (!stopping_) {
    reaper_wake_.wait_for(lock, config_.reaper_interval, [&] { return stopping_; });
    if (stopping_) break;
    lock.unlock();
    registry_->reap();
    if (config_.memory_overcommit_ceiling > config_.memory_overcommit)
      registry_->set_memory_overcommit(
          qos::usage_overcommit({capacity_.memory_bytes, config_.memory_overcommit, config_.memory_overcommit_ceiling,
                                 memory_in_use(), registry_->load().memory_requested}));
    try {
      images_->prune();
    } catch (const std::exception& e) {
      log_warn("pruning image layers: {}", e.what());
    }
    lock.lock();
  }
}

void Agent::stop() {
  if (stopped_ || !started_) return;
  stopped_ = true;
  // Leave the cluster first, so that clients stop placing sandboxes here while the agent winds down.
  if (registration_) registration_->stop();
  stop_serving();
  std::size_t destroyed = registry_->destroy_all("agent shutdown");
  // Requests still running (an exec in a sandbox just destroyed ends now) finish and close their connections; a
  // create that was in flight may have added a sandbox meanwhile, so look once more.
  server_->wait_connections();
  destroyed += registry_->destroy_all("agent shutdown");
  registry_->forget_requests();
  if (destroyed > 0) log_info("destroyed {} sandboxes at shutdown", destroyed);
  if (fncall_) {
    try {
      fncall_->shutdown();
    } catch (const std::exception& e) {
      log_warn("fncall shutdown: {}", e.what());
    }
  }
  for (auto& [kind, backend] : backends_) {
    try {
      backend->shutdown();
    } catch (const std::exception& e) {
      log_warn("backend {} shutdown: {}", kind, e.what());
    }
  }
  // No sandbox is on a network now: the agent's table goes.
  if (network_) network_->shutdown();
  // No sandbox holds a layer now: unmount them all, and the layer file system.
  try {
    images_->shutdown();
  } catch (const std::exception& e) {
    log_warn("unmounting image layers: {}", e.what());
  }
  // No sandbox is left to use the swap the agent made: turn it off (its pages come back into RAM first).
  if (swap_) swap_->turn_off();
}

void Agent::stop_serving() {
  server_->stop_accepting();
  {
    std::lock_guard lock(reaper_mutex_);
    stopping_ = true;
  }
  reaper_wake_.notify_all();
  if (reaper_.joinable()) reaper_.join();
  reclaimer_->stop();
}

void Agent::leave() {
  if (stopped_ || !started_) return;
  stopped_ = true;
  stop_serving();
  log_info("leaving {} sandboxes running for the next start to take over", registry_->load().sandboxes);
}

NodeInfo Agent::node_info() const {
  NodeInfo n;
  n.id = config_.node_id;
  n.version = kVersion;
  n.protocol = kProtocolVersion;
  n.backends = registry_->kinds();
  if (fncall_) n.backends.push_back("fncall");
  n.cores = capacity_.cores;
  n.memory_bytes = capacity_.memory_bytes;
  try {
    DiskUsage disk = probe_disk(config_.home);
    n.disk_bytes = disk.total_bytes;
    n.disk_free_bytes = disk.free_bytes;
  } catch (const std::exception& e) {
    log_warn("{}", e.what());
  }
  NodeLoad load = registry_->load();
  n.sandboxes = load.sandboxes;
  n.cpu_requested = load.cpu_requested;
  n.memory_requested = load.memory_requested;
  n.gpus = registry_->options().gpus;
  n.gpus_free = n.gpus > load.gpus_requested ? n.gpus - load.gpus_requested : 0;
  n.labels = config_.labels;
  n.cpu_overcommit = config_.cpu_overcommit;
  n.memory_overcommit = registry_->memory_overcommit();
  n.cgroup_version = cgroup_version_;
  n.userns = userns_ ? userns_->describe() : "off (no container or fncall backend)";
  n.network = network_ ? network_->describe() : "none (no container backend)";
  try {
    n.images = images_->names();
  } catch (const std::exception& e) {
    log_warn("listing images: {}", e.what());
  }
  try {
    LayerStatus layers = images_->layer_status();
    n.layer_mode = std::move(layers.mode);
    n.cached_layers = std::move(layers.cached_layers);
  } catch (const std::exception& e) {
    log_warn("layer cache status: {}", e.what());
  }
  SwapTotals swap = read_swap_totals();
  n.swap_bytes = swap.total_bytes;
  n.swap_free_bytes = swap.free_bytes;
  n.load1 = load_average_1m();
  n.microvm = microvm_.node_info();
  n.vm = vm_.node_info();
  n.memory_used_bytes = memory_in_use();
  n.pressure = read_pressure();
  n.qos = qos_node_info();
  if (auto it = backends_.find("container"); it != backends_.end()) {
    PoolStats pool = it->second->pool_stats();
    n.warm_pool_size = pool.size;
    n.warm_pool_ready = pool.ready;
    n.warm_pool_claims = pool.claims;
    n.warm_pool_misses = pool.misses;
  }
  return n;
}

std::vector<container::WarmShape> Agent::warm_shapes() const {
  std::vector<container::WarmShape> out;
  if (config_.warm_pools.empty()) return out;
  if (std::find(config_.backends.begin(), config_.backends.end(), "container") == config_.backends.end())
    throw Error(Code::kInvalidArgument, "--warm-pool: pools are of container sandboxes, and this agent serves none");
  // All of them at once could not exceed what the node admits: the arithmetic, if they would.
  double cpu = 0, memory = 0;
  for (const WarmPoolConfig& p : config_.warm_pools) {
    cpu += p.resources.cpu * p.size;
    memory += static_cast<double>(p.resources.memory_bytes) * p.size;
  }
  const double cpu_limit = capacity_.cores * config_.cpu_overcommit;
  const double memory_limit = static_cast<double>(capacity_.memory_bytes) * config_.memory_overcommit;
  if (cpu > cpu_limit + 1e-9)
    throw Error(
        Code::kInvalidArgument,
        fmt::format("--warm-pool: the pools hold {:.2f} cores of sandboxes, above the node's {:.2f} ({} cores x "
                    "cpu overcommit {})",
                    cpu, cpu_limit, capacity_.cores, config_.cpu_overcommit));
  if (memory > memory_limit + 0.5)
    throw Error(Code::kInvalidArgument,
                fmt::format("--warm-pool: the pools hold {} MiB of sandboxes' memory limits, above the node's {} MiB "
                            "({} MiB x memory overcommit {})",
                            static_cast<std::uint64_t>(memory) >> 20, static_cast<std::uint64_t>(memory_limit) >> 20,
                            capacity_.memory_bytes >> 20, config_.memory_overcommit));
  for (const WarmPoolConfig& p : config_.warm_pools) {
    ResolvedImage image;
    try {
      image = images_->resolve(p.image);
    } catch (const Error& e) {
      throw Error(e.code() == Code::kNotFound ? Code::kInvalidArgument : e.code(),
                  fmt::format("--warm-pool {}: {}", p.image, e.what()));
    }
    out.push_back(container::WarmShape{p, std::move(image.layers), std::move(image.hold)});
    log_info("warm pool: {}", container::describe_warm_pool(p));
  }
  return out;
}

QosNodeInfo Agent::qos_node_info() const {
  QosNodeInfo q;
  q.core_scheduling = kernel_qos_.core_scheduling;
  q.core_scheduling_reason = kernel_qos_.core_scheduling_reason;
  q.latency_cpus = latency_cpus_.latency;
  q.cpu_idle = cgroup_cpu_idle_;
  qos::ReclaimerStatus reclaim = reclaimer_->status();
  q.reclaim = reclaim.mode;
  q.reclaim_reason = reclaim.reason;
  q.reclaimed_bytes = reclaim.reclaimed_bytes;
  q.ksm = kernel_qos_.memory_merge;
  qos::KsmStatus ksm = qos::ksm_status();
  q.ksm_sandboxes = ksm.holders;
  q.ksm_saved_bytes = ksm.saved_bytes;
  return q;
}

void Agent::render_cold_memory_metrics(std::string& out) const {
  qos::ReclaimerStatus reclaim = reclaimer_->status();
  out += fmt::format(
      "# HELP dsec_reclaimed_bytes_total Memory the cold-memory reclaimer released from idle sandboxes.\n"
      "# TYPE dsec_reclaimed_bytes_total counter\ndsec_reclaimed_bytes_total {}\n"
      "# HELP dsec_reclaims_total Reclaims of idle sandboxes (one sandbox in one round each).\n"
      "# TYPE dsec_reclaims_total counter\ndsec_reclaims_total {}\n",
      reclaim.reclaimed_bytes, reclaim.sandboxes_reclaimed);
  // Per sandbox, only those the reclaimer has touched (their refaults are read from the kernel).
  std::string reclaimed, refaults;
  for (const Registry::ColdMemoryUsage& u : registry_->cold_memory_usage()) {
    reclaimed += fmt::format("dsec_sandbox_reclaimed_bytes_total{{sandbox=\"{}\"}} {}\n", u.id, u.reclaimed_bytes);
    refaults += fmt::format("dsec_sandbox_refaults_total{{sandbox=\"{}\"}} {}\n", u.id, u.refaults);
  }
  out +=
      "# HELP dsec_sandbox_reclaimed_bytes_total Memory the reclaimer released from the sandbox.\n"
      "# TYPE dsec_sandbox_reclaimed_bytes_total counter\n" +
      reclaimed;
  out +=
      "# HELP dsec_sandbox_refaults_total Pages of the sandbox read back in after reclaim.\n"
      "# TYPE dsec_sandbox_refaults_total counter\n" +
      refaults;
}

}  // namespace dsec::agent
