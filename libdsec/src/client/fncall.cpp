// Function calls from the client (Client::run_code, run_code_many): the call is validated here with the agent's own
// decoder, its image resolved and pinned like a create's, its node chosen for warm pools and load
// (client/fncall_placement.hpp), and the exchange retried under one deadline with the same request id, so a retried
// call is answered once by its node. A node that keeps failing is left for another; a batch is cut into chunks per
// node that travel as POST /v1/fncall/batch, several at once, and a failed node's chunks go to the other nodes.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "common/protocol.hpp"
#include "dsec/retry.hpp"

namespace dsec::detail {
namespace {

using std::chrono::milliseconds;

// C and C++ calls compile before they run (the agent bounds a compile by a minute); an exchange allows this much on
// top of the call's own timeout.
constexpr double kCompileAllowanceSeconds = 60;
// A node queues a call while its pool has no free fork server (for at most a minute by default, then answers
// RESOURCE_EXHAUSTED); an exchange allows for that wait too.
constexpr double kQueueAllowanceSeconds = 60;
// A batch keeps this many chunks in flight on each node, each of about kCallsPerChunkPerCore calls per core of the
// node (at least kMinChunkCalls, at most the agent's kMaxFnCallBatch): enough queued to keep its pools busy while
// one chunk waits for its slowest call, small enough that a failed node's work moves on in pieces.
constexpr std::size_t kChunksInFlightPerNode = 4;
constexpr std::size_t kCallsPerChunkPerCore = 8;
constexpr std::size_t kMinChunkCalls = 16;

std::mt19937_64& fncall_rng() {
  thread_local std::mt19937_64 rng = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd()};
    return std::mt19937_64(seq);
  }();
  return rng;
}

void sleep_for(milliseconds d) { std::this_thread::sleep_for(d); }

milliseconds to_ms(double seconds) {
  return milliseconds{static_cast<std::int64_t>(std::ceil(std::max(0.0, seconds) * 1000.0))};
}

// The longest a call may run on its node: its timeout, and its compile for C and C++.
double call_seconds(const FnCallRequest& r) {
  return r.timeout_seconds + (r.language == "c" || r.language == "cpp" ? kCompileAllowanceSeconds : 0.0);
}

FnCallResult error_result(Code code, std::string message) {
  FnCallResult r;
  r.error_code = std::string(code_name(code));
  r.error = std::move(message);
  return r;
}

// Counts calls as in flight on a node for as long as they are sent and not answered.
class InFlight {
 public:
  InFlight(Node& node, int calls) : node_(node), calls_(calls) { node_.calls_in_flight += calls_; }
  ~InFlight() { node_.calls_in_flight -= calls_; }
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;

 private:
  Node& node_;
  int calls_;
};

// Whether a failed exchange with one node may go to another node: transient failures, a node that does not serve
// the call (an agent without the backend or the language, or without a default image: FAILED_PRECONDITION,
// UNIMPLEMENTED), and a node that broke or timed out. A refusal of the call itself (INVALID_ARGUMENT, NOT_FOUND for
// its image, PERMISSION_DENIED...) would be the same anywhere.
bool another_node_may_help(const Error& e) {
  if (dynamic_cast<const TransportError*>(&e)) return e.code() != Code::kInvalidArgument;
  switch (e.code()) {
    case Code::kUnavailable:
    case Code::kResourceExhausted:
    case Code::kAborted:
    case Code::kUnimplemented:
    case Code::kFailedPrecondition:
    case Code::kInternal:
    case Code::kUnknown:
      return true;
    default:
      return e.retryable();
  }
}

}  // namespace

std::vector<FnCallCandidate> ClientCore::fncall_candidates(const FnCallNeeds& needs,
                                                           const std::vector<NodeView>& nodes) {
  std::vector<FnCallCandidate> out;
  out.reserve(nodes.size());
  static const std::vector<std::string> kNone;
  for (const auto& v : nodes) {
    const bool known = v.info.has_value();
    out.push_back(fncall_candidate(v.id.empty() ? v.node->endpoint : v.id, !v.ejected, known,
                                   known ? v.info->backends : kNone, known ? v.info->cores : 0,
                                   known ? v.info->load1 : 0.0, v.fncall, needs, v.calls_in_flight));
  }
  return out;
}

FnCallResult ClientCore::run_code(FnCallRequest request) {
  check_open();
  if (request.request_id.empty()) request.request_id = random_request_id();
  protocol::json body = protocol::encode(request);
  protocol::decode_fncall_request(body);  // the agent's own validation: a bad call fails before a round trip
  std::shared_ptr<const ResolvedImageRef> image;
  if (!request.image.empty() && images_->enabled()) image = images_->resolve(request.image);
  if (image) {
    body["image"] = image->reference;
    body["image_manifest"] = image->manifest_json;
  }
  const std::string text = body.dump();
  const std::string image_ref = image ? image->reference : request.image;
  const milliseconds run_time = to_ms(call_seconds(request) + kQueueAllowanceSeconds);
  const auto deadline = deadline_after(run_time);

  std::vector<NodePtr> excluded;  // failed this call
  std::optional<Error> last_error;
  for (;;) {
    check_open();
    if (SteadyClock::now() >= deadline)
      throw Error(Code::kDeadlineExceeded,
                  fmt::format("run_code: no node ran the call within the call deadline{}",
                              last_error ? fmt::format(" (last error: {})", last_error->what()) : std::string()));
    NodePtr node;
    auto all = nodes_.view();
    if (all.size() == 1) {
      // One node: nothing to choose (and no GET /v1/node on the way), nowhere else to go.
      if (!excluded.empty()) throw *last_error;
      node = all.front().node;
    } else if (all.empty()) {
      throw Error(Code::kUnavailable, "run_code: this client has no node");
    } else {
      refresh_node_info(deadline);
      std::vector<NodeView> views;
      for (auto& v : nodes_.view())
        if (std::find(excluded.begin(), excluded.end(), v.node) == excluded.end()) views.push_back(std::move(v));
      try {
        if (views.empty()) throw Error(Code::kUnavailable, "run_code: every node failed this call");
        FnCallNeeds needs{request.language, image_ref, request.gpu_mode, request.gpus};
        auto chosen = place_fncalls(fncall_candidates(needs, views), 1, request.request_id);
        node = views.at(chosen.front()).node;
      } catch (const Error&) {
        if (last_error) throw *last_error;
        throw;
      }
    }
    HttpResponse r;
    try {
      InFlight counted(*node, 1);
      // Transient failures are retried on the node with the same request id: it runs the call once and answers
      // every retry with that run's result.
      r = retry_call<SteadyClock>(options_.retry, deadline, sleep_for, fncall_rng(), [&] {
        check_open();
        return call(node, http_request("POST", "/v1/fncall", text, kJson), deadline, run_time);
      });
    } catch (const Error& e) {
      if (closed() || !another_node_may_help(e)) throw;
      excluded.push_back(node);
      last_error = e;
      continue;
    }
    FnCallResult result;
    try {
      result = protocol::decode_fncall_result(parse_json(r, "POST /v1/fncall"));
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      throw Error(Code::kInternal,
                  fmt::format("POST /v1/fncall on {}: malformed answer: {}", node->endpoint, e.what()));
    }
    if (!result.error_code.empty())
      throw Error(code_from_name(result.error_code),
                  fmt::format("POST /v1/fncall on {}: {}", node->endpoint, result.error));
    if (result.node.empty()) result.node = nodes_.view(node).id;
    return result;
  }
}

std::vector<FnCallResult> ClientCore::run_code_many(const std::vector<FnCallRequest>& requests) {
  check_open();
  const std::size_t n = requests.size();
  std::vector<FnCallResult> results(n);
  if (n == 0) return results;
  const std::string base = random_request_id();

  // Every call validated and its image pinned here; a call that fails either gets its error now and is not sent.
  struct Call {
    std::size_t index;
    protocol::json body;
    std::string language;
    std::string image;  // the pinned reference, or the name as given (resolved by the node), or "" (its default)
    GpuMode gpu_mode;
    std::uint32_t gpus;
    double seconds;
    int attempts = 0;
  };
  std::vector<Call> calls;
  calls.reserve(n);
  std::size_t own_errors = 0;
  std::map<std::string, std::shared_ptr<const ResolvedImageRef>> resolved;
  std::map<std::string, Error> unresolved;
  for (std::size_t i = 0; i < n; ++i) {
    const FnCallRequest& req = requests[i];
    try {
      protocol::json body = protocol::encode(req);
      if (req.request_id.empty()) body["request_id"] = fmt::format("{}-{}", base, i);
      protocol::decode_fncall_request(body);
      std::string image_ref = req.image;
      if (!req.image.empty() && images_->enabled()) {
        if (auto bad = unresolved.find(req.image); bad != unresolved.end()) throw bad->second;
        auto it = resolved.find(req.image);
        if (it == resolved.end()) {
          try {
            it = resolved.emplace(req.image, images_->resolve(req.image)).first;
          } catch (const Error& e) {
            unresolved.emplace(req.image, e);
            throw;
          }
        }
        body["image"] = it->second->reference;
        body["image_manifest"] = it->second->manifest_json;
        image_ref = it->second->reference;
      }
      calls.push_back(
          Call{i, std::move(body), req.language, std::move(image_ref), req.gpu_mode, req.gpus, call_seconds(req)});
    } catch (const Error& e) {
      results[i] = error_result(e.code(), e.what());
      ++own_errors;
    }
  }
  if (calls.empty()) return results;

  // The batch's deadline: the call deadline for retries and failover, plus the calls' own time spread over the
  // nodes' cores (a bound for a node that stops answering, not a forecast).
  refresh_node_info(deadline_after());
  double cores = 0, total_seconds = 0, max_seconds = 0;
  for (const auto& v : nodes_.view())
    if (v.info && !v.ejected) cores += std::max<double>(1, v.info->cores);
  for (const auto& c : calls) {
    total_seconds += c.seconds;
    max_seconds = std::max(max_seconds, c.seconds);
  }
  const auto deadline =
      deadline_after(to_ms(total_seconds / std::max(1.0, cores) + max_seconds + kQueueAllowanceSeconds));

  std::vector<std::size_t> pending(calls.size());  // indices into `calls`
  for (std::size_t k = 0; k < calls.size(); ++k) pending[k] = k;
  std::vector<NodePtr> excluded;     // failed this batch
  std::optional<Error> node_error;   // the last failure of a whole node
  std::optional<Error> place_error;  // why calls could not be placed at all
  bool any_answer = false;           // some node answered a chunk
  std::mutex mu;                     // guards results, calls' attempts and the round's bookkeeping below

  // A call that cannot go anywhere: the last node failure says why, when there was one.
  auto unplaced = [&](std::size_t k, const Error& why) {
    const Error& e = node_error ? *node_error : why;
    results[calls[k].index] = error_result(e.code(), fmt::format("no node could run this call: {}", e.what()));
  };

  for (int round = 1; !pending.empty(); ++round) {
    if (closed()) throw Error(Code::kFailedPrecondition, "this dsec client is closed");
    if (SteadyClock::now() >= deadline || round > std::max(1, options_.retry.max_attempts)) {
      Error e(Code::kDeadlineExceeded, "run_code_many: the call was not answered within the deadline and retries");
      for (std::size_t k : pending)
        if (results[calls[k].index].error.empty()) unplaced(k, e);
      break;
    }

    // Place every pending call: grouped by what they need of a node (language and image decide the warm pools).
    auto all = nodes_.view();
    std::vector<NodeView> views;
    if (all.size() > 1) refresh_node_info(deadline);
    for (auto& v : nodes_.view())
      if (std::find(excluded.begin(), excluded.end(), v.node) == excluded.end()) views.push_back(std::move(v));
    std::vector<std::vector<std::size_t>> per_node(views.size());
    if (views.empty()) {
      Error e(Code::kUnavailable, "every node of this client failed this batch");
      for (std::size_t k : pending) unplaced(k, e);
      break;
    }
    if (all.size() == 1) {
      per_node[0] = pending;  // one node: it decides itself
    } else {
      std::map<std::tuple<std::string, std::string, GpuMode, std::uint32_t>, std::vector<std::size_t>> groups;
      for (std::size_t k : pending)
        groups[{calls[k].language, calls[k].image, calls[k].gpu_mode, calls[k].gpus}].push_back(k);
      for (const auto& [key, members] : groups) {
        try {
          FnCallNeeds needs{std::get<0>(key), std::get<1>(key), std::get<2>(key), std::get<3>(key)};
          auto chosen = place_fncalls(fncall_candidates(needs, views), members.size(),
                                      fmt::format("{}-{}-{}", base, needs.language, round));
          for (std::size_t j = 0; j < members.size(); ++j) per_node[chosen[j]].push_back(members[j]);
        } catch (const Error& e) {
          place_error = e;
          for (std::size_t k : members) unplaced(k, e);
        }
      }
    }

    // Chunks per node, several in flight on each node and up to create_concurrency in all.
    struct Chunk {
      std::size_t node;                // index into views
      std::vector<std::size_t> calls;  // indices into `calls`
    };
    std::vector<Chunk> chunks;
    for (std::size_t v = 0; v < views.size(); ++v) {
      const auto& list = per_node[v];
      const std::size_t node_cores = views[v].info ? std::max<std::size_t>(1, views[v].info->cores) : 2;
      const std::size_t size =
          std::clamp(kCallsPerChunkPerCore * node_cores, kMinChunkCalls, protocol::kMaxFnCallBatch);
      for (std::size_t at = 0; at < list.size(); at += size)
        chunks.push_back(Chunk{
            v, std::vector<std::size_t>(list.begin() + static_cast<std::ptrdiff_t>(at),
                                        list.begin() + static_cast<std::ptrdiff_t>(std::min(list.size(), at + size)))});
    }
    pending.clear();
    if (chunks.empty()) break;

    std::condition_variable cv;
    std::vector<std::size_t> in_flight(views.size(), 0);
    std::vector<bool> started(chunks.size(), false);
    std::vector<bool> node_failed(views.size(), false);
    std::size_t unstarted = chunks.size();
    bool call_retry = false;  // some call answered a transient error of its own: back off before the next round

    auto chunk_failed = [&](const Chunk& chunk, const Error& e) {
      std::lock_guard lock(mu);
      if (!closed() && another_node_may_help(e)) {
        // The node failed as a whole: this chunk and its others not yet sent go to the other nodes.
        node_error = e;
        if (!node_failed[chunk.node]) {
          node_failed[chunk.node] = true;
          excluded.push_back(views[chunk.node].node);
          for (std::size_t c = 0; c < chunks.size(); ++c) {
            if (started[c] || chunks[c].node != chunk.node) continue;
            started[c] = true;
            --unstarted;
            pending.insert(pending.end(), chunks[c].calls.begin(), chunks[c].calls.end());
          }
        }
        pending.insert(pending.end(), chunk.calls.begin(), chunk.calls.end());
      } else {
        for (std::size_t k : chunk.calls) results[calls[k].index] = error_result(e.code(), e.what());
      }
    };

    auto run_chunk = [&](const Chunk& chunk) {
      const NodePtr& node = views[chunk.node].node;
      protocol::json batch{{"calls", protocol::json::array()}};
      double longest = 0;
      for (std::size_t k : chunk.calls) {
        batch["calls"].push_back(calls[k].body);
        longest = std::max(longest, calls[k].seconds);
      }
      const std::string text = batch.dump();
      // The node may run this chunk behind the others in flight there, a core's worth of calls at a time.
      const double node_cores = views[chunk.node].info ? std::max<double>(1, views[chunk.node].info->cores) : 1;
      const double waves = std::ceil(static_cast<double>(kChunksInFlightPerNode * chunk.calls.size()) / node_cores);
      const milliseconds run_time = to_ms(waves * longest + kQueueAllowanceSeconds);
      try {
        InFlight counted(*node, static_cast<int>(chunk.calls.size()));
        HttpResponse r = retry_call<SteadyClock>(options_.retry, deadline, sleep_for, fncall_rng(), [&] {
          check_open();
          return call(node, http_request("POST", "/v1/fncall/batch", text, kJson), deadline, run_time);
        });
        protocol::json answer = parse_json(r, "POST /v1/fncall/batch");
        auto it = answer.find("results");
        if (it == answer.end() || !it->is_array() || it->size() != chunk.calls.size())
          throw Error(
              Code::kInternal,
              fmt::format("POST /v1/fncall/batch on {}: sent {} calls, the answer has {} results", node->endpoint,
                          chunk.calls.size(), it != answer.end() && it->is_array() ? it->size() : 0));
        std::vector<FnCallResult> got;
        got.reserve(chunk.calls.size());
        for (const auto& element : *it) got.push_back(protocol::decode_fncall_result(element));
        const std::string node_id = nodes_.view(node).id;
        std::lock_guard lock(mu);
        any_answer = true;
        for (std::size_t j = 0; j < got.size(); ++j) {
          Call& c = calls[chunk.calls[j]];
          FnCallResult& res = got[j];
          ++c.attempts;
          if (!res.error_code.empty()) {
            // The node's verdict on this call; a transient one is tried again next round (anywhere).
            if (is_retryable(code_from_name(res.error_code)) && c.attempts < options_.retry.max_attempts) {
              pending.push_back(chunk.calls[j]);
              call_retry = true;
            }
            res.error = fmt::format("{} (node {})", res.error, node_id.empty() ? node->endpoint : node_id);
          } else if (res.node.empty()) {
            res.node = node_id;
          }
          results[c.index] = std::move(res);
        }
      } catch (const Error& e) {
        chunk_failed(chunk, e);
      } catch (const std::exception& e) {
        chunk_failed(chunk,
                     Error(Code::kInternal, fmt::format("POST /v1/fncall/batch on {}: {}", node->endpoint, e.what())));
      }
    };

    const std::size_t workers = std::min(chunks.size(), std::max<std::size_t>(1, options_.create_concurrency));
    std::vector<std::thread> threads;
    auto worker = [&] {
      for (;;) {
        std::size_t pick = chunks.size();
        {
          std::unique_lock lock(mu);
          for (;;) {
            if (unstarted == 0) return;
            for (std::size_t c = 0; c < chunks.size(); ++c)
              if (!started[c] && in_flight[chunks[c].node] < kChunksInFlightPerNode) {
                pick = c;
                break;
              }
            if (pick < chunks.size()) break;
            cv.wait(lock);
          }
          started[pick] = true;
          --unstarted;
          ++in_flight[chunks[pick].node];
        }
        run_chunk(chunks[pick]);
        {
          std::lock_guard lock(mu);
          --in_flight[chunks[pick].node];
        }
        cv.notify_all();
      }
    };
    threads.reserve(workers);
    try {
      for (std::size_t w = 0; w < workers; ++w) threads.emplace_back(worker);
    } catch (...) {
      {
        std::lock_guard lock(mu);
        for (std::size_t c = 0; c < chunks.size(); ++c)
          if (!started[c]) {
            started[c] = true;
            --unstarted;
          }
      }
      cv.notify_all();
      for (auto& t : threads) t.join();
      throw;
    }
    for (auto& t : threads) t.join();

    std::sort(pending.begin(), pending.end());
    pending.erase(std::unique(pending.begin(), pending.end()), pending.end());
    if (call_retry && !pending.empty()) {
      auto cap = options_.retry.backoff_cap(round + 1);
      std::uniform_int_distribution<std::int64_t> dist(0, cap.count());
      auto wait = milliseconds{dist(fncall_rng())};
      if (SteadyClock::now() + wait < deadline) sleep_for(wait);
    }
  }

  if (closed()) throw Error(Code::kFailedPrecondition, "this dsec client is closed");
  // No node took any of the calls: that is the batch's failure, not each call's.
  if (!any_answer && own_errors == 0 && (node_error || place_error)) {
    const Error& e = node_error ? *node_error : *place_error;
    throw Error(e.code(), fmt::format("run_code_many: no node could run any of the {} calls: {}", n, e.what()),
                e.retryable(), e.fault());
  }
  return results;
}

}  // namespace dsec::detail
