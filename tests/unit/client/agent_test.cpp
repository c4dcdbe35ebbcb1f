// The client against a real dsecd (build/bin/dsecd, its `null` backend; containers where the host runs them):
// the embedded agent's life, connection reuse, sandbox and file calls, create_many, RAII, routing across nodes.
// Skips with the reason when dsecd has not been built or the host lacks what a test needs.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "agent_fixture.hpp"
#include "client/client_core.hpp"
#include "dsec/dsec.hpp"

namespace dsec::detail {
namespace {

namespace fs = std::filesystem;

bool process_alive(pid_t pid) { return ::kill(pid, 0) == 0; }

TEST_F(AgentTest, EmbeddedAgentServesAndStopsWithTheClient) {
  ClientCore core(embedded("cxx-e1"));
  ASSERT_NE(core.embedded_agent(), nullptr);
  pid_t pid = core.embedded_agent()->pid();
  std::string sock = core.endpoint().substr(5);
  EXPECT_TRUE(process_alive(pid));
  EXPECT_TRUE(fs::exists(sock));

  auto nodes = core.nodes();
  ASSERT_EQ(nodes.size(), 1u);
  EXPECT_EQ(nodes[0].id, "cxx-e1");
  auto info = core.create(null_spec());
  EXPECT_TRUE(info.id.starts_with("cxx-e1-")) << info.id;
  EXPECT_EQ(core.get(info.id).state, "running");
  EXPECT_EQ(core.list({}, {}).size(), 1u);
  core.destroy(info.id);
  core.destroy(info.id);  // idempotent
  EXPECT_EQ(core.get(info.id).state, "destroyed");

  core.close();
  EXPECT_FALSE(process_alive(pid));  // stopped and reaped
  EXPECT_FALSE(fs::exists(sock));
  EXPECT_FALSE(fs::exists(fs::path(sock).parent_path()));
}

TEST_F(AgentTest, ASecondCallDoesNotReconnect) {
  ClientCore core(embedded("cxx-ka"));
  auto info = core.create(null_spec());
  auto before = core.stats();
  for (int i = 0; i < 50; ++i) core.get(info.id);
  auto after = core.stats();
  EXPECT_EQ(after.requests - before.requests, 50u);
  EXPECT_EQ(after.connects, before.connects);  // no new connection for 50 calls
  EXPECT_EQ(after.connects, 1u);
}

TEST_F(AgentTest, ThreadsShareAFewConnections) {
  ClientCore core(embedded("cxx-mt"));
  auto info = core.create(null_spec());
  constexpr int kThreads = 6;
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 30; ++i)
        if (core.get(info.id).id == info.id) ++ok;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads * 30);
  EXPECT_LE(core.stats().connects, static_cast<std::uint64_t>(kThreads));
}

TEST_F(AgentTest, FilesAndDirectories) {
  ClientCore core(embedded("cxx-files"));
  auto id = core.create(null_spec()).id;
  std::string bytes("\0\x01binary\xff", 9);
  core.write_file(id, "/data/a.bin", bytes, 0600);
  core.write_file(id, "/data/sub/b.txt", "bee", 0644);
  EXPECT_EQ(core.read_file(id, "/data/a.bin"), bytes);
  try {
    core.read_file(id, "/data/missing");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
  }
  try {
    core.read_file(id, "/data");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
  }
  std::string tar = core.download_tar(id, "/data");
  ASSERT_GE(tar.size(), 1024u);
  core.upload_tar(id, "/copy", tar);
  EXPECT_EQ(core.read_file(id, "/copy/sub/b.txt"), "bee");
  EXPECT_EQ(core.read_file(id, "/copy/a.bin"), bytes);
}

TEST_F(AgentTest, ExecOnTheNullBackendIsUnimplemented) {
  ClientCore core(embedded("cxx-x"));
  auto id = core.create(null_spec()).id;
  ExecRequest r;
  r.shell = "true";
  try {
    core.exec(id, r);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnimplemented);
  }
  // Streamed, the failure comes before any output: the same error, and no callback.
  int calls = 0;
  try {
    core.exec_stream(id, r, [&](int, std::string_view) { ++calls; });
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnimplemented);
    EXPECT_FALSE(e.retryable());
  }
  EXPECT_EQ(calls, 0);
}

TEST_F(AgentTest, CreateManyAndRequestIds) {
  ClientOptions o = embedded("cxx-many");
  o.create_concurrency = 4;
  ClientCore core(o);
  SandboxSpec spec = null_spec();
  spec.request_id = "cxx-batch";
  spec.labels = {{"batch", "1"}};
  auto first = core.create_many(20, spec);
  auto again = core.create_many(20, spec);
  ASSERT_EQ(first.size(), 20u);
  std::set<std::string> ids;
  for (std::size_t i = 0; i < first.size(); ++i) {
    ids.insert(first[i].id);
    EXPECT_EQ(first[i].id, again[i].id);
  }
  EXPECT_EQ(ids.size(), 20u);
  EXPECT_EQ(core.list({{"batch", "1"}}, {}).size(), 20u);

  // More cpu than the node admits: all or nothing.
  auto node = core.nodes().at(0);
  SandboxSpec big = null_spec();
  big.resources.cpu = 1.0;
  big.labels = {{"batch", "2"}};
  auto n = static_cast<std::size_t>(node.cores * node.cpu_overcommit) + 4;
  try {
    core.create_many(n, big);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kResourceExhausted) << e.what();
  }
  EXPECT_TRUE(core.list({{"batch", "2"}}, {}).empty());
}

TEST_F(AgentTest, SandboxHandlesDestroyOnScopeExit) {
  Client client(embedded("cxx-raii"));
  std::string id;
  {
    Sandbox sb = client.create(null_spec());
    id = sb.id();
    EXPECT_EQ(sb.info().state, "running");
  }
  EXPECT_EQ(client.attach(id).info().state, "destroyed");
  Sandbox kept = client.create(null_spec());
  std::string kept_id = kept.release();
  EXPECT_EQ(client.attach(kept_id).info().state, "running");
}

TEST_F(AgentTest, CallsRouteToTheNodeThatMadeTheSandbox) {
  ClientCore a(embedded("cxx-r"));
  ClientCore b(embedded("cxx-r-2"));
  ClientOptions both;
  both.endpoints = {b.endpoint(), a.endpoint()};
  ClientCore core(both);
  auto on_a = a.create(null_spec()).id;
  auto on_b = b.create(null_spec()).id;
  EXPECT_EQ(core.get(on_a).node, "cxx-r");
  EXPECT_EQ(core.get(on_b).node, "cxx-r-2");
  core.destroy(on_a);
  EXPECT_EQ(a.get(on_a).state, "destroyed");
  EXPECT_EQ(b.get(on_b).state, "running");
  // Creates spread over both nodes.
  std::set<std::string> nodes;
  for (int i = 0; i < 4; ++i) nodes.insert(core.create(null_spec()).node);
  EXPECT_EQ(nodes, (std::set<std::string>{"cxx-r", "cxx-r-2"}));
}

TEST_F(AgentTest, ContainerExec) {
  ClientCore core(embedded("cxx-ct", "container"));
  SandboxSpec spec;
  spec.resources.cpu = 0.5;
  SandboxInfo info;
  try {
    info = core.create(spec);
  } catch (const Error& e) {
    GTEST_SKIP() << "container sandboxes cannot be created on this host: " << e.what();
  }
  ExecRequest r;
  r.shell = "echo out; echo err >&2; exit 42";
  auto res = core.exec(info.id, r);
  EXPECT_EQ(res.exit_code, 42);
  EXPECT_EQ(res.stdout_data, "out\n");
  EXPECT_EQ(res.stderr_data, "err\n");
  ExecRequest slow;
  slow.argv = {"sleep", "10"};
  slow.timeout_seconds = 0.3;
  auto t = core.exec(info.id, slow);
  EXPECT_TRUE(t.timed_out);

  // Streamed: each chunk as it comes, stdout and stderr apart, the result without the output.
  ExecRequest streamed;
  streamed.shell = "printf first; sleep 0.6; printf second >&2; exit 3";
  std::vector<std::pair<int, std::string>> chunks;
  std::chrono::steady_clock::time_point first_at;
  auto sr = core.exec_stream(info.id, streamed, [&](int fd, std::string_view data) {
    if (chunks.empty()) first_at = std::chrono::steady_clock::now();
    chunks.emplace_back(fd, std::string(data));
  });
  auto returned = std::chrono::steady_clock::now();
  EXPECT_EQ(sr.exit_code, 3);
  EXPECT_TRUE(sr.stdout_data.empty() && sr.stderr_data.empty());
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0], (std::pair<int, std::string>{1, "first"}));
  EXPECT_EQ(chunks[1], (std::pair<int, std::string>{2, "second"}));
  EXPECT_GT(returned - first_at, std::chrono::milliseconds{400});

  // What the callback throws comes back as it was, and the client goes on working.
  struct Stop {};
  EXPECT_THROW(core.exec_stream(info.id, streamed, [](int, std::string_view) { throw Stop{}; }), Stop);
  EXPECT_EQ(core.exec(info.id, r).exit_code, 42);
  core.destroy(info.id);
}

}  // namespace
}  // namespace dsec::detail
