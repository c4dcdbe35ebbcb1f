// dsec-e2b: E2B's API on dsec (docs/e2b.md). One HTTP server answers both of E2B's planes: the control plane (REST,
// the API key in X-API-KEY: create, list, kill, pause, connect...) and each sandbox's envd (Connect-RPC process and
// filesystem services, /files, /health), told apart by the E2b-Sandbox-Id header the SDKs send on every envd call
// (E2B_SANDBOX_URL points them all at the gateway) or by a `<port>-<sandbox id>.<domain>` host name.
//
// Stateless: a sandbox's E2B side lives in its dsec labels (its access token, its template), its timeout is its
// TTL, a pause is a dsec sleep; what the gateway caches (a sandbox's users, its token) is read again on a miss. So
// several gateways can serve one cluster, and a restart loses nothing.
#pragma once

#include <chrono>
#include <cstddef>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "dsec/client.hpp"
#include "dsec/sandbox.hpp"
#include "http/http.hpp"
#include "http/tokens.hpp"

namespace dsec::e2b {

// The envd version the gateway reports: the SDKs turn features on by it, and every one up to it is served.
inline constexpr const char* kEnvdVersion = "0.6.4";
// Labels that carry a sandbox's E2B side (user metadata may not use the prefix).
inline constexpr const char* kLabelPrefix = "e2b.";
inline constexpr const char* kAccessTokenLabel = "e2b.access-token";
inline constexpr const char* kTemplateLabel = "e2b.template";

struct GatewayOptions {
  ClientOptions client;               // how to reach dsec (endpoints, etcd, stores, or an embedded agent)
  std::filesystem::path tokens_file;  // dsecd's tokens file: API keys are its tokens; empty: any API key
  std::string domain;                 // the sandboxes' `domain` for wildcard DNS deployments; empty: null
  std::string default_user = "user";  // who commands run as where the image has that user (else root)
  std::string network = "none";       // a create that does not set allow_internet_access
  std::chrono::seconds default_timeout{300};
};

// A sandbox as one envd call sees it: a handle, who the call runs as, and that user's home (relative paths).
struct EnvdTarget {
  Sandbox sandbox;
  std::string user;  // "" runs as root
  std::string home;
};

class Gateway {
 public:
  explicit Gateway(GatewayOptions options);
  ~Gateway();
  Gateway(const Gateway&) = delete;
  Gateway& operator=(const Gateway&) = delete;

  agent::HttpResponse handle(agent::HttpRequest& request, agent::ResponseStream& stream);
  // The server's check of a request's header, before its body is read (agent::ServerOptions::admit): 401 for a
  // control-plane call without a known API key and for an envd call without the sandbox's credentials; nothing for
  // the rest, which handle() answers with its body.
  std::optional<agent::HttpResponse> admit(const agent::HttpRequest& header);
  // Closes every client (an embedded agent stops and destroys its sandboxes): calls under way fail and their
  // streams end.
  void close();
  const GatewayOptions& options() const noexcept { return options_; }

 private:
  struct SandboxFacts;
  agent::HttpResponse envd(agent::HttpRequest& request, agent::ResponseStream& stream, const std::string& sandbox_id);
  // The client that acts for an API key: the key as the agents' bearer token when keys are tokens. Throws
  // UNAUTHENTICATED for a key the tokens file does not hold.
  Client& client_for(const std::string& api_key);
  // The sandbox's users and access token, cached.
  // The client an envd call about `sandbox_id` acts through, once its credentials are checked: the sandbox's access
  // token, or (a sandbox without one) an API key of its tenant. UNAUTHENTICATED otherwise.
  // The sandbox an envd call is for (its E2b-Sandbox-Id header, or its host under --domain); "" for the control plane.
  std::string envd_sandbox(const agent::HttpRequest& request) const;
  Client& envd_client(const agent::HttpRequest& request, const std::string& sandbox_id);
  std::shared_ptr<const SandboxFacts> facts(Client& client, const std::string& sandbox_id, bool reload = false);
  EnvdTarget target(Client& client, const std::string& sandbox_id, const std::string& user);

  GatewayOptions options_;
  std::optional<agent::auth::TokenTable> tokens_;
  std::unique_ptr<Client> client_;  // the gateway's own; with tokens, also the embedded agent's owner
  std::mutex mu_;
  std::map<std::string, std::unique_ptr<Client>> clients_;  // per API key, when keys are tokens
  std::map<std::string, std::shared_ptr<const SandboxFacts>> facts_;
};

// The user named by envd's `Authorization: Basic base64("user:")` header; empty when there is none.
std::string basic_auth_user(const agent::HttpRequest& request);
// The sandbox a `<port>-<sandbox id>.<domain>` Host header names (a port after the name is fine); empty when it
// names none, or `domain` is empty.
std::string sandbox_of_host(std::string_view host, const std::string& domain);
// Unix seconds as RFC 3339 in UTC, with milliseconds ("2026-12-03T08:44:01.250Z"), as E2B's API writes times.
std::string rfc3339(double unix_seconds);
// `path` inside the sandbox: absolute as it is, `~` and relative ones under `home`.
std::string resolve_path(const std::string& path, const std::string& home);

}  // namespace dsec::e2b
