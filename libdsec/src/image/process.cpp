#include "image/process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

extern char** environ;

namespace dsec::image {
namespace {

constexpr std::string_view kSbinDirs = "/usr/local/sbin:/usr/sbin:/sbin";

std::string path_variable(const std::vector<std::string>& env) {
  for (const auto& kv : env)
    if (kv.starts_with("PATH=")) return kv.substr(5);
  const char* p = std::getenv("PATH");
  std::string path = p ? p : "/usr/local/bin:/usr/bin:/bin";
  return path + ":" + std::string(kSbinDirs);
}

// Reads what is available on one stream, keeps the tail, and hands complete lines on.
struct Stream {
  UniqueFd fd;
  std::string kept;
  std::string partial;

  void consume(const char* data, std::size_t n, const ProcessOptions& options) {
    kept.append(data, n);
    if (kept.size() > 2 * options.keep_bytes) kept.erase(0, kept.size() - options.keep_bytes);
    if (!options.on_line) return;
    partial.append(data, n);
    std::size_t start = 0;
    for (std::size_t nl; (nl = partial.find('\n', start)) != std::string::npos; start = nl + 1)
      options.on_line(std::string_view(partial).substr(start, nl - start));
    partial.erase(0, start);
  }
  void finish(const ProcessOptions& options) {
    if (options.on_line && !partial.empty()) options.on_line(partial);
    partial.clear();
    if (kept.size() > options.keep_bytes) kept.erase(0, kept.size() - options.keep_bytes);
  }
};

}  // namespace

std::string ProcessResult::status_text() const {
  if (signal != 0) return fmt::format("killed by signal {} ({})", signal, strsignal(signal));
  return fmt::format("exited with status {}", exit_code);
}

std::string ProcessResult::tail(std::size_t lines) const {
  const std::string& text = err.find_first_not_of(" \n") == std::string::npos ? out : err;
  std::size_t last = text.find_last_not_of('\n');
  if (last == std::string::npos) return {};
  std::size_t end = last + 1;
  std::size_t start = end;
  std::size_t count = 0;
  while (start > 0) {
    std::size_t nl = text.rfind('\n', start - 1);
    if (nl == std::string::npos) {
      start = 0;
      break;
    }
    if (++count == lines) {
      start = nl + 1;
      break;
    }
    start = nl;
  }
  return text.substr(start, end - start);
}

std::string find_executable(std::string_view name, const std::vector<std::string>& env) {
  if (name.empty()) return {};
  if (name.find('/') != std::string_view::npos) {
    std::string p(name);
    return ::access(p.c_str(), X_OK) == 0 ? p : std::string();
  }
  std::string path = path_variable(env);
  std::size_t start = 0;
  while (start <= path.size()) {
    std::size_t colon = path.find(':', start);
    std::string dir = path.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    if (!dir.empty()) {
      std::string candidate = dir + "/" + std::string(name);
      if (::access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return {};
}

namespace {

// Starts `exe` with `argv` and `env` (empty: the caller's), stdin from /dev/null and stdout and stderr into the
// pipes' write ends, with default signal handling and an empty signal mask whatever the caller (an agent) has set up.
pid_t spawn_child(const std::string& exe, const std::vector<std::string>& argv, const std::vector<std::string>& env,
                  int out_w, int err_w) {
  std::vector<char*> cargv;
  cargv.reserve(argv.size() + 1);
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  std::vector<char*> cenv;
  if (!env.empty()) {
    cenv.reserve(env.size() + 1);
    for (const auto& kv : env) cenv.push_back(const_cast<char*>(kv.c_str()));
    cenv.push_back(nullptr);
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions, out_w, STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, err_w, STDERR_FILENO);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t all, none;
  sigfillset(&all);
  sigemptyset(&none);
  posix_spawnattr_setsigdefault(&attr, &all);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, exe.c_str(), &actions, &attr, cargv.data(), env.empty() ? environ : cenv.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  if (rc != 0) throw_errno_fmt(rc, "start {}", exe);
  return pid;
}

// Reads both streams until each reaches its end, handing what comes to the streams (lines, caps).
void drain(Stream (&streams)[2], const ProcessOptions& options) {
  char buf[16384];
  while (streams[0].fd || streams[1].fd) {
    pollfd fds[2];
    int n = 0;
    int which[2];
    for (int i = 0; i < 2; ++i) {
      if (!streams[i].fd) continue;
      fds[n] = {streams[i].fd.get(), POLLIN, 0};
      which[n++] = i;
    }
    if (retry_eintr([&] { return ::poll(fds, static_cast<nfds_t>(n), -1); }) < 0) throw_errno(errno, "poll");
    for (int k = 0; k < n; ++k) {
      if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      Stream& s = streams[which[k]];
      ssize_t got = retry_eintr([&] { return ::read(s.fd.get(), buf, sizeof buf); });
      if (got > 0) {
        s.consume(buf, static_cast<std::size_t>(got), options);
      } else {
        s.fd.reset();
      }
    }
  }
}

}  // namespace

ProcessResult run_process(const std::vector<std::string>& argv, const ProcessOptions& options) {
  if (argv.empty()) throw Error(Code::kInvalidArgument, "run_process: empty argv");
  std::string exe = find_executable(argv[0], options.env);
  if (exe.empty())
    throw Error(Code::kFailedPrecondition,
                fmt::format("{}: no such program on PATH ({})", argv[0], path_variable(options.env)));

  int out_pipe[2];
  int err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) throw_errno(errno, "pipe");
  UniqueFd out_r(out_pipe[0]), out_w(out_pipe[1]);
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) throw_errno(errno, "pipe");
  UniqueFd err_r(err_pipe[0]), err_w(err_pipe[1]);

  const pid_t pid = spawn_child(exe, argv, options.env, out_w.get(), err_w.get());
  out_w.reset();
  err_w.reset();

  Stream streams[2];
  streams[0].fd = std::move(out_r);
  streams[1].fd = std::move(err_r);
  drain(streams, options);

  ProcessResult result;
  for (auto& s : streams) s.finish(options);
  result.out = std::move(streams[0].kept);
  result.err = std::move(streams[1].kept);
  int status = 0;
  if (retry_eintr([&] { return ::waitpid(pid, &status, 0); }) < 0) throw_errno_fmt(errno, "wait for {}", exe);
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.signal = WTERMSIG(status);
  }
  return result;
}
}  // namespace dsec::image
