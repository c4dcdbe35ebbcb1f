// The wire between the agent and dsec-init running as pid 1 of a virtual machine (the microvm and vm backends).
//
// In a container, dsec-init takes one connection per exec on a unix socket and gets the command's pipes and cgroup
// as descriptors (init_protocol.hpp). A VM shares no descriptors with the host: its only line to the agent is one
// byte stream (a virtio-serial port named "dsec.agent", which QEMU connects to a unix socket of the agent; vsock
// where the host has it). This protocol carries everything over that stream as frames, each on a channel, so many
// execs and file transfers run at once: the command's output, its stdin and its exit travel as frames of its
// channel, and dsec-init keeps the pipes and the exec's cgroup inside the guest.
//
// A frame: u32 size (of what follows the size, at most kMaxFrameBytes), u8 type, u32 channel, then the payload.
// Integers are little-endian; a string or a byte blob is u32 length + bytes. Channel 0 is the control channel; the
// agent picks a new channel (> 0) for every exec and every file operation.
//
// Control (channel 0):
//   agent -> guest  kHello {u64 realtime ns, bytes entropy, str hostname}: sent on every connection, and whenever
//                   the guest's clock or identity must be renewed (after a restore from a snapshot: the guest clock
//                   stood still, and a clone must not share its parent's random state). The guest sets its clock,
//                   mixes the entropy into its RNG, sets the hostname (when not empty) and answers kHelloReply
//                   {str kernel release, u8 root ready, u32 execs running}.
//                   A new connection means the previous agent is gone: execs of the earlier connection are killed
//                   (their caller can no longer read their result); background processes they started live on.
//   agent -> guest  kSetup {u32 n, n x (str layer serial, str data serial or ""), str disk serial}: once per
//                   boot. The guest finds the virtio-blk disks by serial, mounts each layer read-only as EROFS
//                   (lowest first; a data serial is its blob device) and the writable disk (ext4, made by the agent)
//                   as the upper directory, stacks overlayfs and makes it its root. kOk or kError.
//   agent -> guest  kSync {}: flush every file system (before a snapshot of the disk). kOk.
//   agent -> guest  kPowerOff {}: flush and power off. kOk first.
// Exec (channel c):
//   agent -> guest  kExec {u32 argc + strs, u32 envc + strs "K=V", str cwd, u64 output cap per stream,
//                   u8 stdin follows, and only for a command that runs as a named user: u32 uid, u32 gid, u32 n,
//                   n x u32 supplementary gids}. Without the user part it runs as root (so a guest from before users
//                   still serves the agent's root execs). Then kStdin {bytes} frames (an empty one closes stdin),
//                   kKill {} to kill the command's whole process tree (its cgroup).
//   guest -> agent  kStarted {i32 pid} or kFailed {i32 errno, i32 stage (init_protocol::FailStage)}; then kOutput
//                   {u8 stream 1|2, bytes} as output is read (at most the cap per stream; the rest is read and
//                   dropped), and one kExited {i32 wait status, u8 stdout truncated, u8 stderr truncated} once the
//                   main process ended and its output is drained (at most 50 ms after the exit when a background
//                   process keeps the pipes open).
//   Both ways, windows: the guest sends at most kWindowBytes of output the agent has not acknowledged, and the
//   agent at most kWindowBytes of stdin the guest has not; kCredit {u64 bytes} acknowledges bytes taken (output
//   delivered to the caller; stdin written into the command's pipe). A caller that reads slowly holds its command
//   (its pipe fills), not the guest's memory or the line; stdin waits in the agent, not in the guest.
// Files (channel c), paths absolute inside the guest's root, resolved in it (never following a symlink out of it,
// never crossing into /proc, /dev or /sys):
//   kReadFile {str path, u64 max} -> kData {bytes}... then kDone {u64 total} | kError
//   kWriteFile {str path, u32 mode} then kData {bytes}... and kEnd {} -> kDone {u64 total} | kError
//   kStat {str path} -> kStatReply {u32 st_mode} | kError
//   kPutTree {str dir} then, per entry, kEntry {files::TreeEntry, below} (a regular file's bytes, exactly its
//     size, follow as kData frames), and kEnd {} -> kDone {u64 entries} | kError (the first error ends it)
//   kGetTree {str dir, u64 max} -> kEntry {...} (+ kData for files)... then kDone {u64 entries} | kError
// Snapshot (channel c): kCaptureUpper {u64 max file bytes} -> the writable layer (the overlay's upper directory)
//   walked with every process of the guest's commands frozen: kEntry frames of every kind (whiteouts, FIFOs,
//   opaque directories, hard links by their first name), a regular file's bytes as kData, then kDone {u64 entries}
//   | kError. An upper with metacopy or redirect xattrs is FAILED_PRECONDITION.
// Processes (channel c): kProcessRequest {u32 op, then the op's payload as process_protocol.hpp has it, to the end of
//   the frame} -> kProcessReply {the reply's payload, to the end of the frame}. The guest's dsec-init keeps them in the
//   same table a container's init does (process_table.hpp), each in a cgroup of its own; they outlive the agent's
//   connection (a parked read is dropped with it), a sleep and a fork (they are part of the VM's memory).
// kError is {u32 code (dsec::Code), str message}: the guest's file operations throw the same dsec::Error the
// container tier's do, and the agent rethrows it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/sandbox_tree.hpp"

namespace dsec::guest_protocol {

namespace files = agent::files;

inline constexpr std::uint32_t kMaxFrameBytes = (1u << 20) + 64;
inline constexpr std::size_t kMaxDataChunk = 256u << 10;  // file and output bytes per frame
inline constexpr std::size_t kHeaderBytes = 9;            // u32 size, u8 type, u32 channel
inline constexpr std::uint64_t kWindowBytes = 4u << 20;   // unacknowledged output or stdin per exec
inline constexpr std::uint64_t kCreditStep = 1u << 20;    // acknowledged once this much was taken
inline constexpr const char* kPortName = "dsec.agent";    // the virtio-serial port's name

enum class Type : std::uint8_t {
  kHello = 1,
  kHelloReply = 2,
  kSetup = 3,
  kOk = 4,
  kError = 5,
  kSync = 6,
  kPowerOff = 7,
  kExec = 10,
  kStarted = 11,
  kFailed = 12,
  kOutput = 13,
  kExited = 14,
  kStdin = 15,
  kKill = 16,
  kCredit = 17,
  kReadFile = 20,
  kWriteFile = 21,
  kStat = 22,
  kStatReply = 23,
  kPutTree = 24,
  kGetTree = 25,
  kCaptureUpper = 30,
  kProcessRequest = 31,
  kProcessReply = 32,
  kEntry = 26,
  kData = 27,
  kEnd = 28,
  kDone = 29,
};

struct Frame {
  Type type{};
  std::uint32_t channel = 0;
  std::string payload;
};

// Appends one frame to `out`.
void append_frame(std::string& out, Type type, std::uint32_t channel, std::string_view payload);

// Splits a byte stream into frames. feed() adds bytes; next() returns the next complete frame, if any. A frame
// larger than kMaxFrameBytes makes the stream unusable: next() then throws std::length_error (the peer is broken
// or hostile; the connection must be dropped).
class FrameReader {
 public:
  void feed(std::string_view bytes) { buffer_.append(bytes); }
  std::optional<Frame> next();
  std::size_t buffered() const noexcept { return buffer_.size() - pos_; }

 private:
  std::string buffer_;
  std::size_t pos_ = 0;
};

// Payload building and parsing. Reader's getters throw std::out_of_range on a short or malformed payload.
class Writer {
 public:
  Writer& u8(std::uint8_t v);
  Writer& u32(std::uint32_t v);
  Writer& i32(std::int32_t v) { return u32(static_cast<std::uint32_t>(v)); }
  Writer& u64(std::uint64_t v);
  Writer& str(std::string_view s);
  Writer& strs(const std::vector<std::string>& v);
  std::string take() { return std::move(out_); }
  const std::string& bytes() const noexcept { return out_; }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view payload) : in_(payload) {}
  std::uint8_t u8();
  std::uint32_t u32();
  std::int32_t i32() { return static_cast<std::int32_t>(u32()); }
  std::uint64_t u64();
  std::string str();
  std::vector<std::string> strs(std::uint32_t max_count = 1u << 16);
  bool done() const noexcept { return pos_ == in_.size(); }
  // Throws std::out_of_range unless every byte was read.
  void finish() const;

 private:
  std::string_view in_;
  std::size_t pos_ = 0;
};

// The messages with more than one field, so both ends encode them the same way.
struct ExecStart {
  std::vector<std::string> argv;
  std::vector<std::string> env;
  std::string cwd;
  std::uint64_t max_output = 0;
  bool stdin_follows = false;
  bool has_user = false;  // run as uid/gid/groups (the user part); false: root
  std::uint32_t uid = 0;
  std::uint32_t gid = 0;
  std::vector<std::uint32_t> groups{};
};
std::string encode(const ExecStart& m);
ExecStart decode_exec_start(std::string_view payload);

struct Hello {
  std::uint64_t realtime_ns = 0;
  std::string entropy;
  std::string hostname;
};
std::string encode(const Hello& m);
Hello decode_hello(std::string_view payload);

struct HelloReply {
  std::string kernel_release;
  bool root_ready = false;
  std::uint32_t execs_running = 0;
};
std::string encode(const HelloReply& m);
HelloReply decode_hello_reply(std::string_view payload);

struct SetupLayer {
  std::string serial;
  std::string data_serial;  // empty: the layer is one device
};
struct Setup {
  std::vector<SetupLayer> layers;  // lowest first
  std::string disk_serial;
};
std::string encode(const Setup& m);
Setup decode_setup(std::string_view payload);
// The same layout as one word of a kernel command line, for a full VM whose initramfs builds its root before any
// agent speaks to it (`dsec_root=<disk>/<layer>[+<data>],...`, layers lowest first): serials of 1 to 20 bytes of
// [A-Za-z0-9._-] (virtio-blk keeps 20), at most 128 layers. decode_root_word throws std::invalid_argument on
// anything else.
std::string encode_root_word(const Setup& m);
Setup decode_root_word(std::string_view word);

struct Exited {
  std::int32_t status = 0;
  bool stdout_truncated = false;
  bool stderr_truncated = false;
  // Killed by SIGKILL while the guest kernel's OOM killer killed something (an older guest init leaves the byte out:
  // false). A timeout's kill never sets it.
  bool oom_killed = false;
};
std::string encode(const Exited& m);
Exited decode_exited(std::string_view payload);

// A tree entry: files::TreeEntry {u8 kind, str path, u32 mode, str link, u64 size, u32 uid, u32 gid, u64 mtime,
// u64 atime ns, u64 mtime ns, u8 opaque}.
std::string encode(const files::TreeEntry& m);
files::TreeEntry decode_entry(std::string_view payload);

struct ErrorReply {
  std::uint32_t code = 0;  // dsec::Code
  std::string message;
};
std::string encode(const ErrorReply& m);
ErrorReply decode_error(std::string_view payload);

}  // namespace dsec::guest_protocol
