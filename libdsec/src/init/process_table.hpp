// The processes dsec-init keeps for the agent (process_protocol.hpp): spawned commands with their stdin, stdout and
// stderr (or a pty) held by init, the last kOutputKeep bytes of each output stream, waiting readers. It lives in
// pid 1's event loop: the loop polls the descriptors the table names, hands it what is ready, and tells it which
// of its processes ended. Nothing here blocks: a read that has to wait is parked with its connection and answered
// when there is output, the process ends or its wait passes.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/wire/process_protocol.hpp"

namespace dsec::init {

// One output stream: offsets count every byte ever written; only the last kOutputKeep are kept.
class OutputBuffer {
 public:
  void append(const char* data, std::size_t n);
  std::uint64_t end() const { return base_ + data_.size(); }
  // The kept bytes from `offset` on (from the first kept byte when `offset` is older), at most `max`.
  std::string_view from(std::uint64_t offset, std::size_t max, std::uint64_t& actual) const;

 private:
  std::string data_;
  std::uint64_t base_ = 0;  // offset of data_[0]
};

class ProcessTable {
 public:
  // Where an answer goes: the ticket of its request and the payload. A ticket is the request's connection in a
  // container (the reply closes it) or its channel in a VM.
  using Reply = std::function<void(std::uint64_t ticket, const std::string& payload)>;

  // `drop_capabilities`: every command gives up all of init's capabilities before it execs (a container's init;
  // StartRequest::drop_capabilities). `tickets_are_fds`: a parked read's ticket is a descriptor the table watches,
  // dropping the read when its peer hangs up.
  ProcessTable(const sigset_t& original_mask, bool drop_capabilities, Reply reply, bool tickets_are_fds)
      : original_mask_(original_mask),
        drop_capabilities_(drop_capabilities),
        reply_(std::move(reply)),
        tickets_are_fds_(tickets_are_fds) {}
  ~ProcessTable();
  ProcessTable(const ProcessTable&) = delete;
  ProcessTable& operator=(const ProcessTable&) = delete;

  // Serves one request, with the descriptors it carried (taken, closed). Answers at once, unless the request is a
  // read that waits: the table then keeps the ticket and answers it later.
  void serve(std::uint64_t ticket, process_protocol::Op op, std::string_view payload, std::vector<int>& fds);
  // Forgets every parked read unanswered (their peer is gone: a VM's agent disconnected).
  void drop_parked();

  // The descriptors to poll (appended to `fds`), and what poll found on them (from index `first`).
  void poll_fds(std::vector<pollfd>& fds) const;
  void poll_done(const std::vector<pollfd>& fds, std::size_t first);
  // A child of init ended: true when it was one of the table's (then its readers are answered).
  bool reaped(pid_t pid, int status);
  // Milliseconds until the first parked read's wait passes (-1: none waits), and answering those whose passed.
  int next_timeout_ms() const;
  void expire();

 private:
  struct Process {
    process_protocol::Entry entry;
    int in_fd = -1;   // write end of its stdin (the pty master with a pty)
    int out_fd = -1;  // read end of its stdout (the pty master with a pty)
    int err_fd = -1;  // read end of its stderr (none with a pty)
    std::string stdin_pending;
    bool close_stdin_after = false;
    OutputBuffer out, err;
  };
  struct ParkedRead {
    std::uint64_t ticket;
    pid_t pid;
    std::uint64_t out_offset, err_offset;
    std::uint32_t max;
    std::int64_t deadline_ms;  // monotonic
  };

  std::string spawn(std::string_view payload, std::vector<int>& fds);
  // spawn()'s descriptors: the process's ends and the child's (stdin, stdout, stderr) of a pty of rows x cols (24 x
  // 80 by default), or of three pipes. 0, or the errno of what failed (nothing of it left open).
  static int open_pty(Process& p, std::uint32_t rows, std::uint32_t cols, int (&child)[3]);
  static int open_pipes(Process& p, int (&child)[3]);
  std::string list() const;
  // Answers the read at once (the reply), or nullopt when it has to wait.
  std::optional<std::string> read(std::string_view payload, std::uint64_t ticket);
  std::string read_reply(const Process& p, std::uint64_t out_offset, std::uint64_t err_offset, std::uint32_t max) const;
  std::string write(std::string_view payload);
  std::string signal(std::string_view payload);
  std::string resize(std::string_view payload);
  std::string forget(std::string_view payload);
  std::string children(std::string_view payload) const;

  Process* find(pid_t pid);
  // Drains a process's output descriptors (at most `budget` bytes each); closes one at its end.
  void drain(Process& p, std::size_t budget);
  void flush_stdin(Process& p);
  void close_stdin(Process& p);
  // Answers every parked read of `pid` that has something now (or all of them, with `all`).
  void wake_readers(pid_t pid, bool all);
  // Makes room for one more process: drops the oldest ended one; false when every kept process runs.
  bool make_room();
  void release(Process& p);

  sigset_t original_mask_;
  bool drop_capabilities_;
  Reply reply_;
  bool tickets_are_fds_;
  std::map<pid_t, Process> processes_;
  std::deque<pid_t> order_;  // by spawn, for eviction
  std::vector<ParkedRead> parked_;
};

// Sends one reply (u32 length + payload) and closes the connection. Never blocks pid 1 for long: the agent reads
// its replies at once; a peer that does not is cut off after the send timeout.
void send_process_reply(int conn, const std::string& payload);

}  // namespace dsec::init
