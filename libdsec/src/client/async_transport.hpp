// The asyncio core of a client: calls about sandboxes as non-blocking exchanges on one libcurl multi handle,
// driven by ONE I/O thread per client, however many calls are in flight. A call is what ClientCore::call_sandbox
// does (route to the sandbox's node, one HTTP exchange, retries with the same request id and body under one
// deadline, OutcomeUnknown when no retry can learn an exactly-once request's outcome), with the retry backoff a
// timer of the I/O thread instead of a sleeping thread. Completions are handed over on the I/O thread; the Python
// binding (bindings/python/_dsec_aio.cpp) passes them on to the asyncio loop.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "client/requests.hpp"
#include "client/transport.hpp"

namespace dsec::detail {

class ClientCore;

// A request about one sandbox (requests.hpp), as ClientCore::call_sandbox takes it, and what a streamed answer is
// handed to.
struct AsyncCall {
  explicit AsyncCall(SandboxRequest request_in = {}) : request(std::move(request_in)) {}

  SandboxRequest request;
  // A streamed answer: on_attempt runs as each attempt starts, on_body gets a 2xx answer's bytes as they arrive
  // (both on the I/O thread; what on_body throws ends the call with it, as a decoding error).
  std::function<void()> on_attempt;
  std::function<void(std::string_view)> on_body;
};

// How a call ended, on the I/O thread: its 2xx answer (error null), or the error call_sandbox would have thrown.
using AsyncDone = std::function<void(HttpResponse* response, std::exception_ptr error)>;

class AsyncTransport {
 public:
  // `after_events` (optional) runs on the I/O thread after each round of events in which calls ended or streamed,
  // so that their completions can be handed on together.
  explicit AsyncTransport(std::shared_ptr<ClientCore> core, std::function<void()> after_events = {});
  ~AsyncTransport();  // close()
  AsyncTransport(const AsyncTransport&) = delete;
  AsyncTransport& operator=(const AsyncTransport&) = delete;

  // Starts `call`; `done` runs once on the I/O thread when it ends, unless it is cancelled first. Returns its
  // ticket. FAILED_PRECONDITION once closed.
  std::uint64_t submit(AsyncCall call, AsyncDone done);
  // Takes the call's transfer off the multi handle (its connection is dropped) and forgets it: its done never
  // runs. What the request started on the agent is not stopped. A finished or unknown ticket is ignored.
  void cancel(std::uint64_t ticket);
  // Ends the I/O thread: calls in flight end with FAILED_PRECONDITION "closed". Idempotent.
  void close();
  // Calls submitted and not ended or cancelled yet.
  std::size_t in_flight() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsec::detail
