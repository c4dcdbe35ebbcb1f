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
          auto infos = answers::sandbox_list(r, "POST /v1/sandboxes (count)");
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

}  // namespace dsec::detail
