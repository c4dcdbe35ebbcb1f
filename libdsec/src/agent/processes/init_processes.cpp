// Processes over dsec-init's wire (process_protocol.hpp): encoding requests, decoding replies, and turning init's
// statuses into the protocol's errors.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "agent/processes/processes.hpp"
#include "common/wire/start_error.hpp"

namespace dsec::agent {
namespace {

using namespace process_protocol;

constexpr std::chrono::milliseconds kReplyWithin{10'000};

Error malformed_reply(const std::string& sandbox_id) {
  return Error(Code::kInternal, fmt::format("sandbox {}: its init sent a malformed process reply", sandbox_id));
}

}  // namespace

void InitProcesses::check_status(Reader& r, int pid) const {
  std::int32_t status = 0;
  if (!r.i32(status)) throw malformed_reply(sandbox_id_);
  switch (static_cast<Status>(status)) {
    case Status::kOk:
      return;
    case Status::kNotFound:
      throw Error(Code::kNotFound, fmt::format("sandbox {} has no process {}", sandbox_id_, pid));
    case Status::kEnded:
      throw Error(Code::kFailedPrecondition, fmt::format("process {} of sandbox {} has ended", pid, sandbox_id_));
    case Status::kStdinClosed:
      throw Error(Code::kFailedPrecondition,
                  fmt::format("process {} of sandbox {}: its stdin is closed", pid, sandbox_id_));
    case Status::kStdinFull:
      throw Error(Code::kResourceExhausted,
                  fmt::format("process {} of sandbox {}: {} bytes wait for its stdin already; write again once it "
                              "read them",
                              pid, sandbox_id_, kStdinBuffer),
                  /*retryable=*/true);
    case Status::kTableFull:
      throw Error(
          Code::kResourceExhausted,
          fmt::format("sandbox {} runs {} processes and sessions, its most; end one first", sandbox_id_, kMaxProcesses),
          /*retryable=*/false);
    case Status::kNoTerminal:
      throw Error(Code::kFailedPrecondition,
                  fmt::format("process {} of sandbox {} has no terminal (spawn it with pty)", pid, sandbox_id_));
    case Status::kBadRequest:
      throw Error(Code::kInternal, fmt::format("sandbox {}: its init refused a process request as malformed "
                                               "(an init too old for processes?)",
                                               sandbox_id_));
    case Status::kSystem: {
      std::int32_t err = 0;
      r.i32(err);
      throw Error(Code::kInternal,
                  fmt::format("sandbox {}: its init failed a process request: {}", sandbox_id_, std::strerror(err)));
    }
    default:
      throw malformed_reply(sandbox_id_);
  }
}

std::string InitProcesses::spawn_payload(const SpawnOptions& options, const std::string& start_payload) {
  Writer w;
  w.u32(static_cast<std::uint32_t>(options.kind));
  w.str(options.meta);
  w.u32(options.pty ? 1 : 0);
  w.u32(options.rows);
  w.u32(options.cols);
  w.str(start_payload);
  return std::move(w.bytes());
}

std::variant<ProcessEntry, ExecResult> InitProcesses::spawn_reply(const std::string& reply, const std::string& argv0,
                                                                  const std::string& cwd) const {
  Reader r(reply);
  std::int32_t status = 0;
  if (!r.i32(status)) throw malformed_reply(sandbox_id_);
  if (static_cast<Status>(status) == Status::kStartFailed) {
    std::int32_t err = 0, stage = 0;
    if (!r.i32(err) || !r.i32(stage)) throw malformed_reply(sandbox_id_);
    auto fail = static_cast<init_protocol::FailStage>(stage);
    if (auto result = init::start_failure_result(err, fail, argv0, cwd)) return *result;
    throw init::start_error(err, fail, argv0, cwd);
  }
  Reader again(reply);
  check_status(again, 0);
  ProcessEntry entry;
  if (!again.entry(entry) || !again.done()) throw malformed_reply(sandbox_id_);
  return entry;
}

std::vector<ProcessEntry> InitProcesses::list() {
  std::string reply = exchange(Op::kList, {}, kReplyWithin);
  Reader r(reply);
  check_status(r, 0);
  std::uint32_t n = 0;
  if (!r.u32(n) || n > kMaxProcesses) throw malformed_reply(sandbox_id_);
  std::vector<ProcessEntry> out(n);
  for (auto& e : out)
    if (!r.entry(e)) throw malformed_reply(sandbox_id_);
  if (!r.done()) throw malformed_reply(sandbox_id_);
  return out;
}

ProcessOutput InitProcesses::read(int pid, std::uint64_t stdout_offset, std::uint64_t stderr_offset, std::uint32_t max,
                                  std::chrono::milliseconds wait) {
  Writer w;
  w.i32(pid);
  w.u64(stdout_offset);
  w.u64(stderr_offset);
  w.u32(std::min(max, max_read_bytes()));
  w.u32(static_cast<std::uint32_t>(std::clamp<std::int64_t>(wait.count(), 0, kMaxWaitMs)));
  std::string reply = exchange(Op::kRead, w.bytes(), wait + kReplyWithin);
  Reader r(reply);
  check_status(r, pid);
  ProcessOutput out;
  if (!r.entry(out.entry) || !r.u64(out.stdout_offset) || !r.str(out.stdout_data) || !r.u64(out.stderr_offset) ||
      !r.str(out.stderr_data) || !r.done())
    throw malformed_reply(sandbox_id_);
  return out;
}

void InitProcesses::write_stdin(int pid, std::string_view data, bool close) {
  Writer w;
  w.i32(pid);
  w.u32(close ? 1 : 0);
  w.str(data);
  std::string reply = exchange(Op::kWrite, w.bytes(), kReplyWithin);
  Reader r(reply);
  check_status(r, pid);
}

std::uint32_t InitProcesses::signal(int pid, int sig, Scope scope, const std::vector<int>& spared) {
  Writer w;
  w.i32(pid);
  w.i32(sig);
  w.u32(static_cast<std::uint32_t>(scope));
  w.u32(static_cast<std::uint32_t>(spared.size()));
  for (int s : spared) w.i32(s);
  std::string reply = exchange(Op::kSignal, w.bytes(), kReplyWithin);
  Reader r(reply);
  check_status(r, pid);
  std::uint32_t n = 0;
  if (!r.u32(n)) throw malformed_reply(sandbox_id_);
  return n;
}

void InitProcesses::resize(int pid, unsigned rows, unsigned cols) {
  Writer w;
  w.i32(pid);
  w.u32(rows);
  w.u32(cols);
  std::string reply = exchange(Op::kResize, w.bytes(), kReplyWithin);
  Reader r(reply);
  check_status(r, pid);
}

ProcessEntry InitProcesses::forget(int pid) {
  Writer w;
  w.i32(pid);
  std::string reply = exchange(Op::kForget, w.bytes(), kReplyWithin);
  Reader r(reply);
  check_status(r, pid);
  ProcessEntry e;
  if (!r.entry(e)) throw malformed_reply(sandbox_id_);
  return e;
}

std::vector<int> InitProcesses::children(int pid) {
  Writer w;
  w.i32(pid);
  std::string reply = exchange(Op::kChildren, w.bytes(), kReplyWithin);
  Reader r(reply);
  check_status(r, pid);
  std::uint32_t n = 0;
  if (!r.u32(n) || n > r.left() / 4) throw malformed_reply(sandbox_id_);
  std::vector<int> out(n);
  for (int& c : out) {
    std::int32_t v = 0;
    r.i32(v);
    c = v;
  }
  if (!r.done()) throw malformed_reply(sandbox_id_);
  return out;
}

}  // namespace dsec::agent
