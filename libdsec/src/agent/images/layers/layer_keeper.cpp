#include "agent/images/layers/layer_keeper.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <vector>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/syscall.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::layers {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kKeeperName = "dsec-layer-keeper";

struct ProcStat {
  std::string comm;
  char state = '?';
  pid_t ppid = 0;
  std::uint64_t start_time = 0;
};

// Fields of /proc/<pid>/stat: the name is in parentheses and may hold spaces and parentheses itself, so the fields
// are counted from the last ')'.
std::optional<ProcStat> read_proc_stat(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (!std::getline(in, line)) return std::nullopt;
  auto open = line.find('('), close = line.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close < open) return std::nullopt;
  ProcStat out;
  out.comm = line.substr(open + 1, close - open - 1);
  std::istringstream fields(line.substr(close + 1));
  std::vector<std::string> f;
  for (std::string w; fields >> w;) f.push_back(std::move(w));
  // f[0] is field 3 (state), f[1] field 4 (ppid), f[19] field 22 (starttime).
  if (f.size() < 20 || f[0].empty()) return std::nullopt;
  try {
    out.state = f[0][0];
    out.ppid = static_cast<pid_t>(std::stol(f[1]));
    out.start_time = std::stoull(f[19]);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  return out;
}

bool is_fuse_device(int fd) {
  struct stat st {};
  return ::fstat(fd, &st) == 0 && S_ISCHR(st.st_mode) && major(st.st_rdev) == 10 && minor(st.st_rdev) == 229;
}

// Waits up to `limit` for the process behind `pidfd` to end.
bool wait_exit(int pidfd, std::chrono::milliseconds limit) {
  pollfd p{pidfd, POLLIN, 0};
  auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    int n = ::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(left.count(), 0)));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return false;
  }
}

void write_record(const fs::path& path, const KeeperRecord& r) {
  fs::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "pid " << r.pid << "\nstart_time " << r.start_time << "\nboot_id " << r.boot_id << "\nconnection "
        << r.connection << "\n";
    out.flush();
    if (!out) throw Error(Code::kInternal, fmt::format("write the layer keeper record {}", tmp.string()));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw_errno_fmt(errno, "rename {} to {}", tmp.string(), path.string());
}

}  // namespace

std::optional<KeeperRecord> read_keeper_record(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  KeeperRecord r;
  int seen = 0;
  std::string key;
  while (in >> key) {
    if (key == "pid" && in >> r.pid) seen |= 1;
    else if (key == "start_time" && in >> r.start_time) seen |= 2;
    else if (key == "boot_id" && in >> r.boot_id) seen |= 4;
    else if (key == "connection" && in >> r.connection) seen |= 8;
    else return std::nullopt;
  }
  if (seen != 15 || r.pid <= 0) return std::nullopt;
  return r;
}

std::uint64_t process_start_time(pid_t pid) {
  auto st = read_proc_stat(pid);
  return st ? st->start_time : 0;
}

std::string current_boot_id() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  in >> id;
  return id;
}

fs::path default_keeper_binary() {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return fs::path(kKeeperName);
  return self.parent_path() / kKeeperName;
}

LayerKeeper::LayerKeeper(UniqueFd pidfd, KeeperRecord record, fs::path record_path, bool child)
    : pidfd_(std::move(pidfd)), record_(std::move(record)), record_path_(std::move(record_path)), child_(child) {}

LayerKeeper::~LayerKeeper() {
  if (child_ && !reaped_) {
    pollfd p{pidfd_.get(), POLLIN, 0};
    if (::poll(&p, 1, 0) > 0) reap();
  }
}

std::unique_ptr<LayerKeeper> LayerKeeper::start(const fs::path& binary, int fuse_fd, unsigned connection,
                                                const fs::path& record) {
  if (::access(binary.c_str(), X_OK) != 0)
    throw Error(Code::kNotFound, fmt::format("layer keeper {}: {}", binary.string(), std::strerror(errno)));
  // A duplicate above the standard descriptors becomes the keeper's fd 3 (a dup2 onto itself would leave it
  // close-on-exec).
  UniqueFd dup(::fcntl(fuse_fd, F_DUPFD_CLOEXEC, 10));
  if (!dup) throw_errno(errno, "duplicate the layer file system's FUSE descriptor");

  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attr;
  ::posix_spawn_file_actions_init(&actions);
  ::posix_spawnattr_init(&attr);
  ::posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDWR, 0);
  ::posix_spawn_file_actions_adddup2(&actions, 0, 1);
  ::posix_spawn_file_actions_adddup2(&actions, 0, 2);
  ::posix_spawn_file_actions_adddup2(&actions, dup.get(), 3);
  // Nothing else of the agent's: no other descriptor (whether or not it is close-on-exec), not its directory.
  ::posix_spawn_file_actions_addclosefrom_np(&actions, 4);
  ::posix_spawn_file_actions_addchdir_np(&actions, "/");
  sigset_t none, all;
  sigemptyset(&none);
  sigfillset(&all);
  ::posix_spawnattr_setsigmask(&attr, &none);
  ::posix_spawnattr_setsigdefault(&attr, &all);
  ::posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID | POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::string name(kKeeperName);
  char* argv[] = {name.data(), nullptr};
  char* envp[] = {nullptr};
  pid_t pid = 0;
  int rc = ::posix_spawn(&pid, binary.c_str(), &actions, &attr, argv, envp);
  ::posix_spawn_file_actions_destroy(&actions);
  ::posix_spawnattr_destroy(&attr);
  if (rc != 0) throw_errno_fmt(rc, "start the layer keeper {}", binary.string());

  UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  if (!pidfd) {
    int err = errno;
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
    throw_errno_fmt(err, "pidfd_open of the layer keeper {}", pid);
  }
  KeeperRecord r{pid, process_start_time(pid), current_boot_id(), connection};
  auto keeper = std::unique_ptr<LayerKeeper>(new LayerKeeper(std::move(pidfd), r, record, true));
  try {
    if (r.start_time == 0) throw Error(Code::kInternal, fmt::format("layer keeper {} ended at once", pid));
    write_record(record, r);
  } catch (...) {
    keeper->stop();
    throw;
  }
  return keeper;
}

std::unique_ptr<LayerKeeper> LayerKeeper::find(const fs::path& record, std::string& why) {
  why.clear();
  std::optional<KeeperRecord> r = read_keeper_record(record);
  if (!r) {
    std::error_code ec;
    if (fs::exists(record, ec)) why = fmt::format("the keeper record {} cannot be read", record.string());
    return nullptr;
  }
  if (r->boot_id != current_boot_id()) {
    why = fmt::format("the keeper record {} is from an earlier boot", record.string());
    return nullptr;
  }
  // The pidfd is opened before the process is checked: it then names the process checked, even if the pid is
  // reused right after (a reuse before shows as another start time).
  UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, r->pid, 0)));
  if (!pidfd) {
    why = fmt::format("the layer keeper (pid {}) is gone", r->pid);
    return nullptr;
  }
  std::optional<ProcStat> st = read_proc_stat(r->pid);
  if (!st) {
    why = fmt::format("the layer keeper (pid {}) is gone", r->pid);
    return nullptr;
  }
  if (st->start_time != r->start_time) {
    why = fmt::format("pid {} is another process now (started at tick {}, the keeper at {})", r->pid, st->start_time,
                      r->start_time);
    return nullptr;
  }
  if (st->comm != kKeeperName.substr(0, 15)) {
    why = fmt::format("pid {} runs '{}', not {}", r->pid, st->comm, kKeeperName);
    return nullptr;
  }
  if (st->state == 'Z' || st->state == 'X') {
    why = fmt::format("the layer keeper (pid {}) has ended", r->pid);
    return nullptr;
  }
  return std::unique_ptr<LayerKeeper>(new LayerKeeper(std::move(pidfd), *r, record, st->ppid == ::getpid()));
}

UniqueFd LayerKeeper::take_connection() {
  UniqueFd fd(static_cast<int>(::syscall(SYS_pidfd_getfd, pidfd_.get(), 3, 0)));
  if (!fd) throw_errno_fmt(errno, "take the FUSE connection from the layer keeper (pid {})", record_.pid);
  if (!is_fuse_device(fd.get()))
    throw Error(Code::kFailedPrecondition,
                fmt::format("the layer keeper (pid {}) holds something other than /dev/fuse", record_.pid));
  return fd;
}

bool LayerKeeper::exited() {
  if (reaped_) return true;
  pollfd p{pidfd_.get(), POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  reap();
  return true;
}

void LayerKeeper::reap() {
  if (!child_ || reaped_) return;
  siginfo_t info{};
  int rc = ::waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(pidfd_.get()), &info, WEXITED | WNOHANG);
  if (rc == 0 ? info.si_pid != 0 : errno == ECHILD) reaped_ = true;
}

void LayerKeeper::stop() {
  if (stopped_) return;
  stopped_ = true;
  pollfd p{pidfd_.get(), POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) {
    ::syscall(SYS_pidfd_send_signal, pidfd_.get(), SIGTERM, nullptr, 0);
    if (!wait_exit(pidfd_.get(), std::chrono::milliseconds(2000))) {
      log_warn("layer keeper (pid {}) still there 2 s after SIGTERM; killing it", record_.pid);
      ::syscall(SYS_pidfd_send_signal, pidfd_.get(), SIGKILL, nullptr, 0);
      wait_exit(pidfd_.get(), std::chrono::milliseconds(2000));
    }
  }
  reap();
  // The record goes only while it still names this keeper.
  if (auto r = read_keeper_record(record_path_); r && r->pid == record_.pid && r->start_time == record_.start_time)
    ::unlink(record_path_.c_str());
}

}  // namespace dsec::agent::layers
