// The wire of the processes a sandbox's init keeps (docs/protocol.md, "Processes" and "Shell sessions"): spawned
// commands whose output init holds and whose stdin stays open, read and written by any number of agent calls, and
// still there after an agent restart. Shared by the agent and dsec-init.
//
// On init.sock, one connection per request:
//   agent -> init   u32 kMagic, u32 Op, u32 payload length, payload (sendmsg; a spawn carries the cgroup.procs
//                   descriptors its command joins as SCM_RIGHTS)
//   init  -> agent  u32 payload length, payload: i32 Status first, then the op's answer
// kMagic is above init_protocol::kMaxRequestBytes, so an init that knows no processes refuses such a request as a
// malformed exec and the agent says the sandbox's init is too old. A read that waits holds its connection until
// there is output, the process ends, or the wait passes; every other request is answered at once.
//
// Payloads (u32/u64/i32 in host order, a string is u32 length + bytes, a list is u32 count + items):
//   kSpawn     u32 kind, string meta, u32 pty, u32 rows, u32 cols, string start payload (init_protocol's)
//              -> Entry | kStartFailed: i32 errno, i32 FailStage
//   kList      (empty) -> u32 n, n Entry
//   kRead      i32 pid, u64 stdout offset, u64 stderr offset (kSkip: not read), u32 max bytes, u32 wait ms
//              -> Entry, u64 stdout offset, string stdout, u64 stderr offset, string stderr
//   kWrite     i32 pid, u32 close after, string data -> u32 bytes taken
//   kSignal    i32 pid, i32 signal, u32 Scope, u32 n, n i32 pids spared (kTreeExcept) -> u32 processes signalled
//   kResize    i32 pid, u32 rows, u32 cols -> (nothing)
//   kForget    i32 pid -> Entry (as it was)
//   kChildren  i32 pid -> u32 n, n i32 pids (its children now)
// Entry: i32 pid, u32 kind, string meta, list of strings argv, u32 flags (1 pty, 2 running, 4 stdin open),
//        i32 wait status, i64 started ms, i64 ended ms (realtime), u64 stdout end, u64 stderr end, u32 rows, u32 cols
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "common/protocol/limits.hpp"

namespace dsec::process_protocol {

inline constexpr std::uint32_t kMagic = 0xD5EC0100;
inline constexpr std::uint64_t kSkip = ~std::uint64_t{0};

// What init keeps (reads, waits and terminals are the API's limits, common/protocol/limits.hpp): at most this many
// processes (running, and ended ones until forgotten or evicted, oldest first), the last kOutputKeep bytes of each
// stream, at most kStdinBuffer bytes waiting for a process's stdin.
inline constexpr std::uint32_t kMaxProcesses = 80;
inline constexpr std::size_t kOutputKeep = 1u << 20;
inline constexpr std::size_t kStdinBuffer = 1u << 20;
inline constexpr auto kMaxReadBytes = static_cast<std::uint32_t>(protocol::kMaxOutputRead);
inline constexpr std::uint32_t kMaxWaitMs = static_cast<std::uint32_t>(protocol::kMaxProcessWait * 1000);
inline constexpr std::uint32_t kMaxPayloadBytes = 8u << 20;
inline constexpr std::uint32_t kMaxTerminalSide = protocol::kMaxTerminalSide;

enum class Op : std::uint32_t {
  kSpawn = 1,
  kList = 2,
  kRead = 3,
  kWrite = 4,
  kSignal = 5,
  kResize = 6,
  kForget = 7,
  kChildren = 8,
};

enum class Status : std::int32_t {
  kOk = 0,
  kNotFound = 1,     // no process with that pid in the table
  kEnded = 2,        // the process ended (stdin, signal)
  kStdinClosed = 3,  // its stdin was closed
  kStdinFull = 4,    // kStdinBuffer bytes wait already
  kTableFull = 5,    // kMaxProcesses run
  kNoTerminal = 6,   // a resize of a process without a pty
  kBadRequest = 7,   // malformed
  kStartFailed = 8,  // the command could not start (errno, stage follow)
  kSystem = 9,       // a system call of init's failed (errno follows)
};

enum class Kind : std::uint32_t { kProcess = 0, kSession = 1 };

enum class Scope : std::uint32_t {
  kProcess = 0,     // the process alone
  kGroup = 1,       // its process group
  kTreeExcept = 2,  // every descendant of the process (not itself), but the subtrees of the spared pids
};

inline constexpr std::uint32_t kFlagPty = 1, kFlagRunning = 2, kFlagStdinOpen = 4;

struct Entry {
  std::int32_t pid = 0;
  Kind kind = Kind::kProcess;
  std::string meta;  // a process's tag; a session's description (the agent's)
  std::vector<std::string> argv;
  bool pty = false;
  bool running = false;
  bool stdin_open = false;
  std::int32_t wait_status = 0;  // once ended
  std::int64_t started_ms = 0;
  std::int64_t ended_ms = 0;
  std::uint64_t stdout_end = 0;  // bytes written so far
  std::uint64_t stderr_end = 0;
  std::uint32_t rows = 0, cols = 0;
};

class Writer {
 public:
  void u32(std::uint32_t v) { raw(&v, 4); }
  void i32(std::int32_t v) { raw(&v, 4); }
  void u64(std::uint64_t v) { raw(&v, 8); }
  void i64(std::int64_t v) { raw(&v, 8); }
  void str(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    out_.append(s);
  }
  void strs(const std::vector<std::string>& list) {
    u32(static_cast<std::uint32_t>(list.size()));
    for (const auto& s : list) str(s);
  }
  void entry(const Entry& e) {
    i32(e.pid);
    u32(static_cast<std::uint32_t>(e.kind));
    str(e.meta);
    strs(e.argv);
    u32((e.pty ? kFlagPty : 0) | (e.running ? kFlagRunning : 0) | (e.stdin_open ? kFlagStdinOpen : 0));
    i32(e.wait_status);
    i64(e.started_ms);
    i64(e.ended_ms);
    u64(e.stdout_end);
    u64(e.stderr_end);
    u32(e.rows);
    u32(e.cols);
  }
  std::string& bytes() { return out_; }

 private:
  void raw(const void* p, std::size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string out_;
};

// Reads a payload; every getter returns false once the payload is short (and stays false), so a decoder checks
// once at its end (and that nothing is left over with done()).
class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  bool u32(std::uint32_t& v) { return raw(&v, 4); }
  bool i32(std::int32_t& v) { return raw(&v, 4); }
  bool u64(std::uint64_t& v) { return raw(&v, 8); }
  bool i64(std::int64_t& v) { return raw(&v, 8); }
  bool str(std::string& s) {
    std::uint32_t n = 0;
    if (!u32(n) || in_.size() - pos_ < n) return ok_ = false;
    s.assign(in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool strs(std::vector<std::string>& list) {
    std::uint32_t n = 0;
    // Each string costs at least its length: a count the payload cannot hold is malformed, not an allocation.
    if (!u32(n) || n > (in_.size() - pos_) / 4) return ok_ = false;
    list.resize(n);
    for (auto& s : list)
      if (!str(s)) return false;
    return true;
  }
  bool entry(Entry& e) {
    std::uint32_t kind = 0, flags = 0;
    bool got = i32(e.pid) && u32(kind) && str(e.meta) && strs(e.argv) && u32(flags) && i32(e.wait_status) &&
               i64(e.started_ms) && i64(e.ended_ms) && u64(e.stdout_end) && u64(e.stderr_end) && u32(e.rows) &&
               u32(e.cols);
    e.kind = static_cast<Kind>(kind);
    e.pty = flags & kFlagPty;
    e.running = flags & kFlagRunning;
    e.stdin_open = flags & kFlagStdinOpen;
    return got;
  }
  std::size_t left() const { return in_.size() - pos_; }
  bool ok() const { return ok_; }
  bool done() const { return ok_ && pos_ == in_.size(); }

 private:
  bool raw(void* p, std::size_t n) {
    if (!ok_ || in_.size() - pos_ < n) return ok_ = false;
    std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  std::string_view in_;
  std::size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace dsec::process_protocol
