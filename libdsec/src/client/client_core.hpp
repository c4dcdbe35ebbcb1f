// What dsec::Client and dsec::Sandbox stand on: the endpoints and their connection pools, the node table that
// routes a sandbox id to its node, retries under one deadline, and the embedded agent when there is one.
// Public headers only forward-declare it, so a trainer's translation units never see curl or JSON.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "client/discovery.hpp"
#include "client/embedded_agent.hpp"
#include "client/image_resolver.hpp"
#include "client/node_table.hpp"
#include "client/requests.hpp"
#include "client/transport.hpp"
#include "dsec/client.hpp"
#include "dsec/exec.hpp"
#include "dsec/fncall.hpp"
#include "dsec/placement.hpp"
#include "dsec/sandbox.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/screen.hpp"
#include "dsec/spec.hpp"

namespace dsec::detail {

class ClientCore {
 public:
  explicit ClientCore(ClientOptions options);
  ~ClientCore();
  ClientCore(const ClientCore&) = delete;
  ClientCore& operator=(const ClientCore&) = delete;

  // Stops the embedded agent; every later call throws FAILED_PRECONDITION. Idempotent.
  void close();
  bool closed() const noexcept { return closed_.load(); }

  SandboxInfo create(SandboxSpec spec);
  // With `group` set, every sandbox joins that group under a lease of `group_ttl` seconds (see dsec/group.hpp).
  std::vector<SandboxInfo> create_many(std::size_t n, const SandboxSpec& spec, const std::string& group = {},
                                       std::chrono::seconds group_ttl = {});
  // One sandbox per spec (sandbox i from specs[i]), as one pulse: equal specs are placed and batched together, one
  // batch request per node and distinct spec. The first spec's request_id (or a random one) names the pulse.
  std::vector<SandboxInfo> create_many(const std::vector<SandboxSpec>& specs, const std::string& group = {},
                                       std::chrono::seconds group_ttl = {});
  // POST /v1/groups/{group}/renew on every node that holds one of `members`. UNAVAILABLE naming the nodes that could
  // not be reached (the others are renewed).
  void renew_group(const std::string& group, const std::vector<std::string>& members, std::chrono::seconds ttl);
  // DELETE /v1/groups/{group} on every node that holds one of `members`; a node without the group is fine.
  void destroy_group(const std::string& group, const std::vector<std::string>& members);
  std::size_t create_concurrency() const noexcept { return options_.create_concurrency; }
  SandboxInfo get(const std::string& id);
  NetworkPolicy network(const std::string& id);
  NetworkPolicy set_network(const std::string& id, const NetworkPolicy& policy);
  SandboxInfo set_ttl(const std::string& id, std::chrono::seconds ttl);
  std::string expose(const std::string& id, std::uint32_t port);
  void unexpose(const std::string& id, std::uint32_t port);
  std::map<std::uint32_t, std::string> exposed(const std::string& id);
  NetworkUsage network_usage(const std::string& id);
  std::string screenshot(const std::string& id);
  ScreenState screen_state(const std::string& id);
  ScreenState input(const std::string& id, const std::vector<InputAction>& actions);
  VncEndpoint vnc(const std::string& id);
  void stop_vnc(const std::string& id);
  std::vector<SandboxInfo> list(const Labels& labels, const std::string& tenant);
  std::vector<NodeInfo> nodes();
  // The images of the client's stores, and removing one (Client::images, Client::remove_image).
  std::vector<ImageInfo> images();
  void remove_image(const std::string& name);
  // Idempotent: a sandbox that is already gone is not an error.
  void destroy(const std::string& id);
  SleepResult sleep_or_wake(const std::string& id, bool sleep);
  // POST /v1/sandboxes/{id}/snapshot with a fresh request id (retries repeat it, so they never take two).
  SnapshotResult snapshot(const std::string& id, std::string_view name);
  // A snapshot (under `name`, or a generated one), then create_many(n) of it with the sandbox's spec. A generated
  // snapshot is labelled onto the copies, so it goes with the last of them, unless `keep`.
  std::vector<SandboxInfo> fork(const std::string& id, std::size_t n, std::string_view name, bool keep = false);
  ExecResult exec(const std::string& id, const ExecRequest& request);
  // A streaming exec: output goes to on_output as the agent sends it; what on_output throws aborts the call (the
  // connection is dropped; the command runs on in the sandbox to its end or timeout) and is rethrown as it was.
  ExecResult exec_stream(const std::string& id, const ExecRequest& request,
                         const std::function<void(int fd, std::string_view data)>& on_output);
  // Function calls (client/fncall.cpp): one call on a node chosen for its warm pools and load, retried there on
  // transient errors with the same request id and moved to another node when that one fails; many calls split
  // into one batch request per node and chunk, results in request order.
  FnCallResult run_code(FnCallRequest request);
  std::vector<FnCallResult> run_code_many(const std::vector<FnCallRequest>& requests);

  // A call about a sandbox (requests.hpp): sent to the node that made it, retried as request.how allows under one
  // fresh call deadline (call_deadline + how.extra).
  HttpResponse call_sandbox(const SandboxRequest& request);
  // A command whose answer streams as NDJSON (exec's "stream": true, a session run's), each exchange allowed
  // request.how.extra beyond request_timeout; on_output and retries as exec_stream.
  // With how.request_id (in the body too), retried like call_sandbox's exactly-once calls: a retry's answer replays
  // the output from its start, and what on_output already had is not handed to it twice.
  ExecResult stream_command(const SandboxRequest& request,
                            const std::function<void(int fd, std::string_view data)>& on_output);

  void write_file(const std::string& id, std::string_view path, std::string_view data, unsigned mode);
  std::string read_file(const std::string& id, std::string_view path);
  void upload_tar(const std::string& id, std::string_view dir, std::string_view tar_bytes);
  std::string download_tar(const std::string& id, std::string_view dir);

  std::string endpoint() const;
  std::size_t endpoint_count() const noexcept { return nodes_.live_count(); }
  // Summed over every endpoint: how many requests were sent and how many connections opened for them.
  TransportStats stats() const;
  const EmbeddedAgent* embedded_agent() const noexcept { return agent_.get(); }

  // What the asyncio core (async_transport.hpp) builds its exchanges from, so they route, count a node's health,
  // retry and time out as this class's own calls do.
  const ClientOptions& options() const noexcept { return options_; }
  SteadyClock::time_point deadline_after(std::chrono::milliseconds extra = {}) const;
  void check_open() const;
  // The node that made sandbox `id` (asks unidentified nodes for their ids when needed). NodeLost when that node has
  // left the cluster or is ejected.
  NodePtr route(const std::string& id, SteadyClock::time_point deadline);
  // Counts one exchange with `node` in its health: it answered (whatever it answered), or it could not be reached.
  void count_exchange(const NodePtr& node, bool answered);

 private:
  friend class Pulse;        // one create_many (create.cpp)
  friend class FnCallBatch;  // one run_code_many (fncall.cpp)

  template <typename Op>
  auto retrying(SteadyClock::time_point deadline, Op&& op) -> decltype(op());

  // One HTTP exchange with `node`; a non-2xx answer is thrown as the agent's dsec::Error. Counts the node's health.
  // Each exchange is bounded by request_timeout (+ `extra`, an exec's own timeout) within the call's deadline.
  HttpResponse call(const NodePtr& node, const HttpRequest& request, SteadyClock::time_point deadline,
                    std::chrono::milliseconds extra = {});
  // call() for a request that must not act twice: a transport failure after the request may have reached the
  // agent, and any error the agent answered, are thrown as not retryable.
  HttpResponse call_once(const NodePtr& node, const HttpRequest& request, SteadyClock::time_point deadline,
                         std::chrono::milliseconds extra);
  // One exchange of `request` with its sandbox's node, never repeated, within `deadline`: for calls that must not
  // act twice whose errors keep their own retryable flag (expose, fork, screen input).
  HttpResponse send_once(const SandboxRequest& request, SteadyClock::time_point deadline);
  // Runs `op` (the retried exchanges of an exactly-once request) and turns a failure that leaves the outcome
  // unknown into OutcomeUnknown: the agent's DATA_LOSS "outcome unknown", or a lost answer (`maybe_sent`, set by
  // `op`) that no retry recovered.
  template <typename Op>
  auto exactly_once(const std::string& id, const std::string& request_id, const bool& maybe_sent, Op&& op)
      -> decltype(op());
  // GET /v1/node of every node whose information is older than kInfoMaxAge (concurrently), for placement.
  void refresh_node_info(SteadyClock::time_point deadline);
  // Records a GET /v1/node answer of `node`: its NodeInfo and its function-call pools.
  NodeInfo learn_node_info(const NodePtr& node, const HttpResponse& response);
  // A node discovery reports up (new, or its record changed): its info and function-call pools as registered.
  void node_up(const NodeEvent& event);
  // For function calls with `needs`: what placement needs to know of each of `nodes` (fncall.cpp).
  std::vector<FnCallCandidate> fncall_candidates(const FnCallNeeds& needs, const std::vector<NodeView>& nodes);
  // The client's image stores; FAILED_PRECONDITION when it has none (its agents resolve images themselves).
  ImageResolver& stores();
  // The nodes holding `members` (by their ids); ids no node made are left out.
  std::vector<NodePtr> nodes_of(const std::vector<std::string>& members);
  // Chooses a node for each of `count` sandboxes among the healthy nodes not in `excluded`.
  std::vector<NodePtr> place(const SandboxSpec& spec, std::size_t count, const ResolvedImageRef* image,
                             const std::vector<NodePtr>& excluded);
  // Destroys, on `node`, the sandboxes labelled key=value that are not in `keep` (duplicates left by a create that
  // timed out there and was made elsewhere). Best effort.
  void remove_strays(const NodePtr& node, const std::string& key, const std::string& value,
                     const std::vector<std::string>& keep, SteadyClock::time_point deadline);

  ClientOptions options_;
  std::unique_ptr<EmbeddedAgent> agent_;
  std::unique_ptr<ImageResolver> images_;
  std::unique_ptr<EtcdDiscovery> discovery_;  // with etcd_endpoints: feeds nodes_
  NodeTable nodes_;
  std::unique_ptr<PlacementPolicy> own_policy_;
  PlacementPolicy* policy_ = nullptr;  // options_.placement_policy, else own_policy_
  std::mutex identify_mu_;             // one round of asking nodes for their ids at a time
  std::atomic<bool> closed_{false};
};

// An agent's answer as JSON; a body that is not JSON is INTERNAL naming `what` (the call).
nlohmann::json parse_json(const HttpResponse& r, std::string_view what);

// The dsec::Error of a non-2xx answer of `node` to `request`, as the agent's error body tells it.
Error agent_error(const HttpRequest& request, const std::string& endpoint, const HttpResponse& response);

// An exactly-once request's failure `e` (request `request_id` about sandbox `id`) as OutcomeUnknown when it leaves
// the outcome unknown: the agent's DATA_LOSS "outcome unknown", or a lost answer (`maybe_sent`: the request may
// have reached the agent) that no retry recovered. Nothing otherwise.
std::optional<OutcomeUnknown> outcome_unknown(const Error& e, const std::string& id, const std::string& request_id,
                                              bool maybe_sent);

// 32 hex digits from a random 128-bit value: request ids for creates that came without one.
std::string random_request_id();

}  // namespace dsec::detail
