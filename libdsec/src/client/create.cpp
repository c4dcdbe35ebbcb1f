// Creates: one sandbox (create) or a pulse of them (create_many), placed on the client's nodes, batched per node and
// spec, and moved to another node when one fails.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "client/client_core_internal.hpp"
#include "common/protocol.hpp"

namespace dsec::detail {
namespace {

using std::chrono::milliseconds;

// Placement uses what nodes said about themselves at most this long ago (plus what this client placed since).
constexpr milliseconds kInfoMaxAge{2'000};
// The most sandboxes one create request asks a node for (the agent's limit).
constexpr std::size_t kMaxBatch = 1024;
// A full VM's create may boot a whole system (its kernel, systemd, a desktop: about a minute under TCG, and the
// agent's boot timeout is 300 s) before it answers: each exchange and the call may take that much longer.
constexpr milliseconds kFullSystemBootTime{600'000};
// A create that may wait for room on a full node (queue_timeout) may take that much longer too.
milliseconds create_time(const SandboxSpec& spec) {
  return (spec.kind == "vm" ? kFullSystemBootTime : milliseconds{0}) + spec.queue_timeout;
}

// The agent gets the exact manifest the client resolved: the same layers for every sandbox of a pulse, and no tag
// lookup on the node.
void pin_image(protocol::json& request, const ResolvedImageRef* image) {
  if (!image) return;
  request["image"] = image->reference;
  request["image_manifest"] = image->manifest_json;
}

}  // namespace

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
    for (const auto& s : answers::sandbox_list(r, "GET /v1/sandboxes")) {
      if (std::find(keep.begin(), keep.end(), s.id) != keep.end() || s.state == "destroyed") continue;
      try {
        const SandboxRequest destroy = requests::destroy(s.id);
        call(node, destroy.http(), deadline);
      } catch (const Error&) {
      }
    }
  } catch (const Error&) {
    // Unreachable: whatever it made is reaped with its TTL (or its group's lease).
  }
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

// One create_many in flight: the distinct specs of the pulse, where each of its sandboxes ("slots") stands, and
// what went wrong. Each round places the slots still pending, sends one batch request per node and spec, and keeps
// what failed for the next round on other nodes; at the end it is all or nothing.
class Pulse {
 public:
  Pulse(ClientCore& core, const std::vector<SandboxSpec>& specs, std::string group, std::chrono::seconds group_ttl);
  std::vector<SandboxInfo> run();

 private:
  // A distinct spec of the pulse (equal specs share one), placed and sent as batches of its own.
  struct Kind {
    SandboxSpec spec;
    std::shared_ptr<const ResolvedImageRef> image;
  };
  // One batch request: `slots` (indices into the result) of one kind on one node.
  struct Batch {
    NodePtr node;
    std::size_t kind = 0;
    std::vector<std::size_t> slots;
    std::string request_id;
  };

  // Sorts the specs into kinds (resolving each kind's image once).
  void sort_kinds(const std::vector<SandboxSpec>& specs);
  // False, with last_error_ set, once the call deadline has passed.
  bool in_time();
  // A node for each pending slot; false when none can be placed (last_error_ says why).
  bool place_pending(std::vector<NodePtr>& where);
  // The batch requests for the pending slots placed at `where` (split at the agent's batch limit).
  std::vector<Batch> batches_of(const std::vector<NodePtr>& where);
  // Sends every batch at once; false when a failure ends the pulse, else the failed slots are pending again.
  bool send(std::vector<Batch>& batches);
  void send_batch(const Batch& batch);
  // A batch that failed with `e`: its node is excluded from now on, its slots go to `failed`.
  void batch_failed(const Batch& batch, const Error& e, std::vector<std::size_t>& failed);
  // Removes the copies of nodes that may have made a batch that failed, and either returns every sandbox or takes
  // back what was made and throws.
  std::vector<SandboxInfo> finish();
  std::vector<std::string> made_ids();
  // A group's lease is kept alive while the pulse is still being made (a slow node, a failover), on the nodes that
  // already hold members; the SandboxGroup's own renewal takes over when create_many returns.
  void keep_lease();
  void stop_lease();  // idempotent

  ClientCore& core_;
  const std::size_t n_;
  const std::string group_;
  const std::chrono::seconds group_ttl_;
  milliseconds boot_time_{0};
  SteadyClock::time_point deadline_;
  std::string base_;       // the pulse's request id: batches are base-0, base-1, ...
  bool labelled_ = false;  // with several nodes, every sandbox carries kPulseLabel=base
  std::vector<Kind> kinds_;
  std::vector<std::size_t> kind_of_;  // slot -> index into kinds_
  std::vector<std::size_t> pending_;  // slots not made yet
  std::size_t batch_no_ = 0;

  std::mutex mu_;  // guards what the batches' workers share: made_, excluded_, maybe_made_, last_error_, pending_
  std::vector<std::optional<SandboxInfo>> made_;
  std::vector<NodePtr> excluded_;    // refused, failed or timed out for this pulse
  std::vector<NodePtr> maybe_made_;  // timed out after a batch may have arrived
  std::optional<Error> last_error_;

  std::mutex lease_mu_;
  std::condition_variable lease_cv_;
  bool done_ = false;
  std::thread lease_keeper_;
};

Pulse::Pulse(ClientCore& core, const std::vector<SandboxSpec>& specs, std::string group, std::chrono::seconds group_ttl)
    : core_(core), n_(specs.size()), group_(std::move(group)), group_ttl_(group_ttl), made_(specs.size()) {
  for (const auto& s : specs) {
    protocol::validate(s);
    boot_time_ = std::max(boot_time_, create_time(s));
  }
  deadline_ = core_.deadline_after(boot_time_);
  base_ = specs.front().request_id.empty() ? random_request_id() : specs.front().request_id;
  labelled_ = core_.nodes_.live_count() > 1;
  sort_kinds(specs);
  pending_.resize(n_);
  for (std::size_t i = 0; i < n_; ++i) pending_[i] = i;
}

void Pulse::sort_kinds(const std::vector<SandboxSpec>& specs) {
  kind_of_.resize(n_);
  std::map<std::string, std::size_t> by_encoding;
  for (std::size_t i = 0; i < n_; ++i) {
    SandboxSpec s = specs[i];
    s.request_id.clear();
    if (labelled_) s.labels[std::string(kPulseLabel)] = base_;
    auto [it, added] = by_encoding.try_emplace(protocol::encode(s).dump(), kinds_.size());
    if (added) {
      std::shared_ptr<const ResolvedImageRef> image;
      if (core_.images_->enabled()) image = core_.images_->resolve(s.image);
      kinds_.push_back(Kind{std::move(s), std::move(image)});
    }
    kind_of_[i] = it->second;
  }
}

std::vector<SandboxInfo> Pulse::run() {
  if (!group_.empty()) keep_lease();
  struct StopLease {
    Pulse& pulse;
    ~StopLease() { pulse.stop_lease(); }
  } stop_lease{*this};
  while (!pending_.empty()) {
    core_.check_open();
    std::vector<NodePtr> where;
    if (!in_time() || !place_pending(where)) break;
    std::vector<Batch> batches = batches_of(where);
    if (!send(batches)) break;
  }
  return finish();
}

bool Pulse::in_time() {
  if (SteadyClock::now() < deadline_) return true;
  last_error_ =
      Error(Code::kDeadlineExceeded,
            fmt::format("create_many: {} of {} sandboxes not made within the call deadline{}", pending_.size(), n_,
                        last_error_ ? fmt::format(" (last error: {})", last_error_->what()) : std::string()));
  return false;
}

bool Pulse::place_pending(std::vector<NodePtr>& where) {
  where.assign(pending_.size(), nullptr);
  auto all = core_.nodes_.view();
  if (all.size() == 1) {
    // One node: it decides admission itself; nothing to choose, nowhere else to go.
    if (!excluded_.empty()) return false;
    where.assign(pending_.size(), all.front().node);
    return true;
  }
  core_.refresh_node_info(deadline_);
  try {
    for (std::size_t k = 0; k < kinds_.size(); ++k) {
      std::vector<std::size_t> at;  // positions in `pending_` of this kind's slots
      for (std::size_t p = 0; p < pending_.size(); ++p)
        if (kind_of_[pending_[p]] == k) at.push_back(p);
      if (at.empty()) continue;
      auto placed = core_.place(kinds_[k].spec, at.size(), kinds_[k].image.get(), excluded_);
      for (std::size_t j = 0; j < at.size(); ++j) where[at[j]] = std::move(placed[j]);
    }
  } catch (const Error& e) {
    if (!last_error_ || e.code() != Code::kUnavailable) last_error_ = e;
    return false;
  }
  return true;
}

std::vector<Pulse::Batch> Pulse::batches_of(const std::vector<NodePtr>& where) {
  std::map<std::pair<Node*, std::size_t>, std::vector<std::size_t>> by_node;
  std::map<Node*, NodePtr> owner;
  for (std::size_t k = 0; k < pending_.size(); ++k) {
    by_node[{where[k].get(), kind_of_[pending_[k]]}].push_back(pending_[k]);
    owner[where[k].get()] = where[k];
  }
  std::vector<Batch> batches;
  for (auto& [key, slots] : by_node)
    for (std::size_t at = 0; at < slots.size(); at += kMaxBatch) {
      Batch b;
      b.node = owner[key.first];
      b.kind = key.second;
      b.slots.assign(slots.begin() + static_cast<std::ptrdiff_t>(at),
                     slots.begin() + static_cast<std::ptrdiff_t>(std::min(slots.size(), at + kMaxBatch)));
      b.request_id = fmt::format("{}-{}", base_, batch_no_++);
      batches.push_back(std::move(b));
    }
  return batches;
}

bool Pulse::send(std::vector<Batch>& batches) {
  std::vector<std::size_t> failed;
  std::atomic<std::size_t> next{0};
  run_workers(std::min(batches.size(), core_.options_.create_concurrency), [&] {
    for (std::size_t b = next.fetch_add(1); b < batches.size(); b = next.fetch_add(1)) {
      try {
        send_batch(batches[b]);
      } catch (const Error& e) {
        batch_failed(batches[b], e, failed);
      }
    }
  });
  if (last_error_ && !last_error_->retryable() && last_error_->code() != Code::kDeadlineExceeded) return false;
  std::sort(failed.begin(), failed.end());
  pending_ = std::move(failed);
  return true;
}

void Pulse::send_batch(const Batch& batch) {
  const Kind& kind = kinds_[batch.kind];
  SandboxSpec s = kind.spec;
  s.request_id = batch.request_id;
  protocol::json request = protocol::encode(s);
  request["count"] = batch.slots.size();
  if (!group_.empty()) {
    request["group"] = group_;
    request["group_ttl"] = group_ttl_.count();
  }
  pin_image(request, kind.image.get());
  const std::string body = request.dump();
  auto r = core_.retrying(deadline_, [&] {
    return core_.call(batch.node, http_request("POST", "/v1/sandboxes", body, kJson), deadline_, create_time(s));
  });
  auto infos = answers::sandbox_list(r, "POST /v1/sandboxes (count)");
  if (infos.size() != batch.slots.size())
    throw Error(Code::kInternal, fmt::format("POST /v1/sandboxes: asked for {} sandboxes, the agent answered {}",
                                             batch.slots.size(), infos.size()));
  std::lock_guard lock(mu_);
  for (std::size_t k = 0; k < infos.size(); ++k) {
    if (!infos[k].node.empty()) core_.nodes_.learn(batch.node, infos[k].node);
    made_[batch.slots[k]] = std::move(infos[k]);
  }
  core_.nodes_.placed(batch.node, s.resources.cpu * static_cast<double>(batch.slots.size()),
                      s.resources.memory_bytes * batch.slots.size(), batch.slots.size());
}

void Pulse::batch_failed(const Batch& batch, const Error& e, std::vector<std::size_t>& failed) {
  std::lock_guard lock(mu_);
  auto* transport = dynamic_cast<const TransportError*>(&e);
  if (transport && transport->maybe_sent()) maybe_made_.push_back(batch.node);
  if (std::find(excluded_.begin(), excluded_.end(), batch.node) == excluded_.end()) excluded_.push_back(batch.node);
  failed.insert(failed.end(), batch.slots.begin(), batch.slots.end());
  // A refusal that no other node can change (a bad spec, a missing image) ends the pulse.
  if (!e.retryable() && !transport && e.code() != Code::kDeadlineExceeded) {
    last_error_ = e;
    pending_.clear();
  } else if (!last_error_ || last_error_->retryable()) {
    last_error_ = e;
  }
}

std::vector<std::string> Pulse::made_ids() {
  std::lock_guard lock(mu_);
  std::vector<std::string> ids;
  for (const auto& m : made_)
    if (m) ids.push_back(m->id);
  return ids;
}

std::vector<SandboxInfo> Pulse::finish() {
  if (labelled_) {
    const std::vector<std::string> kept = made_ids();
    for (const NodePtr& node : maybe_made_)
      core_.remove_strays(node, std::string(kPulseLabel), base_, kept, core_.deadline_after());
  }
  const bool complete = std::all_of(made_.begin(), made_.end(), [](const auto& m) { return m.has_value(); });
  if (!complete) {
    // All or nothing: take back what was made, as concurrently as it was made.
    std::atomic<std::size_t> k{0};
    run_workers(std::min(n_, core_.options_.create_concurrency), [&] {
      for (std::size_t i = k.fetch_add(1); i < n_; i = k.fetch_add(1)) {
        if (!made_[i]) continue;
        try {
          core_.destroy(made_[i]->id);
        } catch (const Error&) {
          // Its TTL takes it.
        }
      }
    });
    if (last_error_) throw *last_error_;
    throw Error(Code::kInternal, "create_many: sandboxes missing without an error");
  }
  stop_lease();  // before the sandboxes move out of made_, which it reads
  std::vector<SandboxInfo> out;
  out.reserve(n_);
  for (auto& m : made_) out.push_back(std::move(*m));
  return out;
}

void Pulse::keep_lease() {
  lease_keeper_ = std::thread([this] {
    const auto period = std::max<milliseconds>(group_ttl_ / 3, milliseconds(200));
    std::unique_lock lock(lease_mu_);
    while (!lease_cv_.wait_for(lock, period, [&] { return done_; })) {
      lock.unlock();
      const std::vector<std::string> ids = made_ids();
      try {
        if (!ids.empty()) core_.renew_group(group_, ids, group_ttl_);
      } catch (const Error&) {
      }
      lock.lock();
    }
  });
}

void Pulse::stop_lease() {
  {
    std::lock_guard lock(lease_mu_);
    done_ = true;
  }
  lease_cv_.notify_all();
  if (lease_keeper_.joinable()) lease_keeper_.join();
}

std::vector<SandboxInfo> ClientCore::create_many(const std::vector<SandboxSpec>& specs, const std::string& group,
                                                 std::chrono::seconds group_ttl) {
  if (specs.empty()) return {};
  return Pulse(*this, specs, group, group_ttl).run();
}

}  // namespace dsec::detail
