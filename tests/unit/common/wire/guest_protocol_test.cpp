// The wire between the agent and dsec-init inside a VM (agent/init/guest_protocol) and the agent's end of it
// (agent/guest/guest_channel).
//
// GuestProtocol: frames round trip through FrameReader however the bytes are split or merged, an oversized or
// undersized frame header is std::length_error, every message's encode/decode pair round trips, and malformed payloads
// (short, trailing bytes, NUL in argv/env/cwd/paths, counts the payload cannot hold) are std::out_of_range.
//
// GuestChannel: driven by a fake guest, a thread speaking the frames on the other end of a socketpair: hello, setup,
// sync and power-off; execs with output, stdin, exits, start failures and many at once; a guest that never answers
// after kStarted gets kKill at the exec's timeout; the host-side output cap holds against a guest that sends more;
// kError answers become the dsec::Error with their code; a guest that closes the stream, sends an oversized frame or
// floods a call beyond the mailbox limit loses its connection (UNAVAILABLE) instead of growing the agent's memory;
// files and tar trees round trip against a fake file system.
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "agent/backends/qemu/guest/guest_channel.hpp"
#include "agent/files/tar_stream.hpp"
#include "common/wire/guest_protocol.hpp"
#include "common/wire/init_protocol.hpp"
#include "dsec/error.hpp"
#include "error_test_util.hpp"

namespace dsec {
namespace {

namespace gp = guest_protocol;
namespace files = agent::files;
using agent::guest::GuestChannel;
using gp::Type;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// GuestChannel's kMailboxLimit (guest_channel.cpp): what one call may hold unread.
constexpr std::size_t kMailboxLimit = 64u << 20;

std::string bytes_pattern(std::size_t n, unsigned seed = 1) {
  std::string s(n, '\0');
  std::uint32_t x = seed * 2654435761u + 1;
  for (std::size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    s[i] = static_cast<char>(x >> 24);
  }
  return s;
}

std::string frame_bytes(Type type, std::uint32_t channel, std::string_view payload) {
  std::string out;
  gp::append_frame(out, type, channel, payload);
  return out;
}

std::string u32_le(std::uint32_t v) { return gp::Writer().u32(v).take(); }

bool eventually(const std::function<bool()>& pred, std::chrono::milliseconds timeout = 5s) {
  auto until = Clock::now() + timeout;
  while (!pred()) {
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(5ms);
  }
  return true;
}

// ====================================================================================================== protocol

TEST(GuestProtocol, FramesRoundTrip) {
  const std::string big = bytes_pattern(gp::kMaxFrameBytes - 5);  // the largest payload a frame carries
  std::vector<gp::Frame> sent = {
      {Type::kHello, 0, ""},
      {Type::kOutput, 7, std::string("a\0b\xff", 4)},
      {Type::kData, 0xffffffffu, big},
      {Type::kDone, 1, "x"},
  };
  std::string stream;
  for (const auto& f : sent) gp::append_frame(stream, f.type, f.channel, f.payload);
  EXPECT_EQ(stream.size(), 4 * gp::kHeaderBytes + 4 + 1 + big.size());

  gp::FrameReader reader;
  EXPECT_FALSE(reader.next().has_value());
  reader.feed(stream);
  for (const auto& want : sent) {
    auto got = reader.next();
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->type, want.type);
    EXPECT_EQ(got->channel, want.channel);
    EXPECT_EQ(got->payload, want.payload);
  }
  EXPECT_FALSE(reader.next().has_value());
  EXPECT_EQ(reader.buffered(), 0u);
}

TEST(GuestProtocol, HeaderLayoutIsLittleEndian) {
  std::string f = frame_bytes(Type::kExited, 0x01020304u, "xyz");
  ASSERT_EQ(f.size(), gp::kHeaderBytes + 3);
  EXPECT_EQ(f.substr(0, 4), std::string("\x08\x00\x00\x00", 4));  // 1 type + 4 channel + 3 payload
  EXPECT_EQ(static_cast<unsigned char>(f[4]), static_cast<unsigned char>(Type::kExited));
  EXPECT_EQ(f.substr(5, 4), std::string("\x04\x03\x02\x01", 4));
  EXPECT_EQ(f.substr(9), "xyz");
}

TEST(GuestProtocol, FrameReaderWithSplitFeeds) {
  std::string stream = frame_bytes(Type::kStdin, 3, "hello") + frame_bytes(Type::kKill, 3, "") +
                       frame_bytes(Type::kData, 9, bytes_pattern(70000));
  gp::FrameReader reader;
  std::vector<gp::Frame> got;
  std::vector<std::size_t> completed_at;
  for (std::size_t i = 0; i < stream.size(); ++i) {
    reader.feed(std::string_view(stream).substr(i, 1));
    while (auto f = reader.next()) {
      got.push_back(std::move(*f));
      completed_at.push_back(i + 1);
    }
  }
  ASSERT_EQ(got.size(), 3u);
  // Each frame comes out exactly when its last byte arrived, not before.
  EXPECT_EQ(completed_at[0], gp::kHeaderBytes + 5);
  EXPECT_EQ(completed_at[1], 2 * gp::kHeaderBytes + 5);
  EXPECT_EQ(completed_at[2], stream.size());
  EXPECT_EQ(got[0].payload, "hello");
  EXPECT_EQ(got[1].type, Type::kKill);
  EXPECT_EQ(got[2].payload, bytes_pattern(70000));
  EXPECT_EQ(reader.buffered(), 0u);
}

TEST(GuestProtocol, FrameReaderWithMergedAndRaggedFeeds) {
  // Thousands of frames, fed in pieces that cut headers and payloads anywhere (and pass the 1 MiB compaction mark).
  std::string stream;
  std::vector<std::string> payloads;
  for (int i = 0; i < 3000; ++i) {
    payloads.push_back(bytes_pattern(static_cast<std::size_t>(i * 37 % 2000), static_cast<unsigned>(i)));
    gp::append_frame(stream, Type::kOutput, static_cast<std::uint32_t>(i), payloads.back());
  }
  gp::FrameReader reader;
  std::size_t pos = 0, piece = 1, n = 0;
  while (pos < stream.size()) {
    std::size_t len = std::min(piece, stream.size() - pos);
    reader.feed(std::string_view(stream).substr(pos, len));
    pos += len;
    piece = piece * 7 % 9973 + 1;
    while (auto f = reader.next()) {
      ASSERT_LT(n, payloads.size());
      EXPECT_EQ(f->channel, n);
      EXPECT_EQ(f->payload, payloads[n]);
      ++n;
    }
    EXPECT_LT(reader.buffered(), gp::kMaxFrameBytes + 10000);
  }
  EXPECT_EQ(n, payloads.size());
  EXPECT_EQ(reader.buffered(), 0u);
}

TEST(GuestProtocol, OversizedFrameIsLengthError) {
  {
    // The header alone is enough to refuse: the reader does not wait for (or buffer) the rest.
    gp::FrameReader reader;
    reader.feed(u32_le(gp::kMaxFrameBytes + 1));
    EXPECT_THROW(reader.next(), std::length_error);
  }
  {
    gp::FrameReader reader;
    reader.feed(u32_le(0xffffffffu) + "\x0d");
    EXPECT_THROW(reader.next(), std::length_error);
  }
  for (std::uint32_t size : {0u, 1u, 4u}) {  // shorter than type + channel
    gp::FrameReader reader;
    reader.feed(u32_le(size) + std::string(8, '\0'));
    EXPECT_THROW(reader.next(), std::length_error) << size;
  }
  {
    // Exactly the largest size is a frame.
    gp::FrameReader reader;
    reader.feed(u32_le(gp::kMaxFrameBytes));
    EXPECT_FALSE(reader.next().has_value());
    reader.feed(std::string(gp::kMaxFrameBytes, '\x1b'));
    auto f = reader.next();
    ASSERT_TRUE(f.has_value());
    EXPECT_EQ(f->payload.size(), gp::kMaxFrameBytes - 5);
  }
}

TEST(GuestProtocol, WriterAndReaderPrimitives) {
  std::vector<std::string> list = {"", "a", std::string("\0\xff", 2), bytes_pattern(1000)};
  std::string p = gp::Writer()
                      .u8(0xfe)
                      .u32(0xdeadbeefu)
                      .i32(-12345)
                      .u64(0xfedcba9876543210ull)
                      .str(std::string("x\0y", 3))
                      .strs(list)
                      .str("")
                      .take();
  gp::Reader r(p);
  EXPECT_EQ(r.u8(), 0xfe);
  EXPECT_EQ(r.u32(), 0xdeadbeefu);
  EXPECT_EQ(r.i32(), -12345);
  EXPECT_EQ(r.u64(), 0xfedcba9876543210ull);
  EXPECT_EQ(r.str(), std::string("x\0y", 3));
  EXPECT_FALSE(r.done());
  EXPECT_THROW(r.finish(), std::out_of_range);
  EXPECT_EQ(r.strs(), list);
  EXPECT_EQ(r.str(), "");
  EXPECT_TRUE(r.done());
  EXPECT_NO_THROW(r.finish());
  EXPECT_THROW(r.u8(), std::out_of_range);
  EXPECT_THROW(r.u32(), std::out_of_range);
  EXPECT_THROW(r.u64(), std::out_of_range);
  EXPECT_THROW(r.str(), std::out_of_range);
}

TEST(GuestProtocol, ReaderRefusesWhatThePayloadCannotHold) {
  // A string longer than what is left.
  EXPECT_THROW(gp::Reader(u32_le(10) + "short").str(), std::out_of_range);
  EXPECT_THROW(gp::Reader(u32_le(0xffffffffu)).str(), std::out_of_range);
  // A huge string count: refused before anything is reserved.
  EXPECT_THROW(gp::Reader(u32_le(0xffffffffu)).strs(), std::out_of_range);
  EXPECT_THROW(gp::Reader(u32_le(3) + u32_le(0) + u32_le(0)).strs(), std::out_of_range);
  // More than the caller's maximum, even when the payload could hold them.
  std::vector<std::string> five(5, "");
  std::string p = gp::Writer().strs(five).take();
  EXPECT_THROW(gp::Reader(p).strs(4), std::out_of_range);
  EXPECT_EQ(gp::Reader(p).strs(5).size(), 5u);
  // A short u32/u64.
  EXPECT_THROW(gp::Reader("abc").u32(), std::out_of_range);
  EXPECT_THROW(gp::Reader("abcdefg").u64(), std::out_of_range);
}

// Every cut of a valid payload short of its end must be refused by the decoder, and so must one extra byte.
template <typename Decode>
void expect_strict(const std::string& payload, Decode decode, const char* what) {
  EXPECT_NO_THROW(decode(payload)) << what;
  for (std::size_t n = 0; n < payload.size(); ++n)
    EXPECT_THROW(decode(payload.substr(0, n)), std::out_of_range) << what << " cut at " << n;
  EXPECT_THROW(decode(payload + '\0'), std::out_of_range) << what << " with a trailing byte";
}

TEST(GuestProtocol, ExecStartRoundTripsAndIsStrict) {
  gp::ExecStart m;
  m.argv = {"/bin/sh", "-c", "echo 'a b'; exit 3", ""};
  m.env = {"PATH=/usr/bin:/bin", "EMPTY=", "X=a=b"};
  m.cwd = "/work dir";
  m.max_output = 1ull << 33;
  m.stdin_follows = true;
  std::string p = gp::encode(m);
  gp::ExecStart back = gp::decode_exec_start(p);
  EXPECT_EQ(back.argv, m.argv);
  EXPECT_EQ(back.env, m.env);
  EXPECT_EQ(back.cwd, m.cwd);
  EXPECT_EQ(back.max_output, m.max_output);
  EXPECT_TRUE(back.stdin_follows);
  m.stdin_follows = false;
  m.env.clear();
  m.cwd.clear();
  EXPECT_FALSE(gp::decode_exec_start(gp::encode(m)).stdin_follows);
  expect_strict(p, gp::decode_exec_start, "ExecStart");
}

TEST(GuestProtocol, ExecStartRefusesNulAndEmptyArgv) {
  gp::ExecStart m{{"echo", "ok"}, {"A=1"}, "/", 100, false};
  ASSERT_NO_THROW(gp::decode_exec_start(gp::encode(m)));
  auto with = [&](auto change) {
    gp::ExecStart c = m;
    change(c);
    return gp::encode(c);
  };
  EXPECT_THROW(gp::decode_exec_start(with([](auto& c) { c.argv[1] = std::string("o\0k", 3); })), std::out_of_range);
  EXPECT_THROW(gp::decode_exec_start(with([](auto& c) { c.argv[0] = std::string("\0", 1); })), std::out_of_range);
  EXPECT_THROW(gp::decode_exec_start(with([](auto& c) { c.env[0] = std::string("A=\0", 3); })), std::out_of_range);
  EXPECT_THROW(gp::decode_exec_start(with([](auto& c) { c.cwd = std::string("/tmp\0/x", 7); })), std::out_of_range);
  EXPECT_THROW(gp::decode_exec_start(with([](auto& c) { c.argv.clear(); })), std::out_of_range);
  // An argc the payload cannot hold.
  std::string huge = u32_le(0x7fffffffu) + gp::Writer().strs({}).str("/").u64(0).u8(0).take();
  EXPECT_THROW(gp::decode_exec_start(huge), std::out_of_range);
}

TEST(GuestProtocol, HelloAndReplyRoundTrip) {
  gp::Hello h{0x1122334455667788ull, bytes_pattern(32), "box-7"};
  std::string p = gp::encode(h);
  gp::Hello back = gp::decode_hello(p);
  EXPECT_EQ(back.realtime_ns, h.realtime_ns);
  EXPECT_EQ(back.entropy, h.entropy);
  EXPECT_EQ(back.hostname, h.hostname);
  expect_strict(p, gp::decode_hello, "Hello");

  gp::HelloReply r{"6.1.0-57-cloud-amd64", true, 42};
  std::string rp = gp::encode(r);
  gp::HelloReply rback = gp::decode_hello_reply(rp);
  EXPECT_EQ(rback.kernel_release, r.kernel_release);
  EXPECT_TRUE(rback.root_ready);
  EXPECT_EQ(rback.execs_running, 42u);
  expect_strict(rp, gp::decode_hello_reply, "HelloReply");
}

TEST(GuestProtocol, SetupRoundTripsAndIsStrict) {
  gp::Setup s;
  s.layers = {{"dsec-layer-0", ""}, {"dsec-layer-1", "dsec-data-1"}, {"dsec-layer-2", ""}};
  s.disk_serial = "dsec-disk";
  std::string p = gp::encode(s);
  gp::Setup back = gp::decode_setup(p);
  ASSERT_EQ(back.layers.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(back.layers[i].serial, s.layers[i].serial);
    EXPECT_EQ(back.layers[i].data_serial, s.layers[i].data_serial);
  }
  EXPECT_EQ(back.disk_serial, "dsec-disk");
  expect_strict(p, gp::decode_setup, "Setup");
  EXPECT_TRUE(gp::decode_setup(gp::encode(gp::Setup{})).layers.empty());
  // More layers than a guest mounts.
  gp::Setup many;
  many.layers.resize(129, gp::SetupLayer{"l", ""});
  EXPECT_THROW(gp::decode_setup(gp::encode(many)), std::out_of_range);
  EXPECT_THROW(gp::decode_setup(u32_le(0xffffffffu)), std::out_of_range);
}

TEST(GuestProtocol, ExitedRoundTripsAndIsStrict) {
  for (gp::Exited e : {gp::Exited{0, false, false}, gp::Exited{3 << 8, true, false}, gp::Exited{SIGKILL, false, true},
                       gp::Exited{-1, true, true}, gp::Exited{SIGKILL, false, false, true}}) {
    std::string p = gp::encode(e);
    gp::Exited back = gp::decode_exited(p);
    EXPECT_EQ(back.status, e.status);
    EXPECT_EQ(back.stdout_truncated, e.stdout_truncated);
    EXPECT_EQ(back.stderr_truncated, e.stderr_truncated);
    EXPECT_EQ(back.oom_killed, e.oom_killed);
    // Cuts short of the older form (no OOM byte) are refused, the older form itself is read as no OOM kill, and a
    // byte past the newer form is refused.
    for (std::size_t n = 0; n < 6; ++n) EXPECT_THROW(gp::decode_exited(p.substr(0, n)), std::out_of_range) << n;
    EXPECT_FALSE(gp::decode_exited(p.substr(0, 6)).oom_killed);
    EXPECT_EQ(gp::decode_exited(p.substr(0, 6)).status, e.status);
    EXPECT_THROW(gp::decode_exited(p + '\0'), std::out_of_range);
  }
}

TEST(GuestProtocol, TreeEntryRoundTripsAndIsStrict) {
  std::vector<files::TreeEntry> entries = {
      {files::EntryKind::kDirectory, "d", 0750, "", 0, 1000, 1000, 1700000000},
      {files::EntryKind::kRegular, "d/f", 0640, "", 1ull << 40, 0, 0, -5},
      {files::EntryKind::kSymlink, "d/l", 0777, "../../etc/passwd", 0, 1, 2, 3},
      {files::EntryKind::kHardlink, "d/h", 0640, "d/f", 0, 0, 0, 0},
      // A VM snapshot's kinds, with nanosecond times and the opaque mark.
      {files::EntryKind::kFifo, "d/p", 0600, "", 0, 0, 0, 0, 1700000000123456789, 1700000001987654321, false},
      {files::EntryKind::kWhiteout, "gone", 0, "", 0, 0, 0, 0, 0, 0, false},
      {files::EntryKind::kDirectory, "replaced", 0755, "", 0, 0, 0, 0, 5, 6, true},
  };
  for (const auto& e : entries) {
    std::string p = gp::encode(e);
    files::TreeEntry back = gp::decode_entry(p);
    EXPECT_EQ(back.kind, e.kind);
    EXPECT_EQ(back.path, e.path);
    EXPECT_EQ(back.mode, e.mode);
    EXPECT_EQ(back.link, e.link);
    EXPECT_EQ(back.size, e.size);
    EXPECT_EQ(back.uid, e.uid);
    EXPECT_EQ(back.gid, e.gid);
    EXPECT_EQ(back.mtime, e.mtime);
    EXPECT_EQ(back.atime_ns, e.atime_ns);
    EXPECT_EQ(back.mtime_ns, e.mtime_ns);
    EXPECT_EQ(back.opaque, e.opaque);
    expect_strict(p, gp::decode_entry, "TreeEntry");
  }
  files::TreeEntry bad = entries[1];
  bad.path = std::string("d/\0f", 4);
  EXPECT_THROW(gp::decode_entry(gp::encode(bad)), std::out_of_range);
  bad = entries[2];
  bad.link = std::string("x\0", 2);
  EXPECT_THROW(gp::decode_entry(gp::encode(bad)), std::out_of_range);
  for (std::uint8_t kind : {0, 7, 255}) {
    std::string p = gp::encode(entries[0]);
    p[0] = static_cast<char>(kind);
    EXPECT_THROW(gp::decode_entry(p), std::out_of_range) << int(kind);
  }
}

TEST(GuestProtocol, ErrorReplyRoundTripsAndIsStrict) {
  gp::ErrorReply e{static_cast<std::uint32_t>(Code::kNotFound), "no such file in the sandbox: /x"};
  std::string p = gp::encode(e);
  gp::ErrorReply back = gp::decode_error(p);
  EXPECT_EQ(back.code, e.code);
  EXPECT_EQ(back.message, e.message);
  expect_strict(p, gp::decode_error, "ErrorReply");
}

// ====================================================================================================== a fake guest

// The guest's end of a socketpair, served by a thread: every frame that arrives is recorded and handed to `handler`
// (on that thread), which answers with send(). Stops when the agent closes its end.
class FakeGuest {
 public:
  using Handler = std::function<void(FakeGuest&, const gp::Frame&)>;

  explicit FakeGuest(Handler handler) : handler_(std::move(handler)) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw std::runtime_error("socketpair");
    agent_end_ = UniqueFd(sv[0]);
    guest_ = UniqueFd(sv[1]);
    thread_ = std::thread([this] { serve(); });
  }
  ~FakeGuest() {
    ::shutdown(guest_.get(), SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
  }

  UniqueFd take_agent_end() { return std::move(agent_end_); }

  // False once the agent stopped reading (its end shut down or closed).
  bool send(Type type, std::uint32_t channel, std::string_view payload = {}) {
    std::string f = frame_bytes(type, channel, payload);
    return send_raw(f);
  }
  bool send_raw(std::string_view bytes) {
    std::lock_guard lock(write_mu_);
    while (!bytes.empty()) {
      ssize_t n = ::send(guest_.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      sent_bytes_ += static_cast<std::size_t>(n);
      bytes.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }
  void output(std::uint32_t channel, int stream, std::string_view data) {
    send(Type::kOutput, channel, gp::Writer().u8(static_cast<std::uint8_t>(stream)).str(data).take());
  }
  void exited(std::uint32_t channel, int status, bool out_truncated = false, bool err_truncated = false) {
    send(Type::kExited, channel, gp::encode(gp::Exited{status, out_truncated, err_truncated}));
  }
  void error(std::uint32_t channel, Code code, const std::string& message) {
    send(Type::kError, channel, gp::encode(gp::ErrorReply{static_cast<std::uint32_t>(code), message}));
  }
  void hang_up() { ::shutdown(guest_.get(), SHUT_RDWR); }

  std::vector<gp::Frame> received() const {
    std::lock_guard lock(mu_);
    return frames_;
  }
  std::vector<gp::Frame> received(Type type) const {
    std::vector<gp::Frame> out;
    for (auto& f : received())
      if (f.type == type) out.push_back(f);
    return out;
  }
  // Waits until `pred(frames so far)` holds.
  bool wait_for(const std::function<bool(const std::vector<gp::Frame>&)>& pred,
                std::chrono::milliseconds timeout = 5s) const {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return pred(frames_); });
  }
  std::size_t sent_bytes() const {
    std::lock_guard lock(write_mu_);
    return sent_bytes_;
  }
  Clock::time_point arrival(std::size_t index) const {
    std::lock_guard lock(mu_);
    return arrivals_.at(index);
  }

 private:
  void serve() {
    gp::FrameReader reader;
    char buf[65536];
    for (;;) {
      ssize_t n = ::recv(guest_.get(), buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      reader.feed(std::string_view(buf, static_cast<std::size_t>(n)));
      while (auto f = reader.next()) {
        {
          std::lock_guard lock(mu_);
          frames_.push_back(*f);
          arrivals_.push_back(Clock::now());
        }
        cv_.notify_all();
        if (handler_) handler_(*this, *f);
      }
    }
  }

  Handler handler_;
  UniqueFd agent_end_, guest_;
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::vector<gp::Frame> frames_;
  std::vector<Clock::time_point> arrivals_;
  mutable std::mutex write_mu_;
  std::size_t sent_bytes_ = 0;
  std::thread thread_;
};

bool has_frame(const std::vector<gp::Frame>& frames, Type type, std::uint32_t channel) {
  return std::any_of(frames.begin(), frames.end(),
                     [&](const gp::Frame& f) { return f.type == type && f.channel == channel; });
}

gp::ExecStart exec_start(std::vector<std::string> argv, std::uint64_t max_output = 1u << 20) {
  return gp::ExecStart{std::move(argv), {"PATH=/bin"}, "/", max_output, false};
}

Clock::time_point soon() { return Clock::now() + 5s; }

// A guest that runs a few pretend commands: argv[0] "echo" prints its arguments; "cat" echoes its stdin; "exit N"
// exits N; "kill N" dies of signal N; "fail" cannot start (ENOENT at exec); "nocwd" cannot enter its cwd; "hang"
// starts and never ends unless killed (a kKill is answered as a death by SIGKILL).
void pretend_commands(FakeGuest& g, const gp::Frame& f) {
  static std::mutex mu;
  static std::map<std::uint32_t, std::string> stdin_of;  // per channel, for "cat"
  static std::map<std::uint32_t, bool> killable;
  switch (f.type) {
    case Type::kHello:
      g.send(Type::kHelloReply, f.channel, gp::encode(gp::HelloReply{"6.1.0-fake", false, 0}));
      return;
    case Type::kExec: {
      gp::ExecStart m = gp::decode_exec_start(f.payload);
      const std::string& cmd = m.argv[0];
      if (cmd == "fail") {
        g.send(Type::kFailed, f.channel,
               gp::Writer().i32(ENOENT).i32(static_cast<std::int32_t>(init_protocol::FailStage::kExec)).take());
        return;
      }
      if (cmd == "nocwd") {
        g.send(Type::kFailed, f.channel,
               gp::Writer().i32(ENOENT).i32(static_cast<std::int32_t>(init_protocol::FailStage::kChdir)).take());
        return;
      }
      g.send(Type::kStarted, f.channel, gp::Writer().i32(100).take());
      if (cmd == "echo") {
        std::string out;
        for (std::size_t i = 1; i < m.argv.size(); ++i) out += (i > 1 ? " " : "") + m.argv[i];
        g.output(f.channel, 1, out + "\n");
        g.exited(f.channel, 0);
      } else if (cmd == "exit") {
        g.output(f.channel, 2, "bye\n");
        g.exited(f.channel, std::stoi(m.argv[1]) << 8);
      } else if (cmd == "kill") {
        g.exited(f.channel, std::stoi(m.argv[1]));
      } else if (cmd == "cat") {
        std::lock_guard lock(mu);
        stdin_of[f.channel].clear();
        if (!m.stdin_follows) g.exited(f.channel, 0);
      } else if (cmd == "hang") {
        std::lock_guard lock(mu);
        killable[f.channel] = true;
      }
      return;
    }
    case Type::kStdin: {
      gp::Reader r(f.payload);
      std::string data = r.str();
      r.finish();
      std::lock_guard lock(mu);
      if (!data.empty()) {
        stdin_of[f.channel] += data;
        return;
      }
      std::string all = std::move(stdin_of[f.channel]);
      stdin_of.erase(f.channel);
      for (std::size_t pos = 0; pos < all.size(); pos += gp::kMaxDataChunk)
        g.output(f.channel, 1, std::string_view(all).substr(pos, gp::kMaxDataChunk));
      g.exited(f.channel, 0);
      return;
    }
    case Type::kKill: {
      std::lock_guard lock(mu);
      if (killable.erase(f.channel)) g.exited(f.channel, SIGKILL);
      return;
    }
    default:
      return;
  }
}

// ====================================================================================================== channel

TEST(GuestChannel, HelloSetupSyncPowerOff) {
  FakeGuest guest([](FakeGuest& g, const gp::Frame& f) {
    if (f.type == Type::kHello) g.send(Type::kHelloReply, f.channel, gp::encode(gp::HelloReply{"6.1.0-test", true, 3}));
    if (f.type == Type::kSetup || f.type == Type::kSync || f.type == Type::kPowerOff) g.send(Type::kOk, f.channel);
  });
  GuestChannel channel(guest.take_agent_end(), "sb-1");
  EXPECT_TRUE(channel.connected());
  gp::HelloReply reply = channel.hello(gp::Hello{123456789, "entropy!", "sb-1"}, soon());
  EXPECT_EQ(reply.kernel_release, "6.1.0-test");
  EXPECT_TRUE(reply.root_ready);
  EXPECT_EQ(reply.execs_running, 3u);
  gp::Setup setup;
  setup.layers = {{"dsec-layer-0", ""}};
  setup.disk_serial = "dsec-disk";
  channel.setup(setup, soon());
  channel.sync(soon());
  channel.power_off(soon());

  auto frames = guest.received();
  ASSERT_EQ(frames.size(), 4u);
  gp::Hello h = gp::decode_hello(frames[0].payload);
  EXPECT_EQ(h.realtime_ns, 123456789u);
  EXPECT_EQ(h.entropy, "entropy!");
  EXPECT_EQ(h.hostname, "sb-1");
  EXPECT_EQ(gp::decode_setup(frames[1].payload).disk_serial, "dsec-disk");
  EXPECT_EQ(frames[2].type, Type::kSync);
  EXPECT_EQ(frames[3].type, Type::kPowerOff);
  // Every call had a channel of its own, none the control channel 0.
  for (const auto& f : frames) EXPECT_NE(f.channel, 0u);
  EXPECT_NE(frames[0].channel, frames[1].channel);
}

TEST(GuestChannel, PowerOffOfAGuestThatJustGoesIsFine) {
  FakeGuest guest([](FakeGuest& g, const gp::Frame& f) {
    if (f.type == Type::kPowerOff) g.hang_up();
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  EXPECT_NO_THROW(channel.power_off(soon()));
  EXPECT_TRUE(guest.wait_for([](auto&) { return true; }));
}

TEST(GuestChannel, ExecWithOutputAndExit) {
  FakeGuest guest(pretend_commands);
  GuestChannel channel(guest.take_agent_end(), "sb");
  gp::ExecStart start{{"echo", "hello", "world"}, {"A=1", "B=two"}, "/work", 4096, false};
  ExecResult r = channel.exec(start, "", 10, {});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.signal, 0);
  EXPECT_EQ(r.stdout_data, "hello world\n");
  EXPECT_EQ(r.stderr_data, "");
  EXPECT_FALSE(r.timed_out || r.stdout_truncated || r.stderr_truncated);
  EXPECT_GT(r.duration_seconds, 0);
  // What the guest got is the request as given.
  auto execs = guest.received(Type::kExec);
  ASSERT_EQ(execs.size(), 1u);
  gp::ExecStart got = gp::decode_exec_start(execs[0].payload);
  EXPECT_EQ(got.argv, start.argv);
  EXPECT_EQ(got.env, start.env);
  EXPECT_EQ(got.cwd, "/work");
  EXPECT_EQ(got.max_output, 4096u);
  EXPECT_FALSE(got.stdin_follows);
  EXPECT_TRUE(guest.received(Type::kStdin).empty());

  r = channel.exec(exec_start({"exit", "42"}), "", 10, {});
  EXPECT_EQ(r.exit_code, 42);
  EXPECT_EQ(r.signal, 0);
  EXPECT_EQ(r.stderr_data, "bye\n");
  r = channel.exec(exec_start({"kill", "9"}), "", 10, {});
  EXPECT_EQ(r.exit_code, -1);
  EXPECT_EQ(r.signal, 9);
  EXPECT_FALSE(r.timed_out);
}

TEST(GuestChannel, ExecStreamsToTheSink) {
  FakeGuest guest([](FakeGuest& g, const gp::Frame& f) {
    if (f.type != Type::kExec) return;
    g.send(Type::kStarted, f.channel, gp::Writer().i32(7).take());
    g.output(f.channel, 1, "one");
    g.output(f.channel, 2, "two");
    g.output(f.channel, 1, "three");
    g.exited(f.channel, 0);
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  std::vector<std::pair<int, std::string>> chunks;
  ExecResult r = channel.exec(exec_start({"x"}), "", 10,
                              [&](int fd, std::string_view data) { chunks.emplace_back(fd, std::string(data)); });
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.stdout_data, "");  // streamed, not kept
  EXPECT_EQ(r.stderr_data, "");
  std::vector<std::pair<int, std::string>> want = {{1, "one"}, {2, "two"}, {1, "three"}};
  EXPECT_EQ(chunks, want);
}

TEST(GuestChannel, ExecStdinGoesInChunksThenCloses) {
  FakeGuest guest(pretend_commands);
  GuestChannel channel(guest.take_agent_end(), "sb");
  std::string data = bytes_pattern((3u << 20) + 17);
  ExecResult r = channel.exec(exec_start({"cat"}, 8u << 20), data, 30, {});
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.stdout_data.size(), data.size());
  EXPECT_TRUE(r.stdout_data == data);
  gp::ExecStart got = gp::decode_exec_start(guest.received(Type::kExec).at(0).payload);
  EXPECT_TRUE(got.stdin_follows);
  auto stdin_frames = guest.received(Type::kStdin);
  ASSERT_GE(stdin_frames.size(), 2u);
  std::size_t total = 0;
  for (std::size_t i = 0; i < stdin_frames.size(); ++i) {
    gp::Reader rd(stdin_frames[i].payload);
    std::string piece = rd.str();
    if (i + 1 == stdin_frames.size()) EXPECT_TRUE(piece.empty()) << "stdin ends with an empty kStdin";
    else EXPECT_FALSE(piece.empty());
    EXPECT_LE(piece.size(), gp::kMaxDataChunk);
    total += piece.size();
  }
  EXPECT_EQ(total, data.size());
}

TEST(GuestChannel, ExecThatCannotStartForWhatItNamesIsAResult) {
  FakeGuest guest(pretend_commands);
  GuestChannel channel(guest.take_agent_end(), "sb");
  std::string streamed;
  ExecResult r = channel.exec(exec_start({"fail"}), "", 10, [&](int fd, std::string_view d) {
    if (fd == 2) streamed += d;
  });
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_EQ(r.reason, "executable_not_found");
  EXPECT_NE(r.stderr_data.find("fail"), std::string::npos) << r.stderr_data;
  EXPECT_EQ(streamed, r.stderr_data);  // a streaming caller sees the same line
  gp::ExecStart start = exec_start({"nocwd"});
  start.cwd = "/no/such/dir";
  r = channel.exec(start, "", 10, {});
  EXPECT_EQ(r.exit_code, 127);
  EXPECT_EQ(r.reason, "cwd_not_found");
  EXPECT_NE(r.stderr_data.find("/no/such/dir"), std::string::npos) << r.stderr_data;
  // The channel goes on serving.
  EXPECT_EQ(channel.exec(exec_start({"echo", "ok"}), "", 10, {}).stdout_data, "ok\n");
}

TEST(GuestChannel, SilentExecGetsKillAtItsTimeout) {
  FakeGuest guest(pretend_commands);
  GuestChannel channel(guest.take_agent_end(), "sb");
  auto t0 = Clock::now();
  ExecResult r = channel.exec(exec_start({"hang"}), "", 0.3, {});
  double took = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_TRUE(r.timed_out);
  EXPECT_EQ(r.signal, SIGKILL);
  EXPECT_EQ(r.exit_code, -1);
  EXPECT_GE(took, 0.29);
  EXPECT_LT(took, 3.0);
  // The guest got one kKill, on the exec's channel, at the deadline (not before it).
  auto frames = guest.received();
  std::uint32_t exec_channel = guest.received(Type::kExec).at(0).channel;
  std::optional<std::size_t> kill_at, exec_at;
  for (std::size_t i = 0; i < frames.size(); ++i) {
    if (frames[i].type == Type::kExec) exec_at = i;
    if (frames[i].type == Type::kKill) {
      EXPECT_EQ(frames[i].channel, exec_channel);
      EXPECT_FALSE(kill_at.has_value()) << "more than one kKill";
      kill_at = i;
    }
  }
  ASSERT_TRUE(kill_at && exec_at);
  double after = std::chrono::duration<double>(guest.arrival(*kill_at) - guest.arrival(*exec_at)).count();
  EXPECT_GE(after, 0.25);
  EXPECT_LT(after, 2.0);
}

TEST(GuestChannel, HostSideCapHoldsAgainstAHostileGuest) {
  // The guest ignores the cap it was given and claims nothing was truncated.
  FakeGuest guest([](FakeGuest& g, const gp::Frame& f) {
    if (f.type != Type::kExec) return;
    g.send(Type::kStarted, f.channel, gp::Writer().i32(1).take());
    std::string big = bytes_pattern(2000, 3);
    for (int i = 0; i < 3; ++i) g.output(f.channel, 1, big);
    g.output(f.channel, 2, std::string(999, 'e'));
    g.output(f.channel, 2, "EE");
    g.output(f.channel, 1, "late");
    g.exited(f.channel, 0, false, false);
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  ExecResult r = channel.exec(exec_start({"x"}, 1000), "", 10, {});
  EXPECT_EQ(r.stdout_data, bytes_pattern(2000, 3).substr(0, 1000));
  EXPECT_TRUE(r.stdout_truncated);
  EXPECT_EQ(r.stderr_data, std::string(999, 'e') + "E");
  EXPECT_TRUE(r.stderr_truncated);

  // Streaming: the sink never gets more than the cap either.
  std::map<int, std::size_t> delivered;
  r = channel.exec(exec_start({"x"}, 1000), "", 10,
                   [&](int fd, std::string_view data) { delivered[fd] += data.size(); });
  EXPECT_EQ(delivered[1], 1000u);
  EXPECT_EQ(delivered[2], 1000u);
  EXPECT_TRUE(r.stdout_truncated && r.stderr_truncated);

  // A cap of 0 keeps nothing and says so.
  r = channel.exec(exec_start({"x"}, 0), "", 10, {});
  EXPECT_EQ(r.stdout_data, "");
  EXPECT_TRUE(r.stdout_truncated && r.stderr_truncated);
}

TEST(GuestChannel, ErrorAnswersBecomeTheirDsecError) {
  FakeGuest guest([](FakeGuest& g, const gp::Frame& f) {
    gp::Reader r(f.payload);
    switch (f.type) {
      case Type::kReadFile: {
        std::string path = r.str();
        if (path == "/missing") g.error(f.channel, Code::kNotFound, "no such file in the sandbox: /missing");
        else if (path == "/bogus-code") g.error(f.channel, static_cast<Code>(999), "from the future");
        else if (path == "/ok-code") g.error(f.channel, Code::kOk, "ok is not an error");
        else g.error(f.channel, Code::kInvalidArgument, "read " + path + ": not a regular file");
        return;
      }
      case Type::kStat:
        g.error(f.channel, Code::kPermissionDenied, "no");
        return;
      case Type::kWriteFile:
        g.error(f.channel, Code::kResourceExhausted, "write: No space left on device");
        return;
      case Type::kExec:
        g.send(Type::kStarted, f.channel, gp::Writer().i32(1).take());
        g.error(f.channel, Code::kNotFound, "gone mid-exec");
        return;
      default:
        return;
    }
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  try {
    channel.read_file("/missing", 1 << 20, soon());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
    EXPECT_STREQ(e.what(), "no such file in the sandbox: /missing");
  }
  EXPECT_CODE(channel.read_file("/fifo", 1 << 20, soon()), Code::kInvalidArgument);
  // Codes the agent does not know, and "OK" as an error, are internal errors.
  EXPECT_CODE(channel.read_file("/bogus-code", 1 << 20, soon()), Code::kInternal);
  EXPECT_CODE(channel.read_file("/ok-code", 1 << 20, soon()), Code::kInternal);
  EXPECT_CODE(channel.mode_of("/x", soon()), Code::kPermissionDenied);
  EXPECT_CODE(channel.write_file("/x", "data", 0644, soon()), Code::kResourceExhausted);
  // An error after the exec started is the agent's to report.
  EXPECT_CODE(channel.exec(exec_start({"x"}), "", 10, {}), Code::kInternal);
  EXPECT_TRUE(channel.connected());
}

TEST(GuestChannel, UnexpectedOrMalformedAnswers) {
  FakeGuest guest([](FakeGuest& g, const gp::Frame& f) {
    if (f.type == Type::kStat) {
      gp::Reader r(f.payload);
      if (r.str() == "/short") g.send(Type::kStatReply, f.channel, "\x01");  // a u32 cut short
      else g.send(Type::kDone, f.channel, gp::Writer().u64(0).take());       // the wrong answer
    }
    if (f.type == Type::kReadFile) g.send(Type::kData, f.channel, gp::Writer().u32(100).take() + "short");
    if (f.type == Type::kHello) g.send(Type::kOk, f.channel);
    if (f.type == Type::kExec) g.send(Type::kOutput, f.channel, gp::Writer().u8(1).str("before start").take());
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  EXPECT_CODE(channel.mode_of("/wrong", soon()), Code::kInternal);
  EXPECT_CODE(channel.hello(gp::Hello{}, soon()), Code::kInternal);
  EXPECT_CODE(channel.exec(exec_start({"x"}), "", 10, {}), Code::kInternal);
  // A malformed payload is the protocol's std::out_of_range (the microvm backend turns it into UNAVAILABLE).
  EXPECT_THROW(channel.mode_of("/short", soon()), std::out_of_range);
  EXPECT_THROW(channel.read_file("/x", 1 << 20, soon()), std::out_of_range);
  EXPECT_TRUE(channel.connected());
}

TEST(GuestChannel, AGuestThatClosesTheStreamIsUnavailable) {
  FakeGuest guest([](FakeGuest& g, const gp::Frame& f) {
    if (f.type == Type::kExec) {
      g.send(Type::kStarted, f.channel, gp::Writer().i32(1).take());
      g.output(f.channel, 1, "partial");
      g.hang_up();
    }
  });
  GuestChannel channel(guest.take_agent_end(), "sb-9");
  try {
    channel.exec(exec_start({"x"}), "", 30, {});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnavailable);
    EXPECT_NE(std::string(e.what()).find("sb-9"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(channel.connected());
  // Every later call is UNAVAILABLE at once.
  auto t0 = Clock::now();
  EXPECT_CODE(channel.hello(gp::Hello{}, soon()), Code::kUnavailable);
  EXPECT_CODE(channel.read_file("/x", 1, soon()), Code::kUnavailable);
  EXPECT_CODE(channel.exec(exec_start({"x"}), "", 30, {}), Code::kUnavailable);
  EXPECT_LT(Clock::now() - t0, 2s);
}

TEST(GuestChannel, CloseWakesACallThatWaits) {
  FakeGuest guest(nullptr);  // never answers
  GuestChannel channel(guest.take_agent_end(), "sb");
  std::atomic<int> code{-1};
  std::thread waiter(
      [&] { code = static_cast<int>(dsec::test::code_of([&] { channel.read_file("/x", 1, Clock::now() + 30s); })); });
  ASSERT_TRUE(guest.wait_for([](auto& frames) { return !frames.empty(); }));
  auto t0 = Clock::now();
  channel.close();
  waiter.join();
  EXPECT_LT(Clock::now() - t0, 2s);
  EXPECT_EQ(code.load(), static_cast<int>(Code::kUnavailable));
  EXPECT_FALSE(channel.connected());
}

TEST(GuestChannel, AnOversizedFrameDropsTheConnection) {
  FakeGuest guest([](FakeGuest& g, const gp::Frame& f) {
    if (f.type == Type::kHello) g.send_raw(u32_le(gp::kMaxFrameBytes + 1) + std::string(64, 'x'));
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  try {
    channel.hello(gp::Hello{}, soon());
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnavailable);
    EXPECT_NE(std::string(e.what()).find("malformed frame"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(channel.connected());
}

TEST(GuestChannel, LateFramesOfAFinishedCallAreDropped) {
  // Frames for a channel nobody waits on any more (or never opened) are read and dropped: memory does not grow and
  // the connection stays.
  std::uint32_t hello_channel = 0;
  FakeGuest guest([&](FakeGuest& g, const gp::Frame& f) {
    if (f.type != Type::kHello) return;
    g.send(Type::kHelloReply, f.channel, gp::encode(gp::HelloReply{"r", true, 0}));
    if (hello_channel == 0) {
      hello_channel = f.channel;
      std::string mib(1u << 20, 'z');
      for (int i = 0; i < 100; ++i) g.send(Type::kData, f.channel, gp::Writer().str(mib).take());
      for (int i = 0; i < 100; ++i) g.send(Type::kData, 0xabcdefu, gp::Writer().str(mib).take());
    }
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  channel.hello(gp::Hello{}, soon());
  // The second hello's reply comes after the 200 MiB: the reader went through them all.
  gp::HelloReply r = channel.hello(gp::Hello{}, Clock::now() + 60s);
  EXPECT_EQ(r.kernel_release, "r");
  EXPECT_TRUE(channel.connected());
  EXPECT_GT(guest.sent_bytes(), 200u << 20);
}

TEST(GuestChannel, AFloodBeyondTheMailboxLimitDropsTheConnection) {
  // A guest floods one exec's channel while its consumer (a sink) does not take the frames: the agent stops at its
  // mailbox limit and drops the connection rather than buffer without end.
  std::atomic<bool> guest_send_failed{false};
  FakeGuest guest([&](FakeGuest& g, const gp::Frame& f) {
    if (f.type != Type::kExec) return;
    g.send(Type::kStarted, f.channel, gp::Writer().i32(1).take());
    std::string chunk = gp::Writer().u8(1).str(std::string(gp::kMaxDataChunk * 3, 'f')).take();
    for (std::size_t sent = 0; sent < (512u << 20); sent += chunk.size()) {
      if (!g.send(Type::kOutput, f.channel, chunk)) {
        guest_send_failed = true;
        return;
      }
    }
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  std::mutex mu;
  std::condition_variable cv;
  bool release = false;
  std::atomic<int> code{-1};
  std::thread caller([&] {
    code = static_cast<int>(dsec::test::code_of([&] {
      channel.exec(exec_start({"flood"}, 1ull << 30), "", 120, [&](int, std::string_view) {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return release; });
      });
    }));
  });
  auto until = Clock::now() + 60s;
  while (channel.connected() && Clock::now() < until) std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(channel.connected()) << "the agent buffered " << guest.sent_bytes() << " bytes without dropping";
  {
    std::lock_guard lock(mu);
    release = true;
  }
  cv.notify_all();
  caller.join();
  EXPECT_EQ(code.load(), static_cast<int>(Code::kUnavailable));
  EXPECT_TRUE(eventually([&] { return guest_send_failed.load(); }));
  // The agent took about its limit (plus what the socket buffers hold), not the 512 MiB the guest had.
  EXPECT_GT(guest.sent_bytes(), kMailboxLimit);
  EXPECT_LT(guest.sent_bytes(), kMailboxLimit + (16u << 20));
}

TEST(GuestChannel, ManyExecsAtOnceEachGetTheirOwnFrames) {
  // The guest waits until all execs arrived, then answers them interleaved, in the reverse order.
  constexpr int kN = 12;
  std::vector<std::pair<std::uint32_t, std::string>> pending;  // touched by the guest's thread only
  FakeGuest guest([&](FakeGuest& g, const gp::Frame& f) {
    if (f.type != Type::kExec) return;
    pending.emplace_back(f.channel, gp::decode_exec_start(f.payload).argv.at(1));
    if (pending.size() < kN) return;
    std::reverse(pending.begin(), pending.end());
    for (auto& [ch, tag] : pending) g.send(Type::kStarted, ch, gp::Writer().i32(1).take());
    for (int round = 0; round < 3; ++round)
      for (auto& [ch, tag] : pending) g.output(ch, 1, tag + ":" + std::to_string(round) + ";");
    for (auto& [ch, tag] : pending) {
      g.output(ch, 2, tag);
      g.exited(ch, std::stoi(tag) << 8);
    }
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  std::vector<ExecResult> results(kN);
  std::vector<std::thread> threads;
  for (int i = 0; i < kN; ++i)
    threads.emplace_back([&, i] { results[i] = channel.exec(exec_start({"job", std::to_string(i)}), "", 30, {}); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < kN; ++i) {
    std::string tag = std::to_string(i);
    EXPECT_EQ(results[i].stdout_data, tag + ":0;" + tag + ":1;" + tag + ":2;") << i;
    EXPECT_EQ(results[i].stderr_data, tag) << i;
    EXPECT_EQ(results[i].exit_code, i) << i;
  }
  std::vector<std::uint32_t> channels;
  for (auto& f : guest.received(Type::kExec)) channels.push_back(f.channel);
  std::sort(channels.begin(), channels.end());
  EXPECT_EQ(std::unique(channels.begin(), channels.end()), channels.end()) << "two execs shared a channel";
}

TEST(GuestChannel, ASinkThatThrowsKillsTheCommand) {
  FakeGuest guest([](FakeGuest& g, const gp::Frame& f) {
    if (f.type != Type::kExec) return;
    g.send(Type::kStarted, f.channel, gp::Writer().i32(1).take());
    g.output(f.channel, 1, "first");
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  EXPECT_THROW(channel.exec(exec_start({"x"}), "", 30, [](int, std::string_view) { throw std::runtime_error("stop"); }),
               std::runtime_error);
  std::uint32_t ch = guest.received(Type::kExec).at(0).channel;
  EXPECT_TRUE(guest.wait_for([&](auto& frames) { return has_frame(frames, Type::kKill, ch); }));
  EXPECT_TRUE(channel.connected());
}

TEST(GuestChannel, ACallPastItsDeadlineIsDeadlineExceededAndItsLateAnswerIsDropped) {
  std::uint32_t late_channel = 0;
  FakeGuest guest([&](FakeGuest& g, const gp::Frame& f) {
    if (f.type == Type::kStat) late_channel = f.channel;  // not answered now
    if (f.type == Type::kHello) {
      if (late_channel) g.send(Type::kStatReply, late_channel, gp::Writer().u32(0100644).take());
      g.send(Type::kHelloReply, f.channel, gp::encode(gp::HelloReply{"r", true, 0}));
    }
  });
  GuestChannel channel(guest.take_agent_end(), "sb");
  auto t0 = Clock::now();
  EXPECT_CODE(channel.mode_of("/slow", Clock::now() + 200ms), Code::kDeadlineExceeded);
  EXPECT_GE(Clock::now() - t0, 190ms);
  EXPECT_LT(Clock::now() - t0, 2s);
  EXPECT_EQ(channel.hello(gp::Hello{}, soon()).kernel_release, "r");
  EXPECT_TRUE(channel.connected());
}

// A pretend file system behind the guest's file operations.
class FakeFs {
 public:
  void handle(FakeGuest& g, const gp::Frame& f) {
    std::lock_guard lock(mu_);
    gp::Reader r(f.payload);
    switch (f.type) {
      case Type::kWriteFile: {
        std::string path = r.str();
        unsigned mode = r.u32();
        r.finish();
        writing_[f.channel] = path;
        files_[path] = {"", mode};
        return;
      }
      case Type::kPutTree:
        tree_dir_ = r.str();
        r.finish();
        tree_.clear();
        uploading_[f.channel] = true;
        return;
      case Type::kEntry:
        tree_.emplace_back(gp::decode_entry(f.payload), "");
        return;
      case Type::kData: {
        std::string data = r.str();
        r.finish();
        data_frames_.push_back(data.size());
        if (writing_.count(f.channel)) files_[writing_[f.channel]].first += data;
        else if (uploading_.count(f.channel) && !tree_.empty()) tree_.back().second += data;
        return;
      }
      case Type::kEnd:
        if (auto it = writing_.find(f.channel); it != writing_.end()) {
          g.send(Type::kDone, f.channel, gp::Writer().u64(files_[it->second].first.size()).take());
          writing_.erase(it);
        } else if (uploading_.erase(f.channel)) {
          ends_.push_back(f.channel);
          g.send(Type::kDone, f.channel, gp::Writer().u64(tree_.size()).take());
        }
        return;
      case Type::kReadFile: {
        std::string path = r.str();
        std::uint64_t max = r.u64();
        r.finish();
        auto it = files_.find(path);
        if (it == files_.end()) return g.error(f.channel, Code::kNotFound, "no such file in the sandbox: " + path);
        const std::string& data = it->second.first;
        (void)max;  // a careless guest: the agent's own limit must hold
        for (std::size_t pos = 0; pos < data.size(); pos += 100000)
          g.send(Type::kData, f.channel, gp::Writer().str(std::string_view(data).substr(pos, 100000)).take());
        g.send(Type::kDone, f.channel, gp::Writer().u64(data.size()).take());
        return;
      }
      case Type::kStat: {
        std::string path = r.str();
        if (files_.count(path))
          return (void)g.send(Type::kStatReply, f.channel, gp::Writer().u32(0100000 | files_[path].second).take());
        if (path == tree_dir_) return (void)g.send(Type::kStatReply, f.channel, gp::Writer().u32(040755).take());
        return g.error(f.channel, Code::kNotFound, "no such file in the sandbox: " + path);
      }
      case Type::kGetTree: {
        std::string dir = r.str();
        if (dir != tree_dir_) return g.error(f.channel, Code::kNotFound, "no such directory: " + dir);
        for (const auto& [e, data] : tree_) {
          g.send(Type::kEntry, f.channel, gp::encode(e));
          for (std::size_t pos = 0; pos < data.size(); pos += 70000)
            g.send(Type::kData, f.channel, gp::Writer().str(std::string_view(data).substr(pos, 70000)).take());
        }
        g.send(Type::kDone, f.channel, gp::Writer().u64(tree_.size()).take());
        return;
      }
      default:
        return;
    }
  }

  std::map<std::string, std::pair<std::string, unsigned>> files() {
    std::lock_guard lock(mu_);
    return files_;
  }
  std::vector<std::pair<files::TreeEntry, std::string>> tree() {
    std::lock_guard lock(mu_);
    return tree_;
  }
  std::string tree_dir() {
    std::lock_guard lock(mu_);
    return tree_dir_;
  }
  std::vector<std::size_t> data_frames() {
    std::lock_guard lock(mu_);
    return data_frames_;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::pair<std::string, unsigned>> files_;
  std::map<std::uint32_t, std::string> writing_;
  std::map<std::uint32_t, bool> uploading_;
  std::vector<std::uint32_t> ends_;
  std::string tree_dir_;
  std::vector<std::pair<files::TreeEntry, std::string>> tree_;
  std::vector<std::size_t> data_frames_;
};

// A tar names a directory "d/"; the entry is the same.
std::string without_slash(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

class RecordingSink final : public files::TreeSink {
 public:
  void entry(const files::TreeEntry& e) override { entries.emplace_back(e, ""); }
  void write_data(std::string_view bytes) override { entries.back().second += bytes; }
  std::vector<std::pair<files::TreeEntry, std::string>> entries;
};

TEST(GuestChannel, FilesRoundTripAgainstAFakeGuest) {
  FakeFs fs;
  FakeGuest guest([&](FakeGuest& g, const gp::Frame& f) { fs.handle(g, f); });
  GuestChannel channel(guest.take_agent_end(), "sb");
  std::string data = bytes_pattern((3u << 20) + 5, 9);
  data[0] = '\0';
  channel.write_file("/a/b.bin", data, 0640, soon());
  auto stored = fs.files().at("/a/b.bin");
  EXPECT_TRUE(stored.first == data);
  EXPECT_EQ(stored.second, 0640u);
  for (std::size_t n : fs.data_frames()) EXPECT_LE(n, gp::kMaxDataChunk);
  EXPECT_GE(fs.data_frames().size(), data.size() / gp::kMaxDataChunk);
  EXPECT_TRUE(channel.read_file("/a/b.bin", 1u << 30, soon()) == data);
  EXPECT_EQ(channel.mode_of("/a/b.bin", soon()), 0100640u);
  channel.write_file("/empty", "", 0600, soon());
  EXPECT_EQ(channel.read_file("/empty", 10, soon()), "");
  // The agent's own read limit holds even when the guest sends more.
  EXPECT_CODE(channel.read_file("/a/b.bin", 1000, soon()), Code::kResourceExhausted);
  EXPECT_CODE(channel.read_file("/nope", 10, soon()), Code::kNotFound);
  EXPECT_CODE(channel.mode_of("/nope", soon()), Code::kNotFound);
  EXPECT_TRUE(channel.connected());
}

TEST(GuestChannel, TarTreesRoundTripAgainstAFakeGuest) {
  FakeFs fs;
  FakeGuest guest([&](FakeGuest& g, const gp::Frame& f) { fs.handle(g, f); });
  GuestChannel channel(guest.take_agent_end(), "sb");
  const std::string content = bytes_pattern(600000, 4);
  std::vector<std::pair<files::TreeEntry, std::string>> want = {
      {{files::EntryKind::kDirectory, "d", 0750, "", 0, 0, 0, 1700000000}, ""},
      {{files::EntryKind::kRegular, "d/f", 0640, "", content.size(), 0, 0, 1700000000}, content},
      {{files::EntryKind::kRegular, "d/empty", 0600, "", 0, 0, 0, 1700000000}, ""},
      {{files::EntryKind::kSymlink, "d/l", 0777, "f", 0, 0, 0, 1700000000}, ""},
      {{files::EntryKind::kHardlink, "d/h", 0640, "d/f", 0, 0, 0, 1700000000}, ""},
  };
  files::TarWriter writer(1u << 30);
  for (const auto& [e, bytes] : want) {
    writer.entry(e);
    if (!bytes.empty()) writer.data(bytes);
  }
  std::string tar = writer.finish();

  channel.put_archive("/dst", tar, soon());
  EXPECT_EQ(fs.tree_dir(), "/dst");
  auto got = fs.tree();
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].first.kind, want[i].first.kind) << i;
    EXPECT_EQ(without_slash(got[i].first.path), want[i].first.path) << i;
    EXPECT_EQ(got[i].first.link, want[i].first.link) << i;
    if (want[i].first.kind != files::EntryKind::kSymlink) {
      EXPECT_EQ(got[i].first.mode & 07777, want[i].first.mode) << i;
    }
    if (want[i].first.kind == files::EntryKind::kRegular) {
      EXPECT_EQ(got[i].first.size, want[i].first.size) << i;
    }
    EXPECT_TRUE(got[i].second == want[i].second) << i;
  }
  for (std::size_t n : fs.data_frames()) EXPECT_LE(n, gp::kMaxDataChunk);

  // And back: the tree the guest walks becomes a tar with the same entries.
  std::string back = channel.get_archive("/dst", 1u << 30, soon());
  RecordingSink sink;
  files::extract_tar(back, sink);
  ASSERT_EQ(sink.entries.size(), want.size());
  for (std::size_t i = 0; i < want.size(); ++i) {
    const auto& e = sink.entries[i].first;
    EXPECT_EQ(e.kind, want[i].first.kind) << i;
    EXPECT_EQ(without_slash(e.path), want[i].first.path) << i;
    EXPECT_EQ(e.link, want[i].first.link) << i;
    if (e.kind != files::EntryKind::kSymlink) {
      EXPECT_EQ(e.mode & 07777, want[i].first.mode) << i;
    }
    EXPECT_TRUE(sink.entries[i].second == want[i].second) << i;
  }
  EXPECT_CODE(channel.get_archive("/dst", 1000, soon()), Code::kResourceExhausted);
  EXPECT_CODE(channel.get_archive("/elsewhere", 1u << 30, soon()), Code::kNotFound);

  // A stream that is not a tar is refused, and the upload it opened is closed (kEnd) rather than left open.
  EXPECT_CODE(channel.put_archive("/bad", std::string(1024, 'x'), soon()), Code::kInvalidArgument);
  std::optional<std::uint32_t> bad_channel;
  EXPECT_TRUE(guest.wait_for([&](auto& frames) {
    for (auto& f : frames)
      if (f.type == Type::kPutTree && gp::Reader(f.payload).str() == "/bad") bad_channel = f.channel;
    return bad_channel.has_value();
  }));
  ASSERT_TRUE(bad_channel.has_value());
  EXPECT_TRUE(guest.wait_for([&](auto& frames) { return has_frame(frames, Type::kEnd, *bad_channel); }));
  EXPECT_TRUE(channel.connected());
}

}  // namespace
}  // namespace dsec

namespace dsec {
namespace {

namespace gpr = guest_protocol;

TEST(GuestProtocol, RootWordRoundTripsAndRefusesWhatIsNotASerial) {
  gpr::Setup s;
  s.disk_serial = "dsec-disk";
  s.layers = {{"dsec-layer-0", ""}, {"dsec-layer-1", "dsec-data-1"}, {"dsec-layer-2", ""}};
  std::string word = gpr::encode_root_word(s);
  EXPECT_EQ(word, "dsec-disk/dsec-layer-0,dsec-layer-1+dsec-data-1,dsec-layer-2");
  gpr::Setup back = gpr::decode_root_word(word);
  EXPECT_EQ(back.disk_serial, "dsec-disk");
  ASSERT_EQ(back.layers.size(), 3u);
  EXPECT_EQ(back.layers[1].serial, "dsec-layer-1");
  EXPECT_EQ(back.layers[1].data_serial, "dsec-data-1");
  EXPECT_EQ(back.layers[2].data_serial, "");
  EXPECT_TRUE(gpr::decode_root_word("d/").layers.empty());  // an image of no layer: the disk alone
  for (const char* bad : {"", "no-slash", "/l0", "d/l0,", "d/l0,,l1", "d/l0+", "d/a b", "d/l0;reboot",
                          "d/123456789012345678901", "d/l0+x+y"})
    EXPECT_THROW(gpr::decode_root_word(bad), std::invalid_argument) << bad;
  gpr::Setup spaced = s;
  spaced.disk_serial = "a disk";
  EXPECT_THROW(gpr::encode_root_word(spaced), std::invalid_argument);
}

}  // namespace
}  // namespace dsec
