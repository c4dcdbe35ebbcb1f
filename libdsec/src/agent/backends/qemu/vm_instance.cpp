#include "agent/backends/qemu/vm_instance.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <ctime>

#include <fmt/format.h>

#include "agent/backends/qemu/writable_disk.hpp"
#include "common/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::qemu {
namespace fs = std::filesystem;
namespace gp = guest_protocol;
using qemu::BlockDevice;
using qemu::CmdlineOptions;
using qemu::QemuSpec;
using qemu::QmpClient;
using qemu::VmLaunch;

namespace {

sockaddr_un unix_address(const fs::path& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.string().size() >= sizeof addr.sun_path)
    throw Error(Code::kInvalidArgument, fmt::format("socket path {} is too long", path.string()));
  std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
  return addr;
}

UniqueFd open_or_throw(const fs::path& path, int flags, mode_t mode = 0) {
  UniqueFd fd(::open(path.c_str(), flags | O_CLOEXEC, mode));
  if (!fd) throw_errno_fmt(errno, "open {}", path.string());
  return fd;
}

std::uint64_t realtime_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<std::uint64_t>(ts.tv_nsec);
}

}  // namespace

UniqueFd listen_unix(const fs::path& path) {
  sockaddr_un addr = unix_address(path);
  ::unlink(path.c_str());
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw_errno(errno, "socket");
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    throw_errno_fmt(errno, "bind {}", path.string());
  ::chmod(path.c_str(), 0600);
  if (::listen(fd.get(), 4) != 0) throw_errno_fmt(errno, "listen on {}", path.string());
  return fd;
}

UniqueFd connect_unix(const fs::path& path) {
  sockaddr_un addr = unix_address(path);
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd) throw_errno(errno, "socket");
  if (retry_eintr([&] { return ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr); }) != 0)
    throw_errno_fmt(errno, "connect to {}", path.string());
  return fd;
}

std::unique_ptr<VmInstance> VmInstance::boot(const VmBootSpec& spec, Clock::time_point deadline) {
  return start(spec, nullptr, deadline);
}

std::unique_ptr<VmInstance> VmInstance::restore(const VmBootSpec& spec, const VmRestore& from,
                                                Clock::time_point deadline) {
  return start(spec, &from, deadline);
}

namespace {

// Guest RAM: a memfd of the guest's size (sealable: a frozen copy becomes a template clones map).
UniqueFd guest_ram_memfd(const VmBootSpec& spec) {
  UniqueFd memfd(::memfd_create(("dsec-ram-" + spec.id).c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!memfd) throw_errno(errno, "memfd_create for guest RAM");
  if (::ftruncate(memfd.get(), static_cast<off_t>(spec.memory_bytes)) != 0) throw_errno(errno, "size guest RAM");
  return memfd;
}

// The descriptors handed to QEMU: each at the next free number in QEMU, those named by a path also in an fdset.
class PassedFds {
 public:
  PassedFds(VmLaunch& launch, QemuSpec& q) : launch_(launch), q_(q) {}
  int pass(int fd) {
    launch_.fds.push_back({fd, next_fd_});
    return next_fd_++;
  }
  std::string pass_in_set(int fd) {
    int target = pass(fd);
    q_.fds.push_back({target, ++fdset_});
    return fmt::format("/dev/fdset/{}", fdset_);
  }

 private:
  VmLaunch& launch_;
  QemuSpec& q_;
  int next_fd_ = 3;
  int fdset_ = 0;
};

QemuSpec base_qemu_spec(const VmBootSpec& spec, const VmRestore* from, bool from_template) {
  QemuSpec q;
  q.name = spec.id;
  q.binary = spec.qemu;
  q.accelerator = spec.accelerator;
  q.tcg_tb_size_mib = spec.tcg_tb_size_mib;
  q.vcpus = spec.vcpus;
  q.memory_bytes = spec.memory_bytes;
  q.memory_share = !from_template;
  // No balloon. Its free page reporting gives pages back by punching holes in the RAM's file, and a clone's file is
  // its template's sealed memfd, which refuses (and must); the devices of a template, its clones, a fork's parent
  // and copies, a VM and its woken self must be the same, so no VM has one.
  q.balloon = false;
  q.incoming = from != nullptr;
  q.start_paused = from && from->paused;
  return q;
}

// The image's layers (each with its data file, when it has one) and the sandbox's disk as QEMU's block devices,
// their files opened into `held`; returns what the guest is told of them.
gp::Setup add_block_devices(const VmBootSpec& spec, QemuSpec& q, PassedFds& fds, std::vector<UniqueFd>& held) {
  gp::Setup setup;
  for (std::size_t i = 0; i < spec.layers.size(); ++i) {
    const auto& layer = spec.layers[i];
    held.push_back(open_or_throw(layer.file, O_RDONLY));
    BlockDevice meta;
    meta.node_name = fmt::format("layer{}", i);
    meta.filename = fds.pass_in_set(held.back().get());
    meta.serial = fmt::format("dsec-layer-{}", i);
    q.block_devices.push_back(meta);
    gp::SetupLayer sl{meta.serial, {}};
    if (!layer.data_file.empty()) {
      held.push_back(open_or_throw(layer.data_file, O_RDONLY));
      BlockDevice data;
      data.node_name = fmt::format("layer{}data", i);
      data.filename = fds.pass_in_set(held.back().get());
      data.serial = fmt::format("dsec-data-{}", i);
      q.block_devices.push_back(data);
      sl.data_serial = data.serial;
    }
    setup.layers.push_back(sl);
  }
  if (!spec.disk.empty()) {
    held.push_back(open_or_throw(spec.disk, O_RDWR));
    BlockDevice disk;
    disk.node_name = "disk";
    disk.filename = fds.pass_in_set(held.back().get());
    disk.read_only = false;
    disk.serial = "dsec-disk";
    q.block_devices.push_back(disk);
    setup.disk_serial = disk.serial;
  }
  return setup;
}

std::string guest_kernel_cmdline(const VmBootSpec& spec, const gp::Setup& setup) {
  CmdlineOptions cmdline;
  if (spec.full_system) {
    // dsec-init as the initramfs's /init: the root from these disks, then the image's own init.
    if (spec.layers.empty() || spec.disk.empty())
      throw Error(Code::kInvalidArgument,
                  fmt::format("sandbox {}: a full system boots from layers and a disk", spec.id));
    cmdline.guest_mode = "boot";
    cmdline.extra.push_back("dsec_root=" + gp::encode_root_word(setup));
  } else {
    cmdline.guest_mode = "1";  // dsec-init as the guest's pid 1, serving the agent
  }
  cmdline.accelerator = spec.accelerator;
  cmdline.tsc_khz = spec.tsc_khz;
  return qemu::kernel_cmdline(cmdline);
}

// The guest of `vm` did not come up (`e`): QEMU is stopped, and the error tells what it wrote last.
[[noreturn]] void throw_guest_not_up(VmInstance& vm, const Error& e, const VmBootSpec& spec, bool restoring) {
  // Give QEMU a moment to finish writing why it stopped.
  if (!vm.exited()) vm.kill();
  std::string words = vm.last_words();
  Code code = e.code();
  // A full system's boot stage (dsec-init in the initramfs) that powered the VM off said why on the console: the
  // image cannot boot (no /sbin/init, a root that cannot be built), and a retry would only repeat it.
  if (!restoring && spec.full_system && words.find(": powering off") != std::string::npos)
    throw Error(Code::kFailedPrecondition,
                fmt::format("sandbox {}: the image cannot boot as a full VM{}", spec.id, words), /*retryable=*/false);
  if (code == Code::kDeadlineExceeded)
    throw Error(code, fmt::format("sandbox {}: the guest did not come up in time ({}){}", spec.id, e.what(), words));
  throw Error(code == Code::kInternal ? Code::kUnavailable : code,
              fmt::format("sandbox {}: the guest did not come up: {}{}", spec.id, e.what(), words));
}

}  // namespace

std::unique_ptr<VmInstance> VmInstance::start(const VmBootSpec& spec, const VmRestore* from,
                                              Clock::time_point deadline) {
  std::unique_ptr<VmInstance> vm(new VmInstance());
  vm->id_ = spec.id;
  vm->run_dir_ = spec.run_dir;
  const fs::path& dir = spec.run_dir;

  int memory_fd = -1;
  if (from && from->template_memory) {
    vm->template_ = from->template_memory;
    memory_fd = vm->template_->get();
  } else if (from && !from->into_memfd) {
    // Anonymous RAM: memory_fd stays -1.
  } else {
    UniqueFd memfd = guest_ram_memfd(spec);
    memory_fd = memfd.get();
    vm->memory_ = std::make_shared<const UniqueFd>(std::move(memfd));
  }
  UniqueFd state;
  if (from) state = open_or_throw(from->state_file, O_RDONLY);

  UniqueFd kernel = open_or_throw(spec.kernel, O_RDONLY);
  UniqueFd initrd = open_or_throw(spec.initrd, O_RDONLY);
  UniqueFd console = open_or_throw(dir / "console.log", O_WRONLY | O_CREAT | O_APPEND, 0600);
  UniqueFd qemu_log = open_or_throw(dir / "qemu.log", O_WRONLY | O_CREAT | O_APPEND, 0600);
  UniqueFd qmp_listen = listen_unix(dir / "qmp.sock");
  UniqueFd agent_listen = listen_unix(dir / "agent.sock");

  QemuSpec q = base_qemu_spec(spec, from, !!vm->template_);
  VmLaunch launch;
  std::vector<UniqueFd> held;  // every descriptor handed to QEMU, closed here once it runs
  PassedFds fds(launch, q);
  if (memory_fd >= 0) q.memory_path = fmt::format("/proc/self/fd/{}", fds.pass(memory_fd));
  q.kernel = fmt::format("/proc/self/fd/{}", fds.pass(kernel.get()));
  q.initrd = fmt::format("/proc/self/fd/{}", fds.pass(initrd.get()));
  q.qmp_listen_fd = fds.pass(qmp_listen.get());
  q.agent_listen_fd = fds.pass(agent_listen.get());
  q.console_path = fds.pass_in_set(console.get());

  gp::Setup setup = add_block_devices(spec, q, fds, held);
  q.machine = spec.full_system ? qemu::Machine::kQ35 : qemu::Machine::kMicrovm;
  q.display = spec.display;
  q.usb_input = spec.usb_input;
  q.kernel_cmdline = guest_kernel_cmdline(spec, setup);

  launch.argv = qemu::qemu_argv(q);
  launch.uid = spec.uid;
  launch.gid = spec.gid;
  launch.extra_group = spec.kvm_group;
  launch.cgroup_procs = spec.cgroup_procs;
  launch.log_fd = qemu_log.get();
  launch.sched_idle = spec.sched_idle;
  vm->process_ = qemu::launch_vm(launch);
  // QEMU holds its copies now. The agent keeps none of the listening sockets: with a copy here, a connection to a
  // QEMU that died would wait in the backlog forever instead of failing.
  qmp_listen.reset();
  agent_listen.reset();

  try {
    vm->qmp_.emplace(QmpClient::connect(dir / "qmp.sock", deadline));
    if (from) vm->load_state(state, !!vm->template_, from->paused, deadline);
    if (from && from->paused) return vm;
    vm->guest_ = std::make_unique<guest::GuestChannel>(connect_unix(dir / "agent.sock"), spec.id);
    vm->greet(spec.hostname, deadline, from != nullptr || spec.full_system);
    if (!from && !spec.full_system && (!spec.layers.empty() || !spec.disk.empty())) vm->guest_->setup(setup, deadline);
  } catch (const Error& e) {
    throw_guest_not_up(*vm, e, spec, from != nullptr);
  }
  return vm;
}

std::unique_ptr<VmInstance> VmInstance::attach(const std::string& id, const fs::path& run_dir, pid_t pid,
                                               UniqueFd pidfd, bool clone, const std::string& hostname,
                                               Clock::time_point deadline) {
  std::unique_ptr<VmInstance> vm(new VmInstance());
  vm->id_ = id;
  vm->run_dir_ = run_dir;
  vm->process_.pid = pid;
  vm->process_.pidfd = std::move(pidfd);
  vm->adopted_ = true;
  // QEMU keeps the descriptor it was given for guest RAM (number 3, see start()); the agent takes a copy back.
  // A VM restored into anonymous memory has no such descriptor (its 3 is another file): only a memfd counts.
  UniqueFd memory(static_cast<int>(::syscall(SYS_pidfd_getfd, vm->process_.pidfd.get(), 3, 0)));
  if (memory && ::fcntl(memory.get(), F_GET_SEALS) >= 0)
    (clone ? vm->template_ : vm->memory_) = std::make_shared<const UniqueFd>(std::move(memory));
  vm->qmp_.emplace(QmpClient::connect(run_dir / "qmp.sock", deadline));
  std::string status = qemu::qmp_status(*vm->qmp_);
  if (status != "running")
    throw Error(Code::kFailedPrecondition, fmt::format("sandbox {}: its VM is {}, not running", id, status));
  vm->guest_ = std::make_unique<guest::GuestChannel>(connect_unix(run_dir / "agent.sock"), id);
  vm->greet(hostname, deadline, /*repeat=*/true);
  return vm;
}

void VmInstance::become(const std::string& id, const fs::path& run_dir, const std::string& hostname,
                        Clock::time_point deadline) {
  id_ = id;
  run_dir_ = run_dir;
  guest().relabel(id);
  greet(hostname, deadline, /*repeat=*/false);
}

void VmInstance::greet(const std::string& hostname, Clock::time_point deadline, bool repeat) {
  gp::Hello hello;
  hello.realtime_ns = realtime_ns();
  hello.entropy.resize(32);
  if (::getrandom(hello.entropy.data(), hello.entropy.size(), 0) != static_cast<ssize_t>(hello.entropy.size()))
    hello.entropy.clear();
  hello.hostname = hostname;
  if (!repeat) {
    (void)guest_->hello(hello, deadline);
    return;
  }
  // A restored guest learns only after it runs again that its port's peer changed, and then reopens the port,
  // which can drop a hello sent before: ask again until one is answered.
  for (;;) {
    auto attempt = std::min(deadline, Clock::now() + std::chrono::milliseconds(500));
    try {
      (void)guest_->hello(hello, attempt);
      return;
    } catch (const Error& e) {
      if (e.code() != Code::kDeadlineExceeded || Clock::now() >= deadline) throw;
    }
  }
}

void VmInstance::load_state(const UniqueFd& state, bool ignore_shared, bool paused, Clock::time_point deadline) {
  std::lock_guard lock(qmp_mu_);
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  qmp_->execute(
      "migrate-set-capabilities",
      {{"capabilities", nlohmann::json::array({{{"capability", "x-ignore-shared"}, {"state", ignore_shared}}})}},
      left());
  qmp_->execute_with_fds("getfd", {{"fdname", "state"}}, {state.get()}, left());
  qmp_->execute("migrate-incoming", {{"uri", "fd:state"}}, left());
  // QEMU runs the guest on its own once the stream is loaded (no -S).
  for (;;) {
    std::string status = qemu::qmp_status(*qmp_);
    if (status == "running") return;
    if (status == "paused" || status == "postmigrate") {
      if (!paused) qmp_->execute("cont", nlohmann::json::object(), left());
      return;
    }
    if (status != "inmigrate" && status != "prelaunch")
      throw Error(Code::kUnavailable, fmt::format("restoring the VM ended in state '{}'", status));
    if (Clock::now() >= deadline) throw Error(Code::kDeadlineExceeded, "restoring the VM's state took too long");
    ::usleep(1000);
  }
}

void VmInstance::save(const fs::path& state_file, bool ignore_shared, std::chrono::milliseconds timeout) {
  std::lock_guard lock(qmp_mu_);
  if (!qmp_) throw Error(Code::kUnavailable, fmt::format("sandbox {}: no QMP connection", id_));
  UniqueFd out = open_or_throw(state_file, O_WRONLY | O_CREAT | O_TRUNC, 0600);
  qmp_->execute("stop");
  qmp_->execute(
      "migrate-set-capabilities",
      {{"capabilities", nlohmann::json::array({{{"capability", "x-ignore-shared"}, {"state", ignore_shared}}})}});
  // QEMU throttles migration to 32 MiB/s unless told otherwise; a file takes what the disk gives.
  qmp_->execute("migrate-set-parameters", {{"max-bandwidth", std::int64_t{1} << 40}});
  qmp_->execute_with_fds("getfd", {{"fdname", "save"}}, {out.get()});
  qmp_->execute("migrate", {{"uri", "fd:save"}});
  qemu::qmp_wait_migration(*qmp_, timeout);
  if (::fsync(out.get()) != 0) throw_errno_fmt(errno, "fsync {}", state_file.string());
  // The page cache of what QEMU wrote is charged to the sandbox: on disk now, it need not stay in memory.
  ::posix_fadvise(out.get(), 0, 0, POSIX_FADV_DONTNEED);
}

std::uint64_t VmInstance::punch_zero_pages() {
  if (!memory_) return 0;
  int fd = memory_->get();
  off_t size = ::lseek(fd, 0, SEEK_END);
  constexpr std::size_t kChunk = 1u << 20, kPage = 4096;
  std::vector<char> buf(kChunk);
  std::uint64_t freed = 0;
  for (off_t pos = 0; pos < size;) {
    off_t data = ::lseek(fd, pos, SEEK_DATA);
    if (data < 0) break;
    ssize_t n = ::pread(fd, buf.data(), kChunk, data);
    if (n <= 0) break;
    for (std::size_t off = 0; off + kPage <= static_cast<std::size_t>(n); off += kPage) {
      const char* p = buf.data() + off;
      if (p[0] == 0 && std::memcmp(p, p + 1, kPage - 1) == 0) {
        if (::fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, data + static_cast<off_t>(off), kPage) == 0)
          freed += kPage;
      }
    }
    pos = data + n;
  }
  return freed;
}

VmInstance::~VmInstance() {
  try {
    kill();
  } catch (...) {
  }
}

bool VmInstance::exited() const { return !process_.pidfd || qemu::process_exited(process_.pidfd.get()); }

void VmInstance::kill() {
  if (guest_) guest_->close();
  if (killed_ || !process_.pidfd) return;
  killed_ = true;
  if (!qemu::kill_and_wait(process_.pidfd.get(), process_.pid, std::chrono::seconds(10)))
    log_warn("sandbox {}: QEMU (pid {}) did not exit 10 s after SIGKILL", id_, process_.pid);
}

std::string VmInstance::last_words() const {
  std::string out;
  std::string console = qemu::file_tail(run_dir_ / "console.log", 6);
  std::string qemu_log = qemu::file_tail(run_dir_ / "qemu.log", 4);
  if (!console.empty()) out += "; guest console: " + console;
  if (!qemu_log.empty()) out += "; qemu: " + qemu_log;
  return out;
}

nlohmann::json VmInstance::qmp(std::string_view command, const nlohmann::json& arguments) {
  std::lock_guard lock(qmp_mu_);
  if (!qmp_) throw Error(Code::kUnavailable, fmt::format("sandbox {}: no QMP connection", id_));
  return qmp_->execute(command, arguments);
}

TemplatePtr freeze_vm(VmInstance& vm, std::string key, const fs::path& dir, const fs::path& disk,
                      std::uint64_t memory_bytes) {
  if (!vm.memory()) throw Error(Code::kFailedPrecondition, "a clone of a template cannot itself be frozen");
  const auto started = Clock::now();
  fs::create_directories(dir);
  ::chmod(dir.c_str(), 0700);
  auto t = std::make_shared<qemu::VmTemplate>();
  t->key = std::move(key);
  t->dir = dir;
  t->state = dir / "state";
  t->disk = dir / "disk";
  t->memory_bytes = memory_bytes;
  vm.save(t->state, /*ignore_shared=*/true, std::chrono::seconds(60));
  GuestMemory memory = vm.memory();
  vm.kill();
  // The disk as the stopped guest left it: it and the RAM are one consistent machine.
  if (disk != t->disk) qemu::copy_sparse(disk, t->disk);
  // Every page of the template exists before it is sealed: a clone's fault on a page the template never touched
  // (a read of never-written memory, a migration save reading all of it) would otherwise add the page to the
  // template's memfd, charged to that clone and kept until the template goes. Allocated, the template costs its
  // size once, and clones only ever copy the pages they write.
  if (::fallocate(memory->get(), 0, 0, static_cast<off_t>(memory_bytes)) != 0)
    throw_errno(errno, "allocate the template's guest RAM");
  qemu::seal_memory(memory->get());
  t->memory = std::move(memory);
  t->build_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return t;
}

}  // namespace dsec::agent::qemu
