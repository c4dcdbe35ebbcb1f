#include "client/client_core.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <optional>

#include <fmt/format.h>

#include "client/client_core_internal.hpp"
#include "common/protocol.hpp"

namespace dsec::detail {

using std::chrono::milliseconds;

protocol::json parse_json(const HttpResponse& r, std::string_view what) {
  try {
    return protocol::json::parse(r.body);
  } catch (const protocol::json::exception& e) {
    throw Error(Code::kInternal, fmt::format("{}: the agent answered HTTP {} with a body that is not JSON: {}", what,
                                             r.status, e.what()));
  }
}

std::string random_request_id() {
  auto& rng = thread_rng();
  return fmt::format("{:016x}{:016x}", rng(), rng());
}

namespace {

std::shared_ptr<const Credentials> credentials_of(const ClientOptions& o) {
  auto c = std::make_shared<Credentials>();
  c->token = o.token;
  if (c->token.empty())
    if (const char* env = std::getenv("DSEC_TOKEN")) c->token = env;
  for (char ch : c->token)
    if (static_cast<unsigned char>(ch) < 0x21 || static_cast<unsigned char>(ch) > 0x7e)
      throw Error(Code::kInvalidArgument, "token: only printable characters without spaces (as dsec token new makes)");
  c->ca_file = o.tls_ca_file;
  c->client_cert = o.tls_client_cert;
  c->client_key = o.tls_client_key;
  if (c->client_cert.empty() != c->client_key.empty())
    throw Error(Code::kInvalidArgument, "tls_client_cert and tls_client_key go together");
  return c;
}

}  // namespace

ClientCore::ClientCore(ClientOptions options) : options_(std::move(options)), nodes_(credentials_of(options_)) {
  std::vector<std::string> endpoints = options_.endpoints;
  if (endpoints.empty() && options_.etcd_endpoints.empty()) {
    EmbeddedAgentOptions ao;
    ao.binary = options_.agent_binary;
    ao.candidates = options_.agent_candidates;
    ao.home = options_.home;
    ao.extra_args = options_.agent_args;
    ao.stores = options_.stores;
    ao.registry = options_.registry;
    ao.start_timeout = options_.agent_start_timeout;
    ao.stop_grace = options_.agent_stop_grace;
    agent_ = std::make_unique<EmbeddedAgent>(ao);
    endpoints.push_back(agent_->endpoint());
  }
  for (const auto& e : endpoints) nodes_.add(e);
  if (!options_.etcd_endpoints.empty()) {
    DiscoveryOptions d;
    d.ca_file = options_.etcd_tls_ca_file;
    d.client_cert = options_.etcd_tls_client_cert;
    d.client_key = options_.etcd_tls_client_key;
    discovery_ = std::make_unique<EtcdDiscovery>(
        options_.etcd_endpoints, options_.etcd_prefix,
        [this](const NodeEvent& e) {
          if (e.kind == NodeEvent::Kind::kUp) node_up(e);
          else nodes_.down(e.node_id);
        },
        d);
    discovery_->start();
    // The first listing, so that a create right after construction has nodes to choose from. An etcd that cannot
    // be read yet is not fatal: discovery keeps trying and creates fail with UNAVAILABLE until nodes appear.
    try {
      for (const auto& e : discovery_->snapshot()) node_up(e);
    } catch (const Error&) {
    }
  }
  std::vector<std::string> stores = options_.stores;
  if (stores.empty() && agent_) stores.push_back(agent_->home() + "/store");
  images_ = std::make_unique<ImageResolver>(stores, options_.image_cache_ttl);
  if (options_.placement_policy) {
    policy_ = options_.placement_policy.get();
  } else {
    own_policy_ = make_placement_policy(options_.placement.empty() ? "spread" : options_.placement);
    policy_ = own_policy_.get();
  }
  if (options_.create_concurrency == 0) options_.create_concurrency = 1;
}

ClientCore::~ClientCore() { close(); }

void ClientCore::close() {
  if (closed_.exchange(true)) return;
  if (discovery_) discovery_->stop();
  if (agent_) agent_->stop();
}

std::string ClientCore::endpoint() const {
  if (agent_) return agent_->endpoint();
  auto nodes = nodes_.view();
  return nodes.empty() ? std::string() : nodes.front().node->endpoint;
}

TransportStats ClientCore::stats() const {
  TransportStats total;
  for (const auto& v : nodes_.view()) {
    auto s = v.node->transport.stats();
    total.requests += s.requests;
    total.connects += s.connects;
    total.idle_handles += s.idle_handles;
  }
  return total;
}

SteadyClock::time_point ClientCore::deadline_after(milliseconds extra) const {
  return SteadyClock::now() + options_.call_deadline + extra;
}

void ClientCore::check_open() const {
  if (closed_.load()) throw Error(Code::kFailedPrecondition, "this dsec client is closed");
  if (agent_) {
    if (auto why = agent_->exited_unexpectedly()) throw Error(Code::kUnavailable, *why, false);
  }
}

HttpResponse ClientCore::call(const NodePtr& node, const HttpRequest& request, SteadyClock::time_point deadline,
                              std::chrono::milliseconds extra) {
  HttpResponse r;
  try {
    r = node->transport.send(request, std::min(deadline, SteadyClock::now() + options_.request_timeout + extra));
  } catch (const TransportError&) {
    nodes_.failed(node);
    throw;
  }
  // An agent that answers is alive, whatever it answered.
  nodes_.succeeded(node);
  if (r.status >= 200 && r.status < 300) return r;
  throw agent_error(request, node->endpoint, r);
}

void ClientCore::count_exchange(const NodePtr& node, bool answered) {
  if (answered) nodes_.succeeded(node);
  else nodes_.failed(node);
}

Error agent_error(const HttpRequest& request, const std::string& endpoint, const HttpResponse& r) {
  protocol::json body;
  try {
    body = protocol::json::parse(r.body);
  } catch (const protocol::json::exception&) {
    body = nullptr;  // decode_error falls back to the HTTP status
  }
  Error e = protocol::decode_error(body, static_cast<int>(r.status));
  return Error(e.code(), fmt::format("{} {} on {}: {}", request.method, request.target, endpoint, e.what()),
               e.retryable(), e.fault(), e.outcome_unknown());
}

NodePtr ClientCore::route(const std::string& id, SteadyClock::time_point deadline) {
  if (!valid_sandbox_id(id))
    throw Error(Code::kInvalidArgument, fmt::format("'{}' is not a sandbox id (letters, digits, '-', '_', '.')", id));
  auto check = [&](const NodePtr& node) {
    NodeView v = nodes_.view(node);
    if (v.gone)
      throw NodeLost(v.id,
                     fmt::format("sandbox '{}': its node {} ({}) has left the cluster", id, v.id, node->endpoint));
    if (v.ejected)
      throw NodeLost(v.id, fmt::format("sandbox '{}': its node {} ({}) failed {} times in a row and is ejected", id,
                                       v.id, node->endpoint, v.failures));
    return node;
  };
  if (NodePtr node = nodes_.route(id)) return check(node);
  {
    auto all = nodes_.view();
    if (all.size() == 1 && all.front().id.empty()) return all.front().node;  // one node: it made every sandbox
  }
  // Ask the nodes whose id we do not know yet (one round at a time).
  std::lock_guard identify(identify_mu_);
  std::vector<std::string> unreachable;
  for (const NodePtr& node : nodes_.unidentified()) {
    try {
      auto d = std::min(deadline, SteadyClock::now() + kDiscoveryTimeout);
      auto r = call(node, http_request("GET", "/v1/node"), d);
      nodes_.set_info(node, protocol::decode_node_info(parse_json(r, "GET /v1/node")));
    } catch (const Error& e) {
      unreachable.push_back(fmt::format("{} ({})", node->endpoint, e.code_name()));
    }
  }
  if (NodePtr node = nodes_.route(id)) return check(node);
  std::string known;
  for (const auto& v : nodes_.view())
    if (!v.id.empty()) known += fmt::format("{}{} at {}", known.empty() ? "" : ", ", v.id, v.node->endpoint);
  std::string down;
  for (const auto& u : unreachable) down += (down.empty() ? "" : ", ") + u;
  // A node that could not be asked may be the one: that is worth a retry, an unknown node is not.
  if (!unreachable.empty())
    throw Error(Code::kUnavailable,
                fmt::format("sandbox '{}': no reachable node made it (known nodes: {}; unreachable: {})", id,
                            known.empty() ? "none" : known, down));
  throw Error(Code::kNotFound, fmt::format("sandbox '{}': no node of this client made it (nodes: {})", id,
                                           known.empty() ? "none" : known));
}

void ClientCore::node_up(const NodeEvent& event) {
  NodePtr node = nodes_.up(event.node_id, event.endpoint, event.info);
  protocol::json j = protocol::json::object();
  if (!event.fncall.empty()) j["fncall"] = protocol::json::parse(event.fncall, nullptr, false);
  nodes_.set_fncall(node, parse_fncall_node_state(j));
}

NodeInfo ClientCore::learn_node_info(const NodePtr& node, const HttpResponse& response) {
  protocol::json j = parse_json(response, "GET /v1/node");
  NodeInfo info = protocol::decode_node_info(j);
  nodes_.set_info(node, info);
  nodes_.set_fncall(node, parse_fncall_node_state(j));
  return info;
}

HttpResponse ClientCore::call_once(const NodePtr& node, const HttpRequest& request, SteadyClock::time_point deadline,
                                   milliseconds extra) {
  try {
    return call(node, request, deadline, extra);
  } catch (const TransportError& e) {
    // Once the agent may have the request, doing it twice is worse than failing.
    if (e.maybe_sent() && e.retryable())
      throw Error(e.code(), std::string(e.what()) + " (not retried: the agent may have acted on it)", false, e.fault());
    throw;
  } catch (const Error& e) {
    throw Error(e.code(), e.what(), false, e.fault());
  }
}

HttpResponse ClientCore::call_sandbox(const SandboxRequest& request) {
  const std::string& id = request.sandbox_id;
  const SandboxCall& how = request.how;
  const HttpRequest http = request.http();
  auto deadline = deadline_after(how.extra);
  if (how.request_id.empty())
    return retrying(deadline, [&] {
      NodePtr node = route(id, deadline);
      if (!how.repeatable) return call_once(node, http, deadline, how.extra);
      try {
        return call(node, http, deadline, how.extra);
      } catch (const TransportError& e) {
        // An exchange that timed out is retried too when the request's id makes that safe (sleep, wake): the agent
        // answers it with the first attempt's outcome, waiting for it if it still runs.
        if (how.retry_timeouts && e.code() == Code::kDeadlineExceeded && SteadyClock::now() < deadline)
          throw Error(Code::kUnavailable, std::string(e.what()) + " (retried with the same request id)", true);
        throw;
      }
    });
  bool maybe_sent = false;
  return exactly_once(id, how.request_id, maybe_sent, [&] {
    return retrying(deadline, [&] {
      NodePtr node = route(id, deadline);
      try {
        return call(node, http, deadline, how.extra);
      } catch (const TransportError& e) {
        maybe_sent = maybe_sent || e.maybe_sent();
        throw;
      }
    });
  });
}

HttpResponse ClientCore::send_once(const SandboxRequest& request, SteadyClock::time_point deadline) {
  return call(route(request.sandbox_id, deadline), request.http(), deadline, request.how.extra);
}

std::optional<OutcomeUnknown> outcome_unknown(const Error& e, const std::string& id, const std::string& request_id,
                                              bool maybe_sent) {
  if (dynamic_cast<const OutcomeUnknown*>(&e)) return std::nullopt;
  // The agent knows the command was under way when it stopped, and so never learnt how it ended: its error says so
  // in the outcome_unknown field.
  if (e.code() == Code::kDataLoss && e.outcome_unknown()) return OutcomeUnknown(request_id, e.what());
  // The request may have reached the agent and every retry failed to ask it again: whether the command ran is
  // not known here.
  const bool lost = e.code() == Code::kUnavailable || e.code() == Code::kDeadlineExceeded ||
                    dynamic_cast<const NodeLost*>(&e) != nullptr;
  if (maybe_sent && lost)
    return OutcomeUnknown(request_id,
                          fmt::format("outcome unknown: request '{}' to sandbox {} may have run, and no retry could "
                                      "learn how it ended: {}",
                                      request_id, id, e.what()));
  return std::nullopt;
}

std::vector<SandboxInfo> ClientCore::list(const Labels& labels, const std::string& tenant) {
  std::string target = "/v1/sandboxes";
  char sep = '?';
  for (const auto& [k, v] : labels) {
    target += fmt::format("{}label={}", sep, url_escape(fmt::format("{}={}", k, v)));
    sep = '&';
  }
  if (!tenant.empty()) target += fmt::format("{}tenant={}", sep, url_escape(tenant));
  std::vector<SandboxInfo> out;
  for (const auto& v : nodes_.view()) {
    auto deadline = deadline_after();
    auto r = retrying(deadline, [&] { return call(v.node, http_request("GET", target), deadline); });
    auto part = answers::sandbox_list(r, "GET /v1/sandboxes");
    for (auto& s : part) out.push_back(std::move(s));
  }
  return out;
}

ImageResolver& ClientCore::stores() {
  check_open();
  if (!images_->enabled())
    throw Error(Code::kFailedPrecondition,
                "this client has no image stores: its agents resolve images in their own (ClientOptions::stores)");
  return *images_;
}

std::vector<ImageInfo> ClientCore::images() { return stores().list(); }

void ClientCore::remove_image(const std::string& name) { stores().remove(name); }

std::vector<NodeInfo> ClientCore::nodes() {
  std::vector<NodeInfo> out;
  for (const auto& v : nodes_.view()) {
    auto deadline = deadline_after();
    auto r = retrying(deadline, [&] { return call(v.node, http_request("GET", "/v1/node"), deadline); });
    out.push_back(learn_node_info(v.node, r));
  }
  return out;
}

}  // namespace dsec::detail
