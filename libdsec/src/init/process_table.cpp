#include "init/process_table.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "common/wire/init_protocol.hpp"
#include "init/command_start.hpp"

namespace dsec::init {
namespace {

using namespace process_protocol;

std::int64_t now_ms(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000 + ts.tv_nsec / 1'000'000;
}

std::string status_only(Status s) {
  Writer w;
  w.i32(static_cast<std::int32_t>(s));
  return std::move(w.bytes());
}

std::string system_error(int err) {
  Writer w;
  w.i32(static_cast<std::int32_t>(Status::kSystem));
  w.i32(err);
  return std::move(w.bytes());
}

void set_nonblocking(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

// pid -> parent pid of every process init sees, from /proc (the sandbox's own).
std::map<pid_t, pid_t> parents() {
  std::map<pid_t, pid_t> out;
  DIR* dir = opendir("/proc");
  if (!dir) return out;
  while (dirent* d = readdir(dir)) {
    char* end = nullptr;
    long pid = std::strtol(d->d_name, &end, 10);
    if (pid <= 0 || *end != '\0') continue;
    char path[64];
    std::snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    char buf[512];
    ssize_t n = ::read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) continue;
    buf[n] = '\0';
    // "pid (comm) state ppid ...": comm may hold anything, so the fields start after its last ')'.
    char* close_paren = std::strrchr(buf, ')');
    if (!close_paren) continue;
    char state = 0;
    int ppid = 0;
    if (std::sscanf(close_paren + 1, " %c %d", &state, &ppid) == 2) out[static_cast<pid_t>(pid)] = ppid;
  }
  closedir(dir);
  return out;
}

}  // namespace

void OutputBuffer::append(const char* data, std::size_t n) {
  if (n >= kOutputKeep) {
    base_ += data_.size() + (n - kOutputKeep);
    data_.assign(data + (n - kOutputKeep), kOutputKeep);
    return;
  }
  if (data_.size() + n > kOutputKeep) {
    std::size_t drop = data_.size() + n - kOutputKeep;
    data_.erase(0, drop);
    base_ += drop;
  }
  data_.append(data, n);
}

std::string_view OutputBuffer::from(std::uint64_t offset, std::size_t max, std::uint64_t& actual) const {
  actual = std::clamp(offset, base_, end());
  std::size_t at = static_cast<std::size_t>(actual - base_);
  return std::string_view(data_).substr(at, max);
}

void send_process_reply(int conn, const std::string& payload) {
  timeval tv{2, 0};
  setsockopt(conn, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  std::uint32_t len = static_cast<std::uint32_t>(payload.size());
  std::string message(reinterpret_cast<const char*>(&len), 4);
  message += payload;
  std::string_view left = message;
  while (!left.empty()) {
    ssize_t n = send(conn, left.data(), left.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // the agent went away or stalled: it asks again
    left.remove_prefix(static_cast<std::size_t>(n));
  }
  close(conn);
}

ProcessTable::~ProcessTable() {
  for (auto& [pid, p] : processes_) release(p);
  drop_parked();
}

void ProcessTable::drop_parked() {
  if (tickets_are_fds_)
    for (auto& r : parked_) close(static_cast<int>(r.ticket));
  parked_.clear();
}

void ProcessTable::serve(std::uint64_t ticket, Op op, std::string_view payload, std::vector<int>& fds) {
  std::string reply;
  switch (op) {
    case Op::kSpawn:
      reply = spawn(payload, fds);
      break;
    case Op::kList:
      reply = list();
      break;
    case Op::kRead:
      if (auto r = read(payload, ticket)) reply = std::move(*r);
      else return;  // parked: answered later
      break;
    case Op::kWrite:
      reply = write(payload);
      break;
    case Op::kSignal:
      reply = signal(payload);
      break;
    case Op::kResize:
      reply = resize(payload);
      break;
    case Op::kForget:
      reply = forget(payload);
      break;
    case Op::kChildren:
      reply = children(payload);
      break;
    default:
      reply = status_only(Status::kBadRequest);
  }
  close_all(fds);
  reply_(ticket, reply);
}

ProcessTable::Process* ProcessTable::find(pid_t pid) {
  auto it = processes_.find(pid);
  return it == processes_.end() ? nullptr : &it->second;
}

bool ProcessTable::make_room() {
  if (processes_.size() < kMaxProcesses) return true;
  for (auto it = order_.begin(); it != order_.end(); ++it) {
    Process* p = find(*it);
    if (p && !p->entry.running) {
      pid_t pid = *it;
      order_.erase(it);
      release(*p);
      processes_.erase(pid);
      wake_readers(pid, true);
      return true;
    }
  }
  return false;
}

int ProcessTable::open_pty(Process& p, std::uint32_t rows, std::uint32_t cols, int (&child)[3]) {
  int master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (master < 0) return errno;
  int unlock = 0;
  winsize size{static_cast<unsigned short>(rows ? rows : 24), static_cast<unsigned short>(cols ? cols : 80), 0, 0};
  int slave = -1;
  if (ioctl(master, TIOCSPTLCK, &unlock) != 0 || ioctl(master, TIOCSWINSZ, &size) != 0 ||
      (slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC)) < 0) {
    int err = errno;
    close(master);
    return err;
  }
  p.in_fd = master;
  p.out_fd = master;
  child[0] = slave;
  child[1] = dup(slave);
  child[2] = dup(slave);
  p.entry.rows = size.ws_row;
  p.entry.cols = size.ws_col;
  return 0;
}

int ProcessTable::open_pipes(Process& p, int (&child)[3]) {
  int in[2], out[2], err[2];
  if (pipe2(in, O_CLOEXEC) != 0) return errno;
  if (pipe2(out, O_CLOEXEC) != 0) {
    int e = errno;
    close(in[0]), close(in[1]);
    return e;
  }
  if (pipe2(err, O_CLOEXEC) != 0) {
    int e = errno;
    close(in[0]), close(in[1]), close(out[0]), close(out[1]);
    return e;
  }
  child[0] = in[0], p.in_fd = in[1];
  child[1] = out[1], p.out_fd = out[0];
  child[2] = err[1], p.err_fd = err[0];
  return 0;
}

std::string ProcessTable::spawn(std::string_view payload, std::vector<int>& fds) {
  Reader r(payload);
  std::uint32_t kind = 0, pty = 0, rows = 0, cols = 0;
  std::string meta, start;
  r.u32(kind), r.str(meta), r.u32(pty), r.u32(rows), r.u32(cols), r.str(start);
  init_protocol::StartPayload command;
  if (!r.done() || kind > 1 || rows > kMaxTerminalSide || cols > kMaxTerminalSide ||
      !init_protocol::decode_start_payload(start, command))
    return status_only(Status::kBadRequest);
  if (!make_room()) return status_only(Status::kTableFull);

  Process p;
  int child[3] = {-1, -1, -1};  // the child's stdin, stdout and stderr
  auto close_child_ends = [&] {
    for (int fd : child)
      if (fd >= 0) close(fd);
  };
  if (int e = pty ? open_pty(p, rows, cols, child) : open_pipes(p, child); e != 0) return system_error(e);
  if (child[1] < 0 || child[2] < 0) {
    int e = errno;
    close_child_ends();
    release(p);
    return system_error(e);
  }

  std::vector<std::string> argv = command.argv;  // kept for the entry
  StartRequest req = start_request_of(std::move(command), drop_capabilities_);
  req.controlling_tty = pty != 0;
  req.fds = {child[0], child[1], child[2]};
  req.fds.insert(req.fds.end(), fds.begin(), fds.end());
  fds.clear();  // now in req.fds, closed with it
  int err = 0;
  init_protocol::FailStage stage = init_protocol::FailStage::kRequest;
  pid_t pid = start_command(req, original_mask_, err, stage);
  if (req.set_user) prctl(PR_SET_DUMPABLE, 0);
  close_all(req.fds);
  if (pid < 0) {
    release(p);
    Writer w;
    w.i32(static_cast<std::int32_t>(Status::kStartFailed));
    w.i32(err);
    w.i32(static_cast<std::int32_t>(stage));
    return std::move(w.bytes());
  }
  set_nonblocking(p.in_fd);
  set_nonblocking(p.out_fd);
  if (p.err_fd >= 0) set_nonblocking(p.err_fd);
  p.entry.pid = pid;
  p.entry.kind = static_cast<Kind>(kind);
  p.entry.meta = std::move(meta);
  p.entry.argv = std::move(argv);
  p.entry.pty = pty != 0;
  p.entry.running = true;
  p.entry.stdin_open = true;
  p.entry.started_ms = now_ms(CLOCK_REALTIME);
  Writer w;
  w.i32(static_cast<std::int32_t>(Status::kOk));
  w.entry(p.entry);
  processes_.emplace(pid, std::move(p));
  order_.push_back(pid);
  return std::move(w.bytes());
}

std::string ProcessTable::list() const {
  Writer w;
  w.i32(static_cast<std::int32_t>(Status::kOk));
  w.u32(static_cast<std::uint32_t>(processes_.size()));
  for (const auto& [pid, p] : processes_) w.entry(p.entry);
  return std::move(w.bytes());
}

std::string ProcessTable::read_reply(const Process& p, std::uint64_t out_offset, std::uint64_t err_offset,
                                     std::uint32_t max) const {
  Writer w;
  w.i32(static_cast<std::int32_t>(Status::kOk));
  w.entry(p.entry);
  std::uint64_t actual = 0;
  std::string_view data;
  if (out_offset != kSkip) data = p.out.from(out_offset, max, actual);
  w.u64(out_offset == kSkip ? 0 : actual);
  w.str(data);
  data = {};
  actual = 0;
  if (err_offset != kSkip) data = p.err.from(err_offset, max, actual);
  w.u64(err_offset == kSkip ? 0 : actual);
  w.str(data);
  return std::move(w.bytes());
}

std::optional<std::string> ProcessTable::read(std::string_view payload, std::uint64_t ticket) {
  Reader r(payload);
  std::int32_t pid = 0;
  std::uint64_t out_offset = 0, err_offset = 0;
  std::uint32_t max = 0, wait_ms = 0;
  r.i32(pid), r.u64(out_offset), r.u64(err_offset), r.u32(max), r.u32(wait_ms);
  if (!r.done() || wait_ms > kMaxWaitMs) return status_only(Status::kBadRequest);
  max = std::min(max, kMaxReadBytes);
  Process* p = find(pid);
  if (!p) return status_only(Status::kNotFound);
  bool has_output =
      (out_offset != kSkip && p->out.end() > out_offset) || (err_offset != kSkip && p->err.end() > err_offset);
  if ((has_output && max > 0) || !p->entry.running || wait_ms == 0) return read_reply(*p, out_offset, err_offset, max);
  parked_.push_back({ticket, pid, out_offset, err_offset, max, now_ms(CLOCK_MONOTONIC) + wait_ms});
  return std::nullopt;
}

void ProcessTable::wake_readers(pid_t pid, bool all) {
  Process* p = find(pid);
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (it->pid != pid) {
      ++it;
      continue;
    }
    bool ready = all || !p || !p->entry.running ||
                 (it->max > 0 && ((it->out_offset != kSkip && p->out.end() > it->out_offset) ||
                                  (it->err_offset != kSkip && p->err.end() > it->err_offset)));
    if (!ready) {
      ++it;
      continue;
    }
    reply_(it->ticket, p ? read_reply(*p, it->out_offset, it->err_offset, it->max) : status_only(Status::kNotFound));
    it = parked_.erase(it);
  }
}

int ProcessTable::next_timeout_ms() const {
  if (parked_.empty()) return -1;
  std::int64_t first = parked_.front().deadline_ms;
  for (const auto& r : parked_) first = std::min(first, r.deadline_ms);
  return static_cast<int>(std::clamp<std::int64_t>(first - now_ms(CLOCK_MONOTONIC), 0, kMaxWaitMs));
}

void ProcessTable::expire() {
  std::int64_t now = now_ms(CLOCK_MONOTONIC);
  for (auto it = parked_.begin(); it != parked_.end();) {
    if (it->deadline_ms > now) {
      ++it;
      continue;
    }
    Process* p = find(it->pid);
    reply_(it->ticket, p ? read_reply(*p, it->out_offset, it->err_offset, it->max) : status_only(Status::kNotFound));
    it = parked_.erase(it);
  }
}

void ProcessTable::flush_stdin(Process& p) {
  while (!p.stdin_pending.empty() && p.in_fd >= 0) {
    ssize_t n = ::write(p.in_fd, p.stdin_pending.data(), p.stdin_pending.size());
    if (n > 0) {
      p.stdin_pending.erase(0, static_cast<std::size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    // The reader is gone (EPIPE) or the terminal hung up: nothing more reaches it.
    p.stdin_pending.clear();
    close_stdin(p);
    return;
  }
  if (p.stdin_pending.empty() && p.close_stdin_after) close_stdin(p);
}

void ProcessTable::close_stdin(Process& p) {
  p.entry.stdin_open = false;
  p.close_stdin_after = false;
  if (p.entry.pty) return;  // the master carries output too: a terminal's end of input is ^D, written by write()
  if (p.in_fd >= 0) close(p.in_fd);
  p.in_fd = -1;
}

std::string ProcessTable::write(std::string_view payload) {
  Reader r(payload);
  std::int32_t pid = 0;
  std::uint32_t close_after = 0;
  std::string data;
  r.i32(pid), r.u32(close_after), r.str(data);
  if (!r.done()) return status_only(Status::kBadRequest);
  Process* p = find(pid);
  if (!p) return status_only(Status::kNotFound);
  if (!p->entry.running) return status_only(Status::kEnded);
  if (!p->entry.stdin_open || p->close_stdin_after) return status_only(Status::kStdinClosed);
  if (p->stdin_pending.size() + data.size() > kStdinBuffer) return status_only(Status::kStdinFull);
  p->stdin_pending += data;
  if (close_after) {
    if (p->entry.pty) p->stdin_pending += '\x04';  // the terminal's end of file (in canonical mode)
    p->close_stdin_after = true;
  }
  flush_stdin(*p);
  Writer w;
  w.i32(static_cast<std::int32_t>(Status::kOk));
  w.u32(static_cast<std::uint32_t>(data.size()));
  return std::move(w.bytes());
}

std::string ProcessTable::signal(std::string_view payload) {
  Reader r(payload);
  std::int32_t pid = 0, sig = 0;
  std::uint32_t scope = 0, n = 0;
  r.i32(pid), r.i32(sig), r.u32(scope), r.u32(n);
  if (!r.ok() || n > r.left() / 4 || sig < 0 || sig >= NSIG || scope > 2) return status_only(Status::kBadRequest);
  std::set<pid_t> spared;
  for (std::uint32_t i = 0; i < n; ++i) {
    std::int32_t s = 0;
    r.i32(s);
    spared.insert(s);
  }
  if (!r.done()) return status_only(Status::kBadRequest);
  Process* p = find(pid);
  if (!p) return status_only(Status::kNotFound);
  if (!p->entry.running) return status_only(Status::kEnded);
  std::uint32_t signalled = 0;
  std::set<pid_t> signalled_pids;
  switch (static_cast<Scope>(scope)) {
    case Scope::kProcess:
      signalled = ::kill(pid, sig) == 0;
      break;
    case Scope::kGroup:
      signalled = ::kill(-pid, sig) == 0;
      break;
    case Scope::kTreeExcept:
      // A few rounds: what forked while the first one ran is found by the next (each process signalled once; one
      // that is dying stays listed a while).
      for (int round = 0, sent_before = -1; round < 3 && static_cast<int>(signalled) != sent_before; ++round) {
        sent_before = static_cast<int>(signalled);
        std::map<pid_t, pid_t> parent = parents();
        std::map<pid_t, std::vector<pid_t>> kids;
        for (auto [child, ppid] : parent) kids[ppid].push_back(child);
        std::vector<pid_t> stack;
        for (pid_t c : kids[pid])
          if (!spared.count(c)) stack.push_back(c);
        while (!stack.empty()) {
          pid_t c = stack.back();
          stack.pop_back();
          if (signalled_pids.insert(c).second && ::kill(c, sig) == 0) ++signalled;
          for (pid_t g : kids[c]) stack.push_back(g);
        }
      }
      break;
  }
  Writer w;
  w.i32(static_cast<std::int32_t>(Status::kOk));
  w.u32(signalled);
  return std::move(w.bytes());
}

std::string ProcessTable::resize(std::string_view payload) {
  Reader r(payload);
  std::int32_t pid = 0;
  std::uint32_t rows = 0, cols = 0;
  r.i32(pid), r.u32(rows), r.u32(cols);
  if (!r.done() || rows == 0 || cols == 0 || rows > kMaxTerminalSide || cols > kMaxTerminalSide)
    return status_only(Status::kBadRequest);
  Process* p = find(pid);
  if (!p) return status_only(Status::kNotFound);
  if (!p->entry.pty) return status_only(Status::kNoTerminal);
  if (!p->entry.running) return status_only(Status::kEnded);
  winsize size{static_cast<unsigned short>(rows), static_cast<unsigned short>(cols), 0, 0};
  if (ioctl(p->in_fd, TIOCSWINSZ, &size) != 0) return system_error(errno);
  p->entry.rows = rows;
  p->entry.cols = cols;
  return status_only(Status::kOk);
}

std::string ProcessTable::forget(std::string_view payload) {
  Reader r(payload);
  std::int32_t pid = 0;
  r.i32(pid);
  if (!r.done()) return status_only(Status::kBadRequest);
  Process* p = find(pid);
  if (!p) return status_only(Status::kNotFound);
  if (p->entry.running) {
    ::kill(-pid, SIGKILL);
    ::kill(pid, SIGKILL);
  }
  Writer w;
  w.i32(static_cast<std::int32_t>(Status::kOk));
  w.entry(p->entry);
  release(*p);
  processes_.erase(pid);
  order_.erase(std::remove(order_.begin(), order_.end(), pid), order_.end());
  wake_readers(pid, true);
  return std::move(w.bytes());
}

std::string ProcessTable::children(std::string_view payload) const {
  Reader r(payload);
  std::int32_t pid = 0;
  r.i32(pid);
  if (!r.done()) return status_only(Status::kBadRequest);
  if (!processes_.count(pid)) return status_only(Status::kNotFound);
  std::vector<pid_t> kids;
  for (auto [child, ppid] : parents())
    if (ppid == pid) kids.push_back(child);
  Writer w;
  w.i32(static_cast<std::int32_t>(Status::kOk));
  w.u32(static_cast<std::uint32_t>(kids.size()));
  for (pid_t k : kids) w.i32(k);
  return std::move(w.bytes());
}

void ProcessTable::release(Process& p) {
  if (p.in_fd >= 0 && p.in_fd != p.out_fd) close(p.in_fd);
  if (p.out_fd >= 0) close(p.out_fd);
  if (p.err_fd >= 0) close(p.err_fd);
  p.in_fd = p.out_fd = p.err_fd = -1;
}

void ProcessTable::poll_fds(std::vector<pollfd>& fds) const {
  for (const auto& [pid, p] : processes_) {
    if (p.out_fd >= 0) fds.push_back({p.out_fd, POLLIN, 0});
    if (p.err_fd >= 0) fds.push_back({p.err_fd, POLLIN, 0});
    if (p.in_fd >= 0 && !p.stdin_pending.empty()) fds.push_back({p.in_fd, POLLOUT, 0});
  }
  // A parked reader whose agent went away (it restarted, or gave up) is dropped rather than kept to its deadline.
  if (tickets_are_fds_)
    for (const auto& r : parked_) fds.push_back({static_cast<int>(r.ticket), POLLIN | POLLRDHUP, 0});
}

void ProcessTable::drain(Process& p, std::size_t budget) {
  char buf[65536];
  bool grew = false;
  for (int* fd : {&p.out_fd, &p.err_fd}) {
    OutputBuffer& into = fd == &p.out_fd ? p.out : p.err;
    std::size_t taken = 0;
    while (*fd >= 0 && taken < budget) {
      ssize_t n = ::read(*fd, buf, sizeof buf);
      if (n > 0) {
        into.append(buf, static_cast<std::size_t>(n));
        taken += static_cast<std::size_t>(n);
        grew = true;
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) break;
      // End of output (a pty's master reads EIO once every slave is closed).
      if (fd == &p.out_fd && p.in_fd == p.out_fd) p.in_fd = -1;
      close(*fd);
      *fd = -1;
    }
  }
  p.entry.stdout_end = p.out.end();
  p.entry.stderr_end = p.err.end();
  if (grew) wake_readers(p.entry.pid, false);
}

void ProcessTable::poll_done(const std::vector<pollfd>& fds, std::size_t first) {
  for (std::size_t i = first; i < fds.size(); ++i) {
    if (!fds[i].revents) continue;
    int fd = fds[i].fd;
    bool handled = false;
    for (auto& [pid, p] : processes_) {
      if (fd == p.out_fd || fd == p.err_fd) {
        if (fds[i].events & POLLIN) drain(p, 256u << 10);
        if ((fds[i].events & POLLOUT) && fd == p.in_fd) flush_stdin(p);
        handled = true;
        break;
      }
      if (fd == p.in_fd) {
        flush_stdin(p);
        handled = true;
        break;
      }
    }
    if (handled || !tickets_are_fds_) continue;
    for (auto it = parked_.begin(); it != parked_.end(); ++it) {
      if (it->ticket == static_cast<std::uint64_t>(fd)) {
        close(fd);
        parked_.erase(it);
        break;
      }
    }
  }
}

bool ProcessTable::reaped(pid_t pid, int status) {
  Process* p = find(pid);
  if (!p) return false;
  // What it wrote before it ended is in its pipes already: take it before anyone hears it ended.
  drain(*p, kOutputKeep * 4);
  p->entry.running = false;
  p->entry.wait_status = status;
  p->entry.ended_ms = now_ms(CLOCK_REALTIME);
  p->stdin_pending.clear();
  if (!p->entry.pty) close_stdin(*p);
  p->entry.stdin_open = false;
  wake_readers(pid, true);
  return true;
}

}  // namespace dsec::init
