// Protocol v1 over HTTP: decodes each request into a typed call on the registry (one function per resource) and
// encodes what it returns or throws. Backends never see HTTP or JSON; this is the only place that does both.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "agent/api/audit_log.hpp"
#include "agent/api/routes.hpp"
#include "agent/images/snapshots.hpp"
#include "agent/metrics.hpp"
#include "agent/processes/shell_sessions.hpp"
#include "agent/registry/registry.hpp"
#include "common/protocol/limits.hpp"
#include "dsec/sandbox_info.hpp"
#include "http/http.hpp"
#include "http/tokens.hpp"

namespace dsec::agent {

namespace fncall {
class FnCallService;
}

inline constexpr std::size_t kMaxBatch = protocol::kMaxCreateBatch;

// The "fncall" object of GET /v1/node for this service's state, as JSON text (the etcd registration carries it too).
std::string fncall_status_json(fncall::FnCallService& service);

// Who may call: with `tokens`, a call over TCP (and, with tokens_on_unix, over the unix socket too) needs a bearer
// token of the table, and a tenant token reaches only its tenant's sandboxes and groups (others' answer NOT_FOUND,
// as if they did not exist). Without tokens every caller is the node's operator. `audit`, when set, gets a line
// per call.
struct AccessPolicy {
  std::shared_ptr<const auth::TokenTable> tokens;
  bool tokens_on_unix = false;
  std::shared_ptr<auth::AuditLog> audit;
};

class Router {
 public:
  // `node_info` answers GET /v1/node (the agent knows the host; the router only encodes). Without `snapshots`,
  // snapshot requests are UNIMPLEMENTED. `fncall` serves POST /v1/fncall and /v1/fncall/batch; without it (a node
  // that does not serve function calls) they are FAILED_PRECONDITION.
  Router(Registry& registry, Metrics& metrics, std::function<NodeInfo()> node_info, Snapshots* snapshots = nullptr,
         fncall::FnCallService* fncall = nullptr, AccessPolicy access = {});

  // Never throws: every failure becomes the dsec error JSON with its HTTP status. `stream`, when given, is where
  // a streaming exec writes its NDJSON body; without it such an exec is UNIMPLEMENTED.
  HttpResponse handle(HttpRequest& request, ResponseStream* stream = nullptr,
                      const Peer& peer = Peer{false, false, "unix", ""});
  // The server's check of a request's header, before its body is read (ServerOptions::admit): the answer to a
  // caller that is not authenticated (401), counted and audited as handle() does; nothing for any other request,
  // which handle() then answers with its body.
  std::optional<HttpResponse> admit(const HttpRequest& header, const Peer& peer);

 private:
  // Counts an answer in the metrics and, but for health, metrics and node calls, in the audit log.
  void record(const HttpRequest& request, Route route, const HttpResponse& res, std::string_view code,
              const std::string& who_name, const Peer& peer, const std::string& target_id);
  // The caller of `request`; UNAUTHENTICATED when a token is needed and missing or not the node's.
  auth::Principal authenticate(const HttpRequest& request, const Peer& peer, Route route);
  // NOT_FOUND, worded as for a sandbox that does not exist, unless `who` may reach sandbox `id`.
  void check_sandbox_access(const auth::Principal& who, const std::string& id);
  void check_image_access(const auth::Principal& who, const std::string& image);
  void check_group_access(const auth::Principal& who, const std::string& group);
  HttpResponse dispatch(HttpRequest& request, const Target& target, ResponseStream* stream, const auth::Principal& who);
  HttpResponse node(HttpRequest& request, const auth::Principal& who);
  HttpResponse network(HttpRequest& request, const Target& target);
  HttpResponse ttl(HttpRequest& request, const Target& target);
  HttpResponse ports(HttpRequest& request, const Target& target);
  HttpResponse sandboxes(HttpRequest& request, const Target& target, const auth::Principal& who,
                         ResponseStream* stream);
  HttpResponse sandbox(HttpRequest& request, const Target& target, const auth::Principal& who);
  HttpResponse exec(HttpRequest& request, const Target& target, ResponseStream* stream);
  // Processes and shell sessions (processes.cpp).
  Processes& processes_of(const SandboxHandle& handle, const std::string& id);
  HttpResponse processes(HttpRequest& request, const Target& target);
  HttpResponse process(HttpRequest& request, const Target& target);
  HttpResponse sessions(HttpRequest& request, const Target& target);
  HttpResponse session(HttpRequest& request, const Target& target, ResponseStream* stream);
  // `answer`, once per request id of the sandbox (ExecJournal, ids under `kind`): a repeat gets the first answer.
  // `request` is what the id stands for; an empty id simply answers.
  protocol::json once(const std::string& sandbox_id, std::string_view kind, const std::string& request_id,
                      const std::string& request, const std::function<protocol::json()>& answer);
  HttpResponse files(HttpRequest& request, const Target& target);
  HttpResponse screen(HttpRequest& request, const Target& target);
  HttpResponse sleep_or_wake(HttpRequest& request, const Target& target, const auth::Principal& who, bool sleep);
  HttpResponse snapshot(HttpRequest& request, const Target& target, const auth::Principal& who);
  HttpResponse fork(HttpRequest& request, const Target& target, const auth::Principal& who);
  HttpResponse groups(HttpRequest& request, const Target& target, const auth::Principal& who);
  HttpResponse group(HttpRequest& request, const Target& target, const auth::Principal& who);
  HttpResponse group_renew(HttpRequest& request, const Target& target, const auth::Principal& who);
  HttpResponse fncall(HttpRequest& request, const Target& target, const auth::Principal& who);
  HttpResponse fncall_batch(HttpRequest& request, const Target& target, const auth::Principal& who);
  void admit_fncall(const auth::Principal& who, FnCallRequest& call);
  fncall::FnCallService& fncall_service();
  HttpResponse metrics_text(HttpRequest& request);
  HttpResponse healthz(HttpRequest& request);

  Registry& registry_;
  Metrics& metrics_;
  std::function<NodeInfo()> node_info_;
  Snapshots* snapshots_;
  fncall::FnCallService* fncall_;
  AccessPolicy access_;
  ShellSessions sessions_;
};

}  // namespace dsec::agent
