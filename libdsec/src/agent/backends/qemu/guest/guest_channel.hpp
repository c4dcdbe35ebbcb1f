// The agent's side of the line to dsec-init inside a virtual machine (init/guest_protocol.hpp has the wire): one
// connected stream (QEMU's virtio-serial port "dsec.agent", or vsock), shared by every call about the VM at once.
// Each call gets a channel of its own; a reader thread sorts incoming frames into the calls' mailboxes, so a slow
// consumer of one exec's output holds only that exec.
//
// The same operations as a container's (exec with output caps, stdin, timeouts killing the whole process tree and
// streaming; files; tar streams) with the same errors, so a VM backend is a container backend's twin to callers.
// Used by the microvm backend (and the full VM backend after it).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "agent/backends/backend.hpp"
#include "common/unique_fd.hpp"
#include "common/wire/guest_protocol.hpp"
#include "common/wire/process_protocol.hpp"
#include "dsec/exec.hpp"
#include "image/upper_tree.hpp"

namespace dsec::agent::guest {

using Clock = std::chrono::steady_clock;

class GuestChannel {
 public:
  // `stream` is connected to the guest's port. `label` names the sandbox in errors.
  GuestChannel(UniqueFd stream, std::string label);
  ~GuestChannel();
  GuestChannel(const GuestChannel&) = delete;
  GuestChannel& operator=(const GuestChannel&) = delete;

  // Names another sandbox in errors from now on (a pooled VM claimed by a create); only while no call runs.
  void relabel(std::string label) { label_ = std::move(label); }

  // False once the stream broke (the VM died, or its QEMU closed the port).
  bool connected() const;
  // Ends the stream: every call waiting gets UNAVAILABLE.
  void close();

  // Control. hello() is the first call on every connection; setup() once per boot.
  guest_protocol::HelloReply hello(const guest_protocol::Hello& hello, Clock::time_point deadline);
  void setup(const guest_protocol::Setup& setup, Clock::time_point deadline);
  void sync(Clock::time_point deadline);
  // Asks the guest to power itself off; returns once it said it will (or the deadline passed).
  void power_off(Clock::time_point deadline);

  // Runs a command (argv, env "K=V", cwd already decided by the caller) under the request's timeout, output cap and
  // stdin; with a sink, output goes there as it arrives. A command that cannot start throws what
  // init::start_error says; a guest that goes away during the exec is UNAVAILABLE.
  ExecResult exec(guest_protocol::ExecStart start, std::string_view stdin_data, double timeout_seconds,
                  const OutputSink& sink);

  std::string read_file(std::string_view path, std::size_t max_bytes, Clock::time_point deadline);
  void write_file(std::string_view path, std::string_view data, unsigned mode, Clock::time_point deadline);
  std::uint32_t mode_of(std::string_view path, Clock::time_point deadline);
  // A tar stream extracted into `dir` inside the guest, and a pax tar of `dir`.
  void put_archive(std::string_view dir, std::string_view tar_bytes, Clock::time_point deadline);
  std::string get_archive(std::string_view dir, std::size_t max_bytes, Clock::time_point deadline);
  // The guest's writable layer (every command frozen while it is read) written into `dest` as a layer's tree
  // (upper_capture.hpp).
  image::UpperTreeStats capture_upper(const std::filesystem::path& dest, const image::UpperTreeLimits& limits,
                                      Clock::time_point deadline);
  // One request to the processes the guest's init keeps (process_protocol.hpp), and its reply's payload.
  std::string process_request(process_protocol::Op op, std::string_view payload, Clock::time_point deadline);

 private:
  struct Mailbox {
    std::deque<guest_protocol::Frame> frames;
    std::size_t bytes = 0;
  };
  class Call;
  class ExecRun;  // one exec once its command started

  void read_loop();
  std::uint32_t open_channel();
  void close_channel(std::uint32_t channel);
  void send(guest_protocol::Type type, std::uint32_t channel, std::string_view payload);
  // The next frame of `channel`; nullopt when the deadline passed. UNAVAILABLE once the stream is gone.
  std::optional<guest_protocol::Frame> next(std::uint32_t channel, Clock::time_point deadline);
  // Waits for the one answer of a request: kError is thrown, an unexpected type is INTERNAL.
  guest_protocol::Frame answer(std::uint32_t channel, Clock::time_point deadline, std::string_view what);
  [[noreturn]] void throw_lost(std::string_view what) const;

  UniqueFd stream_;
  std::string label_;
  mutable std::mutex mu_;
  std::condition_variable arrived_;
  std::map<std::uint32_t, Mailbox> mailboxes_;
  std::uint32_t next_channel_ = 1;
  bool broken_ = false;
  std::string broken_reason_;
  std::mutex write_mu_;
  std::thread reader_;
};

}  // namespace dsec::agent::guest
