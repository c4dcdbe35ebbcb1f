// The client side of function calls: placement over warm pools and load (pure logic), and Client::run_code /
// run_code_many against fake agents (the agent's HTTP server with a handler of the test's own) that answer, fail,
// or refuse on command: request ids kept through retries, batches split per node and chunk, results in order,
// failover of a failed node's chunks, per-call errors, and the one case that throws.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <mutex>
#include <set>

#include <fmt/format.h>

#include "agent/agent_test_util.hpp"
#include "agent/metrics.hpp"
#include "client/fncall_placement.hpp"
#include "common/protocol.hpp"
#include "dsec/client.hpp"
#include "dsec/error.hpp"
#include "http/server.hpp"

namespace dsec {
namespace {

using detail::FnCallCandidate;
using detail::place_fncalls;
using protocol::json;
namespace http = boost::beast::http;

FnCallCandidate candidate(std::string id, double cores, double load = 0, bool warm = false) {
  FnCallCandidate c;
  c.id = std::move(id);
  c.capacity = cores;
  c.load = load;
  c.warm = warm;
  return c;
}

std::map<std::size_t, std::size_t> histogram(const std::vector<std::size_t>& chosen) {
  std::map<std::size_t, std::size_t> h;
  for (auto i : chosen) ++h[i];
  return h;
}

TEST(FnCallPlacement, AWarmPoolWinsASingleCallBetweenEqualNodes) {
  std::vector<FnCallCandidate> nodes{candidate("a", 4), candidate("b", 4, 0, true), candidate("c", 4)};
  for (const char* seed : {"x", "y", "z", "w"}) EXPECT_EQ(place_fncalls(nodes, 1, seed), (std::vector<std::size_t>{1}));
  // ... until it is busier than the others by more than the bonus is worth (0.25 x 4 cores = one call).
  nodes[1].load = 2;
  EXPECT_NE(place_fncalls(nodes, 1, "x")[0], 1u);
}

TEST(FnCallPlacement, ABatchLevelsTheNodesByCores) {
  std::vector<FnCallCandidate> nodes{candidate("a", 2), candidate("b", 4, 0, true), candidate("c", 2, 2)};
  auto h = histogram(place_fncalls(nodes, 600, "seed"));
  // Load levels at L: a 2L, b 4L, c 2L - 2 (it had 2 busy already): 8L - 2 = 600.
  EXPECT_NEAR(static_cast<double>(h[0]), 150.5, 2);
  EXPECT_NEAR(static_cast<double>(h[1]), 301, 2);
  EXPECT_NEAR(static_cast<double>(h[2]), 148.5, 2);
}

TEST(FnCallPlacement, EqualNodesStartFromTheSeed) {
  std::vector<FnCallCandidate> nodes{candidate("a", 2), candidate("b", 2), candidate("c", 2), candidate("d", 2)};
  std::set<std::size_t> first;
  for (int i = 0; i < 32; ++i) {
    std::string seed = fmt::format("request-{}", i);
    auto chosen = place_fncalls(nodes, 1, seed);
    EXPECT_EQ(place_fncalls(nodes, 1, seed), chosen);  // the same seed, the same node
    first.insert(chosen[0]);
  }
  EXPECT_GE(first.size(), 3u);
}

TEST(FnCallPlacement, RefusalsSayWhy) {
  std::vector<FnCallCandidate> nodes{candidate("a", 2), candidate("b", 2)};
  nodes[0].healthy = false;
  nodes[1].serves = false;
  nodes[1].refusal = "language: does not serve 'cpp' (serves: python, shell)";
  try {
    place_fncalls(nodes, 1, "s");
    FAIL() << "placed on nodes that cannot take the call";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("b: language: does not serve 'cpp'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("a: unhealthy"), std::string::npos) << e.what();
  }
  nodes[1].healthy = false;
  try {
    place_fncalls(nodes, 1, "s");
    FAIL() << "placed on unhealthy nodes";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnavailable);
  }
  EXPECT_TRUE(place_fncalls(nodes, 0, "s").empty());
}

detail::FnCallNeeds needs(std::string_view language, std::string_view image = {}, GpuMode mode = GpuMode::kNone,
                          std::uint32_t gpus = 0) {
  return detail::FnCallNeeds{language, image, mode, gpus};
}

TEST(FnCallPlacement, CandidatesFromWhatTheNodeReported) {
  auto state = detail::parse_fncall_node_state(json::parse(R"({
      "id": "n1", "cores": 8,
      "fncall": {"languages": ["python", "shell"], "default_image": "bookworm-python:latest",
                 "gpus": ["0", "1"],
                 "pools": [{"image": "bookworm-python:latest@sha256:aa", "language": "python", "idle": 3, "busy": 2,
                            "min": 2, "max": 8},
                           {"image": "busybox", "language": "shell", "idle": 1, "busy": 1, "min": 1, "max": 4},
                           {"image": 7, "language": "python", "idle": "many"},
                           "not a pool"]}})"));
  ASSERT_TRUE(state);
  EXPECT_EQ(state->languages, (std::vector<std::string>{"python", "shell"}));
  EXPECT_EQ(state->gpus, (std::vector<std::string>{"0", "1"}));
  ASSERT_EQ(state->pools.size(), 3u);  // the malformed fields are skipped, the non-object dropped
  EXPECT_EQ(state->pools[0].max, 8u);
  EXPECT_EQ(state->pools[2].idle, 0u);
  EXPECT_FALSE(detail::parse_fncall_node_state(json::parse(R"({"id": "n2"})")));

  const std::vector<std::string> backends{"container", "fncall"};
  auto c = detail::fncall_candidate("n1", true, true, backends, 8, 0.5, state,
                                    needs("python", "bookworm-python:latest@sha256:aa"), 1);
  EXPECT_TRUE(c.serves);
  EXPECT_TRUE(c.warm);
  EXPECT_EQ(c.warm_idle, 3u);
  EXPECT_DOUBLE_EQ(c.capacity, 8);
  EXPECT_DOUBLE_EQ(c.load, 3 + 1);  // busy over all pools (3) over the load average, plus one in flight
  // The default image: a call naming none finds the pool of the node's default.
  EXPECT_TRUE(detail::fncall_candidate("n1", true, true, backends, 8, 0, state, needs("python"), 0).warm);
  EXPECT_FALSE(detail::fncall_candidate("n1", true, true, backends, 8, 0, state, needs("python", "other"), 0).warm);
  auto cpp = detail::fncall_candidate("n1", true, true, backends, 8, 0, state, needs("cpp"), 0);
  EXPECT_FALSE(cpp.serves);
  EXPECT_NE(cpp.refusal.find("does not serve 'cpp'"), std::string::npos) << cpp.refusal;
  auto plain = detail::fncall_candidate("n2", true, true, {"container"}, 8, 0, std::nullopt, needs("python"), 0);
  EXPECT_FALSE(plain.serves);
  EXPECT_NE(plain.refusal.find("does not serve function calls (serves: container)"), std::string::npos);
  // No report yet: unhealthy for placement.
  EXPECT_FALSE(detail::fncall_candidate("n3", true, false, {}, 0, 0, std::nullopt, needs("python"), 0).healthy);
}

TEST(FnCallPlacement, CallsThatWantGpusGoWhereTheyCanHaveThem) {
  auto state = detail::parse_fncall_node_state(json::parse(R"({"fncall": {"languages": ["python"],
      "gpus": ["0", "1"], "gpu_shares": 4, "gpus_free": 1,
      "gpu_usage": [{"device": "0", "exclusive": true, "shares_used": 0},
                    {"device": "1", "exclusive": false, "shares_used": 1}]}})"));
  ASSERT_TRUE(state);
  EXPECT_EQ(state->gpu_shares, 4u);
  EXPECT_EQ(state->gpus_free, 1u);
  EXPECT_EQ(state->shares_free, 3u);  // device 1: 4 - 1; device 0 is held whole
  const std::vector<std::string> backends{"fncall"};
  auto gpu = [&](GpuMode mode, std::uint32_t n, const std::optional<detail::FnCallNodeState>& st) {
    return detail::fncall_candidate("g", true, true, backends, 8, 0, st, needs("python", "", mode, n), 0);
  };
  EXPECT_TRUE(gpu(GpuMode::kExclusive, 1, state).serves);
  EXPECT_TRUE(gpu(GpuMode::kExclusive, 1, state).gpus_free);
  EXPECT_TRUE(gpu(GpuMode::kExclusive, 2, state).serves);  // queued until both are free
  EXPECT_FALSE(gpu(GpuMode::kExclusive, 2, state).gpus_free);
  auto three = gpu(GpuMode::kExclusive, 3, state);
  EXPECT_FALSE(three.serves);
  EXPECT_NE(three.refusal.find("hands 2 GPUs to calls, 3 wanted"), std::string::npos) << three.refusal;
  EXPECT_TRUE(gpu(GpuMode::kShared, 3, state).gpus_free);
  EXPECT_FALSE(gpu(GpuMode::kShared, 4, state).gpus_free);
  EXPECT_FALSE(gpu(GpuMode::kShared, 5, state).serves);
  auto none = detail::parse_fncall_node_state(json::parse(R"({"fncall": {"languages": ["python"]}})"));
  EXPECT_FALSE(gpu(GpuMode::kShared, 1, none).serves);
  EXPECT_FALSE(gpu(GpuMode::kExclusive, 1, none).serves);
  EXPECT_TRUE(gpu(GpuMode::kNone, 0, none).serves);
  // Between two otherwise equal nodes the one with the GPU free wins; a busier one still loses to it.
  std::vector<FnCallCandidate> nodes{candidate("a", 4), candidate("b", 4)};
  nodes[1].gpus_free = true;
  EXPECT_EQ(place_fncalls(nodes, 1, "x"), (std::vector<std::size_t>{1}));
  nodes[1].load = 1;
  EXPECT_EQ(place_fncalls(nodes, 1, "x"), (std::vector<std::size_t>{1}));
}

TEST(FnCallPlacement, ImagesMatchByDigestOrName) {
  using detail::same_fncall_image;
  EXPECT_TRUE(same_fncall_image("", ""));
  EXPECT_TRUE(same_fncall_image("py", "py:latest"));
  EXPECT_TRUE(same_fncall_image("py:latest@sha256:aa", "py"));
  EXPECT_TRUE(same_fncall_image("py:1@sha256:aa", "other:2@sha256:aa"));  // the same manifest
  EXPECT_FALSE(same_fncall_image("py:latest@sha256:aa", "py:latest@sha256:bb"));
  EXPECT_FALSE(same_fncall_image("py:1", "py:2"));
  EXPECT_FALSE(same_fncall_image("py", ""));
  EXPECT_TRUE(same_fncall_image("py", "", "py:latest"));
  EXPECT_TRUE(same_fncall_image("", "py", "py"));
  EXPECT_FALSE(same_fncall_image("registry:5000/py", "registry:5000/py:1"));
}

// A fake agent: the agent's HTTP server with a handler that serves GET /v1/node and the fncall routes. A call's
// "result" is its stdout: "<node>:<code>", so the test sees which node ran what.
class FakeAgent {
 public:
  struct Behaviour {
    std::atomic<int> fail_next{0};  // answer this many requests with 503 UNAVAILABLE first
    std::atomic<bool> down{false};  // every fncall request: 503 UNAVAILABLE
    std::atomic<int> cores{2};
    std::atomic<bool> warm_python{false};
    std::atomic<bool> serves_fncall{true};
  };

  FakeAgent(const std::filesystem::path& dir, std::string id) : id_(std::move(id)) {
    agent::ServerOptions options;
    options.unix_socket = dir / (id_ + ".sock");
    server_ = std::make_unique<agent::Server>(
        options, [this](agent::HttpRequest& req, agent::ResponseStream&, const agent::Peer&) { return handle(req); },
        metrics_);
    server_->start();
    endpoint_ = "unix:" + options.unix_socket.string();
  }
  ~FakeAgent() { server_->stop(); }

  const std::string& endpoint() const { return endpoint_; }
  Behaviour& behaviour() { return behaviour_; }

  // Every request id this agent was sent (in the order received), and the size of each batch.
  std::vector<std::string> request_ids() const {
    std::lock_guard lock(mu_);
    return request_ids_;
  }
  std::vector<std::size_t> batches() const {
    std::lock_guard lock(mu_);
    return batches_;
  }
  int fncall_requests() const { return fncall_requests_.load(); }

 private:
  static agent::HttpResponse reply(http::status status, const json& body) {
    agent::HttpResponse res{status, 11};
    res.set(http::field::content_type, "application/json");
    res.body() = body.dump();
    return res;
  }

  json run(const json& call) {
    FnCallRequest req = protocol::decode_fncall_request(call);
    {
      std::lock_guard lock(mu_);
      request_ids_.push_back(req.request_id);
    }
    if (req.code == "refuse") return json{{"error", {{"code", "NOT_FOUND"}, {"message", "image 'nope' not found"}}}};
    FnCallResult r;
    r.exit_code = 0;
    r.stdout_data = id_ + ":" + req.code;
    r.node = id_;
    return protocol::encode(r);
  }

  agent::HttpResponse handle(agent::HttpRequest& req) {
    std::string target(agent::std_view(req.target()));
    if (target == "/v1/node") {
      json pools = json::array();
      if (behaviour_.warm_python) pools.push_back({{"image", ""}, {"language", "python"}, {"idle", 2}, {"busy", 0}});
      NodeInfo info;
      info.id = id_;
      info.backends = {behaviour_.serves_fncall ? "fncall" : "container"};
      info.cores = static_cast<std::uint32_t>(behaviour_.cores.load());
      info.memory_bytes = 8ull << 30;
      json node = protocol::encode(info);
      if (behaviour_.serves_fncall) node["fncall"] = {{"languages", {"python", "shell"}}, {"pools", pools}};
      return reply(http::status::ok, node);
    }
    ++fncall_requests_;
    if (behaviour_.down || behaviour_.fail_next.fetch_sub(1) > 0)
      return reply(http::status::service_unavailable,
                   protocol::encode_error(Error(Code::kUnavailable, "the fake agent is down")));
    try {
      json body = json::parse(req.body());
      if (target == "/v1/fncall") return reply(http::status::ok, run(body));
      if (target == "/v1/fncall/batch") {
        json results = json::array();
        for (const auto& call : body.at("calls")) results.push_back(run(call));
        std::lock_guard lock(mu_);
        batches_.push_back(results.size());
        return reply(http::status::ok, json{{"results", results}});
      }
    } catch (const Error& e) {
      return reply(static_cast<http::status>(http_status(e.code())), protocol::encode_error(e));
    }
    return reply(http::status::not_found, protocol::encode_error(Error(Code::kNotFound, "no route " + target)));
  }

  std::string id_;
  std::string endpoint_;
  agent::Metrics metrics_;
  std::unique_ptr<agent::Server> server_;
  Behaviour behaviour_;
  mutable std::mutex mu_;
  std::vector<std::string> request_ids_;
  std::vector<std::size_t> batches_;
  std::atomic<int> fncall_requests_{0};
};

class ClientFnCallTest : public ::testing::Test {
 protected:
  Client client_of(const std::vector<FakeAgent*>& agents) {
    ClientOptions o;
    for (auto* a : agents) o.endpoints.push_back(a->endpoint());
    o.retry.initial_backoff = std::chrono::milliseconds{1};
    o.retry.max_backoff = std::chrono::milliseconds{5};
    o.call_deadline = std::chrono::milliseconds{20'000};
    return Client(o);
  }

  static FnCallRequest python(std::string code) {
    FnCallRequest r;
    r.code = std::move(code);
    return r;
  }

  agent::testing::ScratchDir dir_;
};

TEST_F(ClientFnCallTest, RunCodeRetriesWithTheSameRequestId) {
  FakeAgent a(dir_.path(), "a");
  Client client = client_of({&a});
  a.behaviour().fail_next = 2;
  FnCallResult r = client.run_code(python("print(1)"));
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.stdout_data, "a:print(1)");
  EXPECT_EQ(r.node, "a");
  EXPECT_EQ(a.fncall_requests(), 3);  // two refusals, then the answer
  // The caller's request id travels as it is.
  FnCallRequest named = python("x");
  named.request_id = "judge-17";
  client.run_code(named);
  EXPECT_EQ(a.request_ids().back(), "judge-17");
}

TEST_F(ClientFnCallTest, RunCodeRefusesABadCallBeforeSendingIt) {
  FakeAgent a(dir_.path(), "a");
  Client client = client_of({&a});
  FnCallRequest bad = python("print(1)");
  bad.language = "cobol";
  try {
    client.run_code(bad);
    FAIL() << "an unknown language was sent";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("language"), std::string::npos) << e.what();
  }
  EXPECT_EQ(a.fncall_requests(), 0);
}

TEST_F(ClientFnCallTest, RunCodeMovesToAnotherNodeAndPrefersWarmPools) {
  FakeAgent a(dir_.path(), "a"), b(dir_.path(), "b");
  Client client = client_of({&a, &b});
  b.behaviour().warm_python = true;
  for (int i = 0; i < 5; ++i) EXPECT_EQ(client.run_code(python("w")).node, "b");
  EXPECT_EQ(a.fncall_requests(), 0);
  // b goes down: the call is retried there, then made on a.
  b.behaviour().down = true;
  FnCallResult r = client.run_code(python("moved"));
  EXPECT_EQ(r.stdout_data, "a:moved");
  EXPECT_GE(b.fncall_requests(), 5 + 2);
  // The shell is served, cpp by neither: refused with what each node serves.
  b.behaviour().down = false;
  FnCallRequest cpp = python("int main() {}");
  cpp.language = "cpp";
  try {
    Client fresh = client_of({&a, &b});
    fresh.run_code(cpp);
    FAIL() << "a cpp call was placed on nodes that serve python and shell";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not serve 'cpp'"), std::string::npos) << e.what();
  }
}

TEST_F(ClientFnCallTest, RunCodeManyKeepsOrderAndSplitsPerNodeAndChunk) {
  FakeAgent a(dir_.path(), "a"), b(dir_.path(), "b");
  a.behaviour().cores = 2;
  b.behaviour().cores = 6;
  Client client = client_of({&a, &b});
  std::vector<FnCallRequest> calls;
  for (int i = 0; i < 500; ++i) calls.push_back(python(fmt::format("c{}", i)));
  auto results = client.run_code_many(calls);
  ASSERT_EQ(results.size(), calls.size());
  std::map<std::string, int> by_node;
  std::set<std::string> ids;
  for (std::size_t i = 0; i < results.size(); ++i) {
    ASSERT_TRUE(results[i].error.empty()) << i << ": " << results[i].error;
    EXPECT_EQ(results[i].stdout_data, fmt::format("{}:c{}", results[i].node, i));
    ++by_node[results[i].node];
  }
  // Split by cores (2 : 6), in chunks of 8 calls per core (at least 16).
  EXPECT_NEAR(by_node["a"], 125, 3);
  EXPECT_NEAR(by_node["b"], 375, 3);
  for (auto n : a.batches()) EXPECT_LE(n, 16u);
  for (auto n : b.batches()) EXPECT_LE(n, 48u);
  EXPECT_GE(b.batches().size(), 8u);
  // Every call went out once, with a request id of its own.
  for (auto* agent : {&a, &b})
    for (const auto& id : agent->request_ids()) EXPECT_TRUE(ids.insert(id).second) << "sent twice: " << id;
  EXPECT_EQ(ids.size(), calls.size());
}

TEST_F(ClientFnCallTest, RunCodeManyMovesAFailedNodesChunksElsewhere) {
  FakeAgent a(dir_.path(), "a"), b(dir_.path(), "b");
  Client client = client_of({&a, &b});
  client.nodes();  // both known and healthy when the batch is placed
  b.behaviour().down = true;
  std::vector<FnCallRequest> calls;
  for (int i = 0; i < 200; ++i) calls.push_back(python(fmt::format("c{}", i)));
  auto results = client.run_code_many(calls);
  for (std::size_t i = 0; i < results.size(); ++i) {
    ASSERT_TRUE(results[i].error.empty()) << i << ": " << results[i].error;
    EXPECT_EQ(results[i].stdout_data, fmt::format("a:c{}", i));
  }
  EXPECT_GT(b.fncall_requests(), 0);  // b was tried
}

TEST_F(ClientFnCallTest, RunCodeManyGivesEachCallItsOwnError) {
  FakeAgent a(dir_.path(), "a");
  Client client = client_of({&a});
  std::vector<FnCallRequest> calls{python("ok0"), python("refuse"), python("ok2"), python("ok3")};
  calls[3].timeout_seconds = -1;  // refused here, never sent
  auto results = client.run_code_many(calls);
  ASSERT_EQ(results.size(), 4u);
  EXPECT_EQ(results[0].stdout_data, "a:ok0");
  EXPECT_EQ(results[1].error_code, "NOT_FOUND");
  EXPECT_NE(results[1].error.find("image 'nope' not found"), std::string::npos) << results[1].error;
  EXPECT_EQ(results[2].stdout_data, "a:ok2");
  EXPECT_EQ(results[3].error_code, "INVALID_ARGUMENT");
  EXPECT_NE(results[3].error.find("timeout"), std::string::npos) << results[3].error;
  EXPECT_EQ(a.request_ids().size(), 3u);
  EXPECT_TRUE(client.run_code_many({}).empty());
}

TEST_F(ClientFnCallTest, RunCodeManyThrowsOnlyWhenNoNodeTookAnyCall) {
  FakeAgent a(dir_.path(), "a");
  Client client = client_of({&a});
  a.behaviour().down = true;
  std::vector<FnCallRequest> calls{python("x"), python("y")};
  try {
    client.run_code_many(calls);
    FAIL() << "a batch no node took did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnavailable) << e.what();
    EXPECT_NE(std::string(e.what()).find("no node could run any of the 2 calls"), std::string::npos) << e.what();
  }
  // A transient refusal is retried on the node, with the same request ids.
  a.behaviour().down = false;
  a.behaviour().fail_next = 1;
  auto results = client.run_code_many(calls);
  EXPECT_EQ(results[1].stdout_data, "a:y");
}

}  // namespace
}  // namespace dsec
