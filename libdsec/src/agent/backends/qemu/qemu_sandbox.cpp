#include "agent/backends/qemu/qemu_sandbox.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <mutex>

#include <fmt/format.h>

#include "agent/backends/command/exec_command.hpp"
#include "agent/backends/command/exec_user.hpp"
#include "agent/backends/container/process_identity.hpp"
#include "agent/backends/qemu/vm_record.hpp"
#include "agent/backends/qemu/vm_screen.hpp"
#include "agent/node/host.hpp"
#include "agent/node/qos/ksm.hpp"
#include "common/log.hpp"

namespace dsec::agent::qemu {
namespace {

namespace fs = std::filesystem;
namespace gp = guest_protocol;
namespace key = qemu::record_key;

constexpr std::size_t kMaxFileBytes = 1ull << 30;
constexpr auto kFileTimeout = std::chrono::seconds(300);
constexpr auto kSaveTimeout = std::chrono::seconds(120);
constexpr auto kUserDatabaseTimeout = std::chrono::seconds(30);  // reading /etc/passwd or /etc/group for an exec
// A VM's console log and QEMU's own log on the host: cut to their last 64 KiB (enough for the lines error messages
// quote) once over 1 MiB, at each reaper pass; a guest writing its console as fast as it can (about 0.15 MB/s under
// TCG on the test machine; more with KVM, not measured) adds at most that per second between passes.
constexpr std::uint64_t kMaxLogBytes = 1u << 20;
constexpr std::uint64_t kKeptLogBytes = 64u << 10;

// Runs `fn`, turning what a malformed answer of a guest throws (the code inside a VM may take its init over) into
// UNAVAILABLE, so it never reaches a caller as an internal error.
template <typename F>
auto guarded(const std::string& id, F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw Error(Code::kUnavailable,
                fmt::format("sandbox {}: its guest answered with a malformed message ({})", id, e.what()));
  }
}

class QemuSandbox final : public BackendSandbox, public InitProcesses {
 public:
  QemuSandbox(BackendContext& shared, std::string id, SandboxSpec spec, fs::path run_dir, std::uint32_t uid,
              std::unique_ptr<container::SandboxCgroup> cgroup, VmBootSpec boot, std::unique_ptr<VmInstance> vm,
              bool sleeping = false)
      : InitProcesses(id),
        shared_(shared),
        id_(std::move(id)),
        spec_(std::move(spec)),
        run_dir_(std::move(run_dir)),
        data_dir_(shared.data_dir / id_),
        uid_(uid),
        cgroup_(std::move(cgroup)),
        boot_(std::move(boot)),
        vm_(std::move(vm)),
        sleeping_(sleeping) {
    boot_.cgroup_procs.clear();
    // Every QEMU this sandbox starts from now on (a wake, a fork) runs in its class; the one it has now may have
    // been started before the class was known (a pooled VM) or by an earlier agent.
    boot_.sched_idle = spec_.resources.priority == Priority::kBatch;
    if (boot_.sched_idle && vm_ && !set_sched_idle_threads(vm_->pid()))
      log_warn("sandbox {}: not every thread of its QEMU could be made SCHED_IDLE", id_);
    if (spec_.resources.ksm && shared_.kernel_qos.memory_merge) {
      try {
        ksm_hold_ = qos::hold_ksm();
      } catch (const Error& e) {
        log_warn("sandbox {}: {}", id_, e.what());
      }
    }
    qos_ = qos::describe_grant(
        spec_.resources, {&shared_.kernel_qos, &shared_.cpus, shared_.cgroups->version(), shared_.cgroups->cpu_idle(),
                          /*vm=*/true, ksm_hold_ != nullptr});
    if (boot_.display.kind != DisplaySpec::Kind::kNone)
      screen_ = std::make_unique<VmScreen>(
          id_, boot_.display.width, boot_.display.height, [this] { return running_vm("its screen"); }, shared_.network);
    ++shared_.vms;
  }

  ~QemuSandbox() override {
    try {
      destroy();
    } catch (...) {
    }
  }

  ExecResult exec(const ExecRequest& req, const OutputSink& sink) override {
    check_running();
    std::shared_ptr<VmInstance> vm;
    {
      std::lock_guard lock(power_mu_);
      if (sleeping_) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is sleeping; wake it first", id_));
      ++running_execs_;
      vm = vm_;
    }
    struct ExecCount {
      QemuSandbox& self;
      ~ExecCount() {
        std::lock_guard lock(self.power_mu_);
        --self.running_execs_;
      }
    } exec_count{*this};
    ExecCommand command;
    gp::ExecStart start;
    try {
      command = resolve_command(vm->guest(), req);
      start = gp::ExecStart{command.argv,       command.env_strings(), command.cwd, req.max_output_bytes, false,
                            command.named_user, command.uid,           command.gid, command.groups};
      return guarded(id_,
                     [&] { return vm->guest().exec(std::move(start), req.stdin_data, req.timeout_seconds, sink); });
    } catch (const Error& e) {
      if (e.code() == Code::kUnavailable) check_running();
      throw;
    }
  }

  Processes* processes() override { return this; }

  Screen* screen() override { return screen_.get(); }

  std::variant<ProcessEntry, ExecResult> spawn(const ExecRequest& req, const SpawnOptions& options) override {
    std::string payload;
    ExecCommand command;
    with_guest([&](guest::GuestChannel& g) {
      command = resolve_command(g, req);
      payload = spawn_payload(options, command.start_payload());
    });
    return spawn_reply(exchange(process_protocol::Op::kSpawn, payload, std::chrono::seconds(30)), command.argv[0],
                       command.cwd);
  }

  // Sleep saves the guest's RAM and device state to the sandbox's run directory on local disk and ends QEMU, so
  // every byte of its memory goes back to the node; wake starts a QEMU from that state and the guest's processes
  // go on. Its files are out of reach while it sleeps (they live inside the stopped guest).
  SleepReport sleep() override {
    const auto started = Clock::now();
    check_running();  // (takes power_mu_ itself)
    std::lock_guard lock(power_mu_);
    if (sleeping_) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is already sleeping", id_));
    if (!vm_ || vm_->exited()) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {}: its VM stopped", id_));
    if (running_execs_ > 0)
      throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} has {} exec{} running; it can sleep once they end",
                                                         id_, running_execs_, running_execs_ == 1 ? "" : "s"));
    SleepReport report;
    report.memory_before_bytes = cgroup_->memory_current();
    fs::path state = data_dir_ / "sleep.state";
    try {
      vm_->save(state, /*ignore_shared=*/false, kSaveTimeout);
    } catch (...) {
      ::unlink(state.c_str());
      try {
        vm_->qmp("cont");
      } catch (...) {
      }
      throw;
    }
    vm_->kill();
    vm_.reset();  // the last hold on its RAM
    drop_disk_cache();
    sleeping_ = true;
    report.memory_after_bytes = cgroup_->memory_current();
    report.seconds = std::chrono::duration<double>(Clock::now() - started).count();
    return report;
  }

  SleepReport wake() override {
    const auto started = Clock::now();
    std::lock_guard lock(power_mu_);
    if (destroyed_.load()) throw Error(Code::kNotFound, fmt::format("sandbox {} was destroyed", id_));
    if (!sleeping_) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is not sleeping", id_));
    SleepReport report;
    report.memory_before_bytes = cgroup_->memory_current();
    fs::path state = data_dir_ / "sleep.state";
    VmBootSpec boot = with_cgroup(boot_);
    for (const char* log : {"console.log", "qemu.log"}) ::truncate((run_dir_ / log).c_str(), 0);
    vm_ = VmInstance::restore(boot, VmRestore{state, nullptr}, Clock::now() + shared_.settings.boot_timeout);
    ::unlink(state.c_str());
    sleeping_ = false;
    report.memory_after_bytes = cgroup_->memory_current();
    report.seconds = std::chrono::duration<double>(Clock::now() - started).count();
    return report;
  }

  void write_file(std::string_view path, std::string_view data, unsigned mode) override {
    with_guest([&](guest::GuestChannel& g) { g.write_file(path, data, mode, Clock::now() + kFileTimeout); });
  }
  std::string read_file(std::string_view path) override {
    return with_guest(
        [&](guest::GuestChannel& g) { return g.read_file(path, kMaxFileBytes, Clock::now() + kFileTimeout); });
  }
  void put_archive(std::string_view dir, std::string_view tar_bytes) override {
    with_guest([&](guest::GuestChannel& g) { g.put_archive(dir, tar_bytes, Clock::now() + kFileTimeout); });
  }
  std::string get_archive(std::string_view dir) override {
    return with_guest(
        [&](guest::GuestChannel& g) { return g.get_archive(dir, kMaxFileBytes, Clock::now() + kFileTimeout); });
  }
  bool is_directory(std::string_view path) override {
    return with_guest([&](guest::GuestChannel& g) { return S_ISDIR(g.mode_of(path, Clock::now() + kFileTimeout)); });
  }

  // The writable layer as the guest sees it, read by dsec-init inside with every command frozen (the guest walks
  // its own file system: the agent never mounts what the guest wrote), and written here as a layer's tree.
  FilesCapture capture_files(const fs::path& dest, const image::UpperTreeLimits& limits) override {
    check_running();                  // (takes power_mu_ itself)
    std::lock_guard lock(power_mu_);  // one capture at a time, never during a sleep, a wake or a fork
    if (sleeping_)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("sandbox {} is sleeping: a VM is snapshotted awake (its files live in the guest)", id_));
    std::shared_ptr<VmInstance> vm = vm_;
    if (!vm) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {}: its VM stopped", id_));
    FilesCapture out;
    const auto started = Clock::now();
    out.stats = guarded(id_, [&] { return vm->guest().capture_upper(dest, limits, Clock::now() + kFileTimeout); });
    out.frozen_seconds = std::chrono::duration<double>(Clock::now() - started).count();
    return out;
  }

  BackendState recovery_state() override {
    std::lock_guard lock(power_mu_);
    BackendState out{{key::kBootId, container::boot_id()},
                     {key::kUid, std::to_string(uid_)},
                     {key::kCgroup, cgroup_->path()},
                     {key::kMemory, std::to_string(boot_.memory_bytes)},
                     {key::kVcpus, std::to_string(boot_.vcpus)},
                     {key::kHostname, boot_.hostname},
                     {key::kLayers, qemu::encode_layers(boot_.layers)},
                     {key::kAccelerator, boot_.accelerator == Accelerator::kKvm ? "kvm" : "tcg"}};
    if (boot_.full_system) {
      out[key::kKernel] = boot_.kernel.string();
      out[key::kInitrd] = boot_.initrd.string();
      out[key::kDisplay] = encode_display(boot_.display);
    }
    if (vm_) {
      out[key::kQemuPid] = std::to_string(vm_->pid());
      out[key::kQemuStart] = std::to_string(container::process_start_time(vm_->pid()).value_or(0));
      out[key::kRam] = vm_->template_memory() ? "clone" : vm_->memory() ? "own" : "anonymous";
    }
    return out;
  }

  // The VM stops, its RAM becomes a sealed template, and it runs on as the first of that template's clones; its
  // copies start from the same template. A VM that is itself a clone (of an image's template, or of an earlier
  // fork) first takes its RAM as its own: saved whole and loaded into a memfd of its own.
  std::shared_ptr<const ForkSource> fork_source() override {
    check_running();
    std::lock_guard lock(power_mu_);
    if (sleeping_) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} is sleeping; wake it first", id_));
    if (running_execs_ > 0)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("sandbox {} has {} exec{} running; it can be forked once they end", id_, running_execs_,
                              running_execs_ == 1 ? "" : "s"));
    if (!vm_ || vm_->exited()) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {}: its VM stopped", id_));
    const auto deadline = Clock::now() + shared_.settings.boot_timeout;
    if (!vm_->memory()) {
      // A clone of a template, or a VM woken into anonymous memory: its RAM is not a memfd of its own yet.
      fs::path whole = data_dir_ / "fork.state";
      vm_->save(whole, /*ignore_shared=*/false, kSaveTimeout);
      vm_->kill();
      vm_.reset();
      VmBootSpec b = with_cgroup(boot_);
      // Loading the RAM into a memfd allocates all of it before the zero pages are given back: room for that.
      cgroup_->set_limits(2 * boot_.memory_bytes + shared_.settings.overhead_bytes, kQemuPids);
      struct Limits {
        QemuSandbox& self;
        ~Limits() {
          try {
            self.cgroup_->set_limits(self.spec_.resources.memory_bytes + self.shared_.settings.overhead_bytes,
                                     kQemuPids);
          } catch (const std::exception& e) {
            log_warn("sandbox {}: memory limit after a fork: {}", self.id_, e.what());
          }
        }
      } limits{*this};
      VmRestore whole_ram;
      whole_ram.state_file = whole;
      whole_ram.into_memfd = true;
      whole_ram.paused = true;
      vm_ = VmInstance::restore(b, whole_ram, deadline);
      ::unlink(whole.c_str());
      vm_->punch_zero_pages();
    }
    fs::path dir = shared_.data_dir / "forks" / fmt::format("{}-{}", id_, ++forks_);
    TemplatePtr t = freeze_vm(*vm_, "fork:" + id_, dir, boot_.disk, boot_.memory_bytes);
    vm_.reset();
    VmBootSpec b = with_cgroup(boot_);
    vm_ = VmInstance::restore(b, VmRestore{t->state, t->memory}, deadline);
    return std::make_shared<QemuForkSource>(std::move(t), boot_);
  }

  QosGrant qos_grant() override { return qos_; }

  bool alive() override {
    if (destroyed_.load()) return false;
    std::shared_ptr<VmInstance> vm;
    {
      std::lock_guard lock(power_mu_);
      if (sleeping_) return true;
      vm = vm_;
    }
    // No VM while awake: a fork or a wake that failed half way left none.
    if (vm && !vm->exited() && vm->guest().connected()) return true;
    // The VM stopped by itself (the guest panicked or powered off, QEMU crashed or was killed): what it held goes
    // at once, not when the sandbox is destroyed. A guest that powered off closes its port a moment before QEMU
    // exits: QEMU gets that moment, so the console's last lines say why.
    if (vm && !vm->exited()) qemu::wait_exit(vm->pidfd(), vm->pid(), std::chrono::seconds(2));
    release_once(/*stopped_by_itself=*/true);
    return false;
  }

  void upkeep() override {
    // A guest writing to its serial console grows console.log (on /run: memory) as fast as QEMU emulates it.
    for (const char* log : {"console.log", "qemu.log"}) qemu::bound_log(run_dir_ / log, kMaxLogBytes, kKeptLogBytes);
  }

  std::string stopped_reason() override {
    std::lock_guard lock(release_mu_);
    if (!released_) return {};
    return "its VM stopped" + last_words_;
  }

  void destroy() override {
    std::lock_guard lock(destroy_mu_);
    if (destroyed_.exchange(true)) return;
    if (screen_) screen_->stop_vnc();
    release_once(/*stopped_by_itself=*/false);
    std::error_code ec;
    fs::remove_all(run_dir_, ec);
  }

 private:
  std::string hostname() const { return spec_.hostname.empty() ? id_ : spec_.hostname; }

  // The VM while it runs (for `what`: "its screen"); FAILED_PRECONDITION while the sandbox sleeps.
  std::shared_ptr<VmInstance> running_vm(std::string_view what) {
    check_running();
    std::lock_guard lock(power_mu_);
    if (sleeping_)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("sandbox {} is sleeping: {} is back once it is woken", id_, what));
    if (!vm_) throw Error(Code::kFailedPrecondition, fmt::format("sandbox {}: its VM stopped", id_));
    return vm_;
  }

  // The boot spec with this sandbox's cgroup to join (its descriptors live as long as procs_).
  VmBootSpec with_cgroup(const VmBootSpec& boot) {
    procs_ = cgroup_->open_procs();
    VmBootSpec b = boot;
    b.cgroup_procs.clear();
    for (const auto& fd : procs_) b.cgroup_procs.push_back(fd.get());
    return b;
  }

  // The host's page cache of the writable disk is charged to the sandbox; while it sleeps the disk is only a file.
  void drop_disk_cache() {
    UniqueFd disk(::open(boot_.disk.c_str(), O_RDONLY | O_CLOEXEC));
    if (!disk) return;
    ::fdatasync(disk.get());
    ::posix_fadvise(disk.get(), 0, 0, POSIX_FADV_DONTNEED);
  }

  template <typename F>
  auto with_guest(F&& fn) -> decltype(fn(std::declval<guest::GuestChannel&>())) {
    check_running();
    std::shared_ptr<VmInstance> vm;
    {
      std::lock_guard lock(power_mu_);
      if (sleeping_)
        throw Error(Code::kFailedPrecondition,
                    fmt::format("sandbox {} is sleeping: a VM's files are reachable once it is woken", id_));
      vm = vm_;
    }
    try {
      return guarded(id_, [&] { return fn(vm->guest()); });
    } catch (const Error& e) {
      if (e.code() == Code::kUnavailable) check_running();
      throw;
    }
  }

  // Process requests go to the guest's init over the VM's line (GuestChannel::process_request).
  std::string exchange(process_protocol::Op op, const std::string& payload,
                       std::chrono::milliseconds reply_within) override {
    return with_guest(
        [&](guest::GuestChannel& g) { return g.process_request(op, payload, Clock::now() + reply_within); });
  }
  std::uint32_t max_read_bytes() const override { return gp::kMaxDataChunk; }

  // What an exec or a spawn runs, with the user's entry from the guest's own /etc/passwd and /etc/group (read
  // through dsec-init, like any file).
  ExecCommand resolve_command(guest::GuestChannel& guest, const ExecRequest& req) {
    ExecUser user = resolve_exec_user(spec_, req, [&](const std::string& path) -> std::optional<std::string> {
      try {
        return guarded(
            id_, [&] { return guest.read_file(path, kMaxUserDatabaseBytes, Clock::now() + kUserDatabaseTimeout); });
      } catch (const Error& e) {
        if (e.code() == Code::kNotFound) return std::nullopt;
        throw;
      }
    });
    return exec_command(spec_, req, hostname(), user);
  }

  void check_running() {
    if (destroyed_.load()) throw Error(Code::kNotFound, fmt::format("sandbox {} was destroyed", id_));
    if (!alive()) {
      std::lock_guard lock(release_mu_);
      throw Error(Code::kFailedPrecondition,
                  fmt::format("sandbox {} is not running: its VM stopped{}", id_, last_words_), false,
                  Fault::kInfrastructure);
    }
  }

  // Kills QEMU (if it still runs) and hands back its cgroup, writable disk and uid. Idempotent.
  void release_once(bool stopped_by_itself) {
    std::shared_ptr<VmInstance> vm;
    {
      std::lock_guard power(power_mu_);
      vm = vm_;
    }
    std::lock_guard lock(release_mu_);
    if (released_) return;
    released_ = true;
    if (vm) {
      vm->kill();
      if (stopped_by_itself) {
        // QEMU's guest RAM and its own heap are charged to the cgroup: a guest that fills its RAM while QEMU needs
        // more than the overhead allowed gets the whole VM killed by the kernel's OOM killer.
        std::uint64_t ooms = 0;
        try {
          ooms = cgroup_->oom_kills();
        } catch (...) {
        }
        last_words_ = (ooms > 0 ? fmt::format(": QEMU was killed by the out-of-memory killer (its cgroup's limit: "
                                              "the guest's {} MiB of RAM plus {} MiB for QEMU)",
                                              boot_.memory_bytes >> 20, shared_.settings.overhead_bytes >> 20)
                                : std::string()) +
                      vm->last_words();
      }
    }
    try {
      cgroup_->destroy();
    } catch (const std::exception& e) {
      log_warn("sandbox {}: remove its cgroup: {}", id_, e.what());
    }
    std::error_code ec;
    fs::remove_all(data_dir_, ec);
    shared_.uids.give_back(uid_);
    --shared_.vms;
  }

  BackendContext& shared_;
  std::string id_;
  SandboxSpec spec_;
  fs::path run_dir_;   // sockets and logs
  fs::path data_dir_;  // the writable disk, saved state: on local disk
  std::uint32_t uid_;
  std::unique_ptr<container::SandboxCgroup> cgroup_;
  VmBootSpec boot_;                 // how its QEMU was started: a wake starts the next one the same way
  std::mutex power_mu_;             // guards vm_, sleeping_ and running_execs_; held through a sleep or a wake
  std::shared_ptr<VmInstance> vm_;  // null while it sleeps
  bool sleeping_ = false;
  int running_execs_ = 0;
  std::vector<UniqueFd> procs_;
  std::uint32_t forks_ = 0;
  std::atomic<bool> destroyed_{false};
  std::mutex destroy_mu_;
  std::mutex release_mu_;
  bool released_ = false;
  std::string last_words_;
  std::unique_ptr<VmScreen> screen_;  // a full VM with a display
  QosGrant qos_;
  std::shared_ptr<void> ksm_hold_;  // ksmd runs while it lives, when it asked for KSM (QEMU's RAM is mergeable)
};

}  // namespace

std::unique_ptr<BackendSandbox> make_qemu_sandbox(BackendContext& shared, std::string id, SandboxSpec spec,
                                                  fs::path run_dir, std::uint32_t uid,
                                                  std::unique_ptr<container::SandboxCgroup> cgroup, VmBootSpec boot,
                                                  std::unique_ptr<VmInstance> vm, bool sleeping) {
  return std::make_unique<QemuSandbox>(shared, std::move(id), std::move(spec), std::move(run_dir), uid,
                                       std::move(cgroup), std::move(boot), std::move(vm), sleeping);
}

}  // namespace dsec::agent::qemu
