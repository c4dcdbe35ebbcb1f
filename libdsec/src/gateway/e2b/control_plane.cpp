#include "gateway/e2b/control_plane.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <boost/beast/http/field.hpp>
#include <boost/beast/http/status.hpp>
#include <nlohmann/json.hpp>

#include "common/protocol.hpp"
#include "http/query.hpp"
#include "http/tokens.hpp"

namespace dsec::e2b {
namespace http = boost::beast::http;
using agent::HttpRequest;
using agent::HttpResponse;
using json = nlohmann::json;

namespace {

HttpResponse json_answer(unsigned status, const json& body) {
  HttpResponse r{static_cast<http::status>(status), 11};
  r.set(http::field::content_type, "application/json");
  r.body() = body.dump(-1, ' ', false, json::error_handler_t::replace);
  r.prepare_payload();
  return r;
}

// 204 No Content: the SDKs parse anything else as JSON.
HttpResponse no_content() {
  HttpResponse r{http::status::no_content, 11};
  r.prepare_payload();
  return r;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The body of a POST as a JSON object; an empty body is {}.
json body_object(const HttpRequest& request) {
  if (request.body().empty()) return json::object();
  json body = json::parse(request.body(), nullptr, false);
  if (body.is_discarded() || !body.is_object())
    throw Error(Code::kInvalidArgument, "the request body is not a JSON object");
  return body;
}

std::map<std::string, std::string> string_map(const json& body, const char* field) {
  std::map<std::string, std::string> out;
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return out;
  if (!it->is_object()) throw Error(Code::kInvalidArgument, fmt::format("{}: must be an object of strings", field));
  for (const auto& [k, v] : it->items()) {
    if (!v.is_string()) throw Error(Code::kInvalidArgument, fmt::format("{}.{}: must be a string", field, k));
    out.emplace(k, v.get<std::string>());
  }
  return out;
}

// A timeout in whole seconds (E2B's SDKs send ceil(ms / 1000)).
std::optional<std::chrono::seconds> timeout_field(const json& body) {
  auto it = body.find("timeout");
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer() || it->get<std::int64_t>() < 0 || it->get<std::int64_t>() > protocol::kMaxTtlSeconds)
    throw Error(Code::kInvalidArgument, "timeout: must be whole seconds from 0 to one year");
  return std::chrono::seconds(it->get<std::int64_t>());
}

std::string template_of(const SandboxInfo& info) {
  if (auto it = info.labels.find(kTemplateLabel); it != info.labels.end()) return it->second;
  std::string image = info.image;
  if (auto at = image.find('@'); at != std::string::npos) image.resize(at);
  return image;
}

json metadata_of(const SandboxInfo& info) {
  json out = json::object();
  for (const auto& [k, v] : info.labels)
    if (k.rfind(kLabelPrefix, 0) != 0) out[k] = v;
  return out;
}

bool alive(const SandboxInfo& info) { return info.state == "running" || info.state == "sleeping"; }

// A sandbox as create and connect answer it.
json sandbox_json(const SandboxInfo& info, const GatewayOptions& options) {
  json out{{"sandboxID", info.id},
           {"templateID", template_of(info)},
           {"alias", template_of(info)},
           {"clientID", info.node},
           {"envdVersion", kEnvdVersion},
           {"trafficAccessToken", nullptr},
           {"domain", options.domain.empty() ? json(nullptr) : json(options.domain)}};
  if (auto it = info.labels.find(kAccessTokenLabel); it != info.labels.end()) out["envdAccessToken"] = it->second;
  return out;
}

// A sandbox as get and list answer it.
json detail_json(const SandboxInfo& info, const GatewayOptions& options) {
  json out = sandbox_json(info, options);
  out["startedAt"] = rfc3339(info.created_at);
  // No TTL: no end; E2B has no such state, so a far date says it.
  out["endAt"] = rfc3339(info.expires_at > 0 ? info.expires_at : info.created_at + 100.0 * 365 * 86400);
  out["state"] = info.state == "sleeping" ? "paused" : "running";
  out["cpuCount"] = std::max(1, static_cast<int>(std::ceil(info.resources.cpu)));
  out["memoryMB"] = info.resources.memory_bytes >> 20;
  out["diskSizeMB"] = info.resources.disk_bytes >> 20;
  out["metadata"] = metadata_of(info);
  return out;
}

SandboxInfo live_info(Client& client, const std::string& id) {
  SandboxInfo info = client.attach(id).info();
  if (!alive(info))
    throw Error(Code::kNotFound, info.state == "failed" ? fmt::format("sandbox {} failed: {}", id, info.message)
                                                        : fmt::format("sandbox {} not found", id));
  return info;
}

std::vector<std::string> string_list(const json& network, const char* field) {
  std::vector<std::string> out;
  auto it = network.find(field);
  if (it == network.end() || it->is_null()) return out;
  if (!it->is_array()) throw Error(Code::kInvalidArgument, fmt::format("network.{}: must be a list", field));
  for (const auto& v : *it) {
    if (!v.is_string())
      throw Error(Code::kInvalidArgument, fmt::format("network.{}: must be a list of strings", field));
    out.push_back(v.get<std::string>());
  }
  return out;
}

// E2B's network settings as a dsec policy. dsec's egress is an allowlist (first matching rule decides, nothing
// else passes, names resolve only when a rule allows them), which is what E2B means by allowOut with everything else
// denied (denyOut ["0.0.0.0/0"], or allow_internet_access false): E2B's allowOut always wins over denyOut. Without
// a deny-all, E2B's lists change nothing: nullopt, the default stands. What cannot be said so is refused.
std::optional<NetworkPolicy> network_policy(const json& body) {
  const json network = body.contains("network") && body["network"].is_object() ? body["network"] : body;
  for (const char* field : {"rules", "egressProxy", "maskRequestHost", "httpsPorts"}) {
    auto f = network.find(field);
    if (f != network.end() && !f->is_null() && !f->empty())
      throw Error(Code::kInvalidArgument,
                  fmt::format("network.{}: not supported by the dsec gateway (docs/e2b.md)", field));
  }
  std::optional<bool> internet;
  if (auto it = body.find("allow_internet_access"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) throw Error(Code::kInvalidArgument, "allow_internet_access: must be true or false");
    internet = it->get<bool>();
  }
  const auto allow = string_list(network, "allowOut"), deny = string_list(network, "denyOut");
  const bool deny_all = internet == false || std::find(deny.begin(), deny.end(), "0.0.0.0/0") != deny.end();
  if (!deny_all && !deny.empty())
    throw Error(Code::kInvalidArgument,
                "network.denyOut: a dsec sandbox's egress is an allowlist: deny everything (\"0.0.0.0/0\") and list "
                "what is allowed in allowOut");
  NetworkPolicy policy;
  if (!deny_all) {
    if (!internet.has_value()) return std::nullopt;
    policy.mode = "open";
    return policy;
  }
  policy.mode = allow.empty() ? "none" : "egress";
  for (const auto& entry : allow) {
    NetworkRule r;
    const bool address = !entry.empty() && (std::isdigit(static_cast<unsigned char>(entry[0])) != 0);
    (address ? r.cidr : r.host) = entry;
    policy.rules.push_back(std::move(r));
  }
  return policy;
}

HttpResponse create(Client& client, const GatewayOptions& options, const HttpRequest& request) {
  json body = body_object(request);
  SandboxSpec spec;
  auto t = body.find("templateID");
  if (t == body.end() || !t->is_string() || t->get<std::string>().empty())
    throw Error(Code::kInvalidArgument, "templateID: a template (a dsec image name) is required");
  spec.image = t->get<std::string>();
  spec.ttl = timeout_field(body).value_or(options.default_timeout);
  if (spec.ttl.count() == 0) spec.ttl = options.default_timeout;
  for (auto& [k, v] : string_map(body, "metadata")) {
    if (k.rfind(kLabelPrefix, 0) == 0)
      throw Error(Code::kInvalidArgument,
                  fmt::format("metadata.{}: keys starting with '{}' are the gateway's", k, kLabelPrefix));
    spec.labels.emplace(k, v);
  }
  for (auto& [k, v] : string_map(body, "envVars")) spec.env.emplace(k, v);
  if (auto it = body.find("network"); it != body.end() && !it->is_null() && !it->is_object())
    throw Error(Code::kInvalidArgument, "network: must be an object");
  spec.network.mode = options.network;
  if (auto policy = network_policy(body)) spec.network = *policy;
  if (auto it = body.find("autoPause"); it != body.end() && it->is_boolean() && it->get<bool>())
    throw Error(Code::kInvalidArgument,
                "autoPause: not supported by the dsec gateway: a dsec sandbox is destroyed at the end of its timeout");
  for (const char* field : {"mcp", "volumeMounts"}) {
    auto it = body.find(field);
    if (it != body.end() && !it->is_null() && !it->empty())
      throw Error(Code::kInvalidArgument, fmt::format("{}: not supported by the dsec gateway", field));
  }
  spec.labels[kTemplateLabel] = spec.image;
  spec.labels[kAccessTokenLabel] = agent::auth::new_token();
  // The answer is made of what the create sent: no second call to the agent on the create's path.
  SandboxInfo info;
  info.id = client.create(spec).release();            // it lives until its timeout or a kill
  info.node = info.id.substr(0, info.id.rfind('-'));  // ids are "<node>-<random>"
  info.image = spec.image;
  info.labels = spec.labels;
  return json_answer(201, sandbox_json(info, options));
}

// Metadata filter of a list: "k=v&k2=v2" with each key and value URI-encoded once more (docs/e2b.md).
Labels metadata_filter(const std::string& text) {
  Labels labels;
  if (text.empty()) return labels;
  const agent::Query pairs = agent::parse_query(text);
  for (const auto& [k, v] : pairs.items())
    labels[agent::percent_decode(k, "metadata")] = agent::percent_decode(v, "metadata");
  return labels;
}

HttpResponse list(Client& client, const GatewayOptions& options, const agent::Query& query) {
  bool running = true, paused = true;
  if (auto state = query.get("state"); state && !state->empty()) {
    running = paused = false;
    std::string_view rest = *state;
    while (!rest.empty()) {
      auto comma = rest.find(',');
      std::string_view s = rest.substr(0, comma);
      if (s == "running") running = true;
      else if (s == "paused") paused = true;
      else throw Error(Code::kInvalidArgument, fmt::format("state: '{}' is neither running nor paused", s));
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    }
  }
  std::size_t limit = 100;
  if (auto l = query.get("limit"); l && !l->empty()) {
    if (l->size() > 6 || !std::all_of(l->begin(), l->end(), [](char c) { return c >= '0' && c <= '9'; }) ||
        std::stoul(*l) == 0)
      throw Error(Code::kInvalidArgument, "limit: must be a positive whole number");
    limit = std::min<std::size_t>(std::stoul(*l), 1000);
  }
  std::vector<SandboxInfo> found;
  for (auto& info : client.list(metadata_filter(query.get("metadata").value_or(""))))
    if ((running && info.state == "running") || (paused && info.state == "sleeping")) found.push_back(std::move(info));
  // Pages follow creation order; a page's token names the last sandbox it held, so it stays valid while sandboxes
  // come and go.
  auto key = [](const SandboxInfo& i) { return fmt::format("{:017.6f}_{}", i.created_at, i.id); };
  std::sort(found.begin(), found.end(), [&](const auto& a, const auto& b) { return key(a) < key(b); });
  std::size_t first = 0;
  if (auto token = query.get("nextToken"); token && !token->empty())
    first = static_cast<std::size_t>(
        std::upper_bound(found.begin(), found.end(), *token,
                         [&](const std::string& t, const SandboxInfo& i) { return t < key(i); }) -
        found.begin());
  json page = json::array();
  std::size_t i = first;
  for (; i < found.size() && page.size() < limit; ++i) page.push_back(detail_json(found[i], options));
  HttpResponse r = json_answer(200, page);
  if (i < found.size()) r.set("X-Next-Token", key(found[i - 1]));
  return r;
}

HttpResponse connect(Client& client, const GatewayOptions& options, const std::string& id, const HttpRequest& request) {
  json body = body_object(request);
  const std::chrono::seconds timeout = timeout_field(body).value_or(options.default_timeout);
  Sandbox sb = client.attach(id);
  SandboxInfo info = live_info(client, id);
  unsigned status = 200;
  if (info.state == "sleeping") {
    info = sb.wake().info;
    status = 201;
  }
  // Connecting only ever extends the sandbox's life.
  const double deadline = now_seconds() + static_cast<double>(timeout.count());
  if (info.expires_at > 0 && info.expires_at < deadline) info = sb.set_ttl(timeout);
  return json_answer(status, sandbox_json(info, options));
}

HttpResponse pause(Client& client, const std::string& id) {
  Sandbox sb = client.attach(id);
  if (live_info(client, id).state == "sleeping")
    return rest_error(409, fmt::format("sandbox {} is already paused", id));
  try {
    sb.sleep();
  } catch (const Error& e) {
    if (e.code() == Code::kFailedPrecondition) return rest_error(409, e.what());
    throw;
  }
  return no_content();
}

HttpResponse fork(Client& client, const GatewayOptions& options, const std::string& id, const HttpRequest& request) {
  json body = body_object(request);
  std::size_t count = 1;
  if (auto it = body.find("count"); it != body.end() && !it->is_null()) {
    if (!it->is_number_integer() || it->get<std::int64_t>() < 1 || it->get<std::int64_t>() > 1000)
      throw Error(Code::kInvalidArgument, "count: must be from 1 to 1000");
    count = it->get<std::size_t>();
  }
  const auto timeout = timeout_field(body);
  live_info(client, id);
  std::vector<Sandbox> copies = client.attach(id).fork(count);
  json out = json::array();
  for (auto& copy : copies) {
    SandboxInfo info = timeout && timeout->count() > 0 ? copy.set_ttl(*timeout) : copy.info();
    copy.release();
    out.push_back(json{{"sandbox", sandbox_json(info, options)}});
  }
  return json_answer(201, out);
}

HttpResponse snapshot(Client& client, const std::string& id, const HttpRequest& request) {
  json body = body_object(request);
  std::string name;
  if (auto it = body.find("name"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) throw Error(Code::kInvalidArgument, "name: must be a string");
    name = it->get<std::string>();
  }
  live_info(client, id);
  if (name.empty()) name = "e2b-snapshot/" + id + ":" + agent::auth::new_token().substr(5, 12);
  SnapshotResult s = client.attach(id).snapshot(name);
  return json_answer(201, json{{"snapshotID", s.image}, {"names", json::array({name})}});
}

}  // namespace

HttpResponse rest_error(unsigned status, const std::string& message) {
  return json_answer(status, json{{"code", status}, {"message", message}});
}

HttpResponse rest_error(const Error& error) {
  switch (error.code()) {
    case Code::kInvalidArgument:
    case Code::kOutOfRange:
      return rest_error(400, error.what());
    case Code::kUnauthenticated:
      return rest_error(401, error.what());
    case Code::kPermissionDenied:
      return rest_error(403, error.what());
    case Code::kNotFound:
      return rest_error(404, error.what());
    case Code::kAlreadyExists:
    case Code::kAborted:
    case Code::kFailedPrecondition:
      return rest_error(409, error.what());
    case Code::kResourceExhausted:
      return rest_error(429, error.what());
    case Code::kUnimplemented:
      return rest_error(501, error.what());
    case Code::kUnavailable:
      return rest_error(503, error.what());
    case Code::kDeadlineExceeded:
      return rest_error(504, error.what());
    default:
      return rest_error(500, error.what());
  }
}

HttpResponse control_plane(Client& client, const GatewayOptions& options, HttpRequest& request) {
  const std::string target(agent::std_view(request.target()));
  const auto q = target.find('?');
  const agent::Query query = agent::parse_query(q == std::string::npos ? "" : target.substr(q + 1));
  std::vector<std::string> parts;
  {
    std::string_view path = std::string_view(target).substr(0, q);
    std::size_t start = 1;
    while (start <= path.size()) {
      std::size_t slash = path.find('/', start);
      std::string_view part =
          path.substr(start, slash == std::string_view::npos ? std::string_view::npos : slash - start);
      if (!part.empty()) parts.push_back(agent::percent_decode(part, "path"));
      if (slash == std::string_view::npos) break;
      start = slash + 1;
    }
  }
  const auto verb = request.method();
  // /v2/sandboxes..., and the unversioned /sandboxes/{id}... the SDKs call for the rest.
  if (!parts.empty() && parts[0] == "v2") parts.erase(parts.begin());
  if (parts.size() >= 1 && parts[0] == "sandboxes") {
    if (parts.size() == 1 && verb == http::verb::post) return create(client, options, request);
    if (parts.size() == 1 && verb == http::verb::get) return list(client, options, query);
    if (parts.size() >= 2) {
      const std::string& id = parts[1];
      if (parts.size() == 2 && verb == http::verb::get)
        return json_answer(200, detail_json(live_info(client, id), options));
      if (parts.size() == 2 && verb == http::verb::delete_) {
        live_info(client, id);
        client.attach(id).destroy();
        return no_content();
      }
      const std::string action = parts.size() == 3 ? parts[2] : "";
      if (action == "timeout" && verb == http::verb::post) {
        const auto timeout = timeout_field(body_object(request));
        if (!timeout) throw Error(Code::kInvalidArgument, "timeout: required, in seconds");
        live_info(client, id);
        client.attach(id).set_ttl(*timeout);
        return no_content();
      }
      if (action == "pause" && verb == http::verb::post) return pause(client, id);
      if (action == "network" && verb == http::verb::put) {
        const json body = body_object(request);
        auto policy = network_policy(body);
        if (!policy)
          throw Error(Code::kInvalidArgument,
                      "network: nothing to change (allow_internet_access, allowOut "
                      "with denyOut [\"0.0.0.0/0\"])");
        live_info(client, id);
        client.attach(id).set_network(*policy);
        return no_content();
      }
      if ((action == "connect" || action == "resume") && verb == http::verb::post)
        return connect(client, options, id, request);
      if (action == "metrics" && verb == http::verb::get) {
        live_info(client, id);
        return json_answer(200, json::array());
      }
      if (action == "fork" && verb == http::verb::post) return fork(client, options, id, request);
      if (action == "snapshots" && verb == http::verb::post) return snapshot(client, id, request);
    }
  }
  return rest_error(404, fmt::format("{} {}: not an endpoint of the dsec E2B gateway",
                                     std::string(request.method_string()), target.substr(0, q)));
}

}  // namespace dsec::e2b
