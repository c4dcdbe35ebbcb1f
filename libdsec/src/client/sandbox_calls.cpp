// Calls about one sandbox: its information, TTL and destruction, its network and ports, sleep and wake, its screen
// and its files. Each sends its request from requests.hpp and decodes the answer.
#include <map>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "common/protocol.hpp"
#include "common/protocol/screen.hpp"

namespace dsec::detail {
namespace {

// An {"address": ...} answer (an exposed port's, a VNC server's): DATA_LOSS when it names none.
std::string address_of(const HttpResponse& r, std::string_view what) {
  const protocol::json answer = parse_json(r, what);
  auto it = answer.find("address");
  if (it == answer.end() || !it->is_string())
    throw Error(Code::kDataLoss, fmt::format("{}: the answer names no address", what));
  return it->get<std::string>();
}

}  // namespace

SandboxInfo ClientCore::get(const std::string& id) {
  const SandboxRequest request = requests::info(id);
  return answers::sandbox_info(call_sandbox(request), request.what);
}

NetworkPolicy ClientCore::network(const std::string& id) {
  const SandboxRequest request = requests::network(id);
  return protocol::decode_network(parse_json(call_sandbox(request), request.what));
}

NetworkPolicy ClientCore::set_network(const std::string& id, const NetworkPolicy& policy) {
  const SandboxRequest request = requests::set_network(id, policy);
  return protocol::decode_network(parse_json(call_sandbox(request), request.what));
}

SandboxInfo ClientCore::set_ttl(const std::string& id, std::chrono::seconds ttl) {
  const SandboxRequest request = requests::set_ttl(id, ttl);
  return answers::sandbox_info(call_sandbox(request), request.what);
}

NetworkUsage ClientCore::network_usage(const std::string& id) {
  const SandboxRequest request = requests::network_usage(id);
  return protocol::decode_network_usage(parse_json(call_sandbox(request), request.what));
}

std::string ClientCore::screenshot(const std::string& id) {
  auto r = call_sandbox(requests::screenshot(id));
  if (r.content_type != "image/png")
    throw Error(Code::kDataLoss, fmt::format("GET /v1/sandboxes/{{id}}/screen: the answer is {}, not a PNG",
                                             r.content_type.empty() ? "untyped" : r.content_type));
  return std::move(r.body);
}

ScreenState ClientCore::screen_state(const std::string& id) {
  const SandboxRequest request = requests::screen_state(id);
  return protocol::decode_screen_state(parse_json(call_sandbox(request), request.what));
}

ScreenState ClientCore::input(const std::string& id, const std::vector<InputAction>& actions) {
  const SandboxRequest request = requests::screen_input(id, actions);
  // Sent once (a lost answer would press the keys twice). Typing and waits take their time on top.
  std::chrono::milliseconds paced{0};
  for (const InputAction& a : actions) {
    if (a.type == InputAction::Type::kWait) paced += std::chrono::milliseconds(a.interval_ms);
    if (a.type == InputAction::Type::kType)
      paced += std::chrono::milliseconds(std::uint64_t{a.interval_ms ? a.interval_ms : 30} * a.text.size());
  }
  return protocol::decode_screen_state(parse_json(send_once(request, deadline_after(paced)), request.what));
}

VncEndpoint ClientCore::vnc(const std::string& id) {
  const SandboxRequest request = requests::vnc(id);
  const HttpResponse r = call_sandbox(request);
  VncEndpoint out{address_of(r, request.what), {}};
  const protocol::json answer = parse_json(r, request.what);
  if (auto it = answer.find("password"); it != answer.end() && it->is_string()) out.password = it->get<std::string>();
  return out;
}

void ClientCore::stop_vnc(const std::string& id) { call_sandbox(requests::stop_vnc(id)); }

std::string ClientCore::expose(const std::string& id, std::uint32_t port) {
  // Sent once: a lost answer would expose the port twice (the retry is refused as exposed already).
  const SandboxRequest request = requests::expose(id, port);
  return address_of(send_once(request, deadline_after()), request.what);
}

void ClientCore::unexpose(const std::string& id, std::uint32_t port) { call_sandbox(requests::unexpose(id, port)); }

std::map<std::uint32_t, std::string> ClientCore::exposed(const std::string& id) {
  const SandboxRequest request = requests::exposed(id);
  const protocol::json answer = parse_json(call_sandbox(request), request.what);
  std::map<std::uint32_t, std::string> out;
  try {
    for (const auto& p : answer.at("ports"))
      out[p.at("port").get<std::uint32_t>()] = p.at("address").get<std::string>();
  } catch (const protocol::json::exception& e) {
    throw Error(Code::kDataLoss, fmt::format("{}: a malformed answer: {}", request.what, e.what()));
  }
  return out;
}

void ClientCore::destroy(const std::string& id) {
  try {
    call_sandbox(requests::destroy(id));
  } catch (const Error& e) {
    if (e.code() != Code::kNotFound) throw;
  }
}

SleepResult ClientCore::sleep_or_wake(const std::string& id, bool sleep) {
  return answers::sleep_result(call_sandbox(requests::sleep_or_wake(id, sleep)), sleep);
}

void ClientCore::write_file(const std::string& id, std::string_view path, std::string_view data, unsigned mode) {
  call_sandbox(requests::write_file(id, path, data, mode));
}

std::string ClientCore::read_file(const std::string& id, std::string_view path) {
  return answers::file(call_sandbox(requests::read_file(id, path)), path, id);
}

void ClientCore::upload_tar(const std::string& id, std::string_view dir, std::string_view tar_bytes) {
  call_sandbox(requests::upload_tar(id, dir, tar_bytes));
}

std::string ClientCore::download_tar(const std::string& id, std::string_view dir) {
  return call_sandbox(requests::download_tar(id, dir)).body;
}

}  // namespace dsec::detail
