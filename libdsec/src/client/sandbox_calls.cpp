// Calls about one sandbox: its information, TTL and destruction, its network and ports, sleep and wake, its screen
// and its files.
#include <exception>
#include <map>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "client/client_core_internal.hpp"
#include "common/network_rules.hpp"
#include "common/protocol.hpp"
#include "common/protocol/screen.hpp"

namespace dsec::detail {
namespace {

using std::chrono::milliseconds;

// A sleep pushes the sandbox's memory out to swap, which takes as long as writing it (about 10 s per GiB on a
// plain disk); the agent gives up after its --sleep-reclaim-timeout, 60 s by default. Each exchange may take that
// much more than request_timeout.
constexpr milliseconds kSleepTime{60'000};

}  // namespace

SandboxInfo ClientCore::get(const std::string& id) {
  auto r = call_sandbox(id, http_request("GET", sandbox_path(id)));
  return protocol::decode_sandbox_info(parse_json(r, "GET /v1/sandboxes/{id}"));
}

NetworkPolicy ClientCore::network(const std::string& id) {
  auto r = call_sandbox(id, http_request("GET", sandbox_path(id, "/network")));
  return protocol::decode_network(parse_json(r, "GET /v1/sandboxes/{id}/network"));
}

NetworkPolicy ClientCore::set_network(const std::string& id, const NetworkPolicy& policy) {
  network::validate(policy);  // a malformed policy never leaves the client
  // Idempotent (the same policy twice is the same state): retried like a read.
  auto r = call_sandbox(id, http_request("PUT", sandbox_path(id, "/network"), protocol::encode(policy).dump(), kJson));
  return protocol::decode_network(parse_json(r, "PUT /v1/sandboxes/{id}/network"));
}

SandboxInfo ClientCore::set_ttl(const std::string& id, std::chrono::seconds ttl) {
  if (ttl.count() < 0 || ttl.count() > protocol::kMaxTtlSeconds)
    throw Error(Code::kInvalidArgument, fmt::format("ttl: {} s is not from 0 to one year", ttl.count()));
  // A retry moves the deadline by the time between the two: retried like a read.
  auto r = call_sandbox(
      id, http_request("PUT", sandbox_path(id, "/ttl"), protocol::json{{"ttl", ttl.count()}}.dump(), kJson));
  return protocol::decode_sandbox_info(parse_json(r, "PUT /v1/sandboxes/{id}/ttl"));
}

NetworkUsage ClientCore::network_usage(const std::string& id) {
  auto r = call_sandbox(id, http_request("GET", sandbox_path(id, "/network/usage")));
  return protocol::decode_network_usage(parse_json(r, "GET /v1/sandboxes/{id}/network/usage"));
}

std::string ClientCore::screenshot(const std::string& id) {
  auto r = call_sandbox(id, http_request("GET", sandbox_path(id, "/screen")));
  if (r.content_type != "image/png")
    throw Error(Code::kDataLoss, fmt::format("GET /v1/sandboxes/{{id}}/screen: the answer is {}, not a PNG",
                                             r.content_type.empty() ? "untyped" : r.content_type));
  return std::move(r.body);
}

ScreenState ClientCore::screen_state(const std::string& id) {
  auto r = call_sandbox(id, http_request("GET", sandbox_path(id, "/screen/state")));
  return protocol::decode_screen_state(parse_json(r, "GET /v1/sandboxes/{id}/screen/state"));
}

ScreenState ClientCore::input(const std::string& id, const std::vector<InputAction>& actions) {
  const std::string body = protocol::encode_input(actions).dump();
  (void)protocol::decode_input(protocol::json::parse(body));  // a malformed action never leaves the client
  // Not retried once sent: a lost answer would press the keys twice. Typing and waits take their time on top.
  std::chrono::milliseconds paced{0};
  for (const InputAction& a : actions) {
    if (a.type == InputAction::Type::kWait) paced += std::chrono::milliseconds(a.interval_ms);
    if (a.type == InputAction::Type::kType)
      paced += std::chrono::milliseconds(std::uint64_t{a.interval_ms ? a.interval_ms : 30} * a.text.size());
  }
  auto deadline = deadline_after(paced);
  auto r = call(route(id, deadline), http_request("POST", sandbox_path(id, "/screen/input"), body, kJson), deadline);
  return protocol::decode_screen_state(parse_json(r, "POST /v1/sandboxes/{id}/screen/input"));
}

std::string ClientCore::vnc(const std::string& id) {
  // Idempotent: the same endpoint while it lasts.
  auto r = call_sandbox(id, http_request("POST", sandbox_path(id, "/screen/vnc"), "{}", kJson));
  const protocol::json answer = parse_json(r, "POST /v1/sandboxes/{id}/screen/vnc");
  auto it = answer.find("address");
  if (it == answer.end() || !it->is_string())
    throw Error(Code::kDataLoss, "POST /v1/sandboxes/{id}/screen/vnc: the answer names no address");
  return it->get<std::string>();
}

void ClientCore::stop_vnc(const std::string& id) {
  call_sandbox(id, http_request("DELETE", sandbox_path(id, "/screen/vnc")));
}

std::string ClientCore::expose(const std::string& id, std::uint32_t port) {
  if (port < 1 || port > 65535) throw Error(Code::kInvalidArgument, fmt::format("port: {} is not a TCP port", port));
  // Not retried blindly: a lost answer would expose the port twice (the retry is refused as exposed already).
  auto deadline = deadline_after();
  auto r =
      call(route(id, deadline),
           http_request("POST", sandbox_path(id, "/ports"), protocol::json{{"port", port}}.dump(), kJson), deadline);
  const protocol::json answer = parse_json(r, "POST /v1/sandboxes/{id}/ports");
  auto it = answer.find("address");
  if (it == answer.end() || !it->is_string())
    throw Error(Code::kDataLoss, "POST /v1/sandboxes/{id}/ports: the answer names no address");
  return it->get<std::string>();
}

void ClientCore::unexpose(const std::string& id, std::uint32_t port) {
  call_sandbox(id, http_request("DELETE", sandbox_path(id, fmt::format("/ports?port={}", port))));
}

std::map<std::uint32_t, std::string> ClientCore::exposed(const std::string& id) {
  auto r = call_sandbox(id, http_request("GET", sandbox_path(id, "/ports")));
  std::map<std::uint32_t, std::string> out;
  const protocol::json answer = parse_json(r, "GET /v1/sandboxes/{id}/ports");
  try {
    for (const auto& p : answer.at("ports"))
      out[p.at("port").get<std::uint32_t>()] = p.at("address").get<std::string>();
  } catch (const protocol::json::exception& e) {
    throw Error(Code::kDataLoss, fmt::format("GET /v1/sandboxes/{{id}}/ports: a malformed answer: {}", e.what()));
  }
  return out;
}

void ClientCore::destroy(const std::string& id) {
  try {
    call_sandbox(id, http_request("DELETE", sandbox_path(id)));
  } catch (const Error& e) {
    if (e.code() != Code::kNotFound) throw;
  }
}

SleepResult ClientCore::sleep_or_wake(const std::string& id, bool sleep) {
  // Every attempt of this call carries the same request id: when an answer is lost and the call is retried, the
  // agent answers the retry as it answered the first attempt instead of "already sleeping".
  const std::string body = protocol::json{{"request_id", random_request_id()}}.dump();
  const HttpRequest request = http_request("POST", sandbox_path(id, sleep ? "/sleep" : "/wake"), body, kJson);
  const auto deadline = deadline_after(kSleepTime);
  auto r = retrying(deadline, [&] {
    try {
      return call(route(id, deadline), request, deadline, kSleepTime);
    } catch (const TransportError& e) {
      // An exchange that timed out is retried too: the agent answers the same request id with the first attempt's
      // outcome (waiting for it if it still runs), so a retry cannot sleep or wake twice.
      if (e.code() == Code::kDeadlineExceeded && SteadyClock::now() < deadline)
        throw Error(Code::kUnavailable, std::string(e.what()) + " (retried with the same request id)", true);
      throw;
    }
  });
  return decode_sleep_result(r, sleep);
}

SleepResult decode_sleep_result(const HttpResponse& r, bool sleep) {
  const char* what = sleep ? "POST /v1/sandboxes/{id}/sleep" : "POST /v1/sandboxes/{id}/wake";
  protocol::json j = parse_json(r, what);
  SleepResult out;
  out.info = protocol::decode_sandbox_info(j);
  try {
    out.memory_before_bytes = j.at("memory_before_bytes").get<std::uint64_t>();
    out.memory_after_bytes = j.at("memory_after_bytes").get<std::uint64_t>();
    out.memory_released_bytes = j.at("memory_released_bytes").get<std::uint64_t>();
    out.seconds = j.at("seconds").get<double>();
    out.swap_bytes = j.value("swap_bytes", std::uint64_t{0});
  } catch (const std::exception& e) {
    throw Error(Code::kInternal, fmt::format("{}: malformed answer: {}", what, e.what()));
  }
  return out;
}

void ClientCore::write_file(const std::string& id, std::string_view path, std::string_view data, unsigned mode) {
  if (mode > 07777) throw Error(Code::kInvalidArgument, fmt::format("mode: {:#o} is above 07777", mode));
  std::string target = sandbox_path(id, fmt::format("/files?path={}&mode={:04o}", url_escape(path), mode));
  call_sandbox(id, http_request("PUT", target, data, kOctets));
}

std::string ClientCore::read_file(const std::string& id, std::string_view path) {
  auto r = call_sandbox(id, http_request("GET", sandbox_path(id, fmt::format("/files?path={}", url_escape(path)))));
  if (r.content_type.starts_with(kTar))
    throw Error(Code::kInvalidArgument,
                fmt::format("{} in sandbox {} is a directory (download_tar reads a directory)", path, id));
  return std::move(r.body);
}

void ClientCore::upload_tar(const std::string& id, std::string_view dir, std::string_view tar_bytes) {
  std::string target = sandbox_path(id, fmt::format("/files?path={}", url_escape(dir)));
  call_sandbox(id, http_request("PUT", target, tar_bytes, kTar));
}

std::string ClientCore::download_tar(const std::string& id, std::string_view dir) {
  return call_sandbox(id,
                      http_request("GET", sandbox_path(id, fmt::format("/files?path={}&format=tar", url_escape(dir)))))
      .body;
}

}  // namespace dsec::detail
