// The client's transport and call policy against small real HTTP servers on unix sockets: connection reuse, agent
// errors, which calls are retried (exec only when it never reached the agent), create's request ids, create_many's
// all-or-nothing, and routing sandbox ids across nodes.
#include <gtest/gtest.h>
#include <algorithm>

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "client/client_core.hpp"
#include "client/transport.hpp"
#include "common/protocol.hpp"
#include "dsec/client.hpp"
#include "error_test_util.hpp"

namespace dsec::detail {
namespace {

using nlohmann::json;
using std::chrono::milliseconds;

struct Request {
  std::string method;
  std::string target;
  std::map<std::string, std::string> headers;  // lower-case names
  std::string body;
};

struct Reply {
  int status = 200;
  std::string body = "{}";
  std::string content_type = "application/json";
  bool close_without_reply = false;  // read the request, then drop the connection
};

// An HTTP/1.1 server on a unix socket, one thread per connection, keep-alive. It counts the connections it
// accepted and hands each request to `handler`.
class TestServer {
 public:
  explicit TestServer(std::function<Reply(const Request&)> handler) : handler_(std::move(handler)) {
    char dir[] = "/tmp/dsec-client-test-XXXXXX";
    if (!::mkdtemp(dir)) throw std::runtime_error("mkdtemp");
    dir_ = dir;
    path_ = dir_ + "/agent.sock";
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path_.c_str());
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(fd_, 128) != 0)
      throw std::runtime_error("bind/listen");
    acceptor_ = std::thread([this] { accept_loop(); });
  }

  ~TestServer() {
    stopping_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    acceptor_.join();
    {
      std::lock_guard lock(mu_);
      for (int c : conns_) ::shutdown(c, SHUT_RDWR);
    }
    for (auto& t : workers_) t.join();
    ::close(fd_);
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }

  std::string endpoint() const { return "unix:" + path_; }
  int accepted() const { return accepted_.load(); }
  std::vector<Request> requests() const {
    std::lock_guard lock(mu_);
    return requests_;
  }

 private:
  void accept_loop() {
    for (;;) {
      int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) {
        if (stopping_) return;
        continue;
      }
      accepted_++;
      std::lock_guard lock(mu_);
      conns_.push_back(c);
      workers_.emplace_back([this, c] { serve(c); });
    }
  }

  void serve(int c) {
    std::string buf;
    char chunk[65536];
    for (;;) {
      // Head.
      std::size_t head_end;
      while ((head_end = buf.find("\r\n\r\n")) == std::string::npos) {
        ssize_t n = ::read(c, chunk, sizeof chunk);
        if (n <= 0) return finish(c);
        buf.append(chunk, static_cast<std::size_t>(n));
      }
      Request req;
      std::string head = buf.substr(0, head_end);
      buf.erase(0, head_end + 4);
      std::size_t line_end = head.find("\r\n");
      std::string first = head.substr(0, line_end);
      auto sp1 = first.find(' '), sp2 = first.rfind(' ');
      req.method = first.substr(0, sp1);
      req.target = first.substr(sp1 + 1, sp2 - sp1 - 1);
      std::size_t pos = line_end == std::string::npos ? head.size() : line_end + 2;
      while (pos < head.size()) {
        std::size_t e = head.find("\r\n", pos);
        if (e == std::string::npos) e = head.size();
        std::string line = head.substr(pos, e - pos);
        auto colon = line.find(':');
        std::string name = line.substr(0, colon);
        for (auto& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        std::string value = line.substr(colon + 1);
        while (!value.empty() && value.front() == ' ') value.erase(0, 1);
        req.headers[name] = value;
        pos = e + 2;
      }
      std::size_t length = req.headers.count("content-length") ? std::stoul(req.headers["content-length"]) : 0;
      while (buf.size() < length) {
        ssize_t n = ::read(c, chunk, sizeof chunk);
        if (n <= 0) return finish(c);
        buf.append(chunk, static_cast<std::size_t>(n));
      }
      req.body = buf.substr(0, length);
      buf.erase(0, length);
      {
        std::lock_guard lock(mu_);
        requests_.push_back(req);
      }
      Reply reply = handler_(req);
      if (reply.close_without_reply) return finish(c);
      std::string out = fmt::format("HTTP/1.1 {} X\r\nContent-Type: {}\r\nContent-Length: {}\r\n\r\n{}", reply.status,
                                    reply.content_type, reply.body.size(), reply.body);
      if (::send(c, out.data(), out.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(out.size())) return finish(c);
    }
  }

  void finish(int c) {
    std::lock_guard lock(mu_);
    std::erase(conns_, c);
    ::close(c);
  }

  std::function<Reply(const Request&)> handler_;
  std::string dir_, path_;
  int fd_ = -1;
  std::atomic<bool> stopping_{false};
  std::atomic<int> accepted_{0};
  mutable std::mutex mu_;
  std::vector<int> conns_;
  std::vector<Request> requests_;
  std::thread acceptor_;
  std::vector<std::thread> workers_;
};

std::string info_json(const std::string& id, const std::string& node) {
  SandboxInfo info;
  info.id = id;
  info.node = node;
  info.state = "running";
  return protocol::encode(info).dump();
}

ClientOptions fast_options(std::vector<std::string> endpoints) {
  ClientOptions o;
  o.endpoints = std::move(endpoints);
  o.retry.initial_backoff = milliseconds{1};
  o.retry.max_backoff = milliseconds{5};
  o.retry.max_attempts = 4;
  o.call_deadline = milliseconds{10'000};
  return o;
}

ExecRequest shell_exec(std::string command, double timeout_seconds = 600) {
  ExecRequest r;
  r.shell = std::move(command);
  r.timeout_seconds = timeout_seconds;
  return r;
}

// What a roomy node says about itself: 8 cores, 64 GiB, the container and null backends.
std::string node_json(const std::string& node) {
  NodeInfo n;
  n.id = node;
  n.backends = {"container", "null"};
  n.cores = 8;
  n.memory_bytes = 64ull << 30;
  n.cpu_overcommit = 32;
  n.memory_overcommit = 2;
  return protocol::encode(n).dump();
}

// The answer to a batch create (POST with "count"): sandboxes "<node>-<request id>-<i>".
Reply batch_reply(const Request& r, const std::string& node) {
  json body = json::parse(r.body);
  json list = json::array();
  std::size_t count = body.value("count", std::size_t{1});
  for (std::size_t i = 0; i < count; ++i)
    list.push_back(
        json::parse(info_json(fmt::format("{}-{}-{}", node, body.at("request_id").get<std::string>(), i), node)));
  return {201, json{{"sandboxes", list}}.dump()};
}

// A node that knows one sandbox; everything else is NOT_FOUND.
Reply simple_node(const Request& r, const std::string& node) {
  if (r.target == "/v1/node") return {200, node_json(node)};
  if (r.method == "GET" && r.target.starts_with("/v1/sandboxes/" + node + "-"))
    return {200, info_json(r.target.substr(std::string("/v1/sandboxes/").size()), node)};
  return {404, json{{"code", "NOT_FOUND"}, {"message", "no such sandbox"}, {"retryable", false}}.dump()};
}

TEST(Transport, ConnectionRefusedIsRetryableUnavailableAndNotSent) {
  Transport t(parse_endpoint("unix:/tmp/dsec-no-such-dir/agent.sock"));
  try {
    t.send(http_request("GET", "/v1/node"), SteadyClock::now() + milliseconds{2000});
    FAIL() << "send returned";
  } catch (const TransportError& e) {
    EXPECT_EQ(e.code(), Code::kUnavailable);
    EXPECT_TRUE(e.retryable());
    EXPECT_FALSE(e.maybe_sent());
    EXPECT_NE(std::string(e.what()).find("/tmp/dsec-no-such-dir/agent.sock"), std::string::npos) << e.what();
  }
}

TEST(Transport, ASecondCallReusesTheConnection) {
  TestServer server([](const Request& r) { return simple_node(r, "n1"); });
  Transport t(parse_endpoint(server.endpoint()));
  auto deadline = SteadyClock::now() + milliseconds{5000};
  EXPECT_EQ(t.send(http_request("GET", "/v1/node"), deadline).status, 200);
  EXPECT_EQ(t.stats().connects, 1u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(t.send(http_request("GET", "/v1/node"), deadline).status, 200);
  EXPECT_EQ(t.stats().connects, 1u);  // still the first connection
  EXPECT_EQ(t.stats().requests, 21u);
  EXPECT_EQ(server.accepted(), 1);
}

TEST(Transport, ThreadsShareAPoolOfConnections) {
  TestServer server([](const Request& r) { return simple_node(r, "n1"); });
  Transport t(parse_endpoint(server.endpoint()));
  constexpr int kThreads = 8, kCalls = 25;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&] {
      for (int k = 0; k < kCalls; ++k)
        if (t.send(http_request("GET", "/v1/node"), SteadyClock::now() + milliseconds{5000}).status == 200) ++ok;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(ok.load(), kThreads * kCalls);
  EXPECT_LE(server.accepted(), kThreads);  // at most one connection per concurrent caller, never one per call
  EXPECT_LE(t.stats().idle_handles, static_cast<std::size_t>(kThreads));
}

TEST(Transport, ADeadlineThatPassesIsDeadlineExceeded) {
  TestServer server([](const Request& r) {
    std::this_thread::sleep_for(milliseconds{500});
    return simple_node(r, "n1");
  });
  Transport t(parse_endpoint(server.endpoint()));
  auto start = SteadyClock::now();
  try {
    t.send(http_request("GET", "/v1/node"), start + milliseconds{100});
    FAIL() << "send returned";
  } catch (const TransportError& e) {
    EXPECT_EQ(e.code(), Code::kDeadlineExceeded);
    EXPECT_FALSE(e.retryable());
    EXPECT_TRUE(e.maybe_sent());
  }
  EXPECT_LT(SteadyClock::now() - start, milliseconds{450});
}

TEST(ClientCore, AgentErrorsComeBackWithTheirCodeAndMessage) {
  TestServer server([](const Request& r) { return simple_node(r, "n1"); });
  ClientCore core(fast_options({server.endpoint()}));
  try {
    core.get("n1x-00");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
    EXPECT_NE(std::string(e.what()).find("no such sandbox"), std::string::npos) << e.what();
  }
  EXPECT_EQ(server.requests().size(), 1u);  // NOT_FOUND is not retried
  EXPECT_EQ(core.get("n1-abc").id, "n1-abc");
}

TEST(ClientCore, IdempotentCallsAreRetriedOnRetryableErrors) {
  std::atomic<int> calls{0};
  TestServer server([&](const Request& r) -> Reply {
    if (++calls <= 2) return {503, json{{"code", "UNAVAILABLE"}, {"message", "busy"}, {"retryable", true}}.dump()};
    return simple_node(r, "n1");
  });
  ClientCore core(fast_options({server.endpoint()}));
  EXPECT_EQ(core.get("n1-1").id, "n1-1");
  EXPECT_EQ(calls.load(), 3);
}

TEST(ClientCore, UnreachableAgentIsRetriedUntilAttemptsRunOut) {
  ClientCore core(fast_options({"unix:/tmp/dsec-no-such-dir/agent.sock"}));
  EXPECT_CODE(core.get("n1-1"), Code::kUnavailable);
  EXPECT_EQ(core.stats().requests, 4u);  // max_attempts
  // An exec that could not connect never reached the agent, so it is retried too.
  EXPECT_CODE(core.exec("n1-1", shell_exec("true")), Code::kUnavailable);
  EXPECT_EQ(core.stats().requests, 8u);
}

TEST(ClientCore, TheCallDeadlineBoundsAllRetries) {
  auto options = fast_options({"unix:/tmp/dsec-no-such-dir/agent.sock"});
  options.retry.max_attempts = 1'000'000;
  options.retry.initial_backoff = milliseconds{20};
  options.retry.max_backoff = milliseconds{20};
  options.call_deadline = milliseconds{300};
  ClientCore core(options);
  auto start = SteadyClock::now();
  EXPECT_CODE(core.get("n1-1"), Code::kDeadlineExceeded);
  auto took = SteadyClock::now() - start;
  EXPECT_GE(took, milliseconds{200});
  EXPECT_LT(took, milliseconds{2000});
  EXPECT_GT(core.stats().requests, 2u);
}

TEST(ClientCore, ExecIsRetriedUnderItsRequestIdAndALostOutcomeSaysSo) {
  // Every answer lost: the exec is retried with the same request id (the agent runs it at most once), and in the
  // end the client cannot know whether it ran.
  TestServer server([](const Request&) { return Reply{.close_without_reply = true}; });
  ClientCore core(fast_options({server.endpoint()}));
  try {
    core.exec("n1-1", shell_exec("echo once"));
    FAIL();
  } catch (const OutcomeUnknown& e) {
    EXPECT_EQ(e.code(), Code::kDataLoss);
    EXPECT_TRUE(e.infrastructure());
    EXPECT_FALSE(e.retryable());
    EXPECT_EQ(e.request_id().size(), 32u);
    EXPECT_NE(std::string(e.what()).find(e.request_id()), std::string::npos) << e.what();
  }
  auto reqs = server.requests();
  ASSERT_GT(reqs.size(), 1u);
  for (const auto& r : reqs)
    EXPECT_EQ(json::parse(r.body).at("request_id"), json::parse(reqs[0].body).at("request_id"));
}

TEST(ClientCore, ALostExecAnswerIsRecoveredByItsRetry) {
  std::atomic<int> calls{0};
  TestServer server([&](const Request& r) -> Reply {
    if (++calls == 1) return {.close_without_reply = true};
    return {200, json{{"exit_code", 0}, {"stdout", "b25jZQo="}}.dump()};
  });
  ClientCore core(fast_options({server.endpoint()}));
  ExecRequest req = shell_exec("echo once");
  req.request_id = "mine";
  EXPECT_EQ(core.exec("n1-1", req).stdout_data, "once\n");
  auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 2u);
  EXPECT_EQ(json::parse(reqs[1].body).at("request_id"), "mine");
}

TEST(ClientCore, ExecErrorsFromTheAgent) {
  // A refusal the agent says may be retried is (the command did not run); in the end it is the agent's error.
  TestServer draining([](const Request&) {
    return Reply{503, json{{"code", "UNAVAILABLE"}, {"message", "draining"}, {"retryable", true}}.dump()};
  });
  ClientCore core(fast_options({draining.endpoint()}));
  EXPECT_CODE(core.exec("n1-1", shell_exec("true")), Code::kUnavailable);
  EXPECT_GT(draining.requests().size(), 1u);
  // The agent knows an id's command was under way when it stopped: the outcome is unknown, never run again.
  TestServer restarted([](const Request&) {
    return Reply{500, json{{"code", "DATA_LOSS"},
                           {"message", "outcome unknown: exec request 'r' ..."},
                           {"retryable", false},
                           {"fault", "infrastructure"}}
                          .dump()};
  });
  ClientCore again(fast_options({restarted.endpoint()}));
  ExecRequest req = shell_exec("true");
  req.request_id = "r";
  try {
    again.exec("n1-1", req);
    FAIL();
  } catch (const OutcomeUnknown& e) {
    EXPECT_EQ(e.request_id(), "r");
  }
  EXPECT_EQ(restarted.requests().size(), 1u);
}

TEST(ClientCore, ExecRequestsAreCheckedBeforeTheyAreSent) {
  TestServer server([](const Request& r) { return simple_node(r, "n1"); });
  ClientCore core(fast_options({server.endpoint()}));
  EXPECT_CODE(core.exec("n1-1", ExecRequest{}), Code::kInvalidArgument);  // neither argv nor shell
  EXPECT_CODE(core.exec("n1-1", shell_exec("x", -1)), Code::kInvalidArgument);
  EXPECT_CODE(core.exec("../etc", shell_exec("x")), Code::kInvalidArgument);
  EXPECT_TRUE(server.requests().empty());
}

TEST(ClientCore, ARetriedCreateCarriesTheSameRequestId) {
  std::atomic<int> calls{0};
  TestServer server([&](const Request& r) -> Reply {
    if (r.method == "POST" && r.target == "/v1/sandboxes") {
      if (++calls == 1) return {.close_without_reply = true};  // the answer is lost
      return {201, info_json("n1-" + json::parse(r.body).at("request_id").get<std::string>(), "n1")};
    }
    return simple_node(r, "n1");
  });
  ClientCore core(fast_options({server.endpoint()}));
  auto info = core.create(SandboxSpec{});
  auto reqs = server.requests();
  ASSERT_EQ(reqs.size(), 2u);
  std::string id1 = json::parse(reqs[0].body).at("request_id");
  std::string id2 = json::parse(reqs[1].body).at("request_id");
  EXPECT_EQ(id1.size(), 32u);
  EXPECT_EQ(id1, id2);
  EXPECT_EQ(info.id, "n1-" + id1);
  EXPECT_EQ(reqs[0].headers["content-type"], "application/json");

  SandboxSpec spec;
  spec.request_id = "mine";
  core.create(spec);
  EXPECT_EQ(json::parse(server.requests().back().body).at("request_id"), "mine");
}

TEST(ClientCore, InvalidSpecsFailBeforeAnyCall) {
  TestServer server([](const Request& r) { return simple_node(r, "n1"); });
  ClientCore core(fast_options({server.endpoint()}));
  SandboxSpec spec;
  spec.resources.memory_bytes = 1;
  EXPECT_CODE(core.create(spec), Code::kInvalidArgument);
  EXPECT_CODE(core.create_many(3, spec), Code::kInvalidArgument);
  EXPECT_TRUE(server.requests().empty());
}

TEST(ClientCore, CreateManyIsAllOrNothing) {
  std::mutex mu;
  std::vector<std::string> made, deleted;
  TestServer a([&](const Request& r) -> Reply {
    if (r.method == "POST") {
      Reply reply = batch_reply(r, "na");
      const json answer = json::parse(reply.body);
      std::lock_guard lock(mu);
      for (const auto& s : answer.at("sandboxes")) made.push_back(s.at("id").get<std::string>());
      return reply;
    }
    if (r.method == "DELETE") {
      std::lock_guard lock(mu);
      deleted.push_back(r.target.substr(std::string("/v1/sandboxes/").size()));
      return {200, "{}"};
    }
    return simple_node(r, "na");
  });
  TestServer b([&](const Request& r) -> Reply {
    if (r.method == "POST")
      return {400, json{{"code", "INVALID_ARGUMENT"}, {"message", "image gone"}, {"retryable", false}}.dump()};
    return simple_node(r, "nb");
  });
  ClientCore core(fast_options({a.endpoint(), b.endpoint()}));
  SandboxSpec spec;
  spec.request_id = "batch";
  try {
    core.create_many(12, spec);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("image gone"), std::string::npos);
  }
  std::lock_guard lock(mu);
  EXPECT_FALSE(made.empty()) << "the pulse was spread over both nodes";
  std::sort(made.begin(), made.end());
  std::sort(deleted.begin(), deleted.end());
  EXPECT_EQ(deleted, made);  // every sandbox made was destroyed again
}

TEST(ClientCore, CreateManySendsOneBatchPerNodeConcurrently) {
  std::atomic<int> in_flight{0}, peak{0};
  std::mutex mu;
  std::map<std::string, std::vector<std::size_t>> counts;  // node -> batch sizes
  std::set<std::string> request_ids;
  auto handler = [&](const std::string& node) {
    return [&, node](const Request& r) -> Reply {
      if (r.method != "POST") return simple_node(r, node);
      int now = ++in_flight;
      for (int p = peak.load(); now > p && !peak.compare_exchange_weak(p, now);) {
      }
      std::this_thread::sleep_for(milliseconds{50});
      --in_flight;
      json body = json::parse(r.body);
      std::lock_guard lock(mu);
      counts[node].push_back(body.value("count", std::size_t{1}));
      request_ids.insert(body.at("request_id"));
      return batch_reply(r, node);
    };
  };
  TestServer a(handler("na")), b(handler("nb")), c(handler("nc"));
  auto options = fast_options({a.endpoint(), b.endpoint(), c.endpoint()});
  ClientCore core(options);
  auto infos = core.create_many(30, SandboxSpec{});
  ASSERT_EQ(infos.size(), 30u);
  std::set<std::string> ids;
  for (const auto& i : infos) ids.insert(i.id);
  EXPECT_EQ(ids.size(), 30u);
  std::lock_guard lock(mu);
  ASSERT_EQ(counts.size(), 3u) << "spread over every node";
  for (const auto& [node, sizes] : counts) {
    EXPECT_EQ(sizes.size(), 1u) << node << " got more than one request";
    EXPECT_EQ(sizes.front(), 10u) << node;
  }
  EXPECT_EQ(request_ids.size(), 3u);
  EXPECT_GT(peak.load(), 1) << "the batches went out at once";
}

TEST(ClientCore, CreateManyMovesARefusedBatchToAnotherNode) {
  std::atomic<int> b_posts{0};
  TestServer a([&](const Request& r) -> Reply {
    if (r.method == "POST") return batch_reply(r, "na");
    return simple_node(r, "na");
  });
  TestServer b([&](const Request& r) -> Reply {
    if (r.method == "POST") {
      ++b_posts;
      return {503, json{{"code", "UNAVAILABLE"}, {"message", "shutting down"}, {"retryable", true}}.dump()};
    }
    return simple_node(r, "nb");
  });
  ClientCore core(fast_options({a.endpoint(), b.endpoint()}));
  auto infos = core.create_many(8, SandboxSpec{});
  ASSERT_EQ(infos.size(), 8u);
  std::set<std::string> ids;
  for (const auto& i : infos) {
    EXPECT_EQ(i.node, "na");
    ids.insert(i.id);
  }
  EXPECT_EQ(ids.size(), 8u);
  EXPECT_GE(b_posts.load(), 1);
}

TEST(ClientCore, CallsForAnIdGoToTheNodeThatMadeIt) {
  TestServer a([](const Request& r) { return simple_node(r, "rack1"); });
  TestServer b([](const Request& r) { return simple_node(r, "rack1-node2"); });
  ClientCore core(fast_options({a.endpoint(), b.endpoint()}));
  EXPECT_EQ(core.get("rack1-node2-abc").node, "rack1-node2");
  EXPECT_EQ(core.get("rack1-abc").node, "rack1");
  EXPECT_CODE(core.get("rack9-abc"), Code::kNotFound);
  // Each node was asked for its id once; the sandbox calls went to the right node only.
  int a_node = 0, b_node = 0, a_sandbox = 0, b_sandbox = 0;
  for (const auto& r : a.requests()) (r.target == "/v1/node" ? a_node : a_sandbox)++;
  for (const auto& r : b.requests()) (r.target == "/v1/node" ? b_node : b_sandbox)++;
  EXPECT_EQ(a_node, 1);
  EXPECT_EQ(b_node, 1);
  EXPECT_EQ(a_sandbox, 1);
  EXPECT_EQ(b_sandbox, 1);
}

TEST(ClientCore, AnUnreachableNodeMakesRoutingUnavailableNotNotFound) {
  TestServer a([](const Request& r) { return simple_node(r, "n1"); });
  auto options = fast_options({a.endpoint(), "unix:/tmp/dsec-no-such-dir/agent.sock"});
  options.retry.max_attempts = 2;
  ClientCore core(options);
  EXPECT_EQ(core.get("n1-a").id, "n1-a");
  EXPECT_CODE(core.get("n2-a"), Code::kUnavailable);
}

TEST(ClientCore, CreatePlacementSkipsANodeThatCannotBeReached) {
  TestServer a([](const Request& r) -> Reply {
    if (r.method == "POST") return {201, info_json("n1-x", "n1")};
    return simple_node(r, "n1");
  });
  auto options = fast_options({"unix:/tmp/dsec-no-such-dir/agent.sock", a.endpoint()});
  ClientCore core(options);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(core.create(SandboxSpec{}).id, "n1-x");
}

TEST(ClientCore, FilesTravelRawAndDirectoriesAsTar) {
  std::mutex mu;
  std::map<std::string, std::string> files;
  TestServer server([&](const Request& r) -> Reply {
    auto q = r.target.find("?path=");
    if (q == std::string::npos) return simple_node(r, "n1");
    std::string rest = r.target.substr(q + 6);
    std::string path = rest.substr(0, rest.find('&'));
    std::lock_guard lock(mu);
    if (r.method == "PUT") {
      files[path] = r.body;
      files[path + " type"] = r.headers.at("content-type");
      files[path + " query"] = rest;
      return {200, "{}"};
    }
    if (path == "%2Fdir") return {200, "TARBYTES", "application/x-tar"};
    return {200, files[path], "application/octet-stream"};
  });
  ClientCore core(fast_options({server.endpoint()}));
  std::string bytes("a\0b\xff", 4);
  core.write_file("n1-1", "/tmp/x y", bytes, 0755);
  EXPECT_EQ(files["%2Ftmp%2Fx%20y"], bytes);
  EXPECT_EQ(files["%2Ftmp%2Fx%20y type"], "application/octet-stream");
  EXPECT_EQ(files["%2Ftmp%2Fx%20y query"], "%2Ftmp%2Fx%20y&mode=0755");
  EXPECT_EQ(core.read_file("n1-1", "/tmp/x y"), bytes);
  EXPECT_CODE(core.read_file("n1-1", "/dir"), Code::kInvalidArgument);
  EXPECT_EQ(core.download_tar("n1-1", "/dir"), "TARBYTES");
  EXPECT_EQ(server.requests().back().target, "/v1/sandboxes/n1-1/files?path=%2Fdir&format=tar");
  core.upload_tar("n1-1", "/up", "TAR");
  EXPECT_EQ(files["%2Fup type"], "application/x-tar");
  EXPECT_CODE(core.write_file("n1-1", "/x", "", 010000), Code::kInvalidArgument);
}

TEST(ClientCore, ListSendsLabelAndTenantFilters) {
  TestServer server([](const Request& r) -> Reply {
    if (r.target.starts_with("/v1/sandboxes?") || r.target == "/v1/sandboxes")
      return {200, json{{"sandboxes", json::array({json::parse(info_json("n1-a", "n1"))})}}.dump()};
    return simple_node(r, "n1");
  });
  ClientCore core(fast_options({server.endpoint()}));
  auto got = core.list({{"job", "rl 7"}, {"team", "x=y"}}, "t1");
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].id, "n1-a");
  EXPECT_EQ(server.requests().back().target, "/v1/sandboxes?label=job%3Drl%207&label=team%3Dx%3Dy&tenant=t1");
}

TEST(ClientCore, DestroyIsIdempotent) {
  TestServer server([](const Request& r) -> Reply {
    return {404, json{{"code", "NOT_FOUND"}, {"message", "gone"}, {"retryable", false}}.dump()};
  });
  ClientCore core(fast_options({server.endpoint()}));
  EXPECT_NO_THROW(core.destroy("n1-1"));
}

TEST(ClientCore, AClosedClientRefusesCalls) {
  TestServer server([](const Request& r) { return simple_node(r, "n1"); });
  ClientCore core(fast_options({server.endpoint()}));
  core.close();
  EXPECT_CODE(core.get("n1-1"), Code::kFailedPrecondition);
  EXPECT_TRUE(server.requests().empty());
}

TEST(Client, SandboxHandlesOwnWhatCreateMadeAndNotWhatAttachFound) {
  std::mutex mu;
  std::vector<std::string> deleted;
  TestServer server([&](const Request& r) -> Reply {
    if (r.method == "POST")
      return {201, info_json("n1-" + json::parse(r.body).at("request_id").get<std::string>(), "n1")};
    if (r.method == "DELETE") {
      std::lock_guard lock(mu);
      deleted.push_back(r.target);
      return {200, "{}"};
    }
    return simple_node(r, "n1");
  });
  Client client(fast_options({server.endpoint()}));
  std::string created_id, released_id;
  {
    Sandbox sb = client.create(SandboxSpec{});
    created_id = sb.id();
    Sandbox attached = client.attach("n1-other");
    EXPECT_FALSE(attached.owning());
    Sandbox kept = client.create(SandboxSpec{});
    released_id = kept.release();
    EXPECT_FALSE(static_cast<bool>(kept));
  }
  std::lock_guard lock(mu);
  ASSERT_EQ(deleted.size(), 1u);
  EXPECT_EQ(deleted[0], "/v1/sandboxes/" + created_id);
  EXPECT_CODE(client.attach("no/slash"), Code::kInvalidArgument);
}

}  // namespace
}  // namespace dsec::detail
