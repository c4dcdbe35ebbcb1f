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

// One run_code_many: every call validated and its image pinned, then rounds that place the pending calls on the
// nodes, send them as chunks per node (several in flight on each) and keep what failed on a node for the next
// round on the others, until every call has its result or the deadline or the retries run out.
class FnCallBatch {
 public:
  FnCallBatch(ClientCore& core, const std::vector<FnCallRequest>& requests)
      : core_(core), requests_(requests), results_(requests.size()) {}
  std::vector<FnCallResult> run();

 private:
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
  // Chunks per node, several in flight on each node and up to create_concurrency in all.
  struct Chunk {
    std::size_t node;                // index into views
    std::vector<std::size_t> calls;  // indices into `calls`
  };
  // One round's nodes, its chunks and what its workers share (under mu_).
  struct Round {
    std::vector<NodeView> views;
    std::vector<Chunk> chunks;
    std::condition_variable cv;
    std::vector<std::size_t> in_flight;
    std::vector<bool> started;
    std::vector<bool> node_failed;
    std::size_t unstarted = 0;
    bool call_retry = false;  // some call answered a transient error of its own: back off before the next round
  };

  // Validates each request and pins its image (each image resolved once); a failure is that call's result.
  void prepare_calls();
  void prepare_call(std::size_t i);
  // The batch's deadline: the call deadline for retries and failover, plus the calls' own time spread over the
  // nodes' cores (a bound for a node that stops answering, not a forecast).
  SteadyClock::time_point batch_deadline();
  // A call that cannot go anywhere: the last node failure says why, when there was one.
  void unplaced(std::size_t k, const Error& why);
  // One round; false when the batch ends with it.
  bool run_round(int round);
  // The pending calls of each of `views` (the nodes not excluded), grouped by what they need of a node.
  std::vector<std::vector<std::size_t>> place_groups(const std::vector<NodeView>& views, int round);
  std::vector<Chunk> chunks_of(const std::vector<NodeView>& views,
                               const std::vector<std::vector<std::size_t>>& per_node) const;
  // Runs the round's chunks on up to create_concurrency worker threads.
  void send_chunks(Round& r);
  void work(Round& r);
  void run_chunk(Round& r, const Chunk& chunk);
  void take_results(Round& r, const Chunk& chunk, const NodePtr& node, std::vector<FnCallResult>& got);
  void chunk_failed(Round& r, const Chunk& chunk, const Error& e);
  // Before the next round, when some call answered a transient error of its own.
  void back_off(int round);
  // The batch's result once the rounds are over.
  std::vector<FnCallResult> finish();

  ClientCore& core_;
  const std::vector<FnCallRequest>& requests_;
  std::vector<FnCallResult> results_;
  std::string base_;
  std::vector<Call> calls_;
  std::size_t own_errors_ = 0;
  std::map<std::string, std::shared_ptr<const ResolvedImageRef>> resolved_;
  std::map<std::string, Error> unresolved_;
  SteadyClock::time_point deadline_;

  std::vector<std::size_t> pending_;  // indices into `calls_`
  std::vector<NodePtr> excluded_;     // failed this batch
  std::optional<Error> node_error_;   // the last failure of a whole node
  std::optional<Error> place_error_;  // why calls could not be placed at all
  bool any_answer_ = false;           // some node answered a chunk
  std::mutex mu_;                     // guards results, calls' attempts and the round's bookkeeping
};

std::vector<FnCallResult> FnCallBatch::run() {
  if (requests_.empty()) return std::move(results_);
  base_ = random_request_id();
  prepare_calls();
  if (calls_.empty()) return std::move(results_);
  deadline_ = batch_deadline();
  pending_.resize(calls_.size());
  for (std::size_t k = 0; k < calls_.size(); ++k) pending_[k] = k;
  for (int round = 1; !pending_.empty(); ++round)
    if (!run_round(round)) break;
  return finish();
}

void FnCallBatch::prepare_calls() {
  calls_.reserve(requests_.size());
  for (std::size_t i = 0; i < requests_.size(); ++i) {
    try {
      prepare_call(i);
    } catch (const Error& e) {
      results_[i] = error_result(e.code(), e.what());
      ++own_errors_;
    }
  }
}

void FnCallBatch::prepare_call(std::size_t i) {
  const FnCallRequest& req = requests_[i];
  protocol::json body = protocol::encode(req);
  if (req.request_id.empty()) body["request_id"] = fmt::format("{}-{}", base_, i);
  protocol::decode_fncall_request(body);
  std::string image_ref = req.image;
  if (!req.image.empty() && core_.images_->enabled()) {
    if (auto bad = unresolved_.find(req.image); bad != unresolved_.end()) throw bad->second;
    auto it = resolved_.find(req.image);
    if (it == resolved_.end()) {
      try {
        it = resolved_.emplace(req.image, core_.images_->resolve(req.image)).first;
      } catch (const Error& e) {
        unresolved_.emplace(req.image, e);
        throw;
      }
    }
    body["image"] = it->second->reference;
    body["image_manifest"] = it->second->manifest_json;
    image_ref = it->second->reference;
  }
  calls_.push_back(
      Call{i, std::move(body), req.language, std::move(image_ref), req.gpu_mode, req.gpus, call_seconds(req)});
}

SteadyClock::time_point FnCallBatch::batch_deadline() {
  core_.refresh_node_info(core_.deadline_after());
  double cores = 0, total_seconds = 0, max_seconds = 0;
  for (const auto& v : core_.nodes_.view())
    if (v.info && !v.ejected) cores += std::max<double>(1, v.info->cores);
  for (const auto& c : calls_) {
    total_seconds += c.seconds;
    max_seconds = std::max(max_seconds, c.seconds);
  }
  return core_.deadline_after(to_ms(total_seconds / std::max(1.0, cores) + max_seconds + kQueueAllowanceSeconds));
}

void FnCallBatch::unplaced(std::size_t k, const Error& why) {
  const Error& e = node_error_ ? *node_error_ : why;
  results_[calls_[k].index] = error_result(e.code(), fmt::format("no node could run this call: {}", e.what()));
}

bool FnCallBatch::run_round(int round) {
  if (core_.closed()) throw Error(Code::kFailedPrecondition, "this dsec client is closed");
  if (SteadyClock::now() >= deadline_ || round > std::max(1, core_.options_.retry.max_attempts)) {
    Error e(Code::kDeadlineExceeded, "run_code_many: the call was not answered within the deadline and retries");
    for (std::size_t k : pending_)
      if (results_[calls_[k].index].error.empty()) unplaced(k, e);
    return false;
  }

  // Place every pending call: grouped by what they need of a node (language and image decide the warm pools).
  Round r;
  const std::size_t node_count = core_.nodes_.view().size();
  if (node_count > 1) core_.refresh_node_info(deadline_);
  for (auto& v : core_.nodes_.view())
    if (std::find(excluded_.begin(), excluded_.end(), v.node) == excluded_.end()) r.views.push_back(std::move(v));
  std::vector<std::vector<std::size_t>> per_node(r.views.size());
  if (r.views.empty()) {
    Error e(Code::kUnavailable, "every node of this client failed this batch");
    for (std::size_t k : pending_) unplaced(k, e);
    return false;
  }
  if (node_count == 1) {
    per_node[0] = pending_;  // one node: it decides itself
  } else {
    per_node = place_groups(r.views, round);
  }

  r.chunks = chunks_of(r.views, per_node);
  pending_.clear();
  if (r.chunks.empty()) return false;
  r.in_flight.assign(r.views.size(), 0);
  r.started.assign(r.chunks.size(), false);
  r.node_failed.assign(r.views.size(), false);
  r.unstarted = r.chunks.size();
  send_chunks(r);

  std::sort(pending_.begin(), pending_.end());
  pending_.erase(std::unique(pending_.begin(), pending_.end()), pending_.end());
  if (r.call_retry && !pending_.empty()) back_off(round);
  return true;
}

std::vector<std::vector<std::size_t>> FnCallBatch::place_groups(const std::vector<NodeView>& views, int round) {
  std::vector<std::vector<std::size_t>> per_node(views.size());
  std::map<std::tuple<std::string, std::string, GpuMode, std::uint32_t>, std::vector<std::size_t>> groups;
  for (std::size_t k : pending_)
    groups[{calls_[k].language, calls_[k].image, calls_[k].gpu_mode, calls_[k].gpus}].push_back(k);
  for (const auto& [key, members] : groups) {
    try {
      FnCallNeeds needs{std::get<0>(key), std::get<1>(key), std::get<2>(key), std::get<3>(key)};
      auto chosen = place_fncalls(core_.fncall_candidates(needs, views), members.size(),
                                  fmt::format("{}-{}-{}", base_, needs.language, round));
      for (std::size_t j = 0; j < members.size(); ++j) per_node[chosen[j]].push_back(members[j]);
    } catch (const Error& e) {
      place_error_ = e;
      for (std::size_t k : members) unplaced(k, e);
    }
  }
  return per_node;
}

std::vector<FnCallBatch::Chunk> FnCallBatch::chunks_of(const std::vector<NodeView>& views,
                                                       const std::vector<std::vector<std::size_t>>& per_node) const {
  std::vector<Chunk> chunks;
  for (std::size_t v = 0; v < views.size(); ++v) {
    const auto& list = per_node[v];
    const std::size_t node_cores = views[v].info ? std::max<std::size_t>(1, views[v].info->cores) : 2;
    const std::size_t size = std::clamp(kCallsPerChunkPerCore * node_cores, kMinChunkCalls, protocol::kMaxFnCallBatch);
    for (std::size_t at = 0; at < list.size(); at += size)
      chunks.push_back(Chunk{
          v, std::vector<std::size_t>(list.begin() + static_cast<std::ptrdiff_t>(at),
                                      list.begin() + static_cast<std::ptrdiff_t>(std::min(list.size(), at + size)))});
  }
  return chunks;
}

void FnCallBatch::send_chunks(Round& r) {
  const std::size_t workers = std::min(r.chunks.size(), std::max<std::size_t>(1, core_.options_.create_concurrency));
  std::vector<std::thread> threads;
  threads.reserve(workers);
  try {
    for (std::size_t w = 0; w < workers; ++w) threads.emplace_back([this, &r] { work(r); });
  } catch (...) {
    {
      std::lock_guard lock(mu_);
      for (std::size_t c = 0; c < r.chunks.size(); ++c)
        if (!r.started[c]) {
          r.started[c] = true;
          --r.unstarted;
        }
    }
    r.cv.notify_all();
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
}

void FnCallBatch::work(Round& r) {
  for (;;) {
    std::size_t pick = r.chunks.size();
    {
      std::unique_lock lock(mu_);
      for (;;) {
        if (r.unstarted == 0) return;
        for (std::size_t c = 0; c < r.chunks.size(); ++c)
          if (!r.started[c] && r.in_flight[r.chunks[c].node] < kChunksInFlightPerNode) {
            pick = c;
            break;
          }
        if (pick < r.chunks.size()) break;
        r.cv.wait(lock);
      }
      r.started[pick] = true;
      --r.unstarted;
      ++r.in_flight[r.chunks[pick].node];
    }
    run_chunk(r, r.chunks[pick]);
    {
      std::lock_guard lock(mu_);
      --r.in_flight[r.chunks[pick].node];
    }
    r.cv.notify_all();
  }
}

void FnCallBatch::run_chunk(Round& r, const Chunk& chunk) {
  const NodePtr& node = r.views[chunk.node].node;
  protocol::json batch{{"calls", protocol::json::array()}};
  double longest = 0;
  for (std::size_t k : chunk.calls) {
    batch["calls"].push_back(calls_[k].body);
    longest = std::max(longest, calls_[k].seconds);
  }
  const std::string text = batch.dump();
  // The node may run this chunk behind the others in flight there, a core's worth of calls at a time.
  const double node_cores = r.views[chunk.node].info ? std::max<double>(1, r.views[chunk.node].info->cores) : 1;
  const double waves = std::ceil(static_cast<double>(kChunksInFlightPerNode * chunk.calls.size()) / node_cores);
  const milliseconds run_time = to_ms(waves * longest + kQueueAllowanceSeconds);
  try {
    InFlight counted(*node, static_cast<int>(chunk.calls.size()));
    HttpResponse resp = retry_call<SteadyClock>(core_.options_.retry, deadline_, sleep_for, fncall_rng(), [&] {
      core_.check_open();
      return core_.call(node, http_request("POST", "/v1/fncall/batch", text, kJson), deadline_, run_time);
    });
    protocol::json answer = parse_json(resp, "POST /v1/fncall/batch");
    auto it = answer.find("results");
    if (it == answer.end() || !it->is_array() || it->size() != chunk.calls.size())
      throw Error(Code::kInternal,
                  fmt::format("POST /v1/fncall/batch on {}: sent {} calls, the answer has {} results", node->endpoint,
                              chunk.calls.size(), it != answer.end() && it->is_array() ? it->size() : 0));
    std::vector<FnCallResult> got;
    got.reserve(chunk.calls.size());
    for (const auto& element : *it) got.push_back(protocol::decode_fncall_result(element));
    take_results(r, chunk, node, got);
  } catch (const Error& e) {
    chunk_failed(r, chunk, e);
  } catch (const std::exception& e) {
    chunk_failed(r, chunk,
                 Error(Code::kInternal, fmt::format("POST /v1/fncall/batch on {}: {}", node->endpoint, e.what())));
  }
}

void FnCallBatch::take_results(Round& r, const Chunk& chunk, const NodePtr& node, std::vector<FnCallResult>& got) {
  const std::string node_id = core_.nodes_.view(node).id;
  std::lock_guard lock(mu_);
  any_answer_ = true;
  for (std::size_t j = 0; j < got.size(); ++j) {
    Call& c = calls_[chunk.calls[j]];
    FnCallResult& res = got[j];
    ++c.attempts;
    if (!res.error_code.empty()) {
      // The node's verdict on this call; a transient one is tried again next round (anywhere).
      if (is_retryable(code_from_name(res.error_code)) && c.attempts < core_.options_.retry.max_attempts) {
        pending_.push_back(chunk.calls[j]);
        r.call_retry = true;
      }
      res.error = fmt::format("{} (node {})", res.error, node_id.empty() ? node->endpoint : node_id);
    } else if (res.node.empty()) {
      res.node = node_id;
    }
    results_[c.index] = std::move(res);
  }
}

void FnCallBatch::chunk_failed(Round& r, const Chunk& chunk, const Error& e) {
  std::lock_guard lock(mu_);
  if (!core_.closed() && another_node_may_help(e)) {
    // The node failed as a whole: this chunk and its others not yet sent go to the other nodes.
    node_error_ = e;
    if (!r.node_failed[chunk.node]) {
      r.node_failed[chunk.node] = true;
      excluded_.push_back(r.views[chunk.node].node);
      for (std::size_t c = 0; c < r.chunks.size(); ++c) {
        if (r.started[c] || r.chunks[c].node != chunk.node) continue;
        r.started[c] = true;
        --r.unstarted;
        pending_.insert(pending_.end(), r.chunks[c].calls.begin(), r.chunks[c].calls.end());
      }
    }
    pending_.insert(pending_.end(), chunk.calls.begin(), chunk.calls.end());
  } else {
    for (std::size_t k : chunk.calls) results_[calls_[k].index] = error_result(e.code(), e.what());
  }
}

void FnCallBatch::back_off(int round) {
  auto cap = core_.options_.retry.backoff_cap(round + 1);
  std::uniform_int_distribution<std::int64_t> dist(0, cap.count());
  auto wait = milliseconds{dist(fncall_rng())};
  if (SteadyClock::now() + wait < deadline_) sleep_for(wait);
}

std::vector<FnCallResult> FnCallBatch::finish() {
  if (core_.closed()) throw Error(Code::kFailedPrecondition, "this dsec client is closed");
  // No node took any of the calls: that is the batch's failure, not each call's.
  if (!any_answer_ && own_errors_ == 0 && (node_error_ || place_error_)) {
    const Error& e = node_error_ ? *node_error_ : *place_error_;
    throw Error(e.code(),
                fmt::format("run_code_many: no node could run any of the {} calls: {}", requests_.size(), e.what()),
                e.retryable(), e.fault(), e.outcome_unknown());
  }
  return std::move(results_);
}

std::vector<FnCallResult> ClientCore::run_code_many(const std::vector<FnCallRequest>& requests) {
  check_open();
  return FnCallBatch(*this, requests).run();
}

}  // namespace dsec::detail
