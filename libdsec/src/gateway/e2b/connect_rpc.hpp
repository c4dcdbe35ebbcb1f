// The Connect protocol (connectrpc.com/docs/protocol) as E2B's SDKs speak it to a sandbox's envd: JSON codec only
// (the SDKs ask for nothing else), unary calls and server streams over HTTP/1.1.
//
// Unary: POST with a JSON message; 200 and a JSON message, or a non-200 status and {"code": "not_found", "message":
// ...}. Server stream: the request is one envelope, the answer is 200 with envelopes ([flags][u32 big-endian
// length][JSON]), each flushed as it is made, and always ends with an end-stream envelope (flags 0x02) carrying {}
// or {"error": {...}}: a stream's error never changes its status.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "dsec/error.hpp"
#include "http/http.hpp"

namespace dsec::e2b {

using json = nlohmann::json;

// A Connect error: its code as the protocol spells it ("not_found", "invalid_argument", ...) and a message.
class RpcError : public std::runtime_error {
 public:
  RpcError(std::string code, const std::string& message) : std::runtime_error(message), code_(std::move(code)) {}
  const std::string& code() const noexcept { return code_; }

 private:
  std::string code_;
};

// dsec's error as the Connect code of the same meaning (the codes are gRPC's in both).
RpcError rpc_error(const Error& error);
// A message field of the wrong type (nlohmann's type errors as the handlers read fields): invalid_argument.
RpcError bad_field(const json::exception& e);
// The HTTP status of a unary answer with this code.
unsigned http_status_of(std::string_view code);

// The request's JSON message: a unary body, or a stream request's one envelope. INVALID_ARGUMENT-coded RpcError for
// a wrong content type, a malformed envelope or a body that is not a JSON object.
json unary_request(const agent::HttpRequest& request);
json stream_request(const agent::HttpRequest& request);
// A client stream's messages (every envelope of the body, in order; the body is whole once the handler runs).
std::vector<json> stream_messages(const agent::HttpRequest& request);

agent::HttpResponse unary_answer(const json& message);
agent::HttpResponse unary_error(const RpcError& error);

// Connect-Timeout-Ms: nullopt when absent; invalid_argument when not 1 to 10 digits.
std::optional<std::chrono::milliseconds> connect_timeout(const agent::HttpRequest& request);
// Keepalive-Ping-Interval (seconds; E2B's SDKs send 50): how long a stream may stay silent before a keepalive.
std::chrono::milliseconds keepalive_interval(const agent::HttpRequest& request);

// One envelope: flags, big-endian length, payload.
std::string envelope(std::uint8_t flags, std::string_view payload);

// A server stream's answer. The head goes out with the first message (or with finish()).
class ServerStream {
 public:
  explicit ServerStream(agent::ResponseStream& out) : out_(out) {}
  // False once the client is gone (nothing more reaches it).
  bool send(const json& message);
  // The end-stream envelope, with the error if there is one. Once.
  void finish(const std::optional<RpcError>& error = std::nullopt);
  // The client is gone: a write failed, or its side of the connection is closed.
  bool gone() {
    if (!gone_ && out_.begun() && out_.client_gone()) gone_ = true;
    return gone_;
  }

 private:
  void begin();
  agent::ResponseStream& out_;
  bool gone_ = false;
  bool finished_ = false;
};

// A unary call: `call(message)`'s answer, or its error (RpcError or dsec's) as Connect answers one.
template <typename Call>
agent::HttpResponse serve_unary(const agent::HttpRequest& request, Call&& call) {
  try {
    return unary_answer(call(unary_request(request)));
  } catch (const RpcError& e) {
    return unary_error(e);
  } catch (const Error& e) {
    return unary_error(rpc_error(e));
  } catch (const json::exception& e) {  // a field of the wrong type
    return unary_error(bad_field(e));
  }
}

template <typename Parse, typename Body>
agent::HttpResponse serve_parsed_stream(const agent::HttpRequest& request, agent::ResponseStream& stream, Parse parse,
                                        Body&& body) {
  ServerStream out(stream);
  try {
    body(parse(request), out);
  } catch (const RpcError& e) {
    out.finish(e);
  } catch (const Error& e) {
    out.finish(rpc_error(e));
  } catch (const json::exception& e) {  // a field of the wrong type
    out.finish(bad_field(e));
  }
  return {};
}

// A streamed answer: `parse(request)` (stream_request: a server stream's one message; stream_messages: a client
// stream's all) goes to `body(..., out)`, which sends its messages and finishes; what either throws ends the stream
// with the error (the status stays 200).
template <typename Body>
agent::HttpResponse serve_stream(const agent::HttpRequest& request, agent::ResponseStream& stream, Body&& body) {
  return serve_parsed_stream(request, stream, stream_request, std::forward<Body>(body));
}
template <typename Body>
agent::HttpResponse serve_client_stream(const agent::HttpRequest& request, agent::ResponseStream& stream, Body&& body) {
  return serve_parsed_stream(request, stream, stream_messages, std::forward<Body>(body));
}

}  // namespace dsec::e2b
