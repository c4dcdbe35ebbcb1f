#include "client/client_core.hpp"

#include "client/exec_stream.hpp"

#include <algorithm>
#include <cctype>
#include <condition_variable>
#include <exception>
#include <map>
#include <optional>
#include <random>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "common/network_rules.hpp"
#include "common/protocol.hpp"
#include "common/protocol/screen.hpp"
#include "dsec/retry.hpp"
#include "image/store/manifest.hpp"

namespace dsec::detail {
namespace {

using std::chrono::milliseconds;

constexpr std::string_view kJson = "application/json";
constexpr std::string_view kTar = "application/x-tar";
constexpr std::string_view kOctets = "application/octet-stream";
// Asking a node for its id while routing is quick or not at all.
constexpr milliseconds kDiscoveryTimeout{5'000};
// Placement uses what nodes said about themselves at most this long ago (plus what this client placed since).
constexpr milliseconds kInfoMaxAge{2'000};
// The most sandboxes one create request asks a node for (the agent's limit).
constexpr std::size_t kMaxBatch = 1024;
// Labels every create carries: its request id, and for create_many the pulse's base request id. They find the
// copies a node made of a create that timed out there and was then made elsewhere.
constexpr std::string_view kRequestLabel = "dsec.request";
constexpr std::string_view kPulseLabel = "dsec.pulse";
// A sleep pushes the sandbox's memory out to swap, which takes as long as writing it (about 10 s per GiB on a
// plain disk); the agent gives up after its --sleep-reclaim-timeout, 60 s by default. Each exchange may take that
// much more than request_timeout.
constexpr milliseconds kSleepTime{60'000};
// The longest one snapshot exchange may take on top of request_timeout (a large writable layer to copy and pack).
constexpr milliseconds kSnapshotTime{600'000};
// A full VM's create may boot a whole system (its kernel, systemd, a desktop: about a minute under TCG, and the
// agent's boot timeout is 300 s) before it answers: each exchange and the call may take that much longer.
constexpr milliseconds kFullSystemBootTime{600'000};
// A create that may wait for room on a full node (queue_timeout) may take that much longer too.
milliseconds create_time(const SandboxSpec& spec) {
  return (spec.kind == "vm" ? kFullSystemBootTime : milliseconds{0}) + spec.queue_timeout;
}

std::mt19937_64& thread_rng() {
  thread_local std::mt19937_64 rng = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd()};
    return std::mt19937_64(seq);
  }();
  return rng;
}

std::vector<SandboxInfo> decode_sandbox_list(const HttpResponse& r, std::string_view what) {
  auto j = parse_json(r, what);
  auto it = j.find("sandboxes");
  if (it == j.end() || !it->is_array())
    throw Error(Code::kInternal, fmt::format("{}: the agent's answer has no \"sandboxes\" array", what));
  std::vector<SandboxInfo> out;
  out.reserve(it->size());
  for (const auto& s : *it) out.push_back(protocol::decode_sandbox_info(s));
  return out;
}

// The agent gets the exact manifest the client resolved: the same layers for every sandbox of a pulse, and no tag
// lookup on the node.
void pin_image(protocol::json& request, const ResolvedImageRef* image) {
  if (!image) return;
  request["image"] = image->reference;
  request["image_manifest"] = image->manifest_json;
}

// Runs fn(worker) on `workers` threads and waits for all of them.
template <typename Fn>
void run_workers(std::size_t workers, Fn&& fn) {
  std::vector<std::thread> threads;
  threads.reserve(workers);
  try {
    for (std::size_t w = 0; w < workers; ++w) threads.emplace_back(fn);
  } catch (...) {
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
}

}  // namespace

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

template <typename Op>
auto ClientCore::retrying(SteadyClock::time_point deadline, Op&& op) -> decltype(op()) {
  auto sleep = [](milliseconds d) { std::this_thread::sleep_for(d); };
  return retry_call<SteadyClock>(options_.retry, deadline, sleep, thread_rng(), [&] {
    check_open();
    return op();
  });
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
               e.retryable(), e.fault());
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

void ClientCore::refresh_node_info(SteadyClock::time_point deadline) {
  std::vector<NodePtr> stale;
  auto now = SteadyClock::now();
  for (const auto& v : nodes_.view())
    if (!v.ejected && (!v.info || now - v.info_at > kInfoMaxAge)) stale.push_back(v.node);
  if (stale.empty()) return;
  std::atomic<std::size_t> next{0};
  run_workers(std::min(stale.size(), options_.create_concurrency), [&] {
    for (std::size_t i = next.fetch_add(1); i < stale.size(); i = next.fetch_add(1)) {
      try {
        auto d = std::min(deadline, SteadyClock::now() + kDiscoveryTimeout);
        learn_node_info(stale[i], call(stale[i], http_request("GET", "/v1/node"), d));
      } catch (const Error&) {
        // Counted against the node's health by call(); placement skips it while it is ejected.
      }
    }
  });
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

std::vector<NodePtr> ClientCore::place(const SandboxSpec& spec, std::size_t count, const ResolvedImageRef* image,
                                       const std::vector<NodePtr>& excluded) {
  std::vector<NodeCandidate> candidates;
  std::vector<NodePtr> owners;
  for (const auto& v : nodes_.view()) {
    if (std::find(excluded.begin(), excluded.end(), v.node) != excluded.end()) continue;
    NodeCandidate c;
    c.id = v.id.empty() ? v.node->endpoint : v.id;
    if (v.info) c.info = *v.info;
    c.cpu_placed = v.cpu_placed;
    c.memory_placed = v.memory_placed;
    c.sandboxes_placed = v.sandboxes_placed;
    c.healthy = !v.ejected && v.info.has_value();
    if (image && v.info)
      for (const auto& cached : v.info->cached_layers)
        if (std::find(image->layer_digests.begin(), image->layer_digests.end(), cached.digest) !=
            image->layer_digests.end())
          c.cached_image_bytes += cached.cached_bytes;
    candidates.push_back(std::move(c));
    owners.push_back(v.node);
  }
  if (candidates.empty())
    throw Error(Code::kUnavailable, "no node to place sandboxes on: every node is unreachable, ejected or refused");
  PlacementRequest request;
  request.spec = &spec;
  request.count = count;
  if (image) {
    request.image_layers = image->layer_digests;
    request.image_bytes = image->size;
  }
  std::vector<std::size_t> chosen = policy_->place(request, candidates);
  std::vector<NodePtr> out;
  out.reserve(chosen.size());
  for (std::size_t i : chosen) out.push_back(owners.at(i));
  return out;
}

void ClientCore::remove_strays(const NodePtr& node, const std::string& key, const std::string& value,
                               const std::vector<std::string>& keep, SteadyClock::time_point deadline) {
  try {
    auto r =
        call(node, http_request("GET", fmt::format("/v1/sandboxes?label={}", url_escape(key + "=" + value))), deadline);
    for (const auto& s : decode_sandbox_list(r, "GET /v1/sandboxes")) {
      if (std::find(keep.begin(), keep.end(), s.id) != keep.end() || s.state == "destroyed") continue;
      try {
        call(node, http_request("DELETE", sandbox_path(s.id)), deadline);
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
    // Unreachable: whatever it made is reaped with its TTL (or its group's lease).
  }
}

std::string ClientCore::sandbox_path(const std::string& id, std::string_view suffix) const {
  return fmt::format("/v1/sandboxes/{}{}", url_escape(id), suffix);
}

SandboxInfo ClientCore::create(SandboxSpec spec) {
  if (spec.request_id.empty()) spec.request_id = random_request_id();
  protocol::validate(spec);
  const milliseconds boot_time = create_time(spec);
  auto deadline = deadline_after(boot_time);
  std::shared_ptr<const ResolvedImageRef> image;
  if (images_->enabled()) image = images_->resolve(spec.image);
  // With several nodes the request id is also a label, so a copy made by a node that timed out (while another made
  // the sandbox) can be found and removed.
  const bool several = nodes_.live_count() > 1;
  if (several) spec.labels[std::string(kRequestLabel)] = spec.request_id;
  protocol::json request = protocol::encode(spec);
  pin_image(request, image.get());
  const std::string body = request.dump();

  std::vector<NodePtr> excluded;    // refused, failed or timed out for this create
  std::vector<NodePtr> maybe_made;  // timed out after the request may have arrived
  std::optional<Error> last_error;
  for (;;) {
    check_open();
    if (SteadyClock::now() >= deadline)
      throw Error(Code::kDeadlineExceeded,
                  fmt::format("create: no node made the sandbox within the call deadline{}",
                              last_error ? fmt::format(" (last error: {})", last_error->what()) : std::string()));
    NodePtr node;
    if (!several) {
      // One node: it decides admission itself; nothing to choose, nowhere else to go.
      auto all = nodes_.view();
      if (all.empty()) throw Error(Code::kUnavailable, "create: this client has no node");
      if (!excluded.empty()) throw *last_error;
      node = all.front().node;
    } else {
      refresh_node_info(deadline);
      try {
        node = place(spec, 1, image.get(), excluded).front();
      } catch (const Error& e) {
        if (last_error) throw *last_error;
        throw;
      }
    }
    HttpResponse r;
    try {
      // On one node, transient failures are retried there (the request id makes that safe); past the retries the
      // create moves to another node with the same request id.
      r = retrying(deadline,
                   [&] { return call(node, http_request("POST", "/v1/sandboxes", body, kJson), deadline, boot_time); });
    } catch (const TransportError& e) {
      if (e.maybe_sent()) maybe_made.push_back(node);
      excluded.push_back(node);
      last_error = e;
      continue;
    } catch (const Error& e) {
      if (!e.retryable() && e.code() != Code::kDeadlineExceeded) throw;
      excluded.push_back(node);
      last_error = e;
      continue;
    }
    SandboxInfo info = protocol::decode_sandbox_info(parse_json(r, "POST /v1/sandboxes"));
    if (info.id.empty()) throw Error(Code::kInternal, "POST /v1/sandboxes: the agent's answer has no sandbox id");
    nodes_.learn(node, info.node);
    nodes_.placed(node, spec.resources.cpu, spec.resources.memory_bytes, 1);
    if (several)
      for (const NodePtr& other : maybe_made)
        if (other != node) remove_strays(other, std::string(kRequestLabel), spec.request_id, {}, deadline);
    if (info.state == "failed") {
      try {
        destroy(info.id);
      } catch (const Error&) {
      }
      throw Error(Code::kInternal, fmt::format("sandbox {} failed to start: {}", info.id, info.message));
    }
    return info;
  }
}

std::vector<SandboxInfo> ClientCore::create_many(std::size_t n, const SandboxSpec& spec, const std::string& group,
                                                 std::chrono::seconds group_ttl) {
  return create_many(std::vector<SandboxSpec>(n, spec), group, group_ttl);
}

std::vector<SandboxInfo> ClientCore::create_many(const std::vector<SandboxSpec>& specs, const std::string& group,
                                                 std::chrono::seconds group_ttl) {
  const std::size_t n = specs.size();
  if (n == 0) return {};
  milliseconds boot_time{0};
  for (const auto& s : specs) {
    protocol::validate(s);
    boot_time = std::max(boot_time, create_time(s));
  }
  auto deadline = deadline_after(boot_time);
  const std::string base = specs.front().request_id.empty() ? random_request_id() : specs.front().request_id;
  const bool pulse_labelled = nodes_.live_count() > 1;
  // The distinct specs of the pulse (equal specs share one), each placed and sent as batches of its own.
  struct Kind {
    SandboxSpec spec;
    std::shared_ptr<const ResolvedImageRef> image;
  };
  std::vector<Kind> kinds;
  std::vector<std::size_t> kind_of(n);  // slot -> index into kinds
  {
    std::map<std::string, std::size_t> by_encoding;
    for (std::size_t i = 0; i < n; ++i) {
      SandboxSpec s = specs[i];
      s.request_id.clear();
      if (pulse_labelled) s.labels[std::string(kPulseLabel)] = base;
      auto [it, added] = by_encoding.try_emplace(protocol::encode(s).dump(), kinds.size());
      if (added) {
        std::shared_ptr<const ResolvedImageRef> image;
        if (images_->enabled()) image = images_->resolve(s.image);
        kinds.push_back(Kind{std::move(s), std::move(image)});
      }
      kind_of[i] = it->second;
    }
  }

  struct Batch {
    NodePtr node;
    std::size_t kind = 0;
    std::vector<std::size_t> slots;  // indices into the result
    std::string request_id;
  };
  std::vector<std::optional<SandboxInfo>> made(n);
  std::vector<std::size_t> pending(n);
  for (std::size_t i = 0; i < n; ++i) pending[i] = i;
  std::vector<NodePtr> excluded, maybe_made;
  std::optional<Error> last_error;
  std::size_t batch_no = 0;
  std::mutex mu;

  // A group's lease is kept alive while the pulse is still being made (a slow node, a failover), on the nodes that
  // already hold members; the SandboxGroup's own renewal takes over when create_many returns.
  std::mutex renew_mu;
  std::condition_variable renew_cv;
  bool pulse_done = false;
  std::thread renewer;
  if (!group.empty()) {
    renewer = std::thread([&] {
      const auto period = std::max<milliseconds>(group_ttl / 3, milliseconds(200));
      std::unique_lock lock(renew_mu);
      while (!renew_cv.wait_for(lock, period, [&] { return pulse_done; })) {
        lock.unlock();
        std::vector<std::string> ids;
        {
          std::lock_guard made_lock(mu);
          for (const auto& m : made)
            if (m) ids.push_back(m->id);
        }
        try {
          if (!ids.empty()) renew_group(group, ids, group_ttl);
        } catch (const Error&) {
        }
        lock.lock();
      }
    });
  }
  struct StopRenewer {
    std::mutex& m;
    std::condition_variable& cv;
    bool& done;
    std::thread& t;
    ~StopRenewer() {
      {
        std::lock_guard lock(m);
        done = true;
      }
      cv.notify_all();
      if (t.joinable()) t.join();
    }
  } stop_renewer{renew_mu, renew_cv, pulse_done, renewer};

  while (!pending.empty()) {
    check_open();
    if (SteadyClock::now() >= deadline) {
      last_error =
          Error(Code::kDeadlineExceeded,
                fmt::format("create_many: {} of {} sandboxes not made within the call deadline{}", pending.size(), n,
                            last_error ? fmt::format(" (last error: {})", last_error->what()) : std::string()));
      break;
    }
    std::vector<NodePtr> where(pending.size());
    auto all = nodes_.view();
    if (all.size() == 1) {
      // One node: it decides admission itself; nothing to choose, nowhere else to go.
      if (!excluded.empty()) break;
      where.assign(pending.size(), all.front().node);
    } else {
      refresh_node_info(deadline);
      try {
        for (std::size_t k = 0; k < kinds.size(); ++k) {
          std::vector<std::size_t> at;  // positions in `pending` of this kind's slots
          for (std::size_t p = 0; p < pending.size(); ++p)
            if (kind_of[pending[p]] == k) at.push_back(p);
          if (at.empty()) continue;
          auto placed = place(kinds[k].spec, at.size(), kinds[k].image.get(), excluded);
          for (std::size_t j = 0; j < at.size(); ++j) where[at[j]] = std::move(placed[j]);
        }
      } catch (const Error& e) {
        if (!last_error || e.code() != Code::kUnavailable) last_error = e;
        break;
      }
    }
    // One batch request per node and spec (split at the agent's batch limit), all sent at once.
    std::vector<Batch> batches;
    {
      std::map<std::pair<Node*, std::size_t>, std::vector<std::size_t>> by_node;
      std::map<Node*, NodePtr> owner;
      for (std::size_t k = 0; k < pending.size(); ++k) {
        by_node[{where[k].get(), kind_of[pending[k]]}].push_back(pending[k]);
        owner[where[k].get()] = where[k];
      }
      for (auto& [key, slots] : by_node)
        for (std::size_t at = 0; at < slots.size(); at += kMaxBatch) {
          Batch b;
          b.node = owner[key.first];
          b.kind = key.second;
          b.slots.assign(slots.begin() + static_cast<std::ptrdiff_t>(at),
                         slots.begin() + static_cast<std::ptrdiff_t>(std::min(slots.size(), at + kMaxBatch)));
          b.request_id = fmt::format("{}-{}", base, batch_no++);
          batches.push_back(std::move(b));
        }
    }
    std::vector<std::size_t> failed_slots;
    std::atomic<std::size_t> next{0};
    run_workers(std::min(batches.size(), options_.create_concurrency), [&] {
      for (std::size_t b = next.fetch_add(1); b < batches.size(); b = next.fetch_add(1)) {
        Batch& batch = batches[b];
        const Kind& kind = kinds[batch.kind];
        SandboxSpec s = kind.spec;
        s.request_id = batch.request_id;
        protocol::json request = protocol::encode(s);
        request["count"] = batch.slots.size();
        if (!group.empty()) {
          request["group"] = group;
          request["group_ttl"] = group_ttl.count();
        }
        pin_image(request, kind.image.get());
        const std::string body = request.dump();
        try {
          auto r = retrying(deadline, [&] {
            return call(batch.node, http_request("POST", "/v1/sandboxes", body, kJson), deadline, create_time(s));
          });
          auto infos = decode_sandbox_list(r, "POST /v1/sandboxes (count)");
          if (infos.size() != batch.slots.size())
            throw Error(Code::kInternal,
                        fmt::format("POST /v1/sandboxes: asked for {} sandboxes, the agent answered {}",
                                    batch.slots.size(), infos.size()));
          std::lock_guard lock(mu);
          for (std::size_t k = 0; k < infos.size(); ++k) {
            if (!infos[k].node.empty()) nodes_.learn(batch.node, infos[k].node);
            made[batch.slots[k]] = std::move(infos[k]);
          }
          nodes_.placed(batch.node, s.resources.cpu * static_cast<double>(batch.slots.size()),
                        s.resources.memory_bytes * batch.slots.size(), batch.slots.size());
        } catch (const Error& e) {
          std::lock_guard lock(mu);
          auto* transport = dynamic_cast<const TransportError*>(&e);
          if (transport && transport->maybe_sent()) maybe_made.push_back(batch.node);
          if (std::find(excluded.begin(), excluded.end(), batch.node) == excluded.end()) excluded.push_back(batch.node);
          failed_slots.insert(failed_slots.end(), batch.slots.begin(), batch.slots.end());
          // A refusal that no other node can change (a bad spec, a missing image) ends the pulse.
          if (!e.retryable() && !transport && e.code() != Code::kDeadlineExceeded) {
            last_error = e;
            pending.clear();
          } else if (!last_error || last_error->retryable()) {
            last_error = e;
          }
        }
      }
    });
    if (!last_error || last_error->retryable() || last_error->code() == Code::kDeadlineExceeded) {
      std::sort(failed_slots.begin(), failed_slots.end());
      pending = std::move(failed_slots);
    } else {
      break;
    }
  }

  std::vector<std::string> kept;
  for (const auto& m : made)
    if (m) kept.push_back(m->id);
  if (pulse_labelled)
    for (const NodePtr& node : maybe_made) remove_strays(node, std::string(kPulseLabel), base, kept, deadline_after());

  const bool complete = std::all_of(made.begin(), made.end(), [](const auto& m) { return m.has_value(); });
  if (!complete) {
    // All or nothing: take back what was made, as concurrently as it was made.
    std::atomic<std::size_t> k{0};
    run_workers(std::min(n, options_.create_concurrency), [&] {
      for (std::size_t i = k.fetch_add(1); i < n; i = k.fetch_add(1)) {
        if (!made[i]) continue;
        try {
          destroy(made[i]->id);
        } catch (const Error&) {
          // Its TTL takes it.
        }
      }
    });
    if (last_error) throw *last_error;
    throw Error(Code::kInternal, "create_many: sandboxes missing without an error");
  }
  std::vector<SandboxInfo> out;
  out.reserve(n);
  for (auto& m : made) out.push_back(std::move(*m));
  return out;
}

std::vector<NodePtr> ClientCore::nodes_of(const std::vector<std::string>& members) {
  std::vector<NodePtr> out;
  auto deadline = deadline_after();
  for (const auto& id : members) {
    NodePtr node;
    try {
      node = route(id, deadline);
    } catch (const NodeLost&) {
      node = nodes_.route(id);  // its node is gone or ejected: still worth a try for the group as a whole
    } catch (const Error&) {
      continue;
    }
    if (node && std::find(out.begin(), out.end(), node) == out.end()) out.push_back(node);
  }
  return out;
}

void ClientCore::renew_group(const std::string& group, const std::vector<std::string>& members,
                             std::chrono::seconds ttl) {
  check_open();
  const std::string body = protocol::json{{"ttl", ttl.count()}}.dump();
  std::vector<std::string> failed;
  for (const NodePtr& node : nodes_of(members)) {
    auto deadline = deadline_after();
    try {
      retrying(deadline, [&] {
        return call(node, http_request("POST", fmt::format("/v1/groups/{}/renew", url_escape(group)), body, kJson),
                    deadline);
      });
    } catch (const Error& e) {
      failed.push_back(fmt::format("{} ({})", node->endpoint, e.what()));
    }
  }
  if (!failed.empty())
    throw Error(Code::kUnavailable, fmt::format("group {}: lease not renewed on {}", group, fmt::join(failed, "; ")));
}

void ClientCore::destroy_group(const std::string& group, const std::vector<std::string>& members) {
  std::vector<std::string> failed;
  for (const NodePtr& node : nodes_of(members)) {
    auto deadline = deadline_after();
    try {
      retrying(deadline, [&] {
        return call(node, http_request("DELETE", fmt::format("/v1/groups/{}", url_escape(group))), deadline);
      });
    } catch (const Error& e) {
      if (e.code() == Code::kNotFound) continue;
      failed.push_back(fmt::format("{} ({})", node->endpoint, e.what()));
    }
  }
  if (!failed.empty())
    throw Error(Code::kUnavailable, fmt::format("group {}: not destroyed on {}", group, fmt::join(failed, "; ")));
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

HttpResponse ClientCore::call_sandbox(const std::string& id, const HttpRequest& request, SandboxCall how) {
  auto deadline = deadline_after(how.extra);
  if (how.request_id.empty())
    return retrying(deadline, [&] {
      NodePtr node = route(id, deadline);
      return how.repeatable ? call(node, request, deadline, how.extra) : call_once(node, request, deadline, how.extra);
    });
  bool maybe_sent = false;
  return exactly_once(id, how.request_id, maybe_sent, [&] {
    return retrying(deadline, [&] {
      NodePtr node = route(id, deadline);
      try {
        return call(node, request, deadline, how.extra);
      } catch (const TransportError& e) {
        maybe_sent = maybe_sent || e.maybe_sent();
        throw;
      }
    });
  });
}

template <typename Op>
auto ClientCore::exactly_once(const std::string& id, const std::string& request_id, const bool& maybe_sent, Op&& op)
    -> decltype(op()) {
  try {
    return op();
  } catch (const OutcomeUnknown&) {
    throw;
  } catch (const Error& e) {
    if (auto unknown = outcome_unknown(e, id, request_id, maybe_sent)) throw *unknown;
    throw;
  }
}

std::optional<OutcomeUnknown> outcome_unknown(const Error& e, const std::string& id, const std::string& request_id,
                                              bool maybe_sent) {
  if (dynamic_cast<const OutcomeUnknown*>(&e)) return std::nullopt;
  // The agent knows the command was under way when it stopped, and so never learnt how it ended.
  if (e.code() == Code::kDataLoss && std::string_view(e.what()).find("outcome unknown:") != std::string_view::npos)
    return OutcomeUnknown(request_id, e.what());
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

std::vector<SandboxInfo> ClientCore::list(const Labels& labels, const std::string& tenant) {
  std::string target = "/v1/sandboxes";
  char sep = '?';
  for (const auto& [k, v] : labels) {
    target += fmt::format("{}label={}", sep, url_escape(k + "=" + v));
    sep = '&';
  }
  if (!tenant.empty()) target += fmt::format("{}tenant={}", sep, url_escape(tenant));
  std::vector<SandboxInfo> out;
  for (const auto& v : nodes_.view()) {
    auto deadline = deadline_after();
    auto r = retrying(deadline, [&] { return call(v.node, http_request("GET", target), deadline); });
    auto part = decode_sandbox_list(r, "GET /v1/sandboxes");
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

SnapshotResult ClientCore::snapshot(const std::string& id, std::string_view name) {
  const std::string body = protocol::json{{"name", std::string(name)}, {"request_id", random_request_id()}}.dump();
  // A snapshot copies files and compresses a layer: each exchange may take far longer than request_timeout. A
  // retry carries the same request id, so the agent answers it with the snapshot the first attempt takes.
  auto deadline = deadline_after(kSnapshotTime);
  auto r = retrying(deadline, [&] {
    return call(route(id, deadline), http_request("POST", sandbox_path(id, "/snapshot"), body, kJson), deadline,
                kSnapshotTime);
  });
  constexpr const char* what = "POST /v1/sandboxes/{id}/snapshot";
  protocol::json j = parse_json(r, what);
  SnapshotResult out;
  try {
    out.image = j.at("image").get<std::string>();
    out.sandbox_id = j.at("sandbox").get<std::string>();
    out.parent = j.at("parent").get<std::string>();
    out.store = j.at("store").get<std::string>();
    const auto& layer = j.at("layer");
    out.layer_digest = layer.at("digest").get<std::string>();
    out.layer_bytes = layer.at("size").get<std::uint64_t>();
    out.stored_bytes = layer.at("stored_size").get<std::uint64_t>();
    const auto& files = j.at("files");
    out.file_bytes = files.at("bytes").get<std::uint64_t>();
    out.entries = files.at("entries").get<std::uint64_t>();
    out.frozen_seconds = j.at("frozen_seconds").get<double>();
    out.seconds = j.at("seconds").get<double>();
    out.spec = protocol::decode_spec(j.at("spec"));
  } catch (const Error& e) {
    throw Error(Code::kInternal, fmt::format("{}: malformed answer: {}", what, e.what()));
  } catch (const std::exception& e) {
    throw Error(Code::kInternal, fmt::format("{}: malformed answer: {}", what, e.what()));
  }
  return out;
}

std::vector<SandboxInfo> ClientCore::fork(const std::string& id, std::size_t n, std::string_view name, bool keep) {
  if (n == 0) throw Error(Code::kInvalidArgument, "fork: n must be at least 1");
  if (name.empty()) {
    // A backend that can copy a running sandbox (a microVM: processes and memory too) does it on the sandbox's
    // node; the others answer UNIMPLEMENTED and fork through a snapshot of the files. Not retried: the copies may
    // exist once the request arrived.
    const std::string body = protocol::json{{"count", n}}.dump();
    auto deadline = deadline_after(kSnapshotTime);
    try {
      auto r = call(route(id, deadline), http_request("POST", sandbox_path(id, "/fork"), body, kJson), deadline,
                    kSnapshotTime);
      return decode_sandbox_list(r, "POST /v1/sandboxes/{id}/fork");
    } catch (const Error& e) {
      if (e.code() != Code::kUnimplemented) throw;
    }
  }
  std::string snapshot_name(name);
  const bool generated = snapshot_name.empty();
  if (generated) {
    // A repository part starts with a letter or digit; sandbox ids are letters, digits, '-', '_' and '.'.
    std::string_view head = id.empty() ? std::string_view("x") : std::string_view(id).substr(0, 1);
    bool alnum = std::isalnum(static_cast<unsigned char>(head.front()));
    snapshot_name = fmt::format("{}{}{}:{}", protocol::kForkSnapshotPrefix, alnum ? "" : "x", id,
                                random_request_id().substr(0, 16));
  }
  SnapshotResult snap = snapshot(id, snapshot_name);
  SandboxSpec spec = snap.spec;
  spec.image = snap.image;
  spec.request_id.clear();
  spec.group.clear();
  spec.group_ttl = std::chrono::seconds{0};
  spec.labels.erase(std::string(kRequestLabel));
  spec.labels.erase(std::string(kPulseLabel));
  // A generated snapshot lives as long as the sandboxes made from it: their nodes remove its tag when the last of
  // them goes (protocol::kForkSnapshotLabel). A copy of a fork child does not keep its parent's snapshot.
  spec.labels.erase(std::string(protocol::kForkSnapshotLabel));
  if (generated && !keep)
    spec.labels[std::string(protocol::kForkSnapshotLabel)] = image::parse_reference(snap.image).tagged();
  return create_many(n, spec);
}

ExecResult ClientCore::exec(const std::string& id, const ExecRequest& request) {
  // The agent's own validation, run here first: a malformed request fails before it costs a round trip.
  const protocol::json encoded = protocol::encode(request);
  protocol::decode_exec_request(encoded);
  const milliseconds exec_time{static_cast<std::int64_t>(request.timeout_seconds * 1000.0)};
  // Exactly once on the agent by its request id (one is made when the caller gave none), so retries are safe.
  const std::string request_id = request.request_id.empty() ? random_request_id() : request.request_id;
  protocol::json with_id = encoded;
  with_id["request_id"] = request_id;
  auto r = call_sandbox(id, http_request("POST", sandbox_path(id, "/exec"), with_id.dump(), kJson),
                        {exec_time, true, request_id});
  return protocol::decode_exec_result(parse_json(r, "POST /v1/sandboxes/{id}/exec"));
}

namespace {
// Carries an on_output exception through curl and the retry loop, which must neither wrap nor retry it.
struct OutputCallbackFailed {};
}  // namespace

ExecResult ClientCore::exec_stream(const std::string& id, const ExecRequest& request,
                                   const std::function<void(int fd, std::string_view data)>& on_output) {
  protocol::json encoded = protocol::encode(request);
  protocol::decode_exec_request(encoded);
  encoded["stream"] = true;
  const std::string request_id = request.request_id.empty() ? random_request_id() : request.request_id;
  encoded["request_id"] = request_id;
  const milliseconds exec_time{static_cast<std::int64_t>(request.timeout_seconds * 1000.0)};
  return stream_command(id, "/exec", encoded.dump(), exec_time, on_output, request_id);
}

ExecResult ClientCore::stream_command(const std::string& id, std::string_view suffix, const std::string& body,
                                      milliseconds run_time,
                                      const std::function<void(int fd, std::string_view data)>& on_output,
                                      const std::string& request_id) {
  auto deadline = deadline_after(run_time);
  std::exception_ptr callback_error;
  std::optional<ExecStreamDecoder> decoder;
  HttpRequest http = http_request("POST", sandbox_path(id, suffix), body, kJson);
  http.on_body = [&](std::string_view bytes) { decoder->feed(bytes); };
  // What on_output has had, over every attempt: a retry's answer starts again from the first byte.
  StreamReplayFilter replay;
  bool maybe_sent = false;
  auto attempts = [&] {
    return retrying(deadline, [&] {
      NodePtr node = route(id, deadline);
      replay.new_attempt();
      decoder.emplace([&](int fd, std::string_view data) {
        data = replay.fresh(fd, data);
        if (data.empty() || !on_output) return;
        try {
          on_output(fd, data);
        } catch (...) {
          callback_error = std::current_exception();
          throw OutputCallbackFailed{};
        }
      });
      if (request_id.empty()) return call_once(node, http, deadline, run_time);  // never twice
      try {
        return call(node, http, deadline, run_time);
      } catch (const TransportError& e) {
        maybe_sent = maybe_sent || e.maybe_sent();
        throw;
      }
    });
  };
  try {
    if (request_id.empty()) attempts();
    else exactly_once(id, request_id, maybe_sent, attempts);
  } catch (const OutputCallbackFailed&) {
    std::rethrow_exception(callback_error);
  }
  return decoder->finish();
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
