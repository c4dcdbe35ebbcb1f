#include "gateway/e2b/gateway.hpp"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <utility>

#include <fmt/format.h>
#include <openssl/crypto.h>
#include <boost/beast/http/field.hpp>
#include <boost/beast/http/status.hpp>

#include "common/protocol.hpp"
#include "gateway/e2b/connect_rpc.hpp"
#include "gateway/e2b/control_plane.hpp"
#include "gateway/e2b/envd_filesystem.hpp"
#include "gateway/e2b/envd_process.hpp"
#include "http/query.hpp"

namespace dsec::e2b {
namespace http = boost::beast::http;
using agent::HttpRequest;
using agent::HttpResponse;
using agent::std_view;

// What the gateway reads of a sandbox once: its users' homes (from its /etc/passwd) and its access token.
struct Gateway::SandboxFacts {
  std::map<std::string, std::string> homes;  // user -> home
  std::string access_token;                  // empty: none asked for
};

namespace {

constexpr std::size_t kMaxCachedSandboxes = 65536;

std::map<std::string, std::string> parse_passwd(const std::string& text) {
  std::map<std::string, std::string> homes;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + start, end - start);
    std::vector<std::string_view> f;
    std::size_t s = 0;
    for (std::size_t colon; (colon = line.find(':', s)) != std::string_view::npos; s = colon + 1)
      f.push_back(line.substr(s, colon - s));
    f.push_back(line.substr(s));
    if (f.size() >= 6 && !f[0].empty()) homes.emplace(std::string(f[0]), std::string(f[5]));
    start = end + 1;
  }
  return homes;
}

bool constant_time_equal(const std::string& a, const std::string& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

// An answer without a body (/health).
HttpResponse no_body(unsigned status) {
  HttpResponse r{static_cast<http::status>(status), 11};
  r.prepare_payload();
  return r;
}

// Whether an envd call is one of the Connect-RPC services (the rest are /files and /health).
bool is_envd_rpc(std::string_view path) {
  return path.starts_with("/process.Process/") || path.starts_with("/filesystem.Filesystem/");
}

// The error of an envd call to /files or /health: E2B's {"code": <status>, "message"} (502 when the sandbox is gone,
// which the SDKs read as "not running").
HttpResponse rest_envd_error(const RpcError& e, bool sandbox_gone) {
  unsigned status = http_status_of(e.code());
  if (sandbox_gone) status = 502;
  else if (status != 400 && status != 401 && status != 404) status = 500;
  return rest_error(status, e.what());
}

// An envd call's error: rest_envd_error's for /files and /health; for a stream, its end-stream message; for a
// unary call, its status.
HttpResponse envd_error(const HttpRequest& request, agent::ResponseStream& stream, bool rpc, const RpcError& e,
                        bool sandbox_gone) {
  if (!rpc) return rest_envd_error(e, sandbox_gone);
  if (std_view(request[http::field::content_type]).find("connect+json") != std::string_view::npos) {
    ServerStream out(stream);
    out.finish(e);
    return {};
  }
  return unary_error(e);
}

}  // namespace

std::string basic_auth_user(const HttpRequest& request) {
  auto it = request.find(http::field::authorization);
  if (it == request.end()) return {};
  std::string_view v = std_view(it->value());
  if (v.size() < 6 || v.substr(0, 6) != "Basic ") throw RpcError("unauthenticated", "Authorization: Basic expected");
  std::string decoded;
  try {
    decoded = protocol::base64_decode(v.substr(6));
  } catch (const Error&) {
    throw RpcError("unauthenticated", "Authorization: malformed Basic credentials");
  }
  return decoded.substr(0, decoded.find(':'));
}

std::string sandbox_of_host(std::string_view host, const std::string& domain) {
  if (domain.empty()) return {};
  if (auto colon = host.rfind(':'); colon != std::string_view::npos && host.find(']') == std::string_view::npos)
    host = host.substr(0, colon);
  const std::string suffix = "." + domain;
  if (host.size() <= suffix.size() || host.substr(host.size() - suffix.size()) != suffix) return {};
  host = host.substr(0, host.size() - suffix.size());
  auto dash = host.find('-');
  if (dash == std::string_view::npos || dash == 0) return {};
  if (!std::all_of(host.begin(), host.begin() + static_cast<long>(dash), [](char c) { return c >= '0' && c <= '9'; }))
    return {};
  return std::string(host.substr(dash + 1));
}

std::string rfc3339(double unix_seconds) {
  const auto whole = static_cast<std::time_t>(std::floor(unix_seconds));
  const int millis = static_cast<int>((unix_seconds - static_cast<double>(whole)) * 1000);
  std::tm tm{};
  gmtime_r(&whole, &tm);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                     tm.tm_hour, tm.tm_min, tm.tm_sec, std::clamp(millis, 0, 999));
}

std::string resolve_path(const std::string& path, const std::string& home) {
  if (!path.empty() && path[0] == '/') return path;
  if (path == "~") return home;
  if (path.rfind("~/", 0) == 0) return home + path.substr(1);
  return (home == "/" ? std::string("/") : home + "/") + path;
}

Gateway::Gateway(GatewayOptions options) : options_(std::move(options)) {
  if (!options_.tokens_file.empty()) {
    tokens_ = agent::auth::TokenTable::load(options_.tokens_file);
    // The embedded agent holds the same tokens, so the tenants are its own to keep apart: a call with an API key
    // acts as its tenant, the gateway's own calls (envd's, which carry a sandbox's access token instead) as the
    // operator of its socket.
    if (options_.client.endpoints.empty() && options_.client.etcd_endpoints.empty())
      options_.client.agent_args.insert(options_.client.agent_args.end(), {"--tokens", options_.tokens_file.string()});
  }
  client_ = std::make_unique<Client>(options_.client);
}

Gateway::~Gateway() { close(); }

void Gateway::close() {
  std::lock_guard lock(mu_);
  for (auto& [key, client] : clients_) client->close();
  if (client_) client_->close();
}

Client& Gateway::client_for(const std::string& api_key) {
  if (!tokens_) return *client_;
  if (!tokens_->authenticate("Bearer " + api_key))
    throw Error(Code::kUnauthenticated, "the API key is not one of the gateway's");
  std::lock_guard lock(mu_);
  auto& client = clients_[api_key];
  if (!client) {
    ClientOptions o = options_.client;
    if (o.endpoints.empty() && o.etcd_endpoints.empty()) o.endpoints = {client_->endpoint()};  // the embedded agent
    o.token = api_key;
    client = std::make_unique<Client>(o);
  }
  return *client;
}

std::shared_ptr<const Gateway::SandboxFacts> Gateway::facts(Client& client, const std::string& sandbox_id,
                                                            bool reload) {
  {
    std::lock_guard lock(mu_);
    if (auto it = facts_.find(sandbox_id); it != facts_.end() && !reload) return it->second;
  }
  Sandbox sb = client.attach(sandbox_id);
  auto f = std::make_shared<SandboxFacts>();
  SandboxInfo info = sb.info();
  if (info.state != "running" && info.state != "sleeping")
    throw Error(Code::kNotFound, fmt::format("sandbox {} is not running", sandbox_id));
  if (auto it = info.labels.find(kAccessTokenLabel); it != info.labels.end()) f->access_token = it->second;
  try {
    f->homes = parse_passwd(sb.read_file("/etc/passwd"));
  } catch (const Error&) {
    // No /etc/passwd: only root, at /.
  }
  f->homes.emplace("root", "/root");
  std::lock_guard lock(mu_);
  if (facts_.size() >= kMaxCachedSandboxes) facts_.clear();
  facts_[sandbox_id] = f;
  return f;
}

EnvdTarget Gateway::target(Client& client, const std::string& sandbox_id, const std::string& user) {
  auto f = facts(client, sandbox_id);
  std::string who = user;
  if (who.empty()) who = f->homes.count(options_.default_user) ? options_.default_user : "root";
  auto home = f->homes.find(who);
  if (home == f->homes.end()) {
    f = facts(client, sandbox_id, /*reload=*/true);  // a user made since
    home = f->homes.find(who);
    if (home == f->homes.end()) throw RpcError("unauthenticated", fmt::format("the sandbox has no user '{}'", who));
  }
  return EnvdTarget{client.attach(sandbox_id), who == "root" ? std::string() : who,
                    home->second.empty() ? std::string("/") : home->second};
}

Client& Gateway::envd_client(const HttpRequest& request, const std::string& sandbox_id) {
  if (request.find("X-Access-Token") == request.end() && request.find("X-API-KEY") == request.end())
    throw RpcError("unauthenticated", "an envd call needs the sandbox's X-Access-Token (or X-API-KEY)");
  // A sandbox the gateway made carries an access token, which every envd call must present (E2B's SDKs send it).
  auto f = facts(*client_, sandbox_id);
  if (!f->access_token.empty()) {
    auto it = request.find("X-Access-Token");
    if (it == request.end() || !constant_time_equal(std::string(std_view(it->value())), f->access_token))
      throw RpcError("unauthenticated", "X-Access-Token: not this sandbox's access token");
    return *client_;
  }
  // One made through dsec's own API has none: it is reached only with an API key, and every call then goes to the
  // agent as that key's tenant, which answers NOT_FOUND for another tenant's sandbox. Never anonymously: sandbox
  // ids are not secrets.
  auto key = request.find("X-API-KEY");
  if (key == request.end() || key->value().empty())
    throw RpcError("unauthenticated",
                   "this sandbox has no envd access token: an envd call needs X-API-KEY with its tenant's API key");
  Client& tenant = client_for(std::string(std_view(key->value())));
  if (&tenant != client_.get()) tenant.attach(sandbox_id).info();  // NOT_FOUND unless it is the key's tenant's
  return tenant;
}

HttpResponse Gateway::envd(HttpRequest& request, agent::ResponseStream& stream, const std::string& sandbox_id) {
  const std::string target_text(std_view(request.target()));
  const std::string path = target_text.substr(0, target_text.find('?'));
  const bool rpc = is_envd_rpc(path);
  try {
    Client& client = envd_client(request, sandbox_id);
    if (path == "/health") {
      SandboxInfo info = client.attach(sandbox_id).info();
      return no_body(info.state == "running" ? 204 : 502);
    }
    if (path == "/files") {
      std::string user;
      const auto q = target_text.find('?');
      if (q != std::string::npos) user = agent::parse_query(target_text.substr(q + 1)).get("username").value_or("");
      EnvdTarget t = target(client, sandbox_id, user);
      return files_endpoint(t, request);
    }
    if (!rpc) return rest_error(404, fmt::format("{}: not an envd endpoint", path));
    EnvdTarget t = target(client, sandbox_id, basic_auth_user(request));
    const auto slash = path.find('/', 1);
    const std::string service = path.substr(1, slash - 1), method = path.substr(slash + 1);
    if (service == "process.Process") return process_service(t, method, request, stream);
    return filesystem_service(t, method, request, stream);
  } catch (const RpcError& e) {
    return envd_error(request, stream, rpc, e, false);
  } catch (const Error& e) {
    return envd_error(request, stream, rpc, rpc_error(e), e.code() == Code::kNotFound);
  } catch (const json::exception& e) {
    return envd_error(request, stream, rpc, bad_field(e), false);
  } catch (const std::exception& e) {
    return envd_error(request, stream, rpc, RpcError("internal", e.what()), false);
  }
}

std::string Gateway::envd_sandbox(const HttpRequest& request) const {
  if (auto it = request.find("E2b-Sandbox-Id"); it != request.end()) return std::string(std_view(it->value()));
  return sandbox_of_host(std_view(request[http::field::host]), options_.domain);
}

std::optional<HttpResponse> Gateway::admit(const HttpRequest& header) {
  const std::string sandbox_id = envd_sandbox(header);
  if (sandbox_id.empty()) {
    auto key = header.find("X-API-KEY");
    if (key == header.end() || key->value().empty())
      return rest_error(401, "X-API-KEY: an API key is required (E2B_API_KEY)");
    if (tokens_ && !tokens_->authenticate("Bearer " + std::string(std_view(key->value()))))
      return rest_error(401, "the API key is not one of the gateway's");
    return std::nullopt;
  }
  // Until its credentials pass, an envd call's body is not read: a refusal (or a sandbox that is not there) is
  // answered here, in the form the call's client reads: Connect's error for the RPC services, E2B's JSON for the rest.
  const bool rpc = is_envd_rpc(std_view(header.target()));
  // A streamed RPC's error other than a refusal goes in its end-stream message (HTTP 200), which only handle()
  // writes: its clients read a 404 as "unimplemented".
  const bool streamed = std_view(header[http::field::content_type]).find("connect+") != std::string_view::npos;
  auto refuse = [&](const RpcError& e, bool gone) -> std::optional<HttpResponse> {
    if (!rpc) return rest_envd_error(e, gone);
    if (streamed && e.code() != "unauthenticated") return std::nullopt;
    return unary_error(e);
  };
  try {
    envd_client(header, sandbox_id);
  } catch (const RpcError& e) {
    return refuse(e, false);
  } catch (const Error& e) {
    return refuse(rpc_error(e), e.code() == Code::kNotFound);
  } catch (const std::exception& e) {
    return refuse(RpcError("internal", e.what()), false);
  }
  return std::nullopt;
}

HttpResponse Gateway::handle(HttpRequest& request, agent::ResponseStream& stream) {
  const std::string sandbox_id = envd_sandbox(request);
  if (!sandbox_id.empty()) return envd(request, stream, sandbox_id);
  try {
    auto key = request.find("X-API-KEY");
    if (key == request.end() || key->value().empty())
      return rest_error(401, "X-API-KEY: an API key is required (E2B_API_KEY)");
    return control_plane(client_for(std::string(std_view(key->value()))), options_, request);
  } catch (const Error& e) {
    return rest_error(e);
  } catch (const json::exception& e) {
    return rest_error(400, bad_field(e).what());
  } catch (const std::exception& e) {
    return rest_error(500, e.what());
  }
}

}  // namespace dsec::e2b
