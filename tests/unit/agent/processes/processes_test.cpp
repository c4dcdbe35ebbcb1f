// The processes a sandbox's init keeps (init/process_table, init/process_protocol), driven on the host with a small
// event loop standing in for pid 1's; exactly-once execs (agent/registry/exec_journal); the routes of processes and
// sessions.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "agent/api/routes.hpp"
#include "agent/registry/exec_journal.hpp"
#include "common/wire/process_protocol.hpp"
#include "dsec/error.hpp"
#include "init/process_table.hpp"

namespace dsec {
namespace {

using namespace process_protocol;
namespace fs = std::filesystem;

TEST(OutputBuffer, KeepsTheLastBytesAndCountsEveryOne) {
  init::OutputBuffer b;
  std::string chunk(600u << 10, 'a');
  b.append(chunk.data(), chunk.size());
  chunk.assign(600u << 10, 'b');
  b.append(chunk.data(), chunk.size());
  EXPECT_EQ(b.end(), 1200u << 10);
  std::uint64_t at = 0;
  std::string_view got = b.from(0, kOutputKeep, at);
  EXPECT_EQ(at, b.end() - kOutputKeep);  // the oldest bytes are gone: the read starts at the first kept one
  EXPECT_EQ(got.size(), kOutputKeep);
  EXPECT_EQ(got.back(), 'b');
  got = b.from(b.end() - 3, 100, at);
  EXPECT_EQ(at, b.end() - 3);
  EXPECT_EQ(got, "bbb");
  EXPECT_TRUE(b.from(b.end() + 10, 100, at).empty());
  EXPECT_EQ(at, b.end());
}

TEST(ProcessProtocol, EntriesRoundTripAndShortPayloadsAreRefused) {
  Entry e;
  e.pid = 42;
  e.kind = Kind::kSession;
  e.meta = "{\"name\":\"s1\"}";
  e.argv = {"/bin/sh", "-s"};
  e.pty = true;
  e.running = true;
  e.stdout_end = 1ull << 40;
  e.rows = 24;
  e.cols = 80;
  Writer w;
  w.entry(e);
  Reader r(w.bytes());
  Entry back;
  ASSERT_TRUE(r.entry(back) && r.done());
  EXPECT_EQ(back.pid, 42);
  EXPECT_EQ(back.kind, Kind::kSession);
  EXPECT_EQ(back.meta, e.meta);
  EXPECT_EQ(back.argv, e.argv);
  EXPECT_TRUE(back.pty && back.running && !back.stdin_open);
  EXPECT_EQ(back.stdout_end, 1ull << 40);
  for (std::size_t cut = 0; cut < w.bytes().size(); ++cut) {
    Reader shorter(std::string_view(w.bytes()).substr(0, cut));
    Entry x;
    EXPECT_FALSE(shorter.entry(x)) << "cut at " << cut;
  }
  // A count no payload of this size can hold is malformed, not an allocation.
  Writer huge;
  huge.u32(0xFFFFFFFF);
  Reader h(huge.bytes());
  std::vector<std::string> list;
  EXPECT_FALSE(h.strs(list));
}

// The table on the host, with the loop pid 1 runs around it.
class TableHarness {
 public:
  TableHarness()
      : table_(
            mask(), /*drop_capabilities=*/false,
            [this](std::uint64_t ticket, const std::string& reply) { replies_[ticket] = reply; },
            /*tickets_are_fds=*/false) {}

  const std::string& call(Op op, const std::string& payload) {  // the reply stays in replies_
    std::uint64_t ticket = next_++;
    std::vector<int> fds;
    table_.serve(ticket, op, payload, fds);
    for (int i = 0; i < 2000 && !replies_.count(ticket); ++i) turn(5);
    EXPECT_TRUE(replies_.count(ticket)) << "no reply";
    return replies_[ticket];
  }
  // Serves a request whose reply may come later; the reply is then in reply(ticket).
  std::uint64_t start(Op op, const std::string& payload) {
    std::uint64_t ticket = next_++;
    std::vector<int> fds;
    table_.serve(ticket, op, payload, fds);
    return ticket;
  }
  bool has_reply(std::uint64_t ticket) const { return replies_.count(ticket) > 0; }
  void turn(int timeout_ms) {
    std::vector<pollfd> fds;
    table_.poll_fds(fds);
    int t = table_.next_timeout_ms();
    ::poll(fds.data(), fds.size(), t < 0 ? timeout_ms : std::min(t, timeout_ms));
    table_.poll_done(fds, 0);
    table_.expire();
    for (pid_t pid : pids_) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) table_.reaped(pid, status);
    }
  }
  int spawn(const std::vector<std::string>& argv, bool pty = false) {
    std::string start;
    auto u32 = [&](std::uint32_t v) { start.append(reinterpret_cast<const char*>(&v), 4); };
    auto str = [&](const std::string& s) {
      u32(static_cast<std::uint32_t>(s.size()));
      start += s;
    };
    u32(static_cast<std::uint32_t>(argv.size()));
    for (const auto& a : argv) str(a);
    u32(1);
    str("PATH=/usr/bin:/bin");
    str("/");
    Writer w;
    w.u32(0);
    w.str("tag");
    w.u32(pty ? 1 : 0);
    w.u32(24);
    w.u32(80);
    w.str(start);
    Reader r(call(Op::kSpawn, w.bytes()));
    std::int32_t status = -1;
    Entry e;
    EXPECT_TRUE(r.i32(status) && status == 0 && r.entry(e)) << "spawn answered status " << status;
    pids_.push_back(e.pid);
    return e.pid;
  }

 private:
  static sigset_t mask() {
    sigset_t m;
    sigprocmask(SIG_SETMASK, nullptr, &m);
    return m;
  }
  init::ProcessTable table_;
  std::map<std::uint64_t, std::string> replies_;
  std::uint64_t next_ = 1;
  std::vector<pid_t> pids_;
};

std::string read_payload(int pid, std::uint64_t out, std::uint64_t err, std::uint32_t wait_ms) {
  Writer w;
  w.i32(pid);
  w.u64(out);
  w.u64(err);
  w.u32(kMaxReadBytes);
  w.u32(wait_ms);
  return w.bytes();
}

struct Read {
  Entry entry;
  std::string out, err;
};

Read decode_read(const std::string& reply) {
  Reader r(reply);
  std::int32_t status = -1;
  Read got;
  std::uint64_t at = 0;
  EXPECT_TRUE(r.i32(status) && status == 0);
  EXPECT_TRUE(r.entry(got.entry) && r.u64(at) && r.str(got.out) && r.u64(at) && r.str(got.err) && r.done());
  return got;
}

TEST(ProcessTable, KeepsStdinOpenAndOutputReadableAfterTheEnd) {
  TableHarness t;
  int pid = t.spawn({"/bin/sh", "-c", "read line; echo got $line; echo oops >&2; exit 3"});
  // A read that waits is parked until there is output.
  std::uint64_t waiting = t.start(Op::kRead, read_payload(pid, 0, 0, 10'000));
  t.turn(20);
  EXPECT_FALSE(t.has_reply(waiting));
  Writer w;
  w.i32(pid);
  w.u32(1);  // close after
  w.str("hello\n");
  Reader wr(t.call(Op::kWrite, w.bytes()));
  std::int32_t status = -1;
  ASSERT_TRUE(wr.i32(status));
  EXPECT_EQ(status, 0);
  for (int i = 0; i < 400 && !t.has_reply(waiting); ++i) t.turn(5);
  ASSERT_TRUE(t.has_reply(waiting));
  // Wait for its end, then read everything from the start: nothing is consumed by the first read.
  Read done;
  for (int i = 0; i < 200; ++i) {
    done = decode_read(t.call(Op::kRead, read_payload(pid, 0, 0, 50)));
    if (!done.entry.running) break;
    t.turn(10);  // (a read with output to give answers at once: let the loop see the exit)
  }
  EXPECT_FALSE(done.entry.running);
  EXPECT_TRUE(WIFEXITED(done.entry.wait_status) && WEXITSTATUS(done.entry.wait_status) == 3);
  EXPECT_EQ(done.out, "got hello\n");
  EXPECT_EQ(done.err, "oops\n");
  // Its stdin is gone with it.
  Reader again(t.call(Op::kWrite, w.bytes()));
  ASSERT_TRUE(again.i32(status));
  EXPECT_EQ(static_cast<Status>(status), Status::kEnded);
}

TEST(ProcessTable, TreeKillSparesTheNamedChildren) {
  TableHarness t;
  int pid = t.spawn({"/bin/sh", "-c", "sleep 100 & sleep 100 & wait"});
  std::vector<std::int32_t> kids;
  for (int i = 0; i < 200 && kids.size() < 2; ++i) {
    Writer w;
    w.i32(pid);
    Reader r(t.call(Op::kChildren, w.bytes()));
    std::int32_t status = -1;
    std::uint32_t n = 0;
    ASSERT_TRUE(r.i32(status) && r.u32(n));
    kids.resize(n);
    for (auto& k : kids) r.i32(k);
    if (kids.size() < 2) t.turn(10);
  }
  ASSERT_EQ(kids.size(), 2u);
  Writer w;
  w.i32(pid);
  w.i32(SIGKILL);
  w.u32(static_cast<std::uint32_t>(Scope::kTreeExcept));
  w.u32(1);
  w.i32(kids[0]);
  Reader r(t.call(Op::kSignal, w.bytes()));
  std::int32_t status = -1;
  std::uint32_t signalled = 0;
  ASSERT_TRUE(r.i32(status) && r.u32(signalled));
  EXPECT_EQ(signalled, 1u);
  EXPECT_EQ(::kill(kids[0], 0), 0) << "the spared child was killed";
  Writer forget;
  forget.i32(pid);
  t.call(Op::kForget, forget.bytes());
  ::kill(kids[0], SIGKILL);
}

TEST(ProcessTable, UnknownPidsAndMalformedRequests) {
  TableHarness t;
  Reader r(t.call(Op::kRead, read_payload(999999, 0, 0, 0)));
  std::int32_t status = -1;
  ASSERT_TRUE(r.i32(status));
  EXPECT_EQ(static_cast<Status>(status), Status::kNotFound);
  Reader bad(t.call(Op::kRead, "xx"));
  ASSERT_TRUE(bad.i32(status));
  EXPECT_EQ(static_cast<Status>(status), Status::kBadRequest);
  Reader op(t.call(static_cast<Op>(77), ""));
  ASSERT_TRUE(op.i32(status));
  EXPECT_EQ(static_cast<Status>(status), Status::kBadRequest);
}

class ExecJournalTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("dsec-journal-" + std::to_string(::getpid()) + "-" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
};

ExecResult result_with(std::string out) {
  ExecResult r;
  r.exit_code = 0;
  r.stdout_data = std::move(out);
  return r;
}

TEST_F(ExecJournalTest, RunsOnceAndAnswersRepeatsWithTheFirstResult) {
  agent::ExecJournal journal(dir_);
  int runs = 0;
  auto run = [&] { return result_with("run " + std::to_string(++runs)); };
  EXPECT_EQ(journal.run_once("sb", "r1", "fp", run).stdout_data, "run 1");
  EXPECT_EQ(journal.run_once("sb", "r1", "fp", run).stdout_data, "run 1");
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(journal.run_once("other", "r1", "fp", run).stdout_data, "run 2");  // ids are per sandbox
  try {
    journal.run_once("sb", "r1", "another command", run);
    FAIL() << "a reused id with another command ran";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
  }
  // A failure before the command ran forgets the id.
  EXPECT_THROW(journal.run_once("sb", "r2", "fp", [&]() -> ExecResult { throw Error(Code::kUnavailable, "x"); }),
               Error);
  EXPECT_EQ(journal.run_once("sb", "r2", "fp", run).stdout_data, "run 3");
}

TEST_F(ExecJournalTest, ARestartKeepsResultsAndMakesUnfinishedOnesUnknown) {
  {
    agent::ExecJournal journal(dir_);
    journal.run_once("sb", "done", "fp", [] { return result_with(std::string(3u << 20, 'x')); });
  }
  {
    // An exec under way when the agent was killed: its start is on disk, its result never is.
    std::FILE* f = std::fopen((dir_ / "sb.log").c_str(), "a");
    ASSERT_NE(f, nullptr);
    std::fputs("{\"id\":\"cut\",\"fingerprint\":\"fp\",\"started\":1}\n", f);
    std::fclose(f);
  }
  agent::ExecJournal after(dir_);
  ExecResult kept = after.run_once("sb", "done", "fp", [] { return result_with("ran again"); });
  EXPECT_EQ(kept.stdout_data.size(), agent::ExecJournal::kKeptOutput);
  EXPECT_TRUE(kept.stdout_truncated);
  try {
    after.run_once("sb", "cut", "fp", [] { return result_with("ran again"); });
    FAIL() << "an unknown outcome ran again";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kDataLoss);
    EXPECT_TRUE(e.infrastructure());
  }
  after.retain({});
  EXPECT_FALSE(fs::exists(dir_ / "sb.log"));
}

TEST_F(ExecJournalTest, KeepsTheLastIdsOfASandboxAndCompacts) {
  agent::ExecJournal journal(dir_);
  const std::size_t n = agent::ExecJournal::kIdsPerSandbox * 3;
  for (std::size_t i = 0; i < n; ++i)
    journal.run_once("sb", "r" + std::to_string(i), "fp", [&] { return result_with("out " + std::to_string(i)); });
  // The newest are answered from the (compacted) file; the oldest are forgotten.
  EXPECT_EQ(journal.run_once("sb", "r" + std::to_string(n - 1), "fp", [] { return result_with("again"); }).stdout_data,
            "out " + std::to_string(n - 1));
  EXPECT_EQ(journal.run_once("sb", "r0", "fp", [] { return result_with("again"); }).stdout_data, "again");
  EXPECT_LT(fs::file_size(dir_ / "sb.log"), 200u * 1024);
}

TEST_F(ExecJournalTest, JsonAnswersAreKeptWholeAcrossARestart) {
  // Spawns, stdin writes and signals keep their JSON answer (a spawn's pid) under their id.
  int runs = 0;
  {
    agent::ExecJournal journal(dir_);
    auto first = journal.run_once_json("sb", "spawn/s1", "fp", [&] { return protocol::json{{"pid", 40 + ++runs}}; });
    EXPECT_EQ(first["pid"], 41);
    EXPECT_EQ(journal.run_once_json("sb", "spawn/s1", "fp",
                                    [&] {
                                      return protocol::json{{"pid", 40 + ++runs}};
                                    }),
              first);
  }
  agent::ExecJournal after(dir_);
  EXPECT_EQ(after.run_once_json("sb", "spawn/s1", "fp",
                                [&] {
                                  return protocol::json{{"pid", 40 + ++runs}};
                                })["pid"],
            41);
  EXPECT_EQ(runs, 1);
  EXPECT_THROW(after.run_once_json("sb", "spawn/s1", "other", [] { return protocol::json::object(); }), Error);
}

TEST(ProcessRoutes, ParseWithTheirItem) {
  using agent::Route;
  auto t = agent::parse_target("/v1/sandboxes/n1-ab/processes/42/output?stdout=0");
  EXPECT_EQ(t.route, Route::kSandboxProcessOutput);
  EXPECT_EQ(t.sandbox_id, "n1-ab");
  EXPECT_EQ(t.item, "42");
  EXPECT_EQ(agent::parse_target("/v1/sandboxes/n1-ab/processes").route, Route::kSandboxProcesses);
  EXPECT_EQ(agent::parse_target("/v1/sandboxes/n1-ab/processes/7").route, Route::kSandboxProcess);
  EXPECT_EQ(agent::parse_target("/v1/sandboxes/n1-ab/processes/7/stdin").route, Route::kSandboxProcessStdin);
  EXPECT_EQ(agent::parse_target("/v1/sandboxes/n1-ab/sessions").route, Route::kSandboxSessions);
  auto s = agent::parse_target("/v1/sandboxes/n1-ab/sessions/main/run");
  EXPECT_EQ(s.route, Route::kSandboxSessionRun);
  EXPECT_EQ(s.item, "main");
  EXPECT_EQ(agent::parse_target("/v1/sandboxes/n1-ab/sessions/main/restart").route, Route::kSandboxSessionRestart);
  EXPECT_EQ(agent::parse_target("/v1/sandboxes/n1-ab/sessions/main/nope").route, Route::kUnknown);
  EXPECT_EQ(agent::parse_target("/v1/sandboxes/n1-ab/processes/7/run").route, Route::kUnknown);
  EXPECT_EQ(agent::parse_target("/v1/sandboxes/n1-ab/processes//output").route, Route::kUnknown);
}

}  // namespace
}  // namespace dsec
