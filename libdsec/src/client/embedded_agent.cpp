#include "client/embedded_agent.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string_view>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

extern char** environ;

namespace dsec::detail {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

constexpr int kReadyFd = 3;  // the fd number dsecd is told to write "ready\n" to
constexpr int kHighFd = 10;  // fds handed to the child are moved at or above this before the spawn

bool is_executable_file(const std::string& path) {
  struct stat st {};
  return !path.empty() && ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

constexpr std::string_view kDirPrefix = "dsec-client-";

// Whether something accepts connections on a unix socket.
bool socket_in_use(const std::string& path) {
  UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd || path.size() >= sizeof(sockaddr_un::sun_path)) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
}

// The private layer cache holds only files (layers are mounted under the run directory); never crosses a mount.
void remove_layer_cache(const std::string& private_dir) {
  ::nftw((private_dir + "/layers").c_str(),
         [](const char* path, const struct stat*, int type, struct FTW*) {
           if (type == FTW_DP) ::rmdir(path);
           else ::unlink(path);
           return 0;
         },
         16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
}

// The layer keeper an agent killed outright leaves (agent/images/layers/layer_keeper.hpp: it holds the layer file
// system's FUSE connection for a restart that never comes here): killed when its record still names it (pid, start time
// and program checked through a pidfd), which ends the connection, so that nothing waits on it; its record goes.
void end_layer_keeper(const std::string& layers) {
  const std::string record = layers + "/keeper";
  unsigned long long pid = 0, start = 0;
  if (FILE* f = std::fopen(record.c_str(), "re")) {
    char key[32];
    unsigned long long value = 0;
    while (std::fscanf(f, "%31s", key) == 1) {
      if (std::strcmp(key, "pid") == 0 && std::fscanf(f, "%llu", &value) == 1) pid = value;
      else if (std::strcmp(key, "start_time") == 0 && std::fscanf(f, "%llu", &value) == 1) start = value;
      else if (std::fscanf(f, "%*s") == EOF) break;
    }
    std::fclose(f);
  }
  if (pid > 0 && pid < (1ull << 22)) {
    UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0)));
    char stat[512] = {};
    if (pidfd) {
      if (FILE* f = std::fopen(fmt::format("/proc/{}/stat", pid).c_str(), "re")) {
        std::size_t n = std::fread(stat, 1, sizeof stat - 1, f);
        stat[n] = '\0';
        std::fclose(f);
      }
    }
    // "pid (comm) state ppid ...": starttime is the 20th field after the name.
    const char* name = std::strchr(stat, '(');
    const char* close = std::strrchr(stat, ')');
    unsigned long long started = 0;
    if (name && close && close > name &&
        std::string_view(name + 1, static_cast<std::size_t>(close - name - 1)) == "dsec-layer-keep" &&
        std::sscanf(close + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
                    &started) == 1 &&
        started == start)
      ::syscall(SYS_pidfd_send_signal, pidfd.get(), SIGKILL, nullptr, 0);
  }
  ::unlink(record.c_str());
  ::unlink((record + ".tmp").c_str());
}

// An agent killed outright (SIGKILL) leaves its layer mounts under <run dir>/.layers: the layer file system (FUSE)
// and the EROFS mounts over it, and the keeper of the FUSE connection. The keeper ends, the mounts are detached,
// deepest first, with their empty mount points; nothing else under the run directory is touched.
void detach_layer_mounts(const std::string& run_dir) {
  const std::string layers = run_dir + "/.layers";
  end_layer_keeper(layers);
  std::vector<std::string> points;
  if (FILE* f = std::fopen("/proc/self/mountinfo", "re")) {
    char line[4096];
    while (std::fgets(line, sizeof line, f)) {
      char point[4096];
      if (std::sscanf(line, "%*s %*s %*s %*s %4095s", point) != 1) continue;
      std::string_view p(point);
      if (p.starts_with(layers + "/")) points.emplace_back(p);
    }
    std::fclose(f);
  }
  for (auto it = points.rbegin(); it != points.rend(); ++it) ::umount2(it->c_str(), MNT_DETACH);
  for (const auto& p : points) ::rmdir(p.c_str());
  ::rmdir(layers.c_str());
}

// Private directories of trainers that died without stopping their agent (SIGKILL, the OOM killer): the agent got
// SIGTERM then and went away, but nobody removed the directory. Only the files the client puts there are removed
// (recursively only in the layer cache, which holds nothing else), and only when the owning process is gone and no
// agent answers on the socket.
void sweep_stale_dirs(const std::string& base) {
  DIR* dir = ::opendir(base.c_str());
  if (!dir) return;
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(dir)) {
    std::string_view name(e->d_name);
    if (!name.starts_with(kDirPrefix)) continue;
    std::string_view rest = name.substr(kDirPrefix.size());
    pid_t owner = 0;
    auto [ptr, ec] = std::from_chars(rest.data(), rest.data() + rest.size(), owner);
    if (ec != std::errc() || owner <= 0 || ptr == rest.data() + rest.size() || *ptr != '-') continue;
    if (::kill(owner, 0) == 0 || errno != ESRCH) continue;  // the owner lives (or is not ours to judge)
    stale.push_back(base + "/" + std::string(name));
  }
  ::closedir(dir);
  for (const auto& d : stale) {
    if (socket_in_use(d + "/dsecd.sock")) continue;
    ::unlink((d + "/dsecd.sock").c_str());
    ::unlink((d + "/dsecd.log").c_str());
    detach_layer_mounts(d + "/run");
    ::rmdir((d + "/run/.snapshots").c_str());
    ::rmdir((d + "/run").c_str());
    ::rmdir((d + "/state").c_str());
    remove_layer_cache(d);
    ::rmdir(d.c_str());
  }
}

// A directory only this process uses, short enough for a unix socket path inside it, named after the process so
// that a later client can tell when its owner is gone.
std::string make_private_dir() {
  std::vector<std::string> bases;
  if (auto xdg = env_or_empty("XDG_RUNTIME_DIR"); !xdg.empty()) bases.push_back(xdg);
  bases.push_back("/run");
  if (auto tmp = env_or_empty("TMPDIR"); !tmp.empty()) bases.push_back(tmp);
  bases.push_back("/tmp");
  int last_errno = 0;
  for (const auto& base : bases) {
    std::string templ = fmt::format("{}/{}{}-XXXXXX", base, kDirPrefix, ::getpid());
    if (templ.size() + std::strlen("/dsecd.sock") > 107) continue;
    sweep_stale_dirs(base);
    if (::mkdtemp(templ.data())) return templ;
    last_errno = errno;
  }
  throw_errno(last_errno ? last_errno : ENAMETOOLONG,
              "creating a private directory for the embedded dsecd under $XDG_RUNTIME_DIR, /run, $TMPDIR or /tmp");
}

// Moves an fd to kHighFd or above (close-on-exec), so the child's dup2 onto 0..3 never clobbers another one.
UniqueFd move_high(UniqueFd fd, const char* what) {
  int high = ::fcntl(fd.get(), F_DUPFD_CLOEXEC, kHighFd);
  if (high < 0) throw_errno(errno, fmt::format("duplicating the {} fd for the embedded dsecd", what));
  return UniqueFd(high);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const char* abbrev = ::sigabbrev_np(WTERMSIG(status));
    return fmt::format("was killed by signal {} (SIG{})", WTERMSIG(status), abbrev ? abbrev : "?");
  }
  return fmt::format("ended with wait status {:#x}", status);
}

struct SpawnArgs {
  const char* path;
  char* const* argv;
  char* const* envp;
  int null_fd;
  int log_fd;
  int ready_fd;
  pid_t parent;
  volatile int child_errno;  // written by the vfork child (shared memory) when exec fails
};

// vfork shares the address space with the child until it execs, as posix_spawn does, so spawning from a large
// trainer costs no page-table copy. The child only makes async-signal-safe system calls.
[[gnu::noinline]] pid_t spawn_agent(SpawnArgs* a) {
  pid_t pid = ::vfork();
  if (pid != 0) return pid;
  // Child. Dies with the thread that spawned it (the keeper, which lives as long as the Client).
  if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0) {
    a->child_errno = errno;
    ::_exit(127);
  }
  if (::getppid() != a->parent) ::_exit(126);  // the trainer died before prctl took effect
  ::setsid();                                  // a Ctrl-C meant for the trainer does not reach the agent directly
  if (::dup2(a->null_fd, 0) < 0 || ::dup2(a->log_fd, 1) < 0 || ::dup2(a->log_fd, 2) < 0 ||
      ::dup2(a->ready_fd, kReadyFd) < 0) {
    a->child_errno = errno;
    ::_exit(127);
  }
  ::syscall(SYS_close_range, kReadyFd + 1, ~0U, 0);  // nothing else of the trainer's leaks into the agent
  sigset_t none;
  ::sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGPIPE}) ::sigaction(sig, &dfl, nullptr);
  ::execve(a->path, a->argv, a->envp);
  a->child_errno = errno;
  ::_exit(127);
}

}  // namespace

std::string find_agent_binary(const std::string& explicit_path, const std::vector<std::string>& candidates) {
  if (!explicit_path.empty()) {
    if (is_executable_file(explicit_path)) return explicit_path;
    throw Error(Code::kNotFound, fmt::format("agent binary '{}' is not an executable file", explicit_path));
  }
  if (auto env = env_or_empty("DSEC_AGENT"); !env.empty()) {
    if (is_executable_file(env)) return env;
    throw Error(Code::kNotFound, fmt::format("$DSEC_AGENT='{}' is not an executable file", env));
  }
  std::vector<std::string> tried;
#ifdef DSEC_BUILD_AGENT_PATH
  if (is_executable_file(DSEC_BUILD_AGENT_PATH)) return DSEC_BUILD_AGENT_PATH;
  tried.emplace_back(DSEC_BUILD_AGENT_PATH);
#endif
  for (const auto& c : candidates) {
    if (is_executable_file(c)) return c;
    tried.push_back(c);
  }
  std::string path_env = env_or_empty("PATH");
  std::size_t start = 0;
  while (start <= path_env.size() && !path_env.empty()) {
    std::size_t end = path_env.find(':', start);
    if (end == std::string::npos) end = path_env.size();
    std::string dir = path_env.substr(start, end - start);
    if (!dir.empty()) {
      std::string c = dir + "/dsecd";
      if (is_executable_file(c)) return c;
    }
    start = end + 1;
  }
  tried.push_back("dsecd on $PATH");
  std::string list;
  for (const auto& t : tried) list += (list.empty() ? "" : ", ") + t;
  throw Error(Code::kNotFound,
              fmt::format("no dsecd agent binary found (looked at: {}). Set $DSEC_AGENT to its path, or give the "
                          "Client endpoints of running agents",
                          list));
}

EmbeddedAgent::EmbeddedAgent(const EmbeddedAgentOptions& options)
    : binary_(find_agent_binary(options.binary, options.candidates)),
      owner_pid_(::getpid()),
      start_timeout_(options.start_timeout),
      stop_grace_(options.stop_grace) {
  std::string home = options.home;
  if (home.empty()) home = env_or_empty("DSEC_HOME");
  if (home.empty()) home = "/var/lib/dsec";
  home_ = home;

  dir_ = make_private_dir();
  socket_path_ = dir_ + "/dsecd.sock";
  run_dir_ = dir_ + "/run";
  try {
    if (::mkdir(run_dir_.c_str(), 0700) != 0) throw_errno(errno, fmt::format("mkdir {}", run_dir_));

    log_path_ = env_or_empty("DSEC_AGENT_LOG");
    keep_log_ = !log_path_.empty();
    if (log_path_.empty()) log_path_ = dir_ + "/dsecd.log";
    UniqueFd log_fd(::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
    if (!log_fd) throw_errno(errno, fmt::format("opening the embedded dsecd's log {}", log_path_));
    UniqueFd null_fd(::open("/dev/null", O_RDWR | O_CLOEXEC));
    if (!null_fd) throw_errno(errno, "opening /dev/null");
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) throw_errno(errno, "creating the embedded dsecd's ready pipe");
    UniqueFd ready_read(pipe_fds[0]);
    UniqueFd ready_write(pipe_fds[1]);
    log_fd = move_high(std::move(log_fd), "log");
    null_fd = move_high(std::move(null_fd), "/dev/null");
    ready_write = move_high(std::move(ready_write), "ready pipe");

    int efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd < 0) throw_errno(errno, "eventfd for the embedded dsecd's keeper");
    stop_fd_ = efd;

    // The image store (home) is shared; everything that says which sandboxes are this agent's is private, so two
    // trainers on one machine never take each other's sandboxes for leftovers.
    std::string private_name = std::filesystem::path(dir_).filename().string();
    // The layer cache is private too (one agent owns a cache); the stores it streams layers from are shared.
    argv_ = {binary_,      "--socket",      socket_path_,     "--home",        home,
             "--run-dir",  run_dir_,        "--state-dir",    dir_ + "/state", "--cgroup-name",
             private_name, "--layer-cache", dir_ + "/layers", "--ready-fd",    std::to_string(kReadyFd)};
    for (const auto& store : options.stores) argv_.insert(argv_.end(), {"--store", store});
    add_registry_args(options.registry);
    argv_.insert(argv_.end(), options.extra_args.begin(), options.extra_args.end());
    // Function calls that name no image run in the image the quickstart builds, when the home's store has it, unless
    // the caller's flags name another.
    if (std::find(options.extra_args.begin(), options.extra_args.end(), "--fncall-image") == options.extra_args.end() &&
        std::filesystem::exists(std::filesystem::path(home) / "store" / "refs" / "bookworm-python%3Alatest"))
      argv_.insert(argv_.end(), {"--fncall-image", "bookworm-python"});

    // The keeper owns the three child-side fds from here on and closes them once the child has them.
    int rw = ready_write.release(), lf = log_fd.release(), nf = null_fd.release();
    keeper_ = std::thread([this, rw, lf, nf] { keeper_main(rw, lf, nf); });
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return spawned_; });
      if (pid_ < 0) {
        int err = spawn_errno_;
        lock.unlock();
        stop();
        throw_errno(err, fmt::format("starting the embedded agent {}", binary_));
      }
    }
    wait_ready(ready_read.get());
  } catch (...) {
    stop();
    throw;
  }
}

EmbeddedAgent::~EmbeddedAgent() { stop(); }

pid_t EmbeddedAgent::spawn_child(int ready_write_fd, int log_fd, int null_fd, int& err) {
  std::vector<char*> argv;
  for (auto& a : argv_) argv.push_back(a.data());
  argv.push_back(nullptr);
  SpawnArgs args{binary_.c_str(), argv.data(), environ, null_fd, log_fd, ready_write_fd, ::getpid(), 0};
  pid_t pid = spawn_agent(&args);
  err = pid < 0 ? errno : args.child_errno;
  ::close(ready_write_fd);  // the agent holds the only write end now: EOF on it means the agent is gone
  ::close(log_fd);
  ::close(null_fd);

  if (pid > 0 && err != 0) {  // exec failed: the child already exited
    int status = 0;
    retry_eintr([&] { return ::waitpid(pid, &status, 0); });
    pid = -1;
  }
  return pid;
}

bool EmbeddedAgent::reap(pid_t pid, int options) {
  int status = 0;
  pid_t r = retry_eintr([&] { return ::waitpid(pid, &status, options); });
  if (r == pid || (r < 0 && errno == ECHILD)) {  // ECHILD: someone else in the trainer reaped it
    std::lock_guard lock(mu_);
    reaped_ = true;
    wait_status_ = r == pid ? status : 0;
    cv_.notify_all();
    return true;
  }
  return false;
}

bool EmbeddedAgent::wait_exit(pid_t pid, int pidfd, milliseconds timeout) {
  auto until = steady_clock::now() + timeout;
  for (;;) {
    if (reap(pid, WNOHANG)) return true;
    auto left = std::chrono::duration_cast<milliseconds>(until - steady_clock::now()).count();
    if (left <= 0) return false;
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(left));
    } else {
      ::usleep(static_cast<useconds_t>(std::min<long long>(left, 20) * 1000));
    }
  }
}

void EmbeddedAgent::keeper_main(int ready_write_fd, int log_fd, int null_fd) {
  // Signals meant for the trainer go to its other threads.
  sigset_t all;
  ::sigfillset(&all);
  ::pthread_sigmask(SIG_BLOCK, &all, nullptr);

  int err = 0;
  pid_t pid = spawn_child(ready_write_fd, log_fd, null_fd, err);
  {
    std::lock_guard lock(mu_);
    pid_ = pid;
    spawn_errno_ = err;
    spawned_ = true;
  }
  cv_.notify_all();
  if (pid < 0) return;

  // Wait for either the agent's exit or a stop request.
  UniqueFd pidfd(static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)));
  bool exited = false;
  for (;;) {
    pollfd fds[2] = {{stop_fd_, POLLIN, 0}, {pidfd.get(), POLLIN, 0}};
    int n = ::poll(fds, pidfd ? 2 : 1, pidfd ? -1 : 200);
    if (n < 0 && errno != EINTR) break;
    if (!exited && reap(pid, WNOHANG)) exited = true;
    if (fds[0].revents & POLLIN) break;
    if (exited) {
      // Gone on its own; wait for stop() only.
      pollfd stop_only{stop_fd_, POLLIN, 0};
      while (::poll(&stop_only, 1, -1) < 0 && errno == EINTR) {
      }
      break;
    }
  }
  if (!exited) {
    ::kill(pid, SIGTERM);
    if (!wait_exit(pid, pidfd.get(), stop_grace_)) {
      ::kill(pid, SIGKILL);
      wait_exit(pid, pidfd.get(), milliseconds{60'000});
    }
  }
}

void EmbeddedAgent::wait_ready(int ready_read_fd) {
  std::string got;
  auto start = steady_clock::now();
  for (;;) {
    auto waited = std::chrono::duration_cast<milliseconds>(steady_clock::now() - start);
    auto left = start_timeout_ - waited;
    if (left.count() <= 0) {
      std::string tail = log_tail();
      throw Error(Code::kDeadlineExceeded,
                  fmt::format("the embedded agent {} was not ready after {} ms; its log ({}) ends with:\n{}", binary_,
                              start_timeout_.count(), log_path_, tail));
    }
    pollfd p{ready_read_fd, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, "waiting for the embedded dsecd to become ready");
    }
    if (n == 0) continue;
    char buf[64];
    ssize_t r = retry_eintr([&] { return ::read(ready_read_fd, buf, sizeof buf); });
    if (r > 0) {
      got.append(buf, static_cast<std::size_t>(r));
      if (got.find("ready\n") != std::string::npos) return;
      if (got.size() > 256) throw Error(Code::kInternal, "the embedded dsecd wrote garbage on its ready fd");
      continue;
    }
    // EOF: the agent exited (or closed its ready fd) before it was ready.
    std::string status = "closed its ready fd";
    {
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, std::chrono::seconds(5), [&] { return reaped_; })) status = describe_status(wait_status_);
    }
    throw Error(Code::kFailedPrecondition,
                fmt::format("the embedded agent {} {} before it was ready; its log ({}) ends with:\n{}", binary_,
                            status, log_path_, log_tail()));
  }
}

std::optional<std::string> EmbeddedAgent::exited_unexpectedly() const {
  int status = 0;
  {
    std::lock_guard lock(mu_);
    if (!reaped_ || stopping_) return std::nullopt;
    status = wait_status_;
  }
  return fmt::format("the embedded agent {} (pid {}) {}; its log ({}) ends with:\n{}", binary_, pid_,
                     describe_status(status), log_path_, log_tail());
}

std::string EmbeddedAgent::log_tail(std::size_t max_bytes) const {
  UniqueFd fd(::open(log_path_.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return "(no log)";
  off_t size = ::lseek(fd.get(), 0, SEEK_END);
  if (size <= 0) return "(empty log)";
  off_t from = size > static_cast<off_t>(max_bytes) ? size - static_cast<off_t>(max_bytes) : 0;
  std::string out(static_cast<std::size_t>(size - from), '\0');
  ssize_t r = ::pread(fd.get(), out.data(), out.size(), from);
  out.resize(r > 0 ? static_cast<std::size_t>(r) : 0);
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

void EmbeddedAgent::stop() {
  if (::getpid() != owner_pid_) {
    // A forked child of the trainer: the agent and the keeper thread belong to the parent. The keeper does not
    // exist in this process, so its std::thread is left alone (joining or detaching it would be undefined).
    new std::thread(std::move(keeper_));
    return;
  }
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
    stopping_ = true;
  }
  if (stop_fd_ >= 0) {
    std::uint64_t one = 1;
    [[maybe_unused]] ssize_t w = ::write(stop_fd_, &one, sizeof one);
  }
  if (keeper_.joinable()) keeper_.join();
  if (stop_fd_ >= 0) ::close(stop_fd_);
  stop_fd_ = -1;
  cleanup_files();
}

void EmbeddedAgent::add_registry_args(const RegistrySettings& r) {
  if (!r.auth.empty()) {
    // Passwords go in a file only this user reads: a command line is every local user's to see.
    registry_auth_file_ = dir_ + "/registry-auth";
    UniqueFd fd(::open(registry_auth_file_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!fd) throw_errno(errno, fmt::format("writing {}", registry_auth_file_));
    std::string text;
    for (const auto& [host, credential] : r.auth) {
      const auto& [user, password] = credential;
      if (host.find_first_of("=\n") != std::string::npos || user.find_first_of(":\n") != std::string::npos ||
          password.find('\n') != std::string::npos)
        throw Error(Code::kInvalidArgument,
                    fmt::format("registry credentials for '{}': a '=' or newline in the host, a ':' or newline in the "
                                "user, or a newline in the password",
                                host.substr(0, 200)));
      text += fmt::format("{}={}:{}\n", host, user, password);
    }
    if (::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()))
      throw_errno(errno, fmt::format("writing {}", registry_auth_file_));
    argv_.insert(argv_.end(), {"--registry-auth-file", registry_auth_file_});
  }
  for (const auto& [host, url] : r.mirrors)
    argv_.insert(argv_.end(), {"--registry-mirror", fmt::format("{}={}", host, url)});
  for (const auto& host : r.insecure) argv_.insert(argv_.end(), {"--insecure-registry", host});
  if (!r.ca_file.empty()) argv_.insert(argv_.end(), {"--registry-ca", r.ca_file});
  if (!r.default_registry.empty()) argv_.insert(argv_.end(), {"--default-registry", r.default_registry});
}

void EmbeddedAgent::cleanup_files() noexcept {
  // Never recursive: a run directory the agent could not clean may still hold mounts.
  if (!socket_path_.empty()) ::unlink(socket_path_.c_str());
  if (!keep_log_ && !log_path_.empty()) ::unlink(log_path_.c_str());
  if (!run_dir_.empty()) {
    detach_layer_mounts(run_dir_);                // the agent is gone: what it left mounted (killed outright) goes too
    ::rmdir((run_dir_ + "/.snapshots").c_str());  // snapshot staging, empty unless the agent was killed mid-snapshot
    ::rmdir(run_dir_.c_str());
  }
  if (!dir_.empty()) ::rmdir((dir_ + "/state").c_str());
  if (!registry_auth_file_.empty()) ::unlink(registry_auth_file_.c_str());
  if (!dir_.empty()) remove_layer_cache(dir_);
  if (!dir_.empty()) ::rmdir(dir_.c_str());
}

}  // namespace dsec::detail
