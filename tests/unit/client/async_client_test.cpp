// dsec::AsyncClient (the public asyncio-style API) against a real dsecd with container sandboxes: many calls on
// one I/O thread, streamed output in order before the result, files, processes and sessions, and how it ends:
// arguments refused at the call, errors in the completion, a completion that throws, cancel, close.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "agent_fixture.hpp"
#include "dsec/async_client.hpp"
#include "dsec/dsec.hpp"
#include "error_test_util.hpp"

namespace dsec::detail {
namespace {

using namespace std::chrono_literals;

class AsyncClientTest : public AgentTest {
 protected:
  void SetUp() override {
    AgentTest::SetUp();
    if (IsSkipped()) return;
    client_ = std::make_unique<Client>(embedded("cxx-async", "container"));
    SandboxSpec spec;
    spec.resources.cpu = 0.5;
    try {
      sandbox_ = client_->create(spec);
    } catch (const Error& e) {
      GTEST_SKIP() << "container sandboxes cannot be created on this host: " << e.what();
    }
    calls_ = std::make_unique<AsyncClient>(*client_);
  }

  void TearDown() override {
    calls_.reset();
    sandbox_ = Sandbox();
    client_.reset();
  }

  // Starts a call with `start(completion)` and waits for its outcome (a minute at most).
  template <typename T, typename Start>
  AsyncOutcome<T> wait_for(Start start) {
    auto promise = std::make_shared<std::promise<AsyncOutcome<T>>>();
    auto result = promise->get_future();
    start([promise](AsyncOutcome<T>&& outcome) { promise->set_value(std::move(outcome)); });
    if (result.wait_for(60s) != std::future_status::ready) {
      ADD_FAILURE() << "the call did not complete in a minute";
      AsyncOutcome<T> late;
      late.error = std::make_exception_ptr(Error(Code::kDeadlineExceeded, "the test stopped waiting"));
      return late;
    }
    return result.get();
  }

  std::unique_ptr<Client> client_;
  Sandbox sandbox_;
  std::unique_ptr<AsyncClient> calls_;
};

TEST_F(AsyncClientTest, ManyCommandsCompleteOnOneIoThread) {
  constexpr int kCalls = 24;
  std::mutex mu;
  std::vector<std::string> outputs;
  std::set<std::thread::id> threads;
  std::promise<void> all_done;
  for (int i = 0; i < kCalls; ++i) {
    ExecRequest r;
    r.shell = "sleep 0.2; echo " + std::to_string(i);
    calls_->exec(sandbox_.id(), r, [&](AsyncOutcome<ExecResult>&& o) {
      std::lock_guard lock(mu);
      outputs.push_back(o.ok() ? o.value->stdout_data : "error");
      threads.insert(std::this_thread::get_id());
      if (outputs.size() == kCalls) all_done.set_value();
    });
  }
  EXPECT_GT(calls_->in_flight(), 0u);  // every call returned before its command ran
  ASSERT_EQ(all_done.get_future().wait_for(60s), std::future_status::ready);
  std::set<std::string> got(outputs.begin(), outputs.end());
  std::set<std::string> want;
  for (int i = 0; i < kCalls; ++i) want.insert(std::to_string(i) + "\n");
  EXPECT_EQ(got, want);
  EXPECT_EQ(threads.size(), 1u);
  EXPECT_EQ(threads.count(std::this_thread::get_id()), 0u);
  EXPECT_EQ(calls_->in_flight(), 0u);
}

TEST_F(AsyncClientTest, StreamedOutputArrivesInOrderBeforeTheResult) {
  ExecRequest r;
  r.shell = "printf first; sleep 0.3; printf second >&2; exit 3";
  std::vector<std::pair<int, std::string>> chunks;  // the I/O thread's until the completion ran
  auto o = wait_for<ExecResult>([&](const Completion<ExecResult>& done) {
    calls_->exec(sandbox_.id(), r, done,
                 [&](int fd, std::string_view data) { chunks.emplace_back(fd, std::string(data)); });
  });
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o.value->exit_code, 3);
  EXPECT_TRUE(o.value->stdout_data.empty() && o.value->stderr_data.empty());
  ASSERT_EQ(chunks.size(), 2u);
  EXPECT_EQ(chunks[0], (std::pair<int, std::string>{1, "first"}));
  EXPECT_EQ(chunks[1], (std::pair<int, std::string>{2, "second"}));

  // What the output callback throws ends its call with it.
  struct Stop {};
  auto stopped = wait_for<ExecResult>([&](const Completion<ExecResult>& done) {
    calls_->exec(sandbox_.id(), r, done, [](int, std::string_view) { throw Stop{}; });
  });
  EXPECT_THROW(stopped.get(), Stop);
}

TEST_F(AsyncClientTest, FilesProcessesAndSessions) {
  const std::string& id = sandbox_.id();
  auto wrote =
      wait_for<void>([&](const Completion<void>& done) { calls_->write_file(id, "/tmp/a.txt", "hello", 0600, done); });
  ASSERT_TRUE(wrote.ok());
  auto read =
      wait_for<std::string>([&](const Completion<std::string>& done) { calls_->read_file(id, "/tmp/a.txt", done); });
  EXPECT_EQ(read.get(), "hello");
  EXPECT_EQ(sandbox_.read_file("/tmp/a.txt"), "hello");  // the blocking API sees the same file

  ProcessRequest cat;
  cat.argv = {"cat"};
  auto spawned = wait_for<ProcessInfo>([&](const Completion<ProcessInfo>& done) { calls_->spawn(id, cat, done); });
  int pid = spawned.get().pid;
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(
      wait_for<void>([&](const Completion<void>& done) { calls_->write_stdin(id, pid, "through stdin", done); }).ok());
  ASSERT_TRUE(wait_for<void>([&](const Completion<void>& done) { calls_->close_stdin(id, pid, done); }).ok());
  auto ended =
      wait_for<ProcessInfo>([&](const Completion<ProcessInfo>& done) { calls_->process_wait(id, pid, 20, done); });
  EXPECT_FALSE(ended.get().running);
  EXPECT_EQ(ended.get().exit_code, 0);
  auto output = wait_for<ProcessOutput>([&](const Completion<ProcessOutput>& done) {
    calls_->process_output(id, pid, 0, std::nullopt, 0, 1 << 20, done);
  });
  EXPECT_EQ(output.get().stdout_data, "through stdin");
  auto listed = wait_for<std::vector<ProcessInfo>>(
      [&](const Completion<std::vector<ProcessInfo>>& done) { calls_->processes(id, done); });
  EXPECT_EQ(listed.get().size(), 1u);

  SessionOptions options;
  options.name = "work";
  ASSERT_TRUE(wait_for<SessionInfo>([&](const Completion<SessionInfo>& done) {
                calls_->open_session(id, options, done);
              }).ok());
  auto set = wait_for<ExecResult>(
      [&](const Completion<ExecResult>& done) { calls_->session_run(id, "work", "export X=kept", 30, 1 << 20, done); });
  ASSERT_TRUE(set.ok());
  auto echoed = wait_for<ExecResult>(
      [&](const Completion<ExecResult>& done) { calls_->session_run(id, "work", "echo $X", 30, 1 << 20, done); });
  EXPECT_EQ(echoed.get().stdout_data, "kept\n");  // the shell kept its state between runs
  ASSERT_TRUE(wait_for<void>([&](const Completion<void>& done) { calls_->close_session(id, "work", done); }).ok());
  auto gone =
      wait_for<SessionInfo>([&](const Completion<SessionInfo>& done) { calls_->session_info(id, "work", done); });
  EXPECT_CODE(gone.get(), Code::kNotFound);
}

TEST_F(AsyncClientTest, ErrorsCancelAndClose) {
  // Bad arguments are refused at the call; nothing is sent.
  EXPECT_CODE(calls_->write_file(sandbox_.id(), "/tmp/x", "", 010000, [](AsyncOutcome<void>&&) {}),
              Code::kInvalidArgument);
  EXPECT_CODE(calls_->info(sandbox_.id(), nullptr), Code::kInvalidArgument);
  // What the agent answers reaches the completion.
  auto missing =
      wait_for<SandboxInfo>([&](const Completion<SandboxInfo>& done) { calls_->info(sandbox_.id() + "-nope", done); });
  EXPECT_CODE(missing.get(), Code::kNotFound);

  // A completion that throws does not stop the I/O thread.
  calls_->info(sandbox_.id(), [](AsyncOutcome<SandboxInfo>&&) { throw std::runtime_error("the caller's own"); });
  auto info = wait_for<SandboxInfo>([&](const Completion<SandboxInfo>& done) { calls_->info(sandbox_.id(), done); });
  EXPECT_EQ(info.get().state, "running");

  // A cancelled call never completes; the client goes on.
  ExecRequest slow;
  slow.shell = "sleep 30";
  std::atomic<bool> completed{false};
  auto ticket = calls_->exec(sandbox_.id(), slow, [&](AsyncOutcome<ExecResult>&&) { completed = true; });
  std::this_thread::sleep_for(200ms);
  calls_->cancel(ticket);  // taken off by the I/O thread at its next round
  for (int i = 0; i < 500 && calls_->in_flight() > 0; ++i) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(calls_->in_flight(), 0u);
  ExecRequest quick;
  quick.argv = {"true"};
  EXPECT_EQ(wait_for<ExecResult>([&](const Completion<ExecResult>& d) { calls_->exec(sandbox_.id(), quick, d); })
                .get()
                .exit_code,
            0);
  EXPECT_FALSE(completed);

  // close() ends what is in flight with FAILED_PRECONDITION; later calls are refused at once.
  auto promise = std::make_shared<std::promise<AsyncOutcome<ExecResult>>>();
  calls_->exec(sandbox_.id(), slow, [promise](AsyncOutcome<ExecResult>&& o) { promise->set_value(std::move(o)); });
  calls_->close();
  auto closed = promise->get_future();
  ASSERT_EQ(closed.wait_for(10s), std::future_status::ready);
  EXPECT_CODE(closed.get().get(), Code::kFailedPrecondition);
  EXPECT_CODE(calls_->info(sandbox_.id(), [](AsyncOutcome<SandboxInfo>&&) {}), Code::kFailedPrecondition);
  calls_->close();  // idempotent
}

}  // namespace
}  // namespace dsec::detail
