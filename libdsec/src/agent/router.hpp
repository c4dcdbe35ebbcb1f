// Protocol v1 over HTTP: decodes each request into a typed call on the registry (one function per resource) and
// encodes what it returns or throws. Backends never see HTTP or JSON; this is the only place that does both.
#pragma once

#include <functional>

#include "agent/http.hpp"
#include "agent/metrics.hpp"
#include "agent/registry.hpp"
#include "agent/routes.hpp"
#include "agent/snapshots.hpp"
#include "dsec/sandbox_info.hpp"

namespace dsec::agent {

namespace fncall {
class FnCallService;
}

inline constexpr std::size_t kMaxBatch = 1024;

// The "fncall" object of GET /v1/node for this service's state, as JSON text (the etcd registration carries it too).
std::string fncall_status_json(fncall::FnCallService& service);

class Router {
 public:
  // `node_info` answers GET /v1/node (the agent knows the host; the router only encodes). Without `snapshots`,
  // snapshot requests are UNIMPLEMENTED. `fncall` serves POST /v1/fncall and /v1/fncall/batch; without it (a node
  // that does not serve function calls) they are FAILED_PRECONDITION.
  Router(Registry& registry, Metrics& metrics, std::function<NodeInfo()> node_info, Snapshots* snapshots = nullptr,
         fncall::FnCallService* fncall = nullptr);

  // Never throws: every failure becomes the dsec error JSON with its HTTP status. `stream`, when given, is where
  // a streaming exec writes its NDJSON body; without it such an exec is UNIMPLEMENTED.
  HttpResponse handle(HttpRequest& request, ResponseStream* stream = nullptr);

 private:
  HttpResponse dispatch(HttpRequest& request, const Target& target, ResponseStream* stream);
  HttpResponse node(HttpRequest& request);
  HttpResponse sandboxes(HttpRequest& request, const Target& target);
  HttpResponse sandbox(HttpRequest& request, const Target& target);
  HttpResponse exec(HttpRequest& request, const Target& target, ResponseStream* stream);
  HttpResponse files(HttpRequest& request, const Target& target);
  HttpResponse sleep_or_wake(HttpRequest& request, const Target& target, bool sleep);
  HttpResponse snapshot(HttpRequest& request, const Target& target);
  HttpResponse fork(HttpRequest& request, const Target& target);
  HttpResponse groups(HttpRequest& request, const Target& target);
  HttpResponse group(HttpRequest& request, const Target& target);
  HttpResponse group_renew(HttpRequest& request, const Target& target);
  HttpResponse fncall(HttpRequest& request, const Target& target);
  HttpResponse fncall_batch(HttpRequest& request, const Target& target);
  fncall::FnCallService& fncall_service();
  HttpResponse metrics_text(HttpRequest& request);
  HttpResponse healthz(HttpRequest& request);

  Registry& registry_;
  Metrics& metrics_;
  std::function<NodeInfo()> node_info_;
  Snapshots* snapshots_;
  fncall::FnCallService* fncall_;
};

}  // namespace dsec::agent
