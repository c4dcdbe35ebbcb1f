#include "agent/backends/container/user_namespace.hpp"

#include <fcntl.h>
#include <linux/capability.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::container {
namespace {

namespace fs = std::filesystem;

struct Holder {
  pid_t agent;
};

// The child that owns a new namespace until its maps are written and the namespace opened; then it is killed. It
// dies with the agent too, and holds none of its descriptors: an agent killed between the clone and that kill left
// it behind with copies of every descriptor the agent had, the layer file system's /dev/fuse among them, which kept
// that file system's requests waiting for answers nobody would give.
int hold_namespace(void* arg) {
  ::syscall(SYS_close_range, 3U, ~0U, 0U);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != static_cast<const Holder*>(arg)->agent) ::_exit(0);
  for (;;) ::pause();
}

// The holder shares the agent's memory: no copy of the agent's page tables for a child that only waits. Not under
// ThreadSanitizer, whose clone interceptor takes every child for a forked copy and resets the sanitizer's state in
// it, which with CLONE_VM is the agent's own (it then lost the agent's lock ordering and reported races that were not
// there): that build gives the holder a copy.
#if defined(__SANITIZE_THREAD__)
constexpr int kHolderSharesMemory = 0;
#else
constexpr int kHolderSharesMemory = CLONE_VM;
#endif

void write_map(pid_t pid, const char* which, const std::string& map) {
  const std::string path = fmt::format("/proc/{}/{}", pid, which);
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) throw_errno_fmt(errno, "open {}", path);
  if (::write(fd.get(), map.data(), map.size()) != static_cast<ssize_t>(map.size()))
    throw_errno_fmt(errno, "write {} ('{}')", path, map.substr(0, map.size() - 1));
}

// Idmaps the detached mount `mount_fd` with the namespace `userns_fd`: 0 or an errno.
int idmap(int mount_fd, int userns_fd) {
  mount_attr attr{};
  attr.attr_set = MOUNT_ATTR_IDMAP;
  attr.userns_fd = static_cast<std::uint64_t>(userns_fd);
  return ::mount_setattr(mount_fd, "", AT_EMPTY_PATH, &attr, sizeof attr) == 0 ? 0 : errno;
}

void set_effective_to_permitted() {
  __user_cap_header_struct hdr{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2]{};
  if (::syscall(SYS_capget, &hdr, data) != 0) return;
  data[0].effective = data[0].permitted;
  data[1].effective = data[1].permitted;
  ::syscall(SYS_capset, &hdr, data);
}

}  // namespace

UniqueFd make_user_namespace(std::uint32_t first, std::uint32_t count) {
  constexpr std::size_t kStack = 64 << 10;
  void* stack = ::mmap(nullptr, kStack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (stack == MAP_FAILED) throw_errno(errno, "mmap stack");
  // The child shares the agent's memory: no signal handler of the agent may run in it (it inherits this mask).
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  Holder holder{::getpid()};
  pid_t pid = ::clone(hold_namespace, static_cast<char*>(stack) + kStack, kHolderSharesMemory | CLONE_NEWUSER | SIGCHLD,
                      &holder);
  int clone_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  struct Reap {
    pid_t pid;
    void* stack;
    std::size_t size;
    ~Reap() {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        int status;
        while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
        }
      }
      ::munmap(stack, size);
    }
  } reap{pid, stack, kStack};
  if (pid < 0) throw_errno(clone_errno, "clone a user namespace");
  const std::string map = fmt::format("0 {} {}\n", first, count);
  write_map(pid, "uid_map", map);
  write_map(pid, "gid_map", map);
  const std::string ns = fmt::format("/proc/{}/ns/user", pid);
  UniqueFd fd(::open(ns.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw_errno_fmt(errno, "open {}", ns);
  return fd;
}

std::string uid_map_of(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/uid_map", pid));
  std::string out, a, b, c;
  while (in >> a >> b >> c) out += fmt::format("{}{} {} {}", out.empty() ? "" : " ", a, b, c);
  return out;
}

ScopedFsIds::ScopedFsIds(std::optional<std::uint32_t> first) {
  if (!first) return;
  // Per thread (raw syscalls; glibc's setfsuid is per thread too). Leaving fsuid 0 drops the file capabilities from
  // the effective set: they are raised again, so the agent still reaches files of every user inside.
  ::syscall(SYS_setfsgid, *first);
  ::syscall(SYS_setfsuid, *first);
  set_effective_to_permitted();
  active_ = true;
}

ScopedFsIds::~ScopedFsIds() {
  if (!active_) return;
  ::syscall(SYS_setfsuid, 0);  // back to 0: the kernel raises the file capabilities again
  ::syscall(SYS_setfsgid, 0);
}

UserNamespaces::UserNamespaces(UsernsOptions options)
    : options_(std::move(options)), ids_(options_.first, options_.blocks, kUsernsIds, "user namespace ids") {
  if (options_.mode != "auto" && options_.mode != "on" && options_.mode != "off")
    throw Error(Code::kInvalidArgument, fmt::format("--userns: '{}' is not auto, on or off", options_.mode));
  if (options_.blocks == 0 ||
      static_cast<std::uint64_t>(options_.first) + std::uint64_t{options_.blocks} * kUsernsIds > 0xFFFFFFFFull ||
      options_.first == 0)
    throw Error(Code::kInvalidArgument,
                fmt::format("--userns-range {}:{}: the blocks must lie within host ids 1..4294967294", options_.first,
                            options_.blocks));
  if (options_.mode == "off") {
    why_off_ = "turned off (--userns off)";
    return;
  }
  try {
    probe_ns_ = make_user_namespace(options_.first, 1);
    // The writable layer is a tmpfs: it must idmap (Linux 6.3 and later).
    UniqueFd fsfd(::fsopen("tmpfs", FSOPEN_CLOEXEC));
    if (!fsfd) throw_errno(errno, "fsopen tmpfs");
    if (::fsconfig(fsfd.get(), FSCONFIG_CMD_CREATE, nullptr, nullptr, 0) != 0) throw_errno(errno, "create a tmpfs");
    UniqueFd mnt(::fsmount(fsfd.get(), FSMOUNT_CLOEXEC, 0));
    if (!mnt) throw_errno(errno, "fsmount tmpfs");
    if (int err = idmap(mnt.get(), probe_ns_.get()); err != 0)
      throw_errno(err, "an idmapped mount of a tmpfs (the writable layer; Linux 6.3 has them)");
    claims_.emplace(options_.claims_dir, options_.run_dir);
    enabled_ = true;
  } catch (const std::exception& e) {
    why_off_ = fmt::format("the kernel cannot: {}", e.what());
    probe_ns_.reset();
    if (options_.mode == "on")
      throw Error(Code::kFailedPrecondition,
                  fmt::format("--userns on: sandboxes cannot get user namespaces: {}", why_off_));
    log_warn("sandboxes run with host ids: {}", why_off_);
  }
}

UserNamespaces::~UserNamespaces() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_filler_.notify_all();
  if (filler_.joinable()) filler_.join();
  for (auto& ns : ready_) give_back(ns.first);
}

std::string UserNamespaces::describe() const {
  if (!enabled_) return fmt::format("off ({})", why_off_);
  return fmt::format("idmapped (ids from {}, {} blocks of {})", options_.first, options_.blocks, kUsernsIds);
}

UserNamespaces::Namespace UserNamespaces::make_one() {
  Namespace ns;
  ns.first = ids_.take([this](std::uint32_t first) { return claims_->claim(first); });
  try {
    ns.fd = make_user_namespace(ns.first, kUsernsIds);
  } catch (...) {
    give_back(ns.first);
    throw;
  }
  return ns;
}

UserNamespaces::Namespace UserNamespaces::take() {
  if (!enabled_) throw Error(Code::kFailedPrecondition, fmt::format("user namespaces are {}", describe()));
  {
    std::unique_lock lock(mu_);
    if (!started_) {
      // The first take comes after recovery: what the agent before a restart claimed and nobody took back is free.
      started_ = true;
      lock.unlock();
      sweep_previous_claims();
      lock.lock();
      if (options_.ready > 0) filler_ = std::thread([this] { fill(); });
    }
    if (!ready_.empty()) {
      Namespace ns = std::move(ready_.front());
      ready_.pop_front();
      lock.unlock();
      wake_filler_.notify_one();
      return ns;
    }
  }
  return make_one();
}

void UserNamespaces::fill() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    if (ready_.size() >= options_.ready) {
      wake_filler_.wait(lock);
      continue;
    }
    lock.unlock();
    std::optional<Namespace> ns;
    try {
      ns = make_one();
    } catch (const std::exception& e) {
      // Every block in use, or the kernel refused: try again when a block comes back, or in a while.
      (void)e;
    }
    lock.lock();
    if (ns) ready_.push_back(std::move(*ns));
    else wake_filler_.wait_for(lock, std::chrono::seconds(1));
  }
}

void UserNamespaces::give_back(std::uint32_t first) {
  if (claims_) claims_->release(first);
  ids_.give_back(first);
  wake_filler_.notify_one();
}

bool UserNamespaces::adopt(std::uint32_t first) {
  if (!enabled_ || !ids_.claim(first)) return false;
  if (!claims_->take_over(first)) {
    ids_.give_back(first);
    return false;
  }
  return true;
}

void UserNamespaces::sweep_previous_claims() {
  try {
    claims_->release_previous([this](std::uint32_t first) {
      // In use by this agent (adopted): keep. HostIdPool::claim would take it, so ask by trying and undoing.
      if (ids_.claim(first)) {
        ids_.give_back(first);
        return false;
      }
      return true;
    });
  } catch (const std::exception& e) {
    log_warn("host id claims of the agent before the restart: {}", e.what());
  }
}

bool UserNamespaces::can_idmap(const fs::path& dir) {
  if (!enabled_) return false;
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return false;
  {
    std::lock_guard lock(mu_);
    if (auto it = idmappable_.find(st.st_dev); it != idmappable_.end()) return it->second;
  }
  UniqueFd tree(::open_tree(AT_FDCWD, dir.c_str(), OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC));
  int err = tree ? idmap(tree.get(), probe_ns_.get()) : errno;
  if (err != 0)
    log_warn("layers on {} cannot be idmapped ({}): sandboxes over them run with host ids", dir.string(),
             std::strerror(err));
  std::lock_guard lock(mu_);
  idmappable_[st.st_dev] = err == 0;
  return err == 0;
}

}  // namespace dsec::agent::container
