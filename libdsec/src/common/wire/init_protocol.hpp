// The wire between the agent and dsec-init (pid 1 inside a container sandbox).
//
// dsec-init listens on a unix stream socket that the agent bound at <run_dir>/<id>/init.sock before the sandbox
// started. Each exec is one connection:
//   agent -> init   one StartRequest: a 4-byte little-endian length, then the payload below, sent with sendmsg and
//                   SCM_RIGHTS carrying, in order: stdin, stdout, stderr, then zero or more cgroup.procs fds that
//                   the command joins (by writing "0") before it execs.
//   init  -> agent  a Reply kStarted with the command's pid, or kFailed with errno and the stage that failed;
//                   after kStarted, exactly one Reply kExited with the wait status once the command's main process
//                   ends.
// Closing the connection does not kill the command: processes started in the background outlive their exec.
// A request that is malformed (for one, length 0 without descriptors) is answered kFailed with stage kRequest and
// starts nothing: an agent that restarted sends one to check that a sandbox's init still answers.
//
// Payload: u32 argc, argc strings; u32 envc, envc strings ("K=V"); one string cwd; then, only for a command that
// runs as a named user, u32 uid, u32 gid, u32 ngroups, ngroups u32 supplementary gids. A string is u32 length +
// bytes. Without the user part the command runs as root (an agent sends none for root by default, so an older
// dsec-init, which knows no user part, still serves it). Either way the command starts with no capability.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::init_protocol {

inline constexpr std::uint32_t kMaxRequestBytes = 4u << 20;  // argv + env + cwd
inline constexpr int kMaxPassedFds = 8;

enum class ReplyType : std::uint32_t { kStarted = 1, kFailed = 2, kExited = 3 };

// Which step of starting the command failed (kFailed's `b`).
// kUser: dropping the capabilities or setting the groups, gid or uid failed (errno of that call).
enum class FailStage : std::int32_t { kRequest = 1, kFork = 2, kCgroup = 3, kChdir = 4, kExec = 5, kUser = 6 };

// The ids a command may run as, and at most this many supplementary groups.
inline constexpr std::uint32_t kMaxId = 65535;
inline constexpr std::uint32_t kMaxGroups = 256;

struct Reply {
  ReplyType type;
  std::int32_t a;  // kStarted: pid (in the sandbox's pid namespace); kFailed: errno; kExited: wait status
  std::int32_t b;  // kFailed: FailStage
};
static_assert(sizeof(Reply) == 12);

// The command a StartRequest's payload names.
struct StartPayload {
  std::vector<std::string> argv;
  std::vector<std::string> env;
  std::string cwd;
  bool has_user = false;  // the payload has the user part
  std::uint32_t uid = 0;
  std::uint32_t gid = 0;
  std::vector<std::uint32_t> groups;
};

// Decodes a StartRequest's payload (dsec-init); false when it is malformed: no argv, a count of strings the payload
// cannot hold (each costs at least its 4-byte length, so what a count makes dsec-init allocate stays in proportion
// to the payload), a string running past the end, a NUL inside a string, a user part with an id above kMaxId or
// more than kMaxGroups groups, or bytes left over.
inline bool decode_start_payload(std::string_view payload, StartPayload& out) {
  std::size_t pos = 0;
  auto u32 = [&](std::uint32_t& v) {
    if (payload.size() - pos < 4) return false;
    std::memcpy(&v, payload.data() + pos, 4);  // the agent writes host order (both ends run on one host)
    pos += 4;
    return true;
  };
  auto str = [&](std::string& s) {
    std::uint32_t n;
    if (!u32(n) || payload.size() - pos < n) return false;
    s.assign(payload.data() + pos, n);
    pos += n;
    return s.find('\0') == std::string::npos;
  };
  auto strs = [&](std::vector<std::string>& list) {
    std::uint32_t n;
    if (!u32(n) || n > (payload.size() - pos) / 4) return false;
    list.resize(n);
    for (auto& s : list)
      if (!str(s)) return false;
    return true;
  };
  if (!(strs(out.argv) && !out.argv.empty() && strs(out.env) && str(out.cwd))) return false;
  out.has_user = pos != payload.size();
  if (!out.has_user) return true;
  std::uint32_t n = 0;
  if (!u32(out.uid) || !u32(out.gid) || !u32(n) || out.uid > kMaxId || out.gid > kMaxId || n > kMaxGroups ||
      n != (payload.size() - pos) / 4)
    return false;
  out.groups.resize(n);
  for (auto& g : out.groups)
    if (!u32(g) || g > kMaxId) return false;
  return pos == payload.size();
}

// File descriptors dsec-init inherits from the agent.
inline constexpr int kListenFd = 3;   // the listening init.sock
inline constexpr int kScratchFd = 4;  // the sandbox's private tmpfs (upper and work dirs), held for snapshots

}  // namespace dsec::init_protocol
