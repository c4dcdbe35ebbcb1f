#include "gateway/e2b/connect_rpc.hpp"

#include <algorithm>
#include <cctype>

#include <fmt/format.h>
#include <boost/beast/http/field.hpp>
#include <boost/beast/http/status.hpp>

namespace dsec::e2b {
namespace http = boost::beast::http;
using agent::HttpRequest;
using agent::HttpResponse;
using agent::std_view;

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

// The media type without parameters, lower case.
std::string media_type(const HttpRequest& request) {
  std::string type = lower(std_view(request[http::field::content_type]));
  if (auto semi = type.find(';'); semi != std::string::npos) type.resize(semi);
  while (!type.empty() && type.back() == ' ') type.pop_back();
  return type;
}

json parse_object(std::string_view text) {
  json message = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (message.is_discarded() || !message.is_object())
    throw RpcError("invalid_argument", "the request message is not a JSON object");
  return message;
}

}  // namespace

RpcError rpc_error(const Error& error) {
  switch (error.code()) {
    case Code::kCancelled:
      return RpcError("canceled", error.what());
    case Code::kInvalidArgument:
      return RpcError("invalid_argument", error.what());
    case Code::kDeadlineExceeded:
      return RpcError("deadline_exceeded", error.what());
    case Code::kNotFound:
      return RpcError("not_found", error.what());
    case Code::kAlreadyExists:
      return RpcError("already_exists", error.what());
    case Code::kPermissionDenied:
      return RpcError("permission_denied", error.what());
    case Code::kResourceExhausted:
      return RpcError("resource_exhausted", error.what());
    case Code::kFailedPrecondition:
      return RpcError("failed_precondition", error.what());
    case Code::kAborted:
      return RpcError("aborted", error.what());
    case Code::kOutOfRange:
      return RpcError("out_of_range", error.what());
    case Code::kUnimplemented:
      return RpcError("unimplemented", error.what());
    case Code::kUnavailable:
      return RpcError("unavailable", error.what());
    case Code::kDataLoss:
      return RpcError("data_loss", error.what());
    case Code::kUnauthenticated:
      return RpcError("unauthenticated", error.what());
    case Code::kInternal:
      return RpcError("internal", error.what());
    default:
      return RpcError("unknown", error.what());
  }
}

RpcError bad_field(const json::exception& e) {
  return RpcError("invalid_argument", fmt::format("a field of the request has the wrong type: {}", e.what()));
}

unsigned http_status_of(std::string_view code) {
  if (code == "canceled") return 499;
  if (code == "invalid_argument" || code == "failed_precondition" || code == "out_of_range") return 400;
  if (code == "deadline_exceeded") return 504;
  if (code == "not_found") return 404;
  if (code == "already_exists" || code == "aborted") return 409;
  if (code == "permission_denied") return 403;
  if (code == "resource_exhausted") return 429;
  if (code == "unimplemented") return 501;
  if (code == "unavailable") return 503;
  if (code == "unauthenticated") return 401;
  return 500;
}

json unary_request(const HttpRequest& request) {
  if (request.method() != http::verb::post) throw RpcError("unimplemented", "Connect calls are POSTs");
  const std::string type = media_type(request);
  if (type != "application/json")
    throw RpcError("invalid_argument",
                   type == "application/proto"
                       ? "this gateway speaks Connect's JSON codec only (application/json), not application/proto"
                       : "a unary call's Content-Type must be application/json");
  if (request.body().empty()) return json::object();
  return parse_object(request.body());
}

std::vector<json> stream_messages(const HttpRequest& request) {
  if (request.method() != http::verb::post) throw RpcError("unimplemented", "Connect calls are POSTs");
  if (media_type(request) != "application/connect+json")
    throw RpcError("invalid_argument", "a streaming call's Content-Type must be application/connect+json");
  const std::string& body = request.body();
  std::vector<json> messages;
  for (std::size_t at = 0; at < body.size();) {
    if (body.size() - at < 5) throw RpcError("invalid_argument", "the request is not Connect envelopes (a short one)");
    const auto byte = [&](std::size_t i) {
      return static_cast<std::uint32_t>(static_cast<unsigned char>(body[at + i]));
    };
    const std::uint32_t length = byte(1) << 24 | byte(2) << 16 | byte(3) << 8 | byte(4);
    if (length > body.size() - at - 5 || byte(0) > 1)
      throw RpcError("invalid_argument", "the request is not Connect envelopes (flags, length, message)");
    if (byte(0) & 0x01) throw RpcError("unimplemented", "compressed request messages are not supported");
    messages.push_back(parse_object(std::string_view(body).substr(at + 5, length)));
    at += 5 + length;
  }
  return messages;
}

json stream_request(const HttpRequest& request) {
  std::vector<json> messages = stream_messages(request);
  if (messages.size() != 1)
    throw RpcError("invalid_argument", "the request is not one Connect envelope (flags, length, one message)");
  return std::move(messages.front());
}

HttpResponse unary_answer(const json& message) {
  HttpResponse r{http::status::ok, 11};
  r.set(http::field::content_type, "application/json");
  r.body() = message.dump(-1, ' ', false, json::error_handler_t::replace);
  r.prepare_payload();
  return r;
}

HttpResponse unary_error(const RpcError& error) {
  HttpResponse r{static_cast<http::status>(http_status_of(error.code())), 11};
  r.set(http::field::content_type, "application/json");
  r.body() =
      json{{"code", error.code()}, {"message", error.what()}}.dump(-1, ' ', false, json::error_handler_t::replace);
  r.prepare_payload();
  return r;
}

std::optional<std::chrono::milliseconds> connect_timeout(const HttpRequest& request) {
  auto it = request.find("Connect-Timeout-Ms");
  if (it == request.end()) return std::nullopt;
  std::string_view v = std_view(it->value());
  if (v.empty() || v.size() > 10 || !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; }))
    throw RpcError("invalid_argument", "Connect-Timeout-Ms must be 1 to 10 digits");
  return std::chrono::milliseconds(std::stoll(std::string(v)));
}

std::chrono::milliseconds keepalive_interval(const HttpRequest& request) {
  auto it = request.find("Keepalive-Ping-Interval");
  if (it != request.end()) {
    std::string_view v = std_view(it->value());
    if (!v.empty() && v.size() <= 5 && std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      long seconds = std::stol(std::string(v));
      if (seconds >= 1) return std::chrono::seconds(seconds);
    }
  }
  return std::chrono::seconds(90);  // envd's own default
}

std::string envelope(std::uint8_t flags, std::string_view payload) {
  std::string out;
  out.reserve(payload.size() + 5);
  const auto n = static_cast<std::uint32_t>(payload.size());
  out.push_back(static_cast<char>(flags));
  out.push_back(static_cast<char>(n >> 24 & 0xff));
  out.push_back(static_cast<char>(n >> 16 & 0xff));
  out.push_back(static_cast<char>(n >> 8 & 0xff));
  out.push_back(static_cast<char>(n & 0xff));
  out.append(payload);
  return out;
}

void ServerStream::begin() {
  if (out_.begun()) return;
  HttpResponse head{http::status::ok, 11};
  head.set(http::field::content_type, "application/connect+json");
  out_.begin(std::move(head));
}

bool ServerStream::send(const json& message) {
  if (gone_ || finished_) return false;
  begin();
  if (!out_.write(envelope(0, message.dump(-1, ' ', false, json::error_handler_t::replace)))) gone_ = true;
  return !gone_;
}

void ServerStream::finish(const std::optional<RpcError>& error) {
  if (finished_) return;
  finished_ = true;
  if (gone_) return;
  begin();
  json end = json::object();
  if (error) end["error"] = json{{"code", error->code()}, {"message", error->what()}};
  if (!out_.write(envelope(0x02, end.dump(-1, ' ', false, json::error_handler_t::replace)))) gone_ = true;
}

}  // namespace dsec::e2b
