#include "agent/backends/qemu/vm_process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "common/syscall.hpp"

namespace dsec::agent::qemu {
namespace {

enum Step : int { kNone = 0, kDup, kCgroup, kGroups, kGid, kUid, kNoNewPrivs, kSched, kExec };

const char* step_name(int step) {
  switch (step) {
    case kDup:
      return "place its descriptors";
    case kCgroup:
      return "join the sandbox's cgroup";
    case kGroups:
      return "drop supplementary groups";
    case kGid:
      return "change gid";
    case kUid:
      return "change uid";
    case kNoNewPrivs:
      return "set no_new_privs";
    case kSched:
      return "run SCHED_IDLE";
    case kExec:
      return "exec";
    default:
      return "start";
  }
}

// QEMU, started as `pid`, with its pidfd; killed and reaped when there is none.
VmProcess started_process(pid_t pid) {
  VmProcess out;
  out.pid = pid;
  out.pidfd.reset(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!out.pidfd) {
    int err = errno;
    ::kill(pid, SIGKILL);
    int status;
    ::waitpid(pid, &status, 0);
    throw_errno(err, "pidfd_open for QEMU");
  }
  return out;
}

}  // namespace

bool set_sched_idle_threads(pid_t pid) {
  bool all = true;
  // Twice: a thread started during the first pass by a thread not yet changed is caught by the second.
  for (int pass = 0; pass < 2; ++pass) {
    std::error_code ec;
    for (const auto& task : std::filesystem::directory_iterator(fmt::format("/proc/{}/task", pid), ec)) {
      const pid_t tid = static_cast<pid_t>(std::strtol(task.path().filename().c_str(), nullptr, 10));
      sched_param idle{};
      if (tid > 0 && ::sched_getscheduler(tid) != SCHED_IDLE && ::sched_setscheduler(tid, SCHED_IDLE, &idle) != 0)
        all = false;
    }
    if (ec) return false;
  }
  return all;
}

VmProcess launch_vm(const VmLaunch& launch) {
  if (launch.argv.empty()) throw Error(Code::kInvalidArgument, "launch_vm: empty argv");
  // Everything the child touches is made here: between vfork and exec it shares this memory and may not allocate.
  std::vector<std::string> argv_copy = launch.argv;
  std::vector<char*> argv;
  argv.reserve(argv_copy.size() + 1);
  for (auto& a : argv_copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::string path_env = "PATH=/usr/local/bin:/usr/bin:/bin";
  char* envp[] = {path_env.data(), nullptr};
  UniqueFd null_fd(::open("/dev/null", O_RDWR | O_CLOEXEC));
  if (!null_fd) throw_errno(errno, "open /dev/null");
  // What the child reads after vfork is volatile: it runs on this stack frame, and the compiler must not keep these
  // in registers across vfork's second return (-Wclobbered).
  const volatile int log_fd = launch.log_fd >= 0 ? launch.log_fd : null_fd.get();
  int highest_target = 2;
  for (const auto& f : launch.fds) {
    if (f.target < 3) throw Error(Code::kInvalidArgument, "launch_vm: inherited descriptors start at 3");
    highest_target = std::max(highest_target, f.target);
  }
  // Sources are first moved above every target, so placing one cannot overwrite another still to be placed.
  const volatile int park = std::max(highest_target + 1, 64);
  std::vector<int> parked(launch.fds.size(), -1);
  gid_t groups[1] = {launch.extra_group.value_or(0)};
  const volatile int ngroups = launch.extra_group ? 1 : 0;

  volatile int child_step = kNone;
  volatile int child_errno = 0;
  pid_t pid = ::vfork();
  if (pid == 0) {
    auto fail = [&](int step) {
      child_errno = errno;
      child_step = step;
      _exit(127);
    };
    ::setsid();
    for (std::size_t i = 0; i < launch.fds.size(); ++i) {
      parked[i] = ::fcntl(launch.fds[i].source, F_DUPFD_CLOEXEC, park + static_cast<int>(i));
      if (parked[i] < 0) fail(kDup);
    }
    for (int procs : launch.cgroup_procs)
      if (::write(procs, "0", 1) != 1) fail(kCgroup);
    if (::dup2(null_fd.get(), 0) < 0 || ::dup2(log_fd, 1) < 0 || ::dup2(log_fd, 2) < 0) fail(kDup);
    for (std::size_t i = 0; i < launch.fds.size(); ++i)
      if (::dup2(parked[i], launch.fds[i].target) < 0) fail(kDup);
    // Raw syscalls: glibc's wrappers would signal every thread of the agent (which this child shares memory with)
    // to change their ids too.
    if (::syscall(SYS_setgroups, ngroups, groups) != 0) fail(kGroups);
    if (::syscall(SYS_setresgid, launch.gid, launch.gid, launch.gid) != 0) fail(kGid);
    if (::syscall(SYS_setresuid, launch.uid, launch.uid, launch.uid) != 0) fail(kUid);
    if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) fail(kNoNewPrivs);
    if (launch.sched_idle) {
      sched_param idle{};
      if (::sched_setscheduler(0, SCHED_IDLE, &idle) != 0) fail(kSched);
    }
    // Everything else of the agent's stays behind.
    ::syscall(SYS_close_range, static_cast<unsigned>(highest_target + 1), ~0u, 0);
    for (int sig = 1; sig < NSIG; ++sig) ::signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execve(argv[0], argv.data(), envp);
    fail(kExec);
  }
  if (pid < 0) throw_errno(errno, "vfork for QEMU");
  if (child_step != kNone) {
    int status;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    throw_errno_fmt(child_errno, "start QEMU ({}: {})", step_name(child_step), launch.argv[0]);
  }
  return started_process(pid);
}

bool process_exited(int pidfd) {
  pollfd p{pidfd, POLLIN, 0};
  return ::poll(&p, 1, 0) > 0;
}

bool wait_exit(int pidfd, pid_t pid, std::chrono::milliseconds wait) {
  pollfd p{pidfd, POLLIN, 0};
  auto until = std::chrono::steady_clock::now() + wait;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
    int rc = ::poll(&p, 1, static_cast<int>(std::max<long long>(0, left)));
    if (rc > 0) break;
    if (rc < 0 && errno == EINTR) continue;
    if (left <= 0) return false;
  }
  // Reap it when it is ours (a QEMU taken over after a restart is not: the host's init reaps it).
  siginfo_t info{};
  ::waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(pidfd), &info, WEXITED | WNOHANG);
  (void)pid;
  return true;
}

bool kill_and_wait(int pidfd, pid_t pid, std::chrono::milliseconds wait) {
  ::syscall(SYS_pidfd_send_signal, pidfd, SIGKILL, nullptr, 0);
  return wait_exit(pidfd, pid, wait);
}

std::string file_tail(const std::filesystem::path& path, std::size_t lines, std::size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  in.seekg(0, std::ios::end);
  auto size = static_cast<std::size_t>(std::max<std::streamoff>(0, in.tellg()));
  std::size_t from = size > max_bytes ? size - max_bytes : 0;
  in.seekg(static_cast<std::streamoff>(from));
  std::string data(size - from, '\0');
  in.read(data.data(), static_cast<std::streamsize>(data.size()));
  data.resize(static_cast<std::size_t>(in.gcount()));
  std::string clean;
  for (char c : data) {
    auto u = static_cast<unsigned char>(c);
    if (c == '\r') continue;
    if (c == '\n' || c == '\t' || u >= 0x20) clean.push_back(u == 0x7f ? '?' : c);
  }
  while (!clean.empty() && clean.back() == '\n') clean.pop_back();
  std::size_t pos = clean.size();
  for (std::size_t n = 0; n < lines && pos > 0; ++n) {
    auto nl = clean.rfind('\n', pos - 1);
    if (nl == std::string::npos) {
      pos = 0;
      break;
    }
    pos = nl;
  }
  return clean.substr(pos == 0 ? 0 : pos + 1);
}

std::uint64_t bound_log(const std::filesystem::path& path, std::uint64_t max_bytes, std::uint64_t keep_bytes) {
  // Every VM's logs at every reaper pass: a stat, and a descriptor only for a log that is over.
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || static_cast<std::uint64_t>(st.st_size) <= max_bytes)
    return 0;
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_APPEND | O_CLOEXEC | O_NOFOLLOW));
  if (!fd || ::fstat(fd.get(), &st) != 0 || !S_ISREG(st.st_mode)) return 0;
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size <= max_bytes) return 0;
  keep_bytes = std::min(keep_bytes, size);
  std::string tail(keep_bytes, '\0');
  ssize_t got = ::pread(fd.get(), tail.data(), tail.size(), static_cast<off_t>(size - keep_bytes));
  tail.resize(got > 0 ? static_cast<std::size_t>(got) : 0);
  // From the first whole line on, so that what stays reads as it was written.
  if (auto nl = tail.find('\n'); nl != std::string::npos && nl + 1 < tail.size()) tail.erase(0, nl + 1);
  const std::uint64_t dropped = size - tail.size();
  if (::ftruncate(fd.get(), 0) != 0) return 0;
  std::string text =
      fmt::format("[dsec: {} earlier bytes of this log dropped, it keeps the last {}]\n", dropped, keep_bytes) + tail;
  // O_APPEND: whatever the writer appended since the cut stays, ahead of the kept tail.
  for (std::string_view rest = text; !rest.empty();) {
    ssize_t n = ::write(fd.get(), rest.data(), rest.size());
    if (n <= 0) break;
    rest.remove_prefix(static_cast<std::size_t>(n));
  }
  return dropped;
}

}  // namespace dsec::agent::qemu
