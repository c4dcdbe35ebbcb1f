// A client of QEMU's machine protocol (QMP): one JSON object per line over a unix socket. It connects (or adopts a
// connected socket), reads the greeting, negotiates capabilities, then runs one command at a time and matches each
// reply by its "id". Asynchronous events that arrive while it waits are queued, never lost (up to kMaxQueuedEvents;
// past that the oldest are dropped).
//
// Errors:
//   a QMP error reply {"error": {"class", "desc"}}  -> QmpError (a dsec::Error) with the desc in the message:
//       DeviceNotFound, CommandNotFound           -> NOT_FOUND
//       GenericError, DeviceNotActive, KVMMissingCap and any other class -> FAILED_PRECONDITION
//   the socket closed or reset (QEMU died)           -> UNAVAILABLE (and every later call says so at once)
//   no reply or event within the time allowed        -> DEADLINE_EXCEEDED (a late reply is dropped when it comes)
//   a message that is not JSON, or over kMaxMessageBytes -> INTERNAL
//
// QEMU must speak compact JSON (its default, pretty=off): messages are split at newlines.
//
// Not thread-safe: one user at a time (the caller holds a lock around it if several threads share a VM's monitor).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::qemu {

// A QMP error reply. error_class() is QMP's "class" ("GenericError", "DeviceNotFound", ...).
class QmpError : public Error {
 public:
  QmpError(Code code, const std::string& message, std::string error_class)
      : Error(code, message), error_class_(std::move(error_class)) {}
  const std::string& error_class() const noexcept { return error_class_; }

 private:
  std::string error_class_;
};

// The dsec code for a QMP error class (see the table above).
Code code_for_qmp_error_class(std::string_view error_class) noexcept;

class QmpClient {
 public:
  static constexpr std::size_t kMaxQueuedEvents = 4096;
  static constexpr std::size_t kMaxMessageBytes = 64u << 20;

  // Connects to the QMP unix socket at `path`, retrying ECONNREFUSED and ENOENT (QEMU has not bound or listened yet)
  // until `deadline`, then reads the greeting and sends qmp_capabilities, all before `deadline`.
  // DEADLINE_EXCEEDED when QEMU never answers in time, INVALID_ARGUMENT for a path too long for a unix socket.
  static QmpClient connect(const std::filesystem::path& path, std::chrono::steady_clock::time_point deadline);

  // Adopts a connected stream socket (made non-blocking; the flag is shared with every copy of the descriptor), reads
  // the greeting and sends qmp_capabilities before `deadline`.
  explicit QmpClient(UniqueFd connected, std::chrono::steady_clock::time_point deadline);

  QmpClient(QmpClient&&) noexcept = default;
  QmpClient& operator=(QmpClient&&) noexcept = default;
  QmpClient(const QmpClient&) = delete;
  QmpClient& operator=(const QmpClient&) = delete;
  ~QmpClient() = default;

  // Runs one command and returns its "return" value. `arguments` is an object (sent when not empty) or null.
  nlohmann::json execute(std::string_view command, const nlohmann::json& arguments = nlohmann::json::object(),
                         std::chrono::milliseconds timeout = std::chrono::seconds(10));

  // Like execute, with `fds` attached to the command's message (SCM_RIGHTS), for "getfd" and "add-fd". QEMU takes the
  // descriptors as the command arrives; getfd and add-fd use one each. The caller keeps (and may close) its own.
  nlohmann::json execute_with_fds(std::string_view command, const nlohmann::json& arguments,
                                  const std::vector<int>& fds,
                                  std::chrono::milliseconds timeout = std::chrono::seconds(10));

  // The first event named `name`, taking it from the queue (an event that came earlier counts) or waiting up to
  // `timeout` for it; other events that arrive meanwhile stay queued. DEADLINE_EXCEEDED on timeout.
  nlohmann::json wait_event(std::string_view name, std::chrono::milliseconds timeout);

  // Every event received so far (reading what is already on the socket first, without waiting), oldest first; the
  // queue is left empty. Does not throw on a closed socket: the next execute reports it.
  std::vector<nlohmann::json> take_events();

  // The greeting's "QMP" object ({"version": {...}, "capabilities": [...]}).
  const nlohmann::json& greeting() const noexcept { return greeting_; }

  int fd() const noexcept { return fd_.get(); }

 private:
  using Clock = std::chrono::steady_clock;

  void handshake(Clock::time_point deadline);
  nlohmann::json run(std::string_view command, const nlohmann::json& arguments, const std::vector<int>& fds,
                     Clock::time_point deadline, std::string_view what);
  void send_all(std::string_view data, const std::vector<int>& fds, Clock::time_point deadline, std::string_view what);
  // The next whole message, reading as needed until `deadline`. `what` names the wait in errors.
  nlohmann::json next_message(Clock::time_point deadline, std::string_view what);
  // A whole message already received, if there is one.
  std::optional<nlohmann::json> pop_buffered();
  // Reads once what the socket has (waiting until `deadline` for something). False when nothing came in time.
  bool fill(Clock::time_point deadline, std::string_view what);
  void queue_event(nlohmann::json event);
  [[noreturn]] void fail_closed(std::string_view what, int err);

  UniqueFd fd_;
  std::string in_;           // bytes received and not yet parsed
  std::size_t scanned_ = 0;  // in_[0, scanned_) holds no newline
  std::deque<nlohmann::json> events_;
  nlohmann::json greeting_;
  std::uint64_t next_id_ = 1;
  bool closed_ = false;  // the peer hung up: every later call is UNAVAILABLE
  std::string closed_reason_;
};

// query-status's "status" ("prelaunch", "running", "paused", "inmigrate", "postmigrate", "shutdown", ...).
std::string qmp_status(QmpClient& qmp);

// Polls query-migrate (every 1-2 ms) until its status is "completed". "failed" becomes INTERNAL and "cancelled"
// CANCELLED, each with QEMU's error-desc; DEADLINE_EXCEEDED (naming the last status) after `timeout`.
void qmp_wait_migration(QmpClient& qmp, std::chrono::milliseconds timeout);

}  // namespace dsec::agent::qemu
