#include "agent/backends/qemu/guest/guest_channel.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>

#include <fmt/format.h>

#include "agent/backends/qemu/guest/upper_capture.hpp"
#include "agent/files/tar_stream.hpp"
#include "common/syscall.hpp"
#include "common/wire/start_error.hpp"

namespace dsec::agent::guest {

namespace gp = guest_protocol;
using gp::Type;

namespace {

// A write to a guest that takes no data for this long means the guest is wedged.
constexpr int kSendTimeoutSeconds = 30;
constexpr auto kKillGrace = std::chrono::seconds(10);
constexpr auto kStartTimeout = std::chrono::seconds(30);
// What one call's mailbox may hold unread. Callers read as frames arrive, so only a guest that floods a channel
// (the code inside a VM may take its init over) reaches it: the connection is then dropped.
constexpr std::size_t kMailboxLimit = 64u << 20;

std::string data_payload(std::string_view bytes) { return gp::Writer().str(bytes).take(); }

std::string decode_data(const gp::Frame& f) {
  gp::Reader r(f.payload);
  std::string data = r.str();
  r.finish();
  return data;
}

}  // namespace

// A channel held for one call, handed back however the call ends.
class GuestChannel::Call {
 public:
  explicit Call(GuestChannel& owner) : owner_(owner), channel_(owner.open_channel()) {}
  ~Call() { owner_.close_channel(channel_); }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  std::uint32_t id() const noexcept { return channel_; }

 private:
  GuestChannel& owner_;
  std::uint32_t channel_;
};

GuestChannel::GuestChannel(UniqueFd stream, std::string label) : stream_(std::move(stream)), label_(std::move(label)) {
  timeval tv{kSendTimeoutSeconds, 0};
  ::setsockopt(stream_.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  reader_ = std::thread([this] { read_loop(); });
}

GuestChannel::~GuestChannel() {
  close();
  if (reader_.joinable()) reader_.join();
}

bool GuestChannel::connected() const {
  std::lock_guard lock(mu_);
  return !broken_;
}

void GuestChannel::close() {
  {
    std::lock_guard lock(mu_);
    if (!broken_) {
      broken_ = true;
      broken_reason_ = "the connection was closed";
    }
  }
  arrived_.notify_all();
  // Wakes the reader out of its recv.
  ::shutdown(stream_.get(), SHUT_RDWR);
}

void GuestChannel::read_loop() {
  gp::FrameReader reader;
  std::string reason = "the guest closed its port";
  char buf[65536];
  for (;;) {
    ssize_t n = ::recv(stream_.get(), buf, sizeof buf, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n < 0) reason = fmt::format("reading from the guest: {}", std::strerror(errno));
      break;
    }
    reader.feed(std::string_view(buf, static_cast<std::size_t>(n)));
    try {
      std::lock_guard lock(mu_);
      bool any = false;
      while (auto frame = reader.next()) {
        auto it = mailboxes_.find(frame->channel);
        if (it == mailboxes_.end()) continue;  // a call that gave up: its late frames are dropped
        it->second.bytes += frame->payload.size();
        if (it->second.bytes > kMailboxLimit) throw std::length_error("more unread data than a call may hold");
        it->second.frames.push_back(std::move(*frame));
        any = true;
      }
      if (any) arrived_.notify_all();
    } catch (const std::length_error& e) {
      reason = fmt::format("the guest sent too much or a malformed frame ({})", e.what());
      ::shutdown(stream_.get(), SHUT_RDWR);
      break;
    }
  }
  {
    std::lock_guard lock(mu_);
    if (!broken_) {
      broken_ = true;
      broken_reason_ = reason;
    }
  }
  arrived_.notify_all();
}

std::uint32_t GuestChannel::open_channel() {
  std::lock_guard lock(mu_);
  std::uint32_t channel;
  do {
    channel = next_channel_++;
    if (next_channel_ == 0) next_channel_ = 1;
  } while (mailboxes_.count(channel));
  mailboxes_.emplace(channel, Mailbox{});
  return channel;
}

void GuestChannel::close_channel(std::uint32_t channel) {
  std::lock_guard lock(mu_);
  mailboxes_.erase(channel);
}

[[noreturn]] void GuestChannel::throw_lost(std::string_view what) const {
  std::string reason;
  {
    std::lock_guard lock(mu_);
    reason = broken_reason_;
  }
  throw Error(Code::kUnavailable, fmt::format("sandbox {}: lost its guest during {} ({})", label_, what, reason));
}

void GuestChannel::send(Type type, std::uint32_t channel, std::string_view payload) {
  if (payload.size() + 5 > gp::kMaxFrameBytes)
    throw Error(Code::kInvalidArgument, fmt::format("a request of {} bytes is larger than a frame", payload.size()));
  std::string frame;
  gp::append_frame(frame, type, channel, payload);
  std::lock_guard lock(write_mu_);
  std::string_view rest(frame);
  while (!rest.empty()) {
    ssize_t n = ::send(stream_.get(), rest.data(), rest.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      {
        std::lock_guard state(mu_);
        if (!broken_) {
          broken_ = true;
          broken_reason_ = err == EAGAIN ? fmt::format("the guest took no data for {} s", kSendTimeoutSeconds)
                                         : fmt::format("writing to the guest: {}", std::strerror(err));
        }
      }
      arrived_.notify_all();
      ::shutdown(stream_.get(), SHUT_RDWR);
      throw_lost("a request");
    }
    rest.remove_prefix(static_cast<std::size_t>(n));
  }
}

std::optional<gp::Frame> GuestChannel::next(std::uint32_t channel, Clock::time_point deadline) {
  std::unique_lock lock(mu_);
  for (;;) {
    auto it = mailboxes_.find(channel);
    if (it != mailboxes_.end() && !it->second.frames.empty()) {
      gp::Frame f = std::move(it->second.frames.front());
      it->second.frames.pop_front();
      it->second.bytes -= f.payload.size();
      return f;
    }
    if (broken_) {
      lock.unlock();
      throw_lost("a call");
    }
    if (arrived_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline) {
      auto again = mailboxes_.find(channel);
      if (again == mailboxes_.end() || again->second.frames.empty()) return std::nullopt;
    }
  }
}

gp::Frame GuestChannel::answer(std::uint32_t channel, Clock::time_point deadline, std::string_view what) {
  auto f = next(channel, deadline);
  if (!f)
    throw Error(Code::kDeadlineExceeded, fmt::format("sandbox {}: its guest did not answer {} in time", label_, what));
  if (f->type == Type::kError) {
    gp::ErrorReply e = gp::decode_error(f->payload);
    auto code = static_cast<Code>(e.code);
    if (e.code > static_cast<std::uint32_t>(Code::kUnauthenticated) || code == Code::kOk) code = Code::kInternal;
    throw Error(code, e.message);
  }
  return std::move(*f);
}

gp::HelloReply GuestChannel::hello(const gp::Hello& hello, Clock::time_point deadline) {
  Call call(*this);
  send(Type::kHello, call.id(), gp::encode(hello));
  gp::Frame f = answer(call.id(), deadline, "hello");
  if (f.type != Type::kHelloReply) throw Error(Code::kInternal, "guest: unexpected answer to hello");
  return gp::decode_hello_reply(f.payload);
}

void GuestChannel::setup(const gp::Setup& setup, Clock::time_point deadline) {
  Call call(*this);
  send(Type::kSetup, call.id(), gp::encode(setup));
  if (answer(call.id(), deadline, "its root set-up").type != Type::kOk)
    throw Error(Code::kInternal, "guest: unexpected answer to setup");
}

void GuestChannel::sync(Clock::time_point deadline) {
  Call call(*this);
  send(Type::kSync, call.id(), {});
  if (answer(call.id(), deadline, "sync").type != Type::kOk)
    throw Error(Code::kInternal, "guest: unexpected answer to sync");
}

void GuestChannel::power_off(Clock::time_point deadline) {
  Call call(*this);
  send(Type::kPowerOff, call.id(), {});
  try {
    (void)answer(call.id(), deadline, "power off");
  } catch (const Error& e) {
    if (e.code() != Code::kUnavailable && e.code() != Code::kDeadlineExceeded) throw;
  }
}

// One exec after the guest started its command: stdin fed as the guest's window allows, output kept within the
// caps and acknowledged, until the command exits (or is killed at its timeout).
class GuestChannel::ExecRun {
 public:
  ExecRun(GuestChannel& owner, std::uint32_t channel, std::string_view stdin_data, bool stdin_open,
          std::uint64_t max_output, const OutputSink& sink)
      : owner_(owner),
        channel_(channel),
        stdin_data_(stdin_data),
        stdin_open_(stdin_open),
        max_output_(max_output),
        sink_(sink) {}

  // Stdin goes as the guest's window allows (it acknowledges what it wrote into the command's pipe), so a command
  // that does not read it holds it here, not in guest memory.
  void feed_stdin() {
    while (stdin_open_ && stdin_window_ > 0 && !stdin_data_.empty()) {
      auto piece = stdin_data_.substr(0, std::min<std::size_t>(gp::kMaxDataChunk, stdin_window_));
      owner_.send(Type::kStdin, channel_, data_payload(piece));
      stdin_data_.remove_prefix(piece.size());
      stdin_window_ -= piece.size();
    }
    if (stdin_open_ && stdin_data_.empty()) {
      owner_.send(Type::kStdin, channel_, data_payload({}));
      stdin_open_ = false;
    }
  }

  // The frames of the command until it exits; its wait status. Past `deadline` the command is killed.
  int wait_for_exit(Clock::time_point deadline);
  ExecResult& result() { return result_; }

 private:
  void take_output(const gp::Frame& f);
  void take_credit(const gp::Frame& f);

  GuestChannel& owner_;
  std::uint32_t channel_;
  std::string_view stdin_data_;
  std::uint64_t stdin_window_ = gp::kWindowBytes;
  bool stdin_open_;
  std::uint64_t max_output_;
  const OutputSink& sink_;
  std::uint64_t delivered_ = 0;  // output taken since the last acknowledgement
  std::uint64_t stdout_kept_ = 0, stderr_kept_ = 0;
  ExecResult result_;
};

int GuestChannel::ExecRun::wait_for_exit(Clock::time_point deadline) {
  auto wait_until = deadline;
  for (;;) {
    std::optional<gp::Frame> f;
    try {
      f = owner_.next(channel_, wait_until);
    } catch (const Error&) {
      owner_.throw_lost("an exec");
    }
    if (!f) {
      if (!result_.timed_out) {
        result_.timed_out = true;
        owner_.send(Type::kKill, channel_, {});
        wait_until = Clock::now() + kKillGrace;
        continue;
      }
      // Killed but never reported: treat as killed rather than wait forever.
      return SIGKILL;
    }
    if (f->type == Type::kOutput) {
      take_output(*f);
      continue;
    }
    if (f->type == Type::kCredit) {
      take_credit(*f);
      continue;
    }
    if (f->type == Type::kExited) {
      gp::Exited e = gp::decode_exited(f->payload);
      result_.stdout_truncated = result_.stdout_truncated || e.stdout_truncated;
      result_.stderr_truncated = result_.stderr_truncated || e.stderr_truncated;
      result_.oom_killed = e.oom_killed && !result_.timed_out;
      return e.status;
    }
    if (f->type == Type::kError) {
      gp::ErrorReply e = gp::decode_error(f->payload);
      throw Error(Code::kInternal, fmt::format("sandbox {}: exec: {}", owner_.label_, e.message));
    }
  }
}

void GuestChannel::ExecRun::take_output(const gp::Frame& f) {
  gp::Reader r(f.payload);
  int stream = r.u8() == 2 ? 2 : 1;
  std::string data = r.str();
  r.finish();
  const std::uint64_t received = data.size();
  // The guest caps output already; the agent does not rely on it.
  std::uint64_t& kept = stream == 2 ? stderr_kept_ : stdout_kept_;
  std::uint64_t room = max_output_ > kept ? max_output_ - kept : 0;
  if (data.size() > room) {
    data.resize(room);
    (stream == 2 ? result_.stderr_truncated : result_.stdout_truncated) = true;
  }
  kept += data.size();
  if (!data.empty()) {
    if (sink_) sink_(stream, data);
    else (stream == 2 ? result_.stderr_data : result_.stdout_data) += data;
  }
  // Acknowledged once delivered: a caller that reads slowly keeps the command waiting on its pipe.
  delivered_ += received;
  if (delivered_ >= gp::kCreditStep) {
    owner_.send(Type::kCredit, channel_, gp::Writer().u64(delivered_).take());
    delivered_ = 0;
  }
}

void GuestChannel::ExecRun::take_credit(const gp::Frame& f) {
  gp::Reader r(f.payload);
  stdin_window_ += std::min<std::uint64_t>(r.u64(), gp::kWindowBytes);
  stdin_window_ = std::min<std::uint64_t>(stdin_window_, gp::kWindowBytes);
  feed_stdin();
}

ExecResult GuestChannel::exec(gp::ExecStart start, std::string_view stdin_data, double timeout_seconds,
                              const OutputSink& sink) {
  const auto started = Clock::now();
  const std::string argv0 = start.argv.empty() ? std::string() : start.argv.front();
  const std::string cwd = start.cwd;
  const std::string user = fmt::format("uid {}, gid {}", start.uid, start.gid);
  start.stdin_follows = !stdin_data.empty();
  std::string request = gp::encode(start);
  if (request.size() + 64 > gp::kMaxFrameBytes)
    throw Error(Code::kInvalidArgument, "argv and env together exceed 1 MiB");

  Call call(*this);
  send(Type::kExec, call.id(), request);
  // A sink that throws, a caller that goes: whatever ends this call early leaves nothing of the command running.
  struct KillOnUnwind {
    GuestChannel& self;
    std::uint32_t channel;
    int uncaught = std::uncaught_exceptions();
    ~KillOnUnwind() {
      if (std::uncaught_exceptions() > uncaught) {
        try {
          self.send(Type::kKill, channel, {});
        } catch (...) {
        }
      }
    }
  } kill_on_unwind{*this, call.id()};
  gp::Frame first = answer(call.id(), started + kStartTimeout, "an exec");
  if (first.type == Type::kFailed) {
    gp::Reader r(first.payload);
    int err = r.i32();
    auto stage = static_cast<init_protocol::FailStage>(r.i32());
    if (auto result = init::start_failure_result(err, stage, argv0, cwd)) {
      result->duration_seconds = std::chrono::duration<double>(Clock::now() - started).count();
      if (sink) sink(2, result->stderr_data);
      return *result;
    }
    throw init::start_error(err, stage, argv0, cwd, user);
  }
  if (first.type != Type::kStarted) throw Error(Code::kInternal, "guest: unexpected answer to exec");

  ExecRun run(*this, call.id(), stdin_data, start.stdin_follows, start.max_output, sink);
  run.feed_stdin();
  const auto deadline = started + std::chrono::microseconds(static_cast<std::int64_t>(timeout_seconds * 1e6));
  const int status = run.wait_for_exit(deadline);
  ExecResult& result = run.result();
  if (WIFEXITED(status)) {
    result.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    result.exit_code = -1;
    result.signal = WTERMSIG(status);
  }
  result.duration_seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return std::move(result);
}

std::string GuestChannel::read_file(std::string_view path, std::size_t max_bytes, Clock::time_point deadline) {
  Call call(*this);
  send(Type::kReadFile, call.id(), gp::Writer().str(path).u64(max_bytes).take());
  std::string out;
  for (;;) {
    gp::Frame f = answer(call.id(), deadline, "a file read");
    if (f.type == Type::kDone) return out;
    if (f.type != Type::kData) throw Error(Code::kInternal, "guest: unexpected frame in a file read");
    out += decode_data(f);
    if (out.size() > max_bytes)
      throw Error(Code::kResourceExhausted, fmt::format("read {}: larger than the {} byte limit", path, max_bytes));
  }
}

void GuestChannel::write_file(std::string_view path, std::string_view data, unsigned mode, Clock::time_point deadline) {
  Call call(*this);
  send(Type::kWriteFile, call.id(), gp::Writer().str(path).u32(mode).take());
  while (!data.empty()) {
    auto piece = data.substr(0, gp::kMaxDataChunk);
    send(Type::kData, call.id(), data_payload(piece));
    data.remove_prefix(piece.size());
  }
  send(Type::kEnd, call.id(), {});
  if (answer(call.id(), deadline, "a file write").type != Type::kDone)
    throw Error(Code::kInternal, "guest: unexpected answer to a file write");
}

std::uint32_t GuestChannel::mode_of(std::string_view path, Clock::time_point deadline) {
  Call call(*this);
  send(Type::kStat, call.id(), gp::Writer().str(path).take());
  gp::Frame f = answer(call.id(), deadline, "a stat");
  if (f.type != Type::kStatReply) throw Error(Code::kInternal, "guest: unexpected answer to a stat");
  gp::Reader r(f.payload);
  return r.u32();
}

std::string GuestChannel::process_request(process_protocol::Op op, std::string_view payload,
                                          Clock::time_point deadline) {
  Call call(*this);
  std::string request(4, '\0');
  const auto op_value = static_cast<std::uint32_t>(op);
  std::memcpy(request.data(), &op_value, 4);
  request.append(payload);
  if (request.size() + gp::kHeaderBytes > gp::kMaxFrameBytes)
    throw Error(Code::kInvalidArgument, fmt::format("sandbox {}: a process request over {} bytes (argv and env "
                                                    "together are too large for a VM's line)",
                                                    label_, gp::kMaxFrameBytes - gp::kHeaderBytes));
  send(Type::kProcessRequest, call.id(), request);
  gp::Frame f = answer(call.id(), deadline, "a process request");
  if (f.type != Type::kProcessReply) throw Error(Code::kInternal, "guest: unexpected answer to a process request");
  return std::move(f.payload);
}

void GuestChannel::put_archive(std::string_view dir, std::string_view tar_bytes, Clock::time_point deadline) {
  Call call(*this);
  send(Type::kPutTree, call.id(), gp::Writer().str(dir).take());
  // Entries go to the guest as the tar is read; the guest applies them with the files API's tree rules.
  class Sender final : public files::TreeSink {
   public:
    Sender(GuestChannel& channel, std::uint32_t id) : channel_(channel), id_(id) {}
    void entry(const files::TreeEntry& e) override { channel_.send(Type::kEntry, id_, gp::encode(e)); }
    void write_data(std::string_view bytes) override {
      while (!bytes.empty()) {
        auto piece = bytes.substr(0, gp::kMaxDataChunk);
        channel_.send(Type::kData, id_, data_payload(piece));
        bytes.remove_prefix(piece.size());
      }
    }

   private:
    GuestChannel& channel_;
    std::uint32_t id_;
  } sender(*this, call.id());
  try {
    files::extract_tar(tar_bytes, sender);
  } catch (...) {
    // The guest keeps what arrived (as a container keeps what a broken tar extracted); the upload is closed.
    try {
      send(Type::kEnd, call.id(), {});
    } catch (...) {
    }
    throw;
  }
  send(Type::kEnd, call.id(), {});
  if (answer(call.id(), deadline, "a tar upload").type != Type::kDone)
    throw Error(Code::kInternal, "guest: unexpected answer to a tar upload");
}

std::string GuestChannel::get_archive(std::string_view dir, std::size_t max_bytes, Clock::time_point deadline) {
  Call call(*this);
  send(Type::kGetTree, call.id(), gp::Writer().str(dir).u64(max_bytes).take());
  files::TarWriter tar(max_bytes);
  for (;;) {
    gp::Frame f = answer(call.id(), deadline, "a tar download");
    if (f.type == Type::kDone) return tar.finish();
    if (f.type == Type::kEntry) tar.entry(gp::decode_entry(f.payload));
    else if (f.type == Type::kData) tar.data(decode_data(f));
    else throw Error(Code::kInternal, "guest: unexpected frame in a tar download");
  }
}

image::UpperTreeStats GuestChannel::capture_upper(const std::filesystem::path& dest,
                                                  const image::UpperTreeLimits& limits, Clock::time_point deadline) {
  Call call(*this);
  send(Type::kCaptureUpper, call.id(), gp::Writer().u64(limits.max_file_bytes).take());
  UpperTreeWriter tree(dest, limits);
  for (;;) {
    gp::Frame f = answer(call.id(), deadline, "a snapshot");
    if (f.type == Type::kDone) return tree.finish();
    if (f.type == Type::kEntry) tree.entry(gp::decode_entry(f.payload));
    else if (f.type == Type::kData) tree.data(decode_data(f));
    else throw Error(Code::kInternal, "guest: unexpected frame in a snapshot");
  }
}

}  // namespace dsec::agent::guest
