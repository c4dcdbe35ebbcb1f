#include "agent/backends/qemu/qemu_backend.hpp"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "agent/backends/command/exec_command.hpp"
#include "agent/backends/container/cgroup.hpp"
#include "agent/backends/container/process_identity.hpp"
#include "agent/backends/qemu/accelerator.hpp"
#include "agent/backends/qemu/initramfs.hpp"
#include "agent/backends/qemu/microvm/guest_kernel.hpp"
#include "agent/backends/qemu/qemu_sandbox.hpp"
#include "agent/backends/qemu/vm/image_kernel.hpp"
#include "agent/backends/qemu/vm_instance.hpp"
#include "agent/backends/qemu/vm_pool.hpp"
#include "agent/backends/qemu/vm_record.hpp"
#include "agent/backends/qemu/vm_template.hpp"
#include "agent/backends/qemu/writable_disk.hpp"
#include "agent/node/host.hpp"
#include "common/log.hpp"
#include "common/syscall.hpp"

#include <sys/syscall.h>

namespace dsec::agent {
namespace qemu {
namespace {

namespace fs = std::filesystem;
namespace gp = guest_protocol;
namespace key = qemu::record_key;

constexpr std::uint64_t kMinGuestMemory = 128ull << 20;
constexpr std::uint64_t kProbeMemory = 128ull << 20;
constexpr std::uint64_t kMinSystemMemory = 256ull << 20;  // systemd and its services

// Run in a full VM before it is handed out (QemuBackendImpl::wait_system_started); exits 0 once it has started.
constexpr const char* kWaitSystemStarted = R"sh(
state=$(systemctl is-system-running --wait 2>&1)
case "$state" in running|degraded) ;; *) echo "systemd: $state"; exit 1;; esac
[ -f /etc/dsec/ready-files ] || exit 0
while read -r f; do
  case "$f" in /*) ;; *) continue;; esac
  while [ ! -e "$f" ]; do sleep 0.2; done
done < /etc/dsec/ready-files
)sh";

std::string find_on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  dirs += ":/usr/bin:/usr/local/bin";
  std::size_t pos = 0;
  while (pos <= dirs.size()) {
    auto next = dirs.find(':', pos);
    if (next == std::string::npos) next = dirs.size();
    std::string dir = dirs.substr(pos, next - pos);
    if (!dir.empty()) {
      fs::path candidate = fs::path(dir) / name;
      if (::access(candidate.c_str(), X_OK) == 0) return candidate.string();
    }
    pos = next + 1;
  }
  return {};
}

// The QEMU to run, "" when there is none (a configured path that is not an executable counts as none).
std::string qemu_binary(const QemuTierConfig& config) {
  if (!config.qemu.empty()) return ::access(config.qemu.c_str(), X_OK) == 0 ? config.qemu.string() : std::string();
  return find_on_path("qemu-system-x86_64");
}

fs::path init_binary(const AgentConfig& config) {
  if (!config.init_binary.empty()) return config.init_binary;
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  return self.parent_path() / "dsec-init";
}

class QemuBackendImpl final : public QemuBackend {
 public:
  QemuBackendImpl(const AgentConfig& config, Tier tier, std::shared_ptr<network::NodeNetwork> network = nullptr)
      : shared_(config, tier),
        pool_(shared_.settings.templates ? shared_.settings.pool_size : 0, shared_.settings.pool_idle) {
    const QemuTierConfig& settings = shared_.settings;
    shared_.network = std::move(network);
    if (::geteuid() != 0)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("the {} backend needs root (cgroups, uids for QEMU)", shared_.kind));
    shared_.qemu = qemu_binary(settings);
    if (shared_.qemu.empty())
      throw Error(Code::kFailedPrecondition,
                  settings.qemu.empty()
                      ? fmt::format("the {} backend needs qemu-system-x86_64 (Debian package qemu-system-x86; "
                                    "scripts/install-deps.sh)",
                                    shared_.kind)
                      : fmt::format("the {} backend needs QEMU: {} is not an executable", shared_.kind,
                                    settings.qemu.string()));
    if (!full_system()) shared_.kernel = microvm::find_guest_kernel(settings.kernel);
    fs::path init = init_binary(config);
    if (::access(init.c_str(), R_OK) != 0)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("the {} backend needs dsec-init at {}", shared_.kind, init.string()));
    shared_.init_binary = init;
    shared_.work_dir = config.run_dir / ("." + shared_.kind);
    fs::create_directories(shared_.work_dir);
    // Templates of an earlier run: VMs started from them (taken over after a restart) hold their RAM themselves.
    std::error_code ec;
    fs::remove_all(shared_.data_dir / "templates", ec);
    fs::remove_all(shared_.data_dir / "forks", ec);
    fs::create_directories(shared_.data_dir);
    ::chmod(shared_.data_dir.c_str(), 0700);
    if (!full_system()) {
      shared_.initramfs = shared_.work_dir / "initramfs.cpio";
      qemu::write_initramfs(shared_.initramfs, init, microvm::guest_module_files(shared_.kernel));
      ::chmod(shared_.initramfs.c_str(), 0644);
    }
    shared_.tsc_khz = static_cast<std::uint32_t>(qemu::host_tsc_khz());
    shared_.cgroups = container::make_cgroup_driver(config.cgroup_name);
    shared_.kernel_qos = qos::probe_kernel_qos();
    shared_.cpus = qos::resolve_cpu_reservation(config.latency_cpus, shared_.kernel_qos);
    if (!shared_.cpus.empty()) shared_.cgroups->reserve_cpus(shared_.cpus.latency, shared_.cpus.shared);
    remove_pool_leftovers(shared_);
    HostCapacity host = probe_host();
    shared_.host_cores = std::max<std::uint32_t>(1, host.cores);
    shared_.host_memory = host.memory_bytes;
    shared_.templates.set_budget(settings.template_memory_bytes ? settings.template_memory_bytes
                                                                : shared_.host_memory / 4);
    {
      std::lock_guard lock(mu_);
      status_.kernel = shared_.kernel.release;
    }
    prober_ = std::thread([this] { probe(); });
  }

  ~QemuBackendImpl() override {
    pool_.stop();  // its filler runs this object's code
    stopping_ = true;
    if (prober_.joinable()) prober_.join();
  }

  std::string_view kind() const override { return shared_.kind; }

  QemuTierStatus status() const override {
    std::lock_guard lock(mu_);
    QemuTierStatus s = status_;
    s.vms = shared_.vms.load();
    VmPoolStatus pool = pool_.status();
    s.pool_size = pool.size;
    s.pool_ready = pool.ready;
    s.pool_shapes = pool.shapes;
    s.pool_claims = pool.claims;
    s.pool_misses = pool.misses;
    s.pool_failures = pool.failures;
    s.templates = static_cast<std::uint32_t>(shared_.templates.size());
    s.template_bytes = shared_.templates.bytes();
    s.template_evictions = shared_.templates.evictions();
    return s;
  }

  std::unique_ptr<BackendSandbox> create(const CreateParams& params) override {
    const auto started = Clock::now();
    wait_probe(started + shared_.settings.boot_timeout);
    const SandboxSpec& spec = params.spec;
    check_creatable(params);
    const qemu::DisplaySpec display = display_for(spec);
    // A full VM boots its image's own kernel: found in the image (and its initramfs made) before anything else.
    std::optional<vm::ImageBoot> image_boot;
    if (full_system()) image_boot = image_boot_for(params);

    const std::string hostname = spec.hostname.empty() ? params.id : spec.hostname;
    if (!params.fork_of && shared_.settings.templates && shared_.settings.pool_size > 0) {
      if (auto sandbox = claim_pooled(params, image_boot, display, hostname)) return sandbox;
    }
    return create_own_vm(params, image_boot, display, hostname);
  }

  // A VM for a create: a clone of the template of its shape (made on first use), or a boot of its own.
  std::unique_ptr<VmInstance> start_vm(VmBootSpec& boot, container::SandboxCgroup& cgroup,
                                       const std::vector<layers::LayerImage>& layers, std::uint64_t disk_bytes) {
    if (shared_.settings.templates) {
      std::string key = template_key(boot, layers, disk_bytes);
      // A template that cannot be made fails the create with what a boot of this shape says.
      TemplatePtr t = shared_.templates.get(key, [&] { return make_template(key, boot, disk_bytes); });
      try {
        qemu::copy_sparse(t->disk, boot.disk);
        return restore_in(boot, cgroup, VmRestore{t->state, t->memory});
      } catch (const Error& e) {
        log_warn("sandbox {}: start from template failed ({}); booting instead, and the template is made anew", boot.id,
                 e.what());
        shared_.templates.invalidate(key, t);
        ::unlink(boot.disk.c_str());
      }
    }
    shared_.disks.make(boot.disk, disk_bytes);
    return boot_with_retries(boot, &cgroup);
  }

  // A VM started from saved state whose QEMU joins `cgroup` before it runs.
  std::unique_ptr<VmInstance> restore_in(const VmBootSpec& boot, container::SandboxCgroup& cgroup,
                                         const VmRestore& from) {
    std::vector<UniqueFd> procs = cgroup.open_procs();  // open until QEMU has joined
    VmBootSpec b = boot;
    for (const auto& fd : procs) b.cgroup_procs.push_back(fd.get());
    return VmInstance::restore(b, from, Clock::now() + shared_.settings.boot_timeout);
  }

  // Boots; a guest that stays silent is booted once more (a boot can stall early under a loaded TCG host), any
  // other failure would only repeat.
  // A full system's boot that KVM did not run is tried once more under TCG (`boot` then says TCG).
  std::unique_ptr<VmInstance> boot_with_retries(VmBootSpec& boot, container::SandboxCgroup* cgroup) {
    const std::uint32_t attempts = std::max<std::uint32_t>(1, shared_.settings.boot_attempts);
    for (std::uint32_t attempt = 1;; ++attempt) {
      std::vector<UniqueFd> procs;
      if (cgroup) procs = cgroup->open_procs();
      VmBootSpec b = boot;
      for (const auto& fd : procs) b.cgroup_procs.push_back(fd.get());
      try {
        const auto deadline = Clock::now() + shared_.settings.boot_timeout;
        std::unique_ptr<VmInstance> vm = VmInstance::boot(b, deadline);
        if (b.full_system) wait_system_started(*vm, b, deadline);
        return vm;
      } catch (const Error& e) {
        if (boot.full_system && boot.accelerator == Accelerator::kKvm && shared_.settings.accelerator != "kvm") {
          fall_back_to_tcg(e.what());
          boot.accelerator = Accelerator::kTcg;
          boot.kvm_group.reset();
          --attempt;
          for (const char* log : {"console.log", "qemu.log"}) ::unlink((boot.run_dir / log).c_str());
          continue;
        }
        if (e.code() != Code::kDeadlineExceeded || attempt >= attempts) throw;
        log_warn("{}: boot attempt {} failed ({}); trying again", boot.id, attempt, e.what());
        for (const char* log : {"console.log", "qemu.log"}) ::unlink((boot.run_dir / log).c_str());
      }
    }
  }

  static fs::path fresh_dir(const fs::path& dir) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    fs::create_directories(dir);
    ::chmod(dir.c_str(), 0700);
    return dir;
  }

  static std::string template_key(const VmBootSpec& boot, const std::vector<layers::LayerImage>& layers,
                                  std::uint64_t disk_bytes) {
    std::string key = fmt::format("m{}-c{}-d{}", boot.memory_bytes, boot.vcpus, disk_bytes);
    if (boot.full_system)
      key += fmt::format("|{}|{}|{}", boot.kernel.string(), boot.initrd.string(), encode_display(boot.display));
    for (const auto& l : layers) key += "|" + l.file.string() + ":" + l.data_file.string();
    return key;
  }

  // Boots a guest of the create's shape under a template name, lets it set up its root, and freezes it.
  TemplatePtr make_template(const std::string& key, const VmBootSpec& like, std::uint64_t disk_bytes) {
    const auto started = Clock::now();
    fs::path dir = fresh_dir(shared_.data_dir / "templates" / fmt::format("{:016x}", std::hash<std::string>{}(key)));
    std::error_code ec;
    HostIdPool::Lease uid{shared_.uids, shared_.uids.take()};
    VmBootSpec b = like;
    b.id = "template-" + dir.filename().string();
    b.run_dir = dir;
    b.uid = uid.first;
    b.gid = uid.first;
    b.cgroup_procs.clear();
    b.sched_idle = false;  // templates serve every class
    b.disk = dir / "disk";
    b.hostname = "dsec-template";
    try {
      shared_.disks.make(b.disk, disk_bytes);
      std::unique_ptr<VmInstance> vm = boot_with_retries(b, nullptr);
      TemplatePtr t = freeze_vm(*vm, key, dir, b.disk, b.memory_bytes);
      log_info("{} template {} ready in {:.2f} s ({} MiB RAM, {} layers)", shared_.kind, b.id,
               std::chrono::duration<double>(Clock::now() - started).count(), b.memory_bytes >> 20, like.layers.size());
      return t;
    } catch (...) {
      fs::remove_all(dir, ec);
      throw;
    }
  }

  // A VM for the pool of a shape: a clone of the shape's template (made when there is none), in a cgroup of its own
  // name with the shape's limits, warmed up with one command.
  std::unique_ptr<PooledVm> make_pooled(const std::string& template_name, const VmBootSpec& shape,
                                        const Resources& limits, std::uint64_t disk_bytes) {
    if (stopping_) throw Error(Code::kUnavailable, "the agent is stopping");
    TemplatePtr t =
        shared_.templates.get(template_name, [&] { return make_template(template_name, shape, disk_bytes); });
    auto p = std::make_unique<PooledVm>(shared_);
    p->name = "pool-" + random_hex(8);
    p->uid = shared_.uids.take();
    p->has_uid = true;
    p->run_dir = PooledVm::run_dir_of(shared_, p->name);
    p->data_dir = PooledVm::data_dir_of(shared_, p->name);
    for (const fs::path& d : {p->run_dir, p->data_dir}) {
      fs::create_directories(d);
      ::chmod(d.c_str(), 0700);
    }
    {
      // Whichever sandbox this VM becomes, its data directory names the cgroup it runs in.
      std::ofstream out(p->data_dir / "cgroup");
      out << p->name;
      if (!out.flush()) throw Error(Code::kResourceExhausted, "pooled VM: cannot write into " + p->data_dir.string());
    }
    p->cgroup = shared_.cgroups->create(p->name, limits);
    VmBootSpec b = boot_spec(p->name, p->run_dir, p->uid);
    b.vcpus = shape.vcpus;
    b.memory_bytes = shape.memory_bytes;
    b.layers = shape.layers;
    copy_system(b, shape);
    b.disk = p->data_dir / "disk.ext4";
    b.hostname = "dsec-pool";
    qemu::copy_sparse(t->disk, b.disk);
    p->vm = restore_in(b, *p->cgroup, VmRestore{t->state, t->memory});
    p->boot = b;
    // The first command in a fresh QEMU runs through code TCG has not translated yet (a quarter of a second): run
    // one here, so that the sandbox's first exec is as fast as its next ones. What it exits with does not matter.
    gp::ExecStart warm{
        {"/bin/sh", "-c", "true"}, {"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"}, "/", 4096, false};
    try {
      (void)p->vm->guest().exec(std::move(warm), "", 30, OutputSink{});
    } catch (const Error& e) {
      if (e.code() == Code::kUnavailable || e.code() == Code::kDeadlineExceeded) throw;
    }
    return p;
  }

  static std::string random_hex(std::size_t bytes) {
    std::string raw(bytes, '\0');
    if (::getrandom(raw.data(), raw.size(), 0) != static_cast<ssize_t>(raw.size())) throw_errno(errno, "getrandom");
    std::string out;
    for (unsigned char c : raw) out += fmt::format("{:02x}", c);
    return out;
  }

  // Takes over a VM an earlier run of the agent started: its QEMU must be the process the record names (pid, start
  // time, boot), in the sandbox's cgroup, answering on its sockets; a sleeping one needs only its saved state.
  std::unique_ptr<BackendSandbox> adopt(const AdoptParams& p) override {
    const BackendState& st = p.state;
    fs::path run_dir = shared_.config.run_dir / p.id;
    auto value = [this, &st](const char* name) -> const std::string& { return qemu::state_value(kind(), st, name); };
    auto number = [this, &st](const char* name) { return qemu::state_number(kind(), st, name); };
    if (value(key::kBootId) != container::boot_id())
      throw Error(Code::kNotFound, fmt::format("sandbox {}: the host rebooted since its VM started", p.id));
    VmBootSpec boot = boot_spec(p.id, run_dir, static_cast<std::uint32_t>(number(key::kUid)));
    boot.accelerator = value(key::kAccelerator) == "kvm" ? Accelerator::kKvm : Accelerator::kTcg;
    boot.memory_bytes = number(key::kMemory);
    boot.vcpus = static_cast<std::uint32_t>(number(key::kVcpus));
    boot.hostname = value(key::kHostname);
    boot.layers = qemu::decode_layers(kind(), value(key::kLayers));
    boot.disk = shared_.data_dir / p.id / "disk.ext4";
    if (full_system()) {
      // What a wake or a fork starts its next QEMU with: the same kernel, initramfs and screen.
      boot.full_system = true;
      boot.kernel = value(key::kKernel);
      boot.initrd = value(key::kInitrd);
      boot.display = qemu::decode_display(kind(), value(key::kDisplay));
      boot.usb_input = true;
      for (const fs::path& f : {boot.kernel, boot.initrd})
        if (f.parent_path() != shared_.data_dir / "kernels" / f.parent_path().filename() || !fs::exists(f))
          throw Error(Code::kNotFound,
                      fmt::format("sandbox {}: its kernel {} is gone from the agent's cache", p.id, f.string()));
    }
    const std::string& cgroup_path = value(key::kCgroup);
    container::check_adoptable_path(cgroup_path);
    std::unique_ptr<container::SandboxCgroup> cgroup;
    try {
      cgroup = shared_.cgroups->adopt(cgroup_path);
    } catch (const Error& e) {
      // A sleeping VM has no process in its cgroup, which an agent's start removes as empty: made again.
      if (e.code() != Code::kNotFound || !p.sleeping) throw;
      cgroup = shared_.cgroups->create(p.id, vm_limits(p.spec));
    }
    std::unique_ptr<VmInstance> vm;
    if (p.sleeping) {
      if (!fs::exists(shared_.data_dir / p.id / "sleep.state"))
        throw Error(Code::kNotFound, fmt::format("sandbox {}: its saved state is gone", p.id));
    } else {
      auto pid = static_cast<pid_t>(number(key::kQemuPid));
      UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
      if (!pidfd) throw Error(Code::kNotFound, fmt::format("sandbox {}: its QEMU (pid {}) is gone", p.id, pid));
      auto start = container::process_start_time(pid);
      if (!start || std::to_string(*start) != value(key::kQemuStart))
        throw Error(Code::kNotFound, fmt::format("sandbox {}: its QEMU (pid {}) is gone", p.id, pid));
      if (!container::process_in_cgroup(pid, cgroup_path, shared_.cgroups->version()))
        throw Error(Code::kFailedPrecondition,
                    fmt::format("sandbox {}: pid {} is not in the sandbox's cgroup", p.id, pid));
      vm = VmInstance::attach(p.id, run_dir, pid, std::move(pidfd), value(key::kRam) == "clone", boot.hostname,
                              Clock::now() + std::chrono::seconds(10));
    }
    const auto uid = boot.uid;
    shared_.uids.claim(uid);
    return make_qemu_sandbox(shared_, p.id, p.spec, run_dir, uid, std::move(cgroup), std::move(boot), std::move(vm),
                             p.sleeping);
  }

  void remove_leftovers(const std::string& id) override {
    // A sandbox that was a pooled VM runs in the cgroup of that VM's name.
    std::string cgroup_name;
    if (std::ifstream in(shared_.data_dir / id / "cgroup"); in) std::getline(in, cgroup_name);
    if (!cgroup_name.empty() && cgroup_name.find('/') == std::string::npos && cgroup_name != "." &&
        cgroup_name != "..") {
      try {
        shared_.cgroups->remove_sandbox_groups(cgroup_name);
      } catch (const std::exception& e) {
        log_warn("sandbox {}: remove leftover cgroup {}: {}", id, cgroup_name, e.what());
      }
    }
    std::error_code ec;
    fs::remove_all(shared_.config.run_dir / id, ec);
    fs::remove_all(shared_.data_dir / id, ec);
    try {
      shared_.cgroups->remove_sandbox_groups(id);
    } catch (const std::exception& e) {
      log_warn("sandbox {}: remove leftover cgroups: {}", id, e.what());
    }
  }

  void shutdown() override {
    pool_.stop();
    stopping_ = true;
    if (prober_.joinable()) prober_.join();
    shared_.templates.clear();
    std::error_code ec;
    fs::remove_all(shared_.work_dir, ec);
    for (const char* d : {"templates", "forks", "disks", "pool"}) fs::remove_all(shared_.data_dir / d, ec);
    // Full VMs' kernels stay while a sleeping VM (kept for the next run) may need them.
    if (fs::is_directory(shared_.data_dir)) {
      bool only_kernels = true;
      for (const auto& e : fs::directory_iterator(shared_.data_dir, ec))
        if (e.path().filename() != "kernels") only_kernels = false;
      if (only_kernels) fs::remove_all(shared_.data_dir / "kernels", ec);
    }
    fs::remove(shared_.data_dir, ec);  // when no sleeping VM's state is left in it
    fs::remove(shared_.data_dir.parent_path(), ec);
    try {
      shared_.cgroups->remove_subtree_if_empty();
    } catch (const std::exception& e) {
      log_warn("{}: remove the agent's cgroup subtree: {}", shared_.kind, e.what());
    }
  }

 private:
  // create()'s refusals of what this node cannot make, before anything is done for it.
  void check_creatable(const CreateParams& params) const {
    const SandboxSpec& spec = params.spec;
    if (spec.resources.memory_bytes < min_memory())
      throw Error(Code::kInvalidArgument,
                  fmt::format("resources.memory: a {} needs at least {} MiB (asked for {} bytes)", vm_noun(),
                              min_memory() >> 20, spec.resources.memory_bytes));
    const std::uint64_t overhead = shared_.settings.overhead_bytes;
    if (spec.resources.memory_bytes + overhead > shared_.host_memory)
      throw Error(Code::kResourceExhausted,
                  fmt::format("resources.memory: a {} of {} MiB (plus {} MiB for QEMU) does not fit in this "
                              "node's {} MiB",
                              vm_noun(), spec.resources.memory_bytes >> 20, overhead >> 20, shared_.host_memory >> 20),
                  /*retryable=*/false);
    if (params.layer_images.size() != params.image_layers.size())
      throw Error(Code::kFailedPrecondition,
                  fmt::format("the {} backend attaches an image's layers as disks, which needs the node's lazy layer "
                              "mode (this node keeps layers extracted)",
                              shared_.kind));
    if (spec.resources.gpus > 0)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("resources.gpus: this node has no GPU to pass through to a {} (asked for {})", vm_noun(),
                              spec.resources.gpus),
                  /*retryable=*/false);
  }

  // A create from the pool: a VM of its shape booted ahead, made the sandbox. Nullptr when the pool has none (or
  // claiming it failed: its leftovers are removed and the create starts a VM of its own).
  std::unique_ptr<BackendSandbox> claim_pooled(const CreateParams& params,
                                               const std::optional<vm::ImageBoot>& image_boot,
                                               const qemu::DisplaySpec& display, const std::string& hostname) {
    const SandboxSpec& spec = params.spec;
    VmBootSpec shape;
    shape.vcpus = vcpus_for(spec);
    shape.memory_bytes = spec.resources.memory_bytes;
    shape.layers = params.layer_images;
    set_system(shape, image_boot, display);
    const std::uint64_t disk_bytes = spec.resources.disk_bytes;
    const std::string template_name = template_key(shape, shape.layers, disk_bytes);
    const Resources limits = vm_limits(spec);
    std::unique_ptr<PooledVm> pooled = pool_.take(
        fmt::format("{}|cpu{}|{}", template_name, spec.resources.cpu, priority_name(spec.resources.priority)),
        [this, template_name, shape, limits, disk_bytes] {
          return make_pooled(template_name, shape, limits, disk_bytes);
        });
    if (pooled) {
      try {
        fs::path run_dir = shared_.config.run_dir / params.id;
        std::unique_ptr<VmInstance> vm =
            pooled->claim_into(params.id, run_dir, hostname, Clock::now() + shared_.settings.boot_timeout);
        // The sandbox owns its cgroup, uid and directories from here on.
        pooled->has_uid = false;
        return make_qemu_sandbox(shared_, params.id, spec, run_dir, pooled->uid, std::move(pooled->cgroup),
                                 pooled->boot, std::move(vm));
      } catch (const std::exception& e) {
        log_warn("sandbox {}: claiming pooled VM {} failed ({}); starting one instead", params.id, pooled->name,
                 e.what());
        pooled.reset();
        std::error_code ec;
        fs::remove_all(shared_.config.run_dir / params.id, ec);
        fs::remove_all(shared_.data_dir / params.id, ec);
      }
    }
    return nullptr;
  }

  // A create's own VM (booted, a template's clone, or a fork's copy), with its uid, cgroup and directories; what
  // fails leaves none of them.
  std::unique_ptr<BackendSandbox> create_own_vm(const CreateParams& params,
                                                const std::optional<vm::ImageBoot>& image_boot,
                                                const qemu::DisplaySpec& display, const std::string& hostname) {
    const SandboxSpec& spec = params.spec;
    std::uint32_t uid = shared_.uids.take();
    fs::path run_dir = shared_.config.run_dir / params.id;
    std::unique_ptr<container::SandboxCgroup> cgroup;
    try {
      for (const fs::path& d : {run_dir, shared_.data_dir / params.id}) {
        fs::create_directories(d);
        ::chmod(d.c_str(), 0700);
      }
      cgroup = shared_.cgroups->create(params.id, vm_limits(spec));
      VmBootSpec boot = boot_spec(params.id, run_dir, uid);
      boot.sched_idle = spec.resources.priority == Priority::kBatch;
      boot.vcpus = vcpus_for(spec);
      boot.memory_bytes = spec.resources.memory_bytes;
      boot.layers = params.layer_images;
      boot.disk = shared_.data_dir / params.id / "disk.ext4";
      boot.hostname = hostname;
      set_system(boot, image_boot, display);
      std::unique_ptr<VmInstance> vm;
      if (params.fork_of) {
        const auto* source = dynamic_cast<const QemuForkSource*>(params.fork_of.get());
        if (!source) throw Error(Code::kInvalidArgument, fmt::format("fork: the source is not a {}", vm_noun()));
        const VmBootSpec& parent = source->parent_boot;
        boot.layers = parent.layers;
        boot.memory_bytes = parent.memory_bytes;
        boot.vcpus = parent.vcpus;
        copy_system(boot, parent);
        qemu::copy_sparse(source->frozen->disk, boot.disk);
        vm = restore_in(boot, *cgroup, VmRestore{source->frozen->state, source->frozen->memory});
      } else {
        vm = start_vm(boot, *cgroup, params.layer_images, spec.resources.disk_bytes);
      }
      return make_qemu_sandbox(shared_, params.id, spec, run_dir, uid, std::move(cgroup), std::move(boot),
                               std::move(vm));
    } catch (...) {
      if (cgroup) {
        try {
          cgroup->destroy();
        } catch (...) {
        }
      }
      std::error_code ec;
      fs::remove_all(run_dir, ec);
      fs::remove_all(shared_.data_dir / params.id, ec);
      shared_.uids.give_back(uid);
      throw;
    }
  }

  // A VM's cgroup: its cores, its guest RAM plus QEMU's own overhead, QEMU's threads.
  Resources vm_limits(const SandboxSpec& spec) const {
    Resources limits = spec.resources;
    limits.memory_bytes += shared_.settings.overhead_bytes;
    limits.pids = kQemuPids;
    return limits;
  }

  std::uint32_t vcpus_for(const SandboxSpec& spec) const {
    return std::clamp<std::uint32_t>(static_cast<std::uint32_t>(std::ceil(spec.resources.cpu)), 1, shared_.host_cores);
  }

  VmBootSpec boot_spec(const std::string& id, const fs::path& run_dir, std::uint32_t uid) {
    VmBootSpec b;
    b.id = id;
    b.run_dir = run_dir;
    b.qemu = shared_.qemu;
    {
      std::lock_guard lock(mu_);
      b.accelerator = accelerator_;
      b.kvm_group = kvm_group_;
    }
    b.tcg_tb_size_mib = shared_.settings.tcg_tb_size_mib;
    b.tsc_khz = shared_.tsc_khz;
    b.kernel = shared_.kernel.kernel;
    b.initrd = shared_.initramfs;
    b.uid = uid;
    b.gid = uid;
    return b;
  }

  void wait_probe(Clock::time_point deadline) {
    std::unique_lock lock(mu_);
    if (!probed_.wait_until(lock, deadline, [&] { return status_.ready; }))
      throw Error(Code::kUnavailable, fmt::format("the {} backend is still probing its accelerator", shared_.kind),
                  true);
    if (!status_.unavailable.empty())
      throw Error(Code::kFailedPrecondition,
                  fmt::format("this node cannot run {}s: {}", vm_noun(), status_.unavailable));
  }

  // Boots one small guest with the given accelerator; the boot's seconds, or the reason it failed.
  std::pair<double, std::string> probe_boot(Accelerator accel) {
    fs::path dir = fresh_dir(shared_.work_dir / (accel == Accelerator::kKvm ? "probe-kvm" : "probe-tcg"));
    std::error_code ec;
    HostIdPool::Lease uid{shared_.uids, shared_.uids.take()};
    VmBootSpec b = boot_spec("probe", dir, uid.first);
    b.accelerator = accel;
    b.memory_bytes = kProbeMemory;
    auto started = Clock::now();
    try {
      auto vm = VmInstance::boot(b, started + shared_.settings.boot_timeout);
      double seconds = std::chrono::duration<double>(Clock::now() - started).count();
      vm->kill();
      fs::remove_all(dir, ec);
      return {seconds, {}};
    } catch (const std::exception& e) {
      std::string why = e.what();
      fs::remove_all(dir, ec);
      return {0, why};
    }
  }

  void probe() {
    const std::string wanted = shared_.settings.accelerator;
    qemu::KvmAccess access = qemu::host_kvm_access();
    if (full_system()) {
      choose_full_system_accelerator(wanted, access);
      return;
    }
    std::string failure;
    double boot_seconds = 0;
    bool probed = false;
    if (wanted != "tcg" && access.usable) {
      {
        std::lock_guard lock(mu_);
        kvm_group_ = access.group;
      }
      auto [seconds, why] = probe_boot(Accelerator::kKvm);
      probed = true;
      failure = why;
      boot_seconds = seconds;
    }
    qemu::AcceleratorChoice choice =
        qemu::choose_accelerator("--microvm-accelerator", wanted, access, failure, probed, host_is_pvm());
    const Accelerator chosen = choice.kvm ? Accelerator::kKvm : Accelerator::kTcg;
    const std::string& reason = choice.reason;
    const std::string& unavailable = choice.unavailable;
    if (!choice.kvm) {
      boot_seconds = 0;
      std::lock_guard lock(mu_);
      kvm_group_.reset();
    }
    // TCG needs no probe: it runs any guest kernel; whether this one boots, the first create says (with the
    // guest console's last lines when it does not).
    {
      std::lock_guard lock(mu_);
      accelerator_ = chosen;
      status_.ready = true;
      status_.accelerator = chosen == Accelerator::kKvm ? "kvm" : "tcg";
      status_.accelerator_reason = reason;
      status_.unavailable = unavailable;
      status_.probe_boot_seconds = boot_seconds;
    }
    probed_.notify_all();
    if (unavailable.empty())
      log_info(
          "microvm: {} (guest kernel {}){}", status_.accelerator, shared_.kernel.release,
          chosen == Accelerator::kKvm ? fmt::format(", probe boot {:.2f} s", boot_seconds) : "; not KVM: " + reason);
    else log_warn("microvm: cannot run VMs: {}", unavailable);
  }

  // A full VM boots the image's kernel, which no probe at start can boot (there is no image yet): KVM is used where
  // it is usable and not kvm_pvm (which dies on stock kernels), and the first boot whose guest KVM does not run
  // falls back to TCG for good (boot_with_retries).
  void choose_full_system_accelerator(const std::string& wanted, const qemu::KvmAccess& access) {
    qemu::AcceleratorChoice choice;
    if (wanted == "tcg") {
      choice.reason = "configured (--vm-accelerator tcg)";
    } else if (!access.usable) {
      choice.reason = access.reason;
      if (wanted == "kvm") choice.unavailable = "--vm-accelerator kvm: " + access.reason;
    } else if (host_is_pvm() && wanted != "kvm") {
      choice.reason =
          "this host's KVM is kvm_pvm, which runs only guest kernels built for PVM (an image's stock "
          "kernel dies in it); --vm-accelerator kvm tries it anyway";
    } else {
      choice.kvm = true;
      choice.reason = "KVM is usable (a boot whose guest it does not run falls back to TCG)";
    }
    {
      std::lock_guard lock(mu_);
      accelerator_ = choice.kvm ? Accelerator::kKvm : Accelerator::kTcg;
      if (choice.kvm) kvm_group_ = access.group;
      status_.ready = true;
      status_.accelerator = choice.kvm ? "kvm" : "tcg";
      status_.accelerator_reason = choice.reason;
      status_.unavailable = choice.unavailable;
    }
    probed_.notify_all();
    if (choice.unavailable.empty()) log_info("vm: {} ({})", choice.kvm ? "kvm" : "tcg", choice.reason);
    else log_warn("vm: cannot run VMs: {}", choice.unavailable);
  }

  // KVM did not run a full VM's guest: every later VM of this backend uses TCG, and the node says why.
  void fall_back_to_tcg(const std::string& why) {
    std::lock_guard lock(mu_);
    if (accelerator_ == Accelerator::kTcg) return;
    accelerator_ = Accelerator::kTcg;
    kvm_group_.reset();
    status_.accelerator = "tcg";
    status_.accelerator_reason = "KVM did not run a full VM's guest: " + why.substr(0, 400);
    log_warn("vm: KVM did not run the guest ({}); TCG from now on", why);
  }

  static bool host_is_pvm() { return fs::exists("/sys/module/kvm_pvm"); }

  bool full_system() const { return shared_.tier == Tier::kVm; }
  const char* vm_noun() const { return full_system() ? "full VM" : "microVM"; }
  std::uint64_t min_memory() const { return full_system() ? kMinSystemMemory : kMinGuestMemory; }

  // The create's screen: full VMs have one unless it asks for none (1024x768 by default); the others none.
  qemu::DisplaySpec display_for(const SandboxSpec& spec) const {
    if (!full_system() || spec.display == "none") {
      if (!full_system() && !spec.display.empty() && spec.display != "none")
        throw Error(Code::kInvalidArgument,
                    fmt::format("display: a {} has no screen (only kind 'vm' does)", vm_noun()));
      return {};
    }
    DisplaySize size{1024, 768};
    if (!spec.display.empty()) {
      auto asked = parse_display(spec.display);
      if (!asked)
        throw Error(Code::kInvalidArgument,
                    fmt::format("display: '{}' is not WIDTHxHEIGHT from 320x200 to 3840x2160, or none",
                                spec.display.substr(0, 40)));
      size = *asked;
    }
    return qemu::make_display(qemu::DisplaySpec::Kind::kVga, size.width, size.height);
  }

  // The image's own kernel and an initramfs for it: from the highest layer that has a kernel (/vmlinuz), its
  // modules from the same layer. A layer's directory is named by its digest and never changes, so what it gives is
  // remembered: a create does not read and hash the kernel and its modules (about 15 MB) again.
  vm::ImageBoot image_boot_for(const CreateParams& params) {
    for (auto it = params.image_layers.rbegin(); it != params.image_layers.rend(); ++it) {
      {
        std::lock_guard lock(image_boots_mu_);
        if (auto known = image_boots_.find(*it);
            known != image_boots_.end() && fs::exists(known->second.kernel) && fs::exists(known->second.initramfs))
          return known->second;
      }
      struct stat st {};
      if (::lstat((*it / "vmlinuz").c_str(), &st) != 0) continue;
      vm::ImageBoot boot = vm::prepare_image_boot(*it, shared_.init_binary, shared_.data_dir / "kernels");
      std::lock_guard lock(image_boots_mu_);
      return image_boots_[*it] = std::move(boot);
    }
    throw Error(Code::kFailedPrecondition,
                fmt::format("image {}: no kernel to boot (/vmlinuz): a full VM boots its image's own kernel and "
                            "init; build the image with --include systemd-sysv,linux-image-amd64,udev",
                            params.spec.image),
                /*retryable=*/false);
  }

  // A full system's boot: the image's kernel, q35, the screen, USB input.
  static void set_system(VmBootSpec& b, const std::optional<vm::ImageBoot>& image_boot,
                         const qemu::DisplaySpec& display) {
    if (!image_boot) return;
    b.full_system = true;
    b.kernel = image_boot->kernel;
    b.initrd = image_boot->initramfs;
    b.display = display;
    b.usb_input = true;
  }
  static void copy_system(VmBootSpec& b, const VmBootSpec& from) {
    if (!from.full_system) return;
    b.full_system = true;
    b.kernel = from.kernel;
    b.initrd = from.initrd;
    b.display = from.display;
    b.usb_input = from.usb_input;
  }

  // A full system is handed out once it has started: systemd's boot is over (running or degraded) and what the
  // image names in /etc/dsec/ready-files (a path a line, e.g. a file its desktop session writes once its windows
  // are up) exists. Templates are frozen at that point, so their clones start with a system that is up.
  void wait_system_started(VmInstance& vm, const VmBootSpec& b, Clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::seconds>(deadline - Clock::now()).count();
    if (left <= 0) throw Error(Code::kDeadlineExceeded, fmt::format("{}: no time left to wait for its system", b.id));
    gp::ExecStart wait{{"/bin/sh", "-c", kWaitSystemStarted},
                       {"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"},
                       "/",
                       64 << 10,
                       false};
    ExecResult r;
    try {
      r = vm.guest().exec(std::move(wait), "", static_cast<double>(left), OutputSink{});
    } catch (const Error& e) {
      throw Error(e.code(), fmt::format("{}: waiting for its system to start: {}{}", b.id, e.what(), vm.last_words()),
                  e.retryable());
    }
    if (r.timed_out || r.exit_code != 0)
      throw Error(Code::kDeadlineExceeded, fmt::format("{}: its system did not start in time ({}): {}{}", b.id,
                                                       r.timed_out ? "timed out" : fmt::format("exit {}", r.exit_code),
                                                       r.stdout_data.substr(0, 2000), vm.last_words()));
  }

  BackendContext shared_;
  VmPool pool_;
  mutable std::mutex mu_;
  std::condition_variable probed_;
  MicroVmStatus status_;
  Accelerator accelerator_ = Accelerator::kTcg;
  std::optional<gid_t> kvm_group_;
  std::atomic<bool> stopping_{false};
  std::thread prober_;
  std::mutex image_boots_mu_;
  std::map<fs::path, vm::ImageBoot> image_boots_;  // full VMs: a kernel layer's directory -> its kernel in the cache
};

}  // namespace
}  // namespace qemu

std::unique_ptr<QemuBackend> make_microvm_backend(const AgentConfig& config) {
  return std::make_unique<qemu::QemuBackendImpl>(config, qemu::Tier::kMicrovm);
}

std::unique_ptr<QemuBackend> make_vm_backend(const AgentConfig& config, std::shared_ptr<network::NodeNetwork> network) {
  return std::make_unique<qemu::QemuBackendImpl>(config, qemu::Tier::kVm, std::move(network));
}

std::string microvm_unavailable_reason(const AgentConfig& config) {
  if (qemu::qemu_binary(config.microvm).empty())
    return config.microvm.qemu.empty() ? "qemu-system-x86_64 is not installed"
                                       : config.microvm.qemu.string() + " is not an executable";
  try {
    (void)microvm::find_guest_kernel(config.microvm.kernel);
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace dsec::agent
