// Blocks of host ids (HostIdPool) and their host-wide claims (HostIdClaims): a block goes to one holder at a time,
// claims of live agents and of dead agents whose run directory remains are honoured, stale ones are taken over, and
// an agent restarted on its run directory takes its own back.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <optional>
#include <set>

#include "agent/agent_test_util.hpp"
#include "agent/backends/container/process_identity.hpp"
#include "agent/node/host_id_claims.hpp"
#include "agent/node/host_id_pool.hpp"

namespace dsec::agent {
namespace {

using testing::ScratchDir;
namespace fs = std::filesystem;

TEST(HostIdPool, HandsOutEachBlockOnceAndTakesItBack) {
  HostIdPool pool(1000, 3, 100, "test ids");
  std::set<std::uint32_t> got{pool.take(), pool.take(), pool.take()};
  EXPECT_EQ(got, (std::set<std::uint32_t>{1000, 1100, 1200}));
  try {
    pool.take();
    FAIL() << "a fourth block";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kResourceExhausted);
    EXPECT_NE(std::string(e.what()).find("test ids"), std::string::npos) << e.what();
  }
  pool.give_back(1100);
  EXPECT_EQ(pool.take(), 1100u);
  EXPECT_EQ(pool.in_use(), 3u);
}

TEST(HostIdPool, ClaimsOnlyStartsOfFreeBlocksAndSkipsRefusedOnes) {
  HostIdPool pool(1000, 4, 100);
  EXPECT_FALSE(pool.claim(1050));  // not the start of a block
  EXPECT_FALSE(pool.claim(900));
  EXPECT_FALSE(pool.claim(1400));  // past the last block
  EXPECT_TRUE(pool.claim(1200));
  EXPECT_FALSE(pool.claim(1200));  // in use already
  // Another holder has 1000 and 1100: the pool passes over them.
  EXPECT_EQ(pool.take([](std::uint32_t first) { return first >= 1300; }), 1300u);
  EXPECT_THROW(pool.take([](std::uint32_t) { return false; }), Error);
}

// A claim file as another agent would write it.
void write_claim(const fs::path& dir, std::uint32_t first, pid_t pid, std::uint64_t start, const std::string& run) {
  std::ofstream(dir / std::to_string(first)) << pid << " " << start << " " << run << "\n";
}

TEST(HostIdClaims, HonoursLiveHoldersAndKeptRunDirectoriesAndTakesOverStaleOnes) {
  ScratchDir scratch;
  const fs::path dir = scratch.path() / "claims", run = scratch.path() / "run", other_run = scratch.path() / "other";
  fs::create_directories(run);
  fs::create_directories(other_run);
  HostIdClaims claims(dir, run);
  EXPECT_TRUE(claims.claim(100));
  EXPECT_TRUE(claims.claim(100));  // ours already

  // pid 1 is alive: its claim holds whatever its run directory.
  const std::uint64_t init_start = container::process_start_time(1).value();
  write_claim(dir, 200, 1, init_start, "/nonexistent");
  EXPECT_FALSE(claims.claim(200));
  EXPECT_FALSE(claims.take_over(200));
  // A dead holder (pid 1 with another start time is no process) whose run directory remains: its sandboxes may run.
  write_claim(dir, 300, 1, init_start + 12345, other_run.string());
  EXPECT_FALSE(claims.claim(300));
  // ... and once that directory is gone, the claim is stale.
  fs::remove(other_run);
  EXPECT_TRUE(claims.claim(300));
  // The agent before a restart on this run directory: only a take-over (adoption) gets its claims.
  write_claim(dir, 400, 1, init_start + 1, run.string());
  EXPECT_FALSE(claims.claim(400));
  EXPECT_TRUE(claims.take_over(400));

  claims.release(100);
  EXPECT_FALSE(fs::exists(dir / "100"));
  claims.release(200);  // another's: left alone
  EXPECT_TRUE(fs::exists(dir / "200"));
  // Nothing written aside is left.
  for (const auto& e : fs::directory_iterator(dir)) EXPECT_NE(e.path().filename().string()[0], '.') << e.path();
}

// A holder that was killed but not reaped yet (a zombie: its parent has not waited for it) holds nothing: its claim
// is the run directory's, as a dead holder's is.
TEST(HostIdClaims, AnUnreapedDeadHolderIsDead) {
  ScratchDir scratch;
  const fs::path dir = scratch.path() / "claims", run = scratch.path() / "run";
  fs::create_directories(run);
  HostIdClaims claims(dir, run);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(0);
  // Alive or not yet: its start time is readable until it has exited.
  std::optional<std::uint64_t> started;
  for (int i = 0; i < 1000; ++i) {
    std::ifstream stat("/proc/" + std::to_string(child) + "/stat");
    std::string text((std::istreambuf_iterator<char>(stat)), {});
    if (text.find(") Z ") != std::string::npos) break;
    started = container::process_start_time(child);
    ::usleep(1000);
  }
  EXPECT_EQ(container::process_start_time(child), std::nullopt) << "a zombie counted as a live process";
  write_claim(dir, 500, child, started.value_or(1), "/nonexistent");
  EXPECT_TRUE(claims.claim(500));  // stale: its holder is dead and its run directory gone
  int status;
  ::waitpid(child, &status, 0);
}

TEST(HostIdClaims, ReleasesWhatTheAgentBeforeARestartLeftExceptWhatIsKept) {
  ScratchDir scratch;
  const fs::path dir = scratch.path() / "claims", run = scratch.path() / "run";
  fs::create_directories(run);
  HostIdClaims claims(dir, run);
  const std::uint64_t gone_start = container::process_start_time(1).value() + 7;
  for (std::uint32_t first : {10u, 20u, 30u}) write_claim(dir, first, 1, gone_start, run.string());
  write_claim(dir, 40, 1, gone_start, "/elsewhere-that-is-kept");  // another agent's
  fs::create_directories(scratch.path() / "elsewhere");
  claims.release_previous([](std::uint32_t first) { return first == 20; });
  EXPECT_FALSE(fs::exists(dir / "10"));
  EXPECT_TRUE(fs::exists(dir / "20"));
  EXPECT_FALSE(fs::exists(dir / "30"));
  EXPECT_TRUE(fs::exists(dir / "40"));
}

}  // namespace
}  // namespace dsec::agent
