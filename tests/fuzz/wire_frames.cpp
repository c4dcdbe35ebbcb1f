// Fuzz target: the binary wires between the agent and what runs inside a sandbox.
//  - The VM wire (common/wire/guest_protocol.hpp): a byte stream cut into frames by FrameReader (fed in pieces), each
//    frame's payload decoded as its type says, as guest_init and guest_channel do. Bad input is std::out_of_range
//    (a payload) or std::length_error (a frame size); a message that decodes encodes to one that decodes the same.
//  - The container wire (common/wire/init_protocol.hpp): a StartRequest's payload as dsec-init decodes it.
//  - The fork server's frames (agent/fncall/wire.hpp): bytes a zygote or a call's process writes on its
//    socket, read by recv_frame and interpreted as the agent interprets each message type. Bad input is dsec::Error.
//
// Input: byte 0 picks the wire (0 VM, 1 container, 2 fork server, 3 fork server frames given as lines of JSON), byte 1
// the piece size of the VM stream (or the blob size of framed lines); the rest is the wire's bytes.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "agent/fncall/wire.hpp"
#include "common/unique_fd.hpp"
#include "common/wire/guest_protocol.hpp"
#include "common/wire/init_protocol.hpp"
#include "common/wire/process_protocol.hpp"
#include "dsec/error.hpp"
#include "fuzz_util.hpp"

namespace {

namespace gp = dsec::guest_protocol;
using gp::Type;

bool same(const gp::ExecStart& a, const gp::ExecStart& b) {
  return a.argv == b.argv && a.env == b.env && a.cwd == b.cwd && a.max_output == b.max_output &&
         a.stdin_follows == b.stdin_follows;
}
bool same(const gp::Hello& a, const gp::Hello& b) {
  return a.realtime_ns == b.realtime_ns && a.entropy == b.entropy && a.hostname == b.hostname;
}
bool same(const gp::HelloReply& a, const gp::HelloReply& b) {
  return a.kernel_release == b.kernel_release && a.root_ready == b.root_ready && a.execs_running == b.execs_running;
}
bool same(const gp::Setup& a, const gp::Setup& b) {
  if (a.layers.size() != b.layers.size() || a.disk_serial != b.disk_serial) return false;
  for (std::size_t i = 0; i < a.layers.size(); ++i)
    if (a.layers[i].serial != b.layers[i].serial || a.layers[i].data_serial != b.layers[i].data_serial) return false;
  return true;
}
bool same(const gp::Exited& a, const gp::Exited& b) {
  return a.status == b.status && a.stdout_truncated == b.stdout_truncated && a.stderr_truncated == b.stderr_truncated;
}
bool same(const dsec::agent::files::TreeEntry& a, const dsec::agent::files::TreeEntry& b) {
  return a.kind == b.kind && a.path == b.path && a.mode == b.mode && a.link == b.link && a.size == b.size &&
         a.uid == b.uid && a.gid == b.gid && a.mtime == b.mtime && a.atime_ns == b.atime_ns &&
         a.mtime_ns == b.mtime_ns && a.opaque == b.opaque;
}
bool same(const gp::ErrorReply& a, const gp::ErrorReply& b) { return a.code == b.code && a.message == b.message; }

// decode(encode(decode(p))) == decode(p).
template <typename Decode>
void round_trip(std::string_view payload, Decode decode, const char* what) {
  auto m = decode(payload);
  std::string again = gp::encode(m);
  try {
    if (!same(decode(again), m)) fuzz::fail(std::string(what) + ": encode/decode changed the message");
  } catch (const std::out_of_range& e) {
    fuzz::fail(std::string(what) + ": refused its own encoding: " + e.what());
  }
}

// The messages whose payload the agent or the guest reads field by field.
void decode_frame(const gp::Frame& f) {
  gp::Reader r(f.payload);
  switch (f.type) {
    case Type::kHello:
      round_trip(f.payload, gp::decode_hello, "decode_hello");
      break;
    case Type::kHelloReply:
      round_trip(f.payload, gp::decode_hello_reply, "decode_hello_reply");
      break;
    case Type::kSetup:
      round_trip(f.payload, gp::decode_setup, "decode_setup");
      break;
    case Type::kExec:
      round_trip(f.payload, gp::decode_exec_start, "decode_exec_start");
      break;
    case Type::kExited:
      round_trip(f.payload, gp::decode_exited, "decode_exited");
      break;
    case Type::kEntry:
      round_trip(f.payload, gp::decode_entry, "decode_entry");
      break;
    case Type::kError:
      round_trip(f.payload, gp::decode_error, "decode_error");
      break;
    case Type::kStarted:
      r.i32();
      r.finish();
      break;
    case Type::kFailed:
      r.i32();
      r.i32();
      r.finish();
      break;
    case Type::kOutput:
      r.u8();
      r.str();
      r.finish();
      break;
    case Type::kStdin:
    case Type::kData:
    case Type::kStat:
    case Type::kPutTree:
      r.str();
      r.finish();
      break;
    case Type::kReadFile:
    case Type::kGetTree:
      r.str();
      r.u64();
      r.finish();
      break;
    case Type::kWriteFile:
      r.str();
      r.u32();
      r.finish();
      break;
    case Type::kStatReply:
      r.u32();
      r.finish();
      break;
    case Type::kCredit:
    case Type::kCaptureUpper:
    case Type::kDone:
      r.u64();
      r.finish();
      break;
    case Type::kProcessRequest:
      r.u32();
      break;  // the op's payload follows, to the end
    case Type::kProcessReply: {
      // What the agent reads of a guest's process replies (agent/processes/init_processes.cpp): a list of entries,
      // and a read's entry and output.
      namespace pp = dsec::process_protocol;
      std::int32_t status = 0;
      std::uint32_t n = 0;
      pp::Entry e;
      pp::Reader list(f.payload);
      if (list.i32(status) && list.u32(n))
        for (std::uint32_t i = 0; i < n && list.entry(e); ++i) {
        }
      pp::Reader read(f.payload);
      std::string data;
      std::uint64_t at = 0;
      (void)(read.i32(status) && read.entry(e) && read.u64(at) && read.str(data) && read.u64(at) && read.str(data));
      break;
    }
    default:
      r.finish();
      break;  // kOk, kSync, kPowerOff, kKill, kEnd: no payload
  }
}

void guest_stream(std::string_view bytes, std::size_t piece) {
  gp::FrameReader reader;
  try {
    while (!bytes.empty()) {
      std::size_t n = std::min(piece, bytes.size());
      reader.feed(bytes.substr(0, n));
      bytes.remove_prefix(n);
      while (auto f = reader.next()) {
        if (f->payload.size() + 5 > gp::kMaxFrameBytes) fuzz::fail("FrameReader: a frame over kMaxFrameBytes");
        try {
          decode_frame(*f);
        } catch (const std::out_of_range&) {
        }
      }
    }
  } catch (const std::length_error&) {
  }
}

// The payload as the agent writes it (container_backend.cpp).
std::string encode_start_payload(const dsec::init_protocol::StartPayload& p) {
  std::string out;
  auto u32 = [&](std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  auto str = [&](const std::string& s) {
    u32(static_cast<std::uint32_t>(s.size()));
    out += s;
  };
  u32(static_cast<std::uint32_t>(p.argv.size()));
  for (const auto& a : p.argv) str(a);
  u32(static_cast<std::uint32_t>(p.env.size()));
  for (const auto& e : p.env) str(e);
  str(p.cwd);
  if (p.has_user) {
    u32(p.uid);
    u32(p.gid);
    u32(static_cast<std::uint32_t>(p.groups.size()));
    for (std::uint32_t g : p.groups) u32(g);
  }
  return out;
}

void init_payload(std::string_view payload) {
  dsec::init_protocol::StartPayload p;
  if (!dsec::init_protocol::decode_start_payload(payload, p)) return;
  if (p.argv.empty()) fuzz::fail("decode_start_payload: accepted an empty argv");
  for (const auto* list : {&p.argv, &p.env})
    for (const auto& s : *list)
      if (s.find('\0') != std::string::npos) fuzz::fail("decode_start_payload: accepted a NUL in a string");
  if (encode_start_payload(p) != payload) fuzz::fail("decode_start_payload: accepted a payload the agent never writes");
}

// What the agent reads of each message a fork server sends (fork_server.cpp, call.cpp): only through Frame's
// accessors, which must take any header.
void read_like_the_agent(const dsec::agent::fncall::Frame& f) {
  std::string type = f.type();
  if (type == "status") {
    (void)f.integer("status");
  } else if (type == "compiled") {
    (void)f.integer("exit_code").value_or(-1);
    (void)f.number("seconds", 0.0);
  } else if (type == "failed" || type == "fatal" || type == "ready") {
    (void)f.text("stage", "setup");
    (void)f.text("message", "failed");
  } else if (type == "hello") {
    if (auto failed = f.header.find("failed"); failed != f.header.end() && failed->is_object())
      for (auto& [name, why] : failed->items()) (void)why.dump();
  }
}

void fork_server_frames(std::string_view bytes) {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) fuzz::fail("socketpair");
  dsec::UniqueFd agent_end(sv[0]), peer_end(sv[1]);
  int buf = 1 << 20;
  ::setsockopt(peer_end.get(), SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  ::setsockopt(agent_end.get(), SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  while (!bytes.empty()) {
    ssize_t n = ::send(peer_end.get(), bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    if (n <= 0) break;  // what the socket does not take is not part of the input
    bytes.remove_prefix(static_cast<std::size_t>(n));
  }
  peer_end.reset();
  using dsec::agent::fncall::Frame;
  try {
    for (int frames = 0; frames < 64; ++frames) {
      Frame f;
      bool timed_out = false;
      if (!dsec::agent::fncall::recv_frame(agent_end.get(), f, std::chrono::steady_clock::now(), &timed_out)) break;
      if (timed_out) fuzz::fail("recv_frame: timed out on a closed socket");
      read_like_the_agent(f);
    }
  } catch (const dsec::Error&) {
  }
}

// Fork server frames from lines: each line is a frame's JSON header (with a blob of `blob` bytes), framed here, so
// that the fuzzer's mutations of the JSON are not undone by a length that no longer matches.
std::string frames_from_lines(std::string_view lines, std::size_t blob) {
  std::string out;
  auto u32 = [&](std::size_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  };
  fuzz::Input in(reinterpret_cast<const std::uint8_t*>(lines.data()), lines.size());
  while (!in.empty()) {
    std::string_view header = in.until('\n');
    u32(header.size());
    u32(blob);
    out += header;
    out.append(blob, 'b');
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Input in(data, size);
  std::uint8_t wire = in.byte() % 4;
  std::size_t piece = 1 + in.byte();
  std::string_view bytes = in.rest();
  if (wire == 0) guest_stream(bytes, piece);
  else if (wire == 1) init_payload(bytes);
  else if (wire == 2) fork_server_frames(bytes);
  else fork_server_frames(frames_from_lines(bytes, piece - 1));
  return 0;
}
