// The client's side of a streaming exec: the agent's NDJSON body (protocol v1, "stream": true) decoded as it
// arrives. Pure functions over bytes, so they are tested without a socket.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "dsec/error.hpp"
#include "dsec/exec.hpp"

namespace dsec::detail {

// Splits a byte stream into '\n'-terminated lines, whatever the pieces it arrives in. A '\r' before the '\n' is
// dropped; empty lines are skipped. A line longer than max_line is INTERNAL (the agent never sends one).
class LineSplitter {
 public:
  explicit LineSplitter(std::size_t max_line) : max_line_(max_line) {}
  void feed(std::string_view bytes, const std::function<void(std::string_view line)>& on_line);
  // Bytes of an unfinished last line.
  std::size_t pending() const noexcept { return partial_.size(); }

 private:
  std::size_t max_line_;
  std::string partial_;
};

// Output callback of a streaming exec: fd 1 (stdout) or 2 (stderr), and the bytes.
using ExecOutputCallback = std::function<void(int fd, std::string_view data)>;

// Decodes the NDJSON lines of a streaming exec: {"stdout": b64} / {"stderr": b64} go to the callback (what it
// throws propagates), then one {"result": ExecResult} or {"error": {...}} ends the body.
class ExecStreamDecoder {
 public:
  static constexpr std::size_t kMaxLine = 64u << 20;

  explicit ExecStreamDecoder(ExecOutputCallback on_output) : on_output_(std::move(on_output)), lines_(kMaxLine) {}
  void feed(std::string_view bytes);
  // Once the body ended: the result, or the agent's error thrown as dsec::Error (never retryable: the command ran).
  // A body without its final line is UNAVAILABLE (the connection broke mid-exec).
  ExecResult finish();
  bool done() const noexcept { return result_.has_value() || error_.has_value(); }

 private:
  void line(std::string_view text);

  ExecOutputCallback on_output_;
  LineSplitter lines_;
  std::optional<ExecResult> result_;
  std::optional<Error> error_;
};

// A streamed command's output over its attempts: an exactly-once request's retry replays the output from its
// start, and the caller's on_output gets only the bytes it had not had.
class StreamReplayFilter {
 public:
  // A new attempt's answer starts.
  void new_attempt() noexcept { seen_[0] = seen_[1] = 0; }
  // The part of `data` (stream `fd`: 1 or 2) not delivered by an earlier attempt; counted as delivered.
  std::string_view fresh(int fd, std::string_view data) noexcept;

 private:
  std::uint64_t delivered_[2] = {0, 0};  // over every attempt
  std::uint64_t seen_[2] = {0, 0};       // this attempt's
};

// A streamed command's answer over its attempts (ClientCore::stream_command, the asyncio core): each attempt's body
// decoded as it arrives, and on_output handed only the bytes no earlier attempt delivered.
class StreamedCommand {
 public:
  explicit StreamedCommand(ExecOutputCallback on_output) : on_output_(std::move(on_output)) {}
  // An attempt's answer starts: decoding starts again from its first byte.
  void new_attempt();
  // The current attempt's body, piece by piece. What on_output throws propagates.
  void feed(std::string_view bytes) { decoder_->feed(bytes); }
  // Once the last attempt's body ended: as ExecStreamDecoder::finish.
  ExecResult finish() { return decoder_->finish(); }

 private:
  ExecOutputCallback on_output_;
  StreamReplayFilter replay_;
  std::optional<ExecStreamDecoder> decoder_;
};

}  // namespace dsec::detail
