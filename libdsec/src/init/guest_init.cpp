// dsec-init as pid 1 of a virtual machine (guest_protocol.hpp has the wire).
//
// Boot: mount /dev, /proc and /sys of the initramfs, load the kernel modules the initramfs carries (in the order of
// their names), find the virtio-serial port named "dsec.agent" and serve the agent on it. The agent's kSetup names
// the image's layers and the writable disk by their virtio-blk serials: the layers are mounted read-only as EROFS,
// the disk as ext4, overlayfs stacks them, and the overlay becomes the root (the initramfs's /dev, /proc and /sys
// move into it; cgroup2, devpts and /dev/shm are mounted there). From then on every command and every file
// operation happens in that root.
//
// Serving: one poll loop over the port, a signalfd for SIGCHLD, and the pipes of every running exec. An exec gets a
// cgroup of its own (/sys/fs/cgroup/dsec/x<channel>), so a kill (a timeout) ends its whole process tree, and its
// output is read here and sent as frames, capped per stream. The port reads EOF while no agent is connected to the
// host side (a restart of the agent, a restore from a snapshot): execs whose caller is gone are killed, and the loop
// waits for the next agent's kHello.
#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <linux/random.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/reboot.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "common/sandbox_tree.hpp"
#include "common/wire/guest_protocol.hpp"
#include "dsec/error.hpp"
#include "init/command_start.hpp"
#include "init/guest_system.hpp"
#include "init/init_main.hpp"
#include "init/process_table.hpp"

namespace dsec::init {
namespace {

namespace gp = guest_protocol;
namespace files = agent::files;
using gp::Type;
using Clock = std::chrono::steady_clock;

constexpr auto kOutputGrace = std::chrono::milliseconds(50);
constexpr std::size_t kOutputBackpressure = 4u << 20;  // stop reading commands' output while this much waits

struct Exec {
  std::uint32_t channel = 0;
  pid_t pid = -1;
  int out = -1, err = -1, in = -1;
  std::string cgroup;
  std::uint64_t cap = 0;
  std::uint64_t out_kept = 0, err_kept = 0;
  bool out_truncated = false, err_truncated = false;
  std::string stdin_pending;
  bool stdin_closing = false;                   // close once stdin_pending is written
  std::uint64_t stdin_taken = 0;                // written into the pipe since the last kCredit
  std::uint64_t out_credit = gp::kWindowBytes;  // output the agent will take before it acknowledges more
  bool exited = false;
  int status = 0;
  Clock::time_point exited_at{};
  std::uint64_t oom_kills_at_start = 0;  // the guest kernel's OOM kill count when the command started
};

// A write of a file or a tree coming from the agent, frame by frame.
struct Upload {
  UniqueFd file;                                         // kWriteFile
  std::unique_ptr<files::SandboxTree::Extraction> tree;  // kPutTree
  std::string path;
  std::uint64_t bytes = 0, entries = 0;
  bool failed = false;  // an error was sent: the rest of the upload is read and dropped
};

// How dsec-init runs in the VM: as its pid 1 (a microVM: it builds the root when the agent's kSetup asks, and owns
// the whole cgroup tree), or as a service of the image's own init (a full VM: the root was built at boot, systemd
// delegates a cgroup subtree to it, and powering off is systemd's).
enum class GuestMode { kPid1, kService };

// Where a service's commands get their cgroups: below its own (systemd's Delegate=yes), from /proc/self/cgroup.
std::string delegated_cgroup() {
  std::string text = read_small_file("/proc/self/cgroup");
  for (std::size_t at = 0; at < text.size();) {
    std::size_t end = text.find('\n', at);
    std::string line = text.substr(at, end == std::string::npos ? std::string::npos : end - at);
    if (line.rfind("0::", 0) == 0) return "/sys/fs/cgroup" + line.substr(3) + "/dsec";
    if (end == std::string::npos) break;
    at = end + 1;
  }
  return "/sys/fs/cgroup/dsec";
}

class GuestInit {
 public:
  explicit GuestInit(GuestMode mode) : mode_(mode) {
    if (mode_ == GuestMode::kService) {
      // The root is the image's own, set up at boot (guest_boot.cpp); the writable layer's upper directory is where
      // the boot stage left it.
      exec_cgroups_ = delegated_cgroup();
      if (::mkdir(exec_cgroups_.c_str(), 0755) != 0 && errno != EEXIST)
        log_line("mkdir " + exec_cgroups_ + ": " + errno_text(errno));
      upper_ = UniqueFd(::open(kServiceUpper, O_PATH | O_DIRECTORY | O_CLOEXEC));
      tree_.emplace(UniqueFd(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC)));
      root_ready_ = true;
    }
    sigset_t mask;
    sigprocmask(SIG_SETMASK, nullptr, &original_mask_);
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigprocmask(SIG_BLOCK, &mask, nullptr);
    sigdelset(&original_mask_, SIGCHLD);
    sigchld_ = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    utsname u{};
    ::uname(&u);
    release_ = u.release;
    // The processes the agent keeps here (spawned commands, shell sessions): a request's ticket is its channel.
    processes_.emplace(
        original_mask_, /*drop_capabilities=*/false,
        [this](std::uint64_t channel, const std::string& reply) {
          send(Type::kProcessReply, static_cast<std::uint32_t>(channel), reply);
        },
        /*tickets_are_fds=*/false);
  }

  [[noreturn]] void serve(const std::string& port_path) {
    port_path_ = port_path;
    for (;;) {
      try {
        loop_once();
      } catch (const std::exception& e) {
        log_line(std::string("serving: ") + e.what());
        disconnect();
        ::usleep(10000);
      }
    }
  }

 private:
  // ---- the port ----
  void open_port() {
    if (port_ >= 0) return;
    port_ = ::open(port_path_.c_str(), O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (port_ < 0) {
      log_line("open " + port_path_ + ": " + errno_text(errno));
      ::usleep(100000);
    }
  }

  // The agent went away: execs whose caller it was cannot be answered any more.
  void disconnect() {
    out_.clear();
    reader_ = gp::FrameReader();
    uploads_.clear();
    for (auto& [channel, exec] : execs_) kill_exec(exec);
    // Processes run on for the next agent; reads it waited on are not answered.
    processes_->drop_parked();
    if (port_ >= 0) {
      ::close(port_);
      port_ = -1;
    }
    connected_ = false;
  }

  void send(Type type, std::uint32_t channel, std::string_view payload = {}) {
    if (!connected_) return;
    gp::append_frame(out_, type, channel, payload);
  }
  void send_error(std::uint32_t channel, const Error& e) {
    send(Type::kError, channel, gp::encode(gp::ErrorReply{static_cast<std::uint32_t>(e.code()), e.what()}));
  }
  void send_error(std::uint32_t channel, Code code, const std::string& message) {
    send(Type::kError, channel, gp::encode(gp::ErrorReply{static_cast<std::uint32_t>(code), message}));
  }

  // Writes what it can of the output queue; false when the port is closed.
  bool flush() {
    while (!out_.empty() && port_ >= 0) {
      ssize_t n = ::write(port_, out_.data(), out_.size());
      if (n > 0) {
        out_.erase(0, static_cast<std::size_t>(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) return true;
      return false;
    }
    return true;
  }

  // Waits until the queue is below `limit` (a large file or tree is sent in steps, not queued whole).
  void flush_below(std::size_t limit) {
    while (out_.size() > limit) {
      if (!flush()) throw Error(Code::kUnavailable, "the agent went away");
      if (out_.size() <= limit) break;
      pollfd p{port_, POLLOUT, 0};
      int rc = ::poll(&p, 1, 1000);
      if (rc > 0 && (p.revents & (POLLHUP | POLLERR))) throw Error(Code::kUnavailable, "the agent went away");
    }
  }

  // ---- one turn of the loop ----
  void loop_once() {
    open_port();
    if (port_ < 0) return;
    std::vector<pollfd> fds;
    fds.push_back({port_, static_cast<short>(POLLIN | (out_.empty() ? 0 : POLLOUT)), 0});
    fds.push_back({sigchld_, POLLIN, 0});
    std::vector<std::pair<std::uint32_t, int>> watched;  // (channel, which: 1 out, 2 err, 0 stdin)
    bool room = out_.size() < kOutputBackpressure;
    for (auto& [channel, exec] : execs_) {
      if (room && exec.out >= 0 && may_read(exec, 1)) {
        fds.push_back({exec.out, POLLIN, 0});
        watched.emplace_back(channel, 1);
      }
      if (room && exec.err >= 0 && may_read(exec, 2)) {
        fds.push_back({exec.err, POLLIN, 0});
        watched.emplace_back(channel, 2);
      }
      if (exec.in >= 0 && !exec.stdin_pending.empty()) {
        fds.push_back({exec.in, POLLOUT, 0});
        watched.emplace_back(channel, 0);
      }
    }
    const std::size_t first_process_fd = fds.size();
    processes_->poll_fds(fds);
    int timeout = processes_->next_timeout_ms();
    auto now = Clock::now();
    for (auto& [channel, exec] : execs_) {
      if (!exec.exited) continue;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(exec.exited_at + kOutputGrace - now).count();
      int t = static_cast<int>(std::max<long long>(0, left) + 1);
      timeout = timeout < 0 ? t : std::min(timeout, t);
    }
    if (!connected_) timeout = timeout < 0 ? 10 : std::min(timeout, 10);
    int rc = ::poll(fds.data(), fds.size(), timeout);
    if (rc < 0 && errno != EINTR) throw Error(Code::kInternal, "poll: " + errno_text(errno));
    if (rc > 0) {
      if (fds[1].revents) reap();
      processes_->poll_done(fds, first_process_fd);
      for (std::size_t i = 0; i < watched.size(); ++i) {
        if (!fds[i + 2].revents) continue;
        auto it = execs_.find(watched[i].first);
        if (it == execs_.end()) continue;
        if (watched[i].second == 0) feed_stdin(it->second);
        else read_output(it->second, watched[i].second);
      }
      if (fds[0].revents & POLLIN) read_port();
      else if (fds[0].revents & (POLLHUP | POLLERR)) {
        // No agent on the host side. Drop what was queued for the one that left, and look again shortly.
        if (connected_) disconnect();
      }
      if (port_ >= 0 && !out_.empty() && !flush()) disconnect();
    }
    processes_->expire();
    finish_exits();
    if (port_ >= 0 && !out_.empty() && !flush()) disconnect();
  }

  void read_port() {
    char buf[65536];
    for (;;) {
      ssize_t n = ::read(port_, buf, sizeof buf);
      if (n > 0) {
        connected_ = true;
        reader_.feed(std::string_view(buf, static_cast<std::size_t>(n)));
        while (auto frame = reader_.next()) handle(*frame);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) return;
      // EOF: the host side is not connected.
      if (connected_) disconnect();
      return;
    }
  }

  void handle(const gp::Frame& f) {
    try {
      switch (f.type) {
        case Type::kHello:
          return on_hello(f);
        case Type::kSetup:
          return on_setup(f);
        case Type::kSync:
          ::sync();
          return send(Type::kOk, f.channel);
        case Type::kPowerOff:
          ::sync();
          send(Type::kOk, f.channel);
          flush();
          if (mode_ == GuestMode::kPid1) ::reboot(RB_POWER_OFF);
          else ::kill(1, SIGRTMIN + 4);  // systemd's orderly power-off
          return;
        case Type::kExec:
          return on_exec(f);
        case Type::kStdin:
          return on_stdin(f);
        case Type::kKill: {
          auto it = execs_.find(f.channel);
          if (it != execs_.end()) kill_exec(it->second);
          return;
        }
        case Type::kCredit: {
          auto it = execs_.find(f.channel);
          if (it == execs_.end()) return;
          gp::Reader r(f.payload);
          it->second.out_credit += std::min<std::uint64_t>(r.u64(), gp::kWindowBytes);
          it->second.out_credit = std::min<std::uint64_t>(it->second.out_credit, gp::kWindowBytes);
          return;
        }
        case Type::kReadFile:
          return on_read_file(f);
        case Type::kWriteFile:
        case Type::kPutTree:
          return on_upload_start(f);
        case Type::kEntry:
        case Type::kData:
        case Type::kEnd:
          return on_upload_part(f);
        case Type::kStat: {
          gp::Reader r(f.payload);
          std::string path = r.str();
          r.finish();
          return send(Type::kStatReply, f.channel, gp::Writer().u32(tree().mode_of(path)).take());
        }
        case Type::kGetTree:
          return on_get_tree(f);
        case Type::kCaptureUpper:
          return on_capture_upper(f);
        case Type::kProcessRequest:
          return on_process_request(f);
        default:
          return send_error(f.channel, Code::kInvalidArgument, "unknown frame type");
      }
    } catch (const Error& e) {
      send_error(f.channel, e);
    } catch (const std::out_of_range& e) {
      send_error(f.channel, Code::kInvalidArgument, e.what());
    }
  }

  // ---- control ----
  void on_hello(const gp::Frame& f) {
    gp::Hello h = gp::decode_hello(f.payload);
    // A new agent: what the earlier connection ran in the foreground has nobody to report to.
    for (auto& [channel, exec] : execs_) kill_exec(exec);
    uploads_.clear();
    if (h.realtime_ns) {
      timespec ts{static_cast<time_t>(h.realtime_ns / 1000000000ull), static_cast<long>(h.realtime_ns % 1000000000ull)};
      ::clock_settime(CLOCK_REALTIME, &ts);
    }
    if (!h.entropy.empty()) add_entropy(h.entropy);
    if (!h.hostname.empty()) ::sethostname(h.hostname.data(), h.hostname.size());
    gp::HelloReply reply{release_, root_ready_, static_cast<std::uint32_t>(execs_.size())};
    send(Type::kHelloReply, f.channel, gp::encode(reply));
  }

  static void add_entropy(const std::string& bytes) {
    int fd = ::open("/dev/urandom", O_WRONLY | O_CLOEXEC);
    if (fd < 0) return;
    std::vector<char> buf(sizeof(rand_pool_info) + bytes.size());
    auto* info = reinterpret_cast<rand_pool_info*>(buf.data());
    info->entropy_count = static_cast<int>(bytes.size() * 8);
    info->buf_size = static_cast<int>(bytes.size());
    std::memcpy(info->buf, bytes.data(), bytes.size());
    ::ioctl(fd, RNDADDENTROPY, info);
    ::ioctl(fd, RNDRESEEDCRNG);
    ::close(fd);
  }

  void on_setup(const gp::Frame& f) {
    if (root_ready_) throw Error(Code::kFailedPrecondition, "guest setup: the root is set up already");
    build_overlay_root(gp::decode_setup(f.payload));
    upper_ = UniqueFd(::open("/rw/upper", O_PATH | O_DIRECTORY | O_CLOEXEC));
    enter_new_root();
    mount_or_log("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620");
    mount_or_log("shm", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    mount_or_log("cgroup2", "/sys/fs/cgroup", "cgroup2", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr);
    ::mkdir(exec_cgroups_.c_str(), 0755);
    tree_.emplace(UniqueFd(::open("/", O_PATH | O_DIRECTORY | O_CLOEXEC)));
    root_ready_ = true;
    send(Type::kOk, f.channel);
  }

  files::SandboxTree& tree() {
    if (!tree_) throw Error(Code::kFailedPrecondition, "the guest's root is not set up yet");
    return *tree_;
  }

  // OOM kills by the guest kernel since boot (/proc/vmstat oom_kill; 0 where it is not counted).
  static std::uint64_t oom_kill_count() {
    char buf[8192];
    UniqueFd fd(::open("/proc/vmstat", O_RDONLY | O_CLOEXEC));
    if (!fd) return 0;
    std::size_t len = 0;
    ssize_t n;
    while (len < sizeof buf - 1 && (n = ::read(fd.get(), buf + len, sizeof buf - 1 - len)) > 0)
      len += static_cast<std::size_t>(n);
    buf[len] = '\0';
    const char* at = std::strstr(buf, "\noom_kill ");
    return at ? std::strtoull(at + 10, nullptr, 10) : 0;
  }

  // The descriptors a command joins cgroup `group` with (start_command): the group's directory, which the clone
  // starts it in, and its cgroup.procs as the fallback.
  static void join_fds(const std::string& group, std::vector<int>& fds) {
    int dir = ::open(group.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) fds.push_back(dir);
    int procs = ::open((group + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC);
    if (procs >= 0) fds.push_back(procs);
  }

  // ---- processes (process_protocol.hpp): {u32 op, then the op's payload} ----
  void on_process_request(const gp::Frame& f) {
    if (!root_ready_) throw Error(Code::kFailedPrecondition, "the guest's root is not set up yet");
    if (f.payload.size() < 4) throw Error(Code::kInvalidArgument, "a process request without its op");
    std::uint32_t op = 0;
    std::memcpy(&op, f.payload.data(), 4);
    std::vector<int> fds;
    if (static_cast<process_protocol::Op>(op) == process_protocol::Op::kSpawn) {
      // Each process gets a cgroup of its own, as an exec does; those of ended processes go at the next spawn.
      for (auto it = process_groups_.begin(); it != process_groups_.end();)
        it = ::rmdir(it->c_str()) == 0 || errno == ENOENT ? process_groups_.erase(it) : std::next(it);
      std::string group = exec_cgroups_ + "/p" + std::to_string(++process_group_counter_);
      if (::mkdir(group.c_str(), 0755) == 0) {
        process_groups_.insert(group);
        join_fds(group, fds);
      }
    }
    processes_->serve(f.channel, static_cast<process_protocol::Op>(op), std::string_view(f.payload).substr(4), fds);
  }

  // ---- execs ----
  void on_exec(const gp::Frame& f) {
    if (!root_ready_) throw Error(Code::kFailedPrecondition, "the guest's root is not set up yet");
    if (execs_.count(f.channel)) throw Error(Code::kInvalidArgument, "channel in use");
    gp::ExecStart m = gp::decode_exec_start(f.payload);
    Exec exec;
    exec.channel = f.channel;
    exec.cap = m.max_output;
    exec.cgroup = exec_cgroups_ + "/x" + std::to_string(f.channel);
    if (::mkdir(exec.cgroup.c_str(), 0755) != 0 && errno != EEXIST)
      throw Error(Code::kInternal, "mkdir " + exec.cgroup + ": " + errno_text(errno));
    std::vector<int> group_fds;
    join_fds(exec.cgroup, group_fds);
    int in[2], out[2], err[2];
    if (::pipe2(in, O_CLOEXEC) != 0) {
      close_all(group_fds);
      throw Error(Code::kResourceExhausted, "pipe: " + errno_text(errno));
    }
    if (::pipe2(out, O_CLOEXEC) != 0) {
      ::close(in[0]);
      ::close(in[1]);
      close_all(group_fds);
      throw Error(Code::kResourceExhausted, "pipe: " + errno_text(errno));
    }
    if (::pipe2(err, O_CLOEXEC) != 0) {
      for (int fd : {in[0], in[1], out[0], out[1]}) ::close(fd);
      close_all(group_fds);
      throw Error(Code::kResourceExhausted, "pipe: " + errno_text(errno));
    }
    StartRequest req;
    req.argv = std::move(m.argv);
    req.env = std::move(m.env);
    req.cwd = std::move(m.cwd);
    req.fds = {in[0], out[1], err[1]};
    // In a VM, root commands keep root's capabilities (the VM is the boundary); a named user's command gets its ids,
    // and for a uid other than 0 the kernel drops every capability with the change (and no_new_privs keeps setuid
    // programs from handing root back).
    req.set_user = m.has_user;
    req.uid = m.uid;
    req.gid = m.gid;
    req.groups.assign(m.groups.begin(), m.groups.end());
    req.fds.insert(req.fds.end(), group_fds.begin(), group_fds.end());
    int error = 0;
    init_protocol::FailStage stage = init_protocol::FailStage::kRequest;
    pid_t pid = start_command(req, original_mask_, error, stage);
    close_all(req.fds);
    if (pid < 0) {
      for (int fd : {in[1], out[0], err[0]}) ::close(fd);
      ::rmdir(exec.cgroup.c_str());
      send(Type::kFailed, f.channel, gp::Writer().i32(error).i32(static_cast<std::int32_t>(stage)).take());
      return;
    }
    exec.pid = pid;
    exec.oom_kills_at_start = oom_kill_count();
    exec.out = out[0];
    exec.err = err[0];
    exec.in = in[1];
    for (int fd : {exec.out, exec.err, exec.in}) ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
    if (!m.stdin_follows) {
      ::close(exec.in);
      exec.in = -1;
    }
    send(Type::kStarted, f.channel, gp::Writer().i32(pid).take());
    execs_.emplace(f.channel, std::move(exec));
  }

  void on_stdin(const gp::Frame& f) {
    auto it = execs_.find(f.channel);
    if (it == execs_.end() || it->second.in < 0) return;  // ended, or its stdin closed: dropped like a pipe would
    gp::Reader r(f.payload);
    std::string data = r.str();
    Exec& exec = it->second;
    if (data.empty()) exec.stdin_closing = true;
    else exec.stdin_pending += data;
    feed_stdin(exec);
  }

  void feed_stdin(Exec& exec) {
    while (exec.in >= 0 && !exec.stdin_pending.empty()) {
      ssize_t n = ::write(exec.in, exec.stdin_pending.data(), exec.stdin_pending.size());
      if (n > 0) {
        exec.stdin_pending.erase(0, static_cast<std::size_t>(n));
        exec.stdin_taken += static_cast<std::uint64_t>(n);
        if (exec.stdin_taken >= gp::kCreditStep || exec.stdin_pending.empty()) {
          send(Type::kCredit, exec.channel, gp::Writer().u64(exec.stdin_taken).take());
          exec.stdin_taken = 0;
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) return;
      // The command closed its stdin: the rest is dropped.
      exec.stdin_pending.clear();
      ::close(exec.in);
      exec.in = -1;
    }
    if (exec.in >= 0 && exec.stdin_pending.empty() && exec.stdin_closing) {
      ::close(exec.in);
      exec.in = -1;
    }
  }

  // Output may be read while the agent's window has room, or once the stream's cap is reached (the rest is read and
  // dropped, costing no window).
  static bool may_read(const Exec& exec, int stream) {
    std::uint64_t kept = stream == 1 ? exec.out_kept : exec.err_kept;
    return exec.out_credit > 0 || kept >= exec.cap;
  }

  // Reads what is there (within the window); closes the stream at EOF.
  void read_output(Exec& exec, int stream) {
    int& fd = stream == 1 ? exec.out : exec.err;
    std::uint64_t& kept = stream == 1 ? exec.out_kept : exec.err_kept;
    bool& truncated = stream == 1 ? exec.out_truncated : exec.err_truncated;
    char buf[65536];
    for (int rounds = 0; fd >= 0 && rounds < 16 && may_read(exec, stream); ++rounds) {
      std::size_t want = sizeof buf;
      if (kept < exec.cap) want = static_cast<std::size_t>(std::min<std::uint64_t>(want, exec.out_credit));
      ssize_t n = ::read(fd, buf, want);
      if (n > 0) {
        std::uint64_t room = exec.cap > kept ? exec.cap - kept : 0;
        std::uint64_t take = std::min<std::uint64_t>(room, static_cast<std::uint64_t>(n));
        if (take < static_cast<std::uint64_t>(n)) truncated = true;
        if (take > 0) {
          kept += take;
          exec.out_credit -= std::min(exec.out_credit, take);
          gp::Writer w;
          w.u8(static_cast<std::uint8_t>(stream)).str(std::string_view(buf, take));
          send(Type::kOutput, exec.channel, w.bytes());
        }
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno == EAGAIN) return;
      ::close(fd);
      fd = -1;
    }
  }

  void reap() {
    signalfd_siginfo info;
    while (::read(sigchld_, &info, sizeof info) == sizeof info) {
    }
    int status;
    pid_t pid;
    while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
      if (processes_->reaped(pid, status)) continue;
      for (auto& [channel, exec] : execs_) {
        if (exec.pid == pid && !exec.exited) {
          exec.exited = true;
          exec.status = status;
          exec.exited_at = Clock::now();
        }
      }
      // Any other pid: an orphan or a background process, reaped with nobody to tell.
    }
  }

  // Execs whose command ended and whose output is drained (or whose grace passed) are reported and forgotten.
  void finish_exits() {
    auto now = Clock::now();
    for (auto it = execs_.begin(); it != execs_.end();) {
      Exec& exec = it->second;
      if (!exec.exited) {
        ++it;
        continue;
      }
      if (out_.size() < kOutputBackpressure) {
        if (exec.out >= 0) read_output(exec, 1);
        if (exec.err >= 0) read_output(exec, 2);
      }
      bool drained = exec.out < 0 && exec.err < 0;
      // Past the grace the pipes are closed even if a background process holds them, unless output written before
      // is still in them and the agent's window has no room for it yet (a slow reader): that output waits.
      if (!drained && (now < exec.exited_at + kOutputGrace || (exec.out_credit == 0 && output_waiting(exec)))) {
        ++it;
        continue;
      }
      for (int fd : {exec.out, exec.err, exec.in})
        if (fd >= 0) ::close(fd);
      // A SIGKILL while the kernel's OOM killer struck: the OOM killer's (the agent's timeout kill is told apart
      // by the agent; another process's SIGKILL at that moment would be taken for it, as in a container).
      const bool oom =
          WIFSIGNALED(exec.status) && WTERMSIG(exec.status) == SIGKILL && oom_kill_count() > exec.oom_kills_at_start;
      send(Type::kExited, exec.channel,
           gp::encode(gp::Exited{exec.status, exec.out_truncated, exec.err_truncated, oom}));
      // Background processes keep the group; it is removed once they are gone.
      if (::rmdir(exec.cgroup.c_str()) != 0) lingering_groups_.insert(exec.cgroup);
      it = execs_.erase(it);
    }
    for (auto it = lingering_groups_.begin(); it != lingering_groups_.end();) {
      if (::rmdir(it->c_str()) == 0 || errno == ENOENT) it = lingering_groups_.erase(it);
      else ++it;
    }
  }

  static bool output_waiting(const Exec& exec) {
    for (int fd : {exec.out, exec.err}) {
      if (fd < 0) continue;
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, 0) > 0 && (p.revents & POLLIN)) return true;
    }
    return false;
  }

  void kill_exec(Exec& exec) {
    if (!write_small_file(exec.cgroup + "/cgroup.kill", "1") && exec.pid > 0) ::kill(-exec.pid, SIGKILL);
  }

  // ---- files ----
  void on_read_file(const gp::Frame& f) {
    gp::Reader r(f.payload);
    std::string path = r.str();
    std::uint64_t max = r.u64();
    r.finish();
    UniqueFd fd = tree().open_for_reading(path);
    struct stat st {};
    if (::fstat(fd.get(), &st) == 0 && static_cast<std::uint64_t>(st.st_size) > max)
      throw Error(Code::kResourceExhausted, "read " + files::normalize_sandbox_path(path) + ": larger than the " +
                                                std::to_string(max) + " byte limit");
    std::uint64_t total = 0;
    std::string buf(gp::kMaxDataChunk, '\0');
    for (;;) {
      ssize_t n = ::read(fd.get(), buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw Error(Code::kInternal, "read " + path + ": " + errno_text(errno));
      if (n == 0) break;
      total += static_cast<std::uint64_t>(n);
      if (total > max) throw Error(Code::kResourceExhausted, "read " + path + ": larger than the limit");
      send(Type::kData, f.channel, gp::Writer().str(std::string_view(buf.data(), static_cast<std::size_t>(n))).bytes());
      flush_below(2u << 20);
    }
    send(Type::kDone, f.channel, gp::Writer().u64(total).take());
  }

  void on_get_tree(const gp::Frame& f) {
    gp::Reader r(f.payload);
    std::string dir = r.str();
    std::uint64_t max = r.u64();
    r.finish();
    std::uint64_t entries = 0;
    tree().walk(
        dir, max,
        [&](const files::TreeEntry& e) {
          ++entries;
          send(Type::kEntry, f.channel, gp::encode(e));
          flush_below(2u << 20);
        },
        [&](std::string_view bytes) {
          while (!bytes.empty()) {
            auto piece = bytes.substr(0, gp::kMaxDataChunk);
            send(Type::kData, f.channel, gp::Writer().str(piece).bytes());
            flush_below(2u << 20);
            bytes.remove_prefix(piece.size());
          }
        });
    send(Type::kDone, f.channel, gp::Writer().u64(entries).take());
  }

  // ---- snapshot: the writable layer as it is, every command frozen meanwhile ----
  void on_capture_upper(const gp::Frame& f) {
    gp::Reader r(f.payload);
    std::uint64_t max = r.u64();
    r.finish();
    if (!upper_) throw Error(Code::kFailedPrecondition, "the guest's root is not set up yet");
    UniqueFd top(::openat(upper_.get(), ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!top) throw Error(Code::kInternal, "open the upper directory: " + errno_text(errno));
    struct stat st {};
    ::fstat(top.get(), &st);
    const std::string freeze = exec_cgroups_ + "/cgroup.freeze";
    write_small_file(freeze, "1");
    struct Thaw {
      std::string path;
      ~Thaw() { write_small_file(path, "0"); }
    } thaw{freeze};
    wait_frozen();
    ::sync();
    // A full system's services (systemd's journal, a desktop session) write to the writable layer too, outside the
    // frozen commands: its file system is frozen as well while it is read (reads go on; writes wait).
    struct FsFreeze {
      UniqueFd fd;
      ~FsFreeze() {
        if (fd) ::ioctl(fd.get(), FITHAW, 0);
      }
    } fs_freeze;
    if (mode_ == GuestMode::kService) {
      UniqueFd disk(::open(kServiceDisk, O_RDONLY | O_DIRECTORY | O_CLOEXEC));
      if (disk && ::ioctl(disk.get(), FIFREEZE, 0) == 0) fs_freeze.fd = std::move(disk);
      else log_line(std::string("snapshot: freeze ") + kServiceDisk + ": " + errno_text(errno));
    }
    Capture c{f.channel, max, st.st_dev, 0, 0, {}};
    capture_dir(top.get(), "", c);
    send(Type::kDone, f.channel, gp::Writer().u64(c.entries).take());
  }

  struct Capture {
    std::uint32_t channel;
    std::uint64_t max;
    dev_t dev;
    std::uint64_t bytes = 0, entries = 0;
    std::map<std::pair<dev_t, ino_t>, std::string> links;
  };

  void wait_frozen() const {
    const std::string events = exec_cgroups_ + "/cgroup.events";
    for (int i = 0; i < 200; ++i) {
      if (read_small_file(events).find("frozen 1") != std::string::npos) return;
      ::usleep(5000);
    }
  }

  static std::string xattr_of(int fd, const char* name) {
    char buf[256];
    ssize_t n = ::fgetxattr(fd, name, buf, sizeof buf);
    return n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
  }

  void emit(const files::TreeEntry& e, Capture& c) {
    ++c.entries;
    send(Type::kEntry, c.channel, gp::encode(e));
    flush_below(2u << 20);
  }

  // A regular file of the writable layer: its entry (a hard link to one sent before, when it is one) and its data.
  void capture_file(int dirfd, const std::string& name, const struct stat& st, files::TreeEntry& e, Capture& c) {
    const std::string& path = e.path;
    if (st.st_nlink > 1) {
      auto [it, fresh] = c.links.try_emplace({st.st_dev, st.st_ino}, path);
      if (!fresh) {
        e.kind = files::EntryKind::kHardlink;
        e.link = it->second;
        emit(e, c);
        return;
      }
    }
    UniqueFd file(::openat(dirfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (!file) return;
    if (!xattr_of(file.get(), "trusted.overlay.metacopy").empty() ||
        ::fgetxattr(file.get(), "trusted.overlay.metacopy", nullptr, 0) >= 0)
      throw Error(Code::kFailedPrecondition, "/" + path + " is an overlayfs metacopy: its data is in a lower layer");
    if (c.bytes + static_cast<std::uint64_t>(st.st_size) > c.max)
      throw Error(Code::kResourceExhausted, "the writable layer holds more than the snapshot's limit", false);
    c.bytes += static_cast<std::uint64_t>(st.st_size);
    e.kind = files::EntryKind::kRegular;
    e.size = static_cast<std::uint64_t>(st.st_size);
    emit(e, c);
    send_file_data(file.get(), e.size, c.channel);
  }

  // `size` bytes of the file open as `fd`, as data frames of `channel`.
  void send_file_data(int fd, std::uint64_t size, std::uint32_t channel) {
    std::string buf(gp::kMaxDataChunk, '\0');
    std::uint64_t left = size;
    while (left > 0) {
      ssize_t n = ::read(fd, buf.data(), std::min<std::uint64_t>(left, buf.size()));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        // Shrunk under us (it cannot: everything is frozen, but the entry promised its size): zeros.
        std::fill(buf.begin(), buf.end(), '\0');
        n = static_cast<ssize_t>(std::min<std::uint64_t>(left, buf.size()));
      }
      send(Type::kData, channel, gp::Writer().str(std::string_view(buf.data(), static_cast<std::size_t>(n))).bytes());
      flush_below(2u << 20);
      left -= static_cast<std::uint64_t>(n);
    }
  }

  void capture_dir(int dirfd, const std::string& rel, Capture& c) {
    UniqueFd iter(::dup(dirfd));
    DIR* dir = iter ? ::fdopendir(iter.release()) : nullptr;
    if (!dir) throw Error(Code::kInternal, "opendir " + rel + ": " + errno_text(errno));
    std::unique_ptr<DIR, int (*)(DIR*)> closer(dir, ::closedir);
    while (dirent* d = ::readdir(dir)) {
      std::string name = d->d_name;
      if (name == "." || name == "..") continue;
      std::string path = rel;
      if (!path.empty()) path += '/';
      path += name;
      struct stat st {};
      if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
      files::TreeEntry e;
      e.path = path;
      e.mode = st.st_mode & 07777;
      e.uid = st.st_uid;
      e.gid = st.st_gid;
      e.atime_ns = st.st_atim.tv_sec * 1000000000ll + st.st_atim.tv_nsec;
      e.mtime_ns = st.st_mtim.tv_sec * 1000000000ll + st.st_mtim.tv_nsec;
      e.mtime = st.st_mtim.tv_sec;
      if (S_ISDIR(st.st_mode)) {
        if (st.st_dev != c.dev) continue;
        UniqueFd sub(::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        if (!sub) continue;
        if (!xattr_of(sub.get(), "trusted.overlay.redirect").empty())
          throw Error(Code::kFailedPrecondition,
                      "/" + path + " carries an overlayfs redirect: it cannot be copied alone");
        e.kind = files::EntryKind::kDirectory;
        e.opaque = xattr_of(sub.get(), "trusted.overlay.opaque") == "y";
        emit(e, c);
        capture_dir(sub.get(), path, c);
      } else if (S_ISREG(st.st_mode)) {
        capture_file(dirfd, name, st, e, c);
      } else if (S_ISLNK(st.st_mode)) {
        char target[4096];
        ssize_t n = ::readlinkat(dirfd, name.c_str(), target, sizeof target);
        if (n < 0) continue;
        e.kind = files::EntryKind::kSymlink;
        e.link.assign(target, static_cast<std::size_t>(n));
        emit(e, c);
      } else if (S_ISFIFO(st.st_mode)) {
        e.kind = files::EntryKind::kFifo;
        emit(e, c);
      } else if (S_ISCHR(st.st_mode) && st.st_rdev == 0) {
        e.kind = files::EntryKind::kWhiteout;
        emit(e, c);
      }
      // Sockets and other devices are not part of a layer.
    }
  }

  void on_upload_start(const gp::Frame& f) {
    Upload& up = uploads_[f.channel];
    up = Upload{};
    gp::Reader r(f.payload);
    up.path = r.str();
    try {
      if (f.type == Type::kWriteFile) {
        std::uint32_t mode = r.u32();
        r.finish();
        up.file = tree().open_for_writing(up.path, mode);
      } else {
        r.finish();
        up.tree = std::make_unique<files::SandboxTree::Extraction>(tree(), up.path);
      }
    } catch (...) {
      up.failed = true;
      throw;
    }
  }

  void on_upload_part(const gp::Frame& f) {
    auto it = uploads_.find(f.channel);
    if (it == uploads_.end()) throw Error(Code::kInvalidArgument, "upload data without an upload");
    Upload& up = it->second;
    if (f.type == Type::kEnd) {
      bool failed = up.failed;
      std::uint64_t count = up.tree ? up.entries : up.bytes;
      if (!failed && up.tree) up.tree->finish();
      uploads_.erase(it);
      if (!failed) send(Type::kDone, f.channel, gp::Writer().u64(count).take());
      return;
    }
    if (up.failed) return;
    try {
      if (f.type == Type::kEntry) {
        if (!up.tree) throw Error(Code::kInvalidArgument, "a tree entry in a file upload");
        up.tree->entry(gp::decode_entry(f.payload));
        ++up.entries;
        return;
      }
      gp::Reader r(f.payload);
      std::string data = r.str();
      r.finish();
      up.bytes += data.size();
      if (up.tree) {
        up.tree->write_data(data);
        return;
      }
      std::string_view left = data;
      while (!left.empty()) {
        ssize_t n = ::write(up.file.get(), left.data(), left.size());
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
          int err = errno;
          throw Error(err == ENOSPC || err == EDQUOT || err == EFBIG ? Code::kResourceExhausted : Code::kInternal,
                      "write " + files::normalize_sandbox_path(up.path) + ": " + errno_text(err));
        }
        left.remove_prefix(static_cast<std::size_t>(n));
      }
    } catch (...) {
      up.failed = true;
      throw;
    }
  }

  std::string port_path_;
  int port_ = -1;
  bool connected_ = false;
  int sigchld_ = -1;
  sigset_t original_mask_{};
  std::string release_;
  GuestMode mode_;
  std::string exec_cgroups_ = "/sys/fs/cgroup/dsec";  // execs' groups are x<channel> in it, processes' p<n>
  bool root_ready_ = false;
  std::optional<files::SandboxTree> tree_;
  UniqueFd upper_;
  std::string out_;
  gp::FrameReader reader_;
  std::map<std::uint32_t, Exec> execs_;
  std::map<std::uint32_t, Upload> uploads_;
  std::set<std::string> lingering_groups_;
  std::optional<ProcessTable> processes_;
  std::set<std::string> process_groups_;  // cgroups made for processes, removed once empty
  std::uint64_t process_group_counter_ = 0;
};

}  // namespace

int run_guest_init() {
  mount_api_file_systems();
  write_small_file("/proc/self/oom_score_adj", "-1000");
  // The guest's console is where its kernel and this init log; the agent keeps its last lines for errors.
  int console = ::open("/dev/console", O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (console >= 0) {
    ::dup2(console, 1);
    ::dup2(console, 2);
    ::close(console);
  }
  int null = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null >= 0) {
    ::dup2(null, 0);
    ::close(null);
  }
  load_modules();
  loopback_up();
  std::string port = find_port(guest_protocol::kPortName, std::chrono::seconds(30));
  if (port.empty()) {
    log_line("no virtio-serial port named dsec.agent: powering off");
    ::reboot(RB_POWER_OFF);
    for (;;) ::pause();
  }
  GuestInit init(GuestMode::kPid1);
  init.serve(port);
}

int run_guest_service() {
  // Started by the image's init from the unit the boot stage wrote: the API file systems, the modules, the console
  // and the network are the system's. Without the port there is nothing to serve: exit, and the unit restarts it.
  std::string port = find_port(guest_protocol::kPortName, std::chrono::seconds(30));
  if (port.empty()) {
    log_line("no virtio-serial port named dsec.agent");
    return 1;
  }
  GuestInit init(GuestMode::kService);
  init.serve(port);
}

}  // namespace dsec::init
