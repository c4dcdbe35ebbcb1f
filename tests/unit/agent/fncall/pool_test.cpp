// The fncall backend's pieces that need no fork server: how a pool sizes itself to load, and the frames the agent
// and the fork servers exchange (over a socket pair, with descriptors).
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "agent/fncall/pool_sizing.hpp"
#include "agent/fncall/wire.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::fncall {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

PoolLoad load(std::size_t servers, std::size_t busy, std::size_t waiting, std::size_t idle_expired, std::size_t min,
              std::size_t max) {
  PoolLoad l;
  l.servers = servers;
  l.busy = busy;
  l.waiting = waiting;
  l.idle_expired = idle_expired;
  l.min = min;
  l.max = max;
  return l;
}

TEST(FnCallPoolSizing, AnIdlePoolKeepsItsMinimum) {
  EXPECT_EQ(pool_target(load(0, 0, 0, 0, 2, 8)), 2u);
  PoolDecision d = decide_pool_size(load(0, 0, 0, 0, 2, 8));
  EXPECT_EQ(d.start, 2u);
  EXPECT_EQ(d.stop, 0u);
  // Nothing to do at the minimum.
  d = decide_pool_size(load(2, 0, 0, 2, 2, 8));
  EXPECT_EQ(d.start, 0u);
  EXPECT_EQ(d.stop, 0u);
}

TEST(FnCallPoolSizing, LoadGrowsThePoolWithOneSpareUpToItsMaximum) {
  // One call running: it and a spare, so the next call finds a child armed.
  EXPECT_EQ(pool_target(load(1, 1, 0, 0, 1, 8)), 2u);
  EXPECT_EQ(decide_pool_size(load(1, 1, 0, 0, 1, 8)).start, 1u);
  // Three running, two waiting: six.
  EXPECT_EQ(decide_pool_size(load(3, 3, 2, 0, 1, 8)).start, 3u);
  // Never past the maximum, however many wait.
  EXPECT_EQ(pool_target(load(8, 8, 100, 0, 1, 8)), 8u);
  EXPECT_EQ(decide_pool_size(load(8, 8, 100, 0, 1, 8)).start, 0u);
  EXPECT_EQ(decide_pool_size(load(6, 6, 100, 0, 1, 8)).start, 2u);
  // Servers still starting count: no second start for the same waiting call.
  EXPECT_EQ(decide_pool_size(load(2, 0, 1, 0, 0, 8)).start, 0u);
}

TEST(FnCallPoolSizing, ServersAboveTheTargetStopOnlyOnceIdleLongEnough) {
  // Eight servers, nothing to do, none idle for long: keep them (the next burst needs them).
  EXPECT_EQ(decide_pool_size(load(8, 0, 0, 0, 1, 8)).stop, 0u);
  // Five idle past the timeout: they go, as far as the target allows.
  EXPECT_EQ(decide_pool_size(load(8, 0, 0, 5, 1, 8)).stop, 5u);
  EXPECT_EQ(decide_pool_size(load(8, 0, 0, 8, 1, 8)).stop, 7u);
  EXPECT_EQ(decide_pool_size(load(8, 0, 0, 8, 3, 8)).stop, 5u);
  // Busy servers hold the target up.
  EXPECT_EQ(decide_pool_size(load(8, 4, 0, 4, 1, 8)).stop, 3u);
}

TEST(FnCallPoolSizing, APoolWithoutMinimumEmptiesWhenIdle) {
  // A pool of another image than the default: none wanted once there is no work.
  EXPECT_EQ(pool_target(load(1, 0, 0, 0, 0, 8)), 0u);
  EXPECT_EQ(decide_pool_size(load(1, 0, 0, 0, 0, 8)).stop, 0u);  // not idle long enough yet
  EXPECT_EQ(decide_pool_size(load(1, 0, 0, 1, 0, 8)).stop, 1u);
  // Its first call starts one for the call and a spare.
  EXPECT_EQ(decide_pool_size(load(0, 0, 1, 0, 0, 8)).start, 2u);
  // A language turned off (max 0) never starts anything.
  EXPECT_EQ(decide_pool_size(load(0, 0, 5, 0, 0, 0)).start, 0u);
}

struct SocketPair {
  UniqueFd a, b;
  SocketPair() {
    int fds[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    a.reset(fds[0]);
    b.reset(fds[1]);
  }
};

TEST(FnCallWire, FramesCarryHeaderBlobAndDescriptors) {
  SocketPair p;
  int pipefd[2];
  ASSERT_EQ(::pipe2(pipefd, O_CLOEXEC), 0);
  UniqueFd r(pipefd[0]), w(pipefd[1]);
  std::string blob(3 << 20, 'z');  // larger than the socket's buffer: the reader drains while the writer writes
  blob[17] = '\0';
  std::thread writer([&] { send_frame(p.a.get(), json{{"type", "call"}, {"n", 5}}, blob, {w.get()}); });
  Frame f;
  ASSERT_TRUE(recv_frame(p.b.get(), f, Clock::now() + 10s));
  writer.join();
  EXPECT_EQ(f.type(), "call");
  EXPECT_EQ(f.header["n"], 5);
  EXPECT_EQ(f.blob, blob);
  ASSERT_EQ(f.fds.size(), 1u);
  // The descriptor is the pipe's write end, and close-on-exec.
  EXPECT_EQ(::write(f.fds[0].get(), "ok", 2), 2);
  char buf[2];
  EXPECT_EQ(::read(r.get(), buf, 2), 2);
  EXPECT_EQ(std::string(buf, 2), "ok");
  EXPECT_TRUE(::fcntl(f.fds[0].get(), F_GETFD) & FD_CLOEXEC);
}

TEST(FnCallWire, EndOfFileTimeoutsAndTruncatedFrames) {
  {
    SocketPair p;
    p.a.reset();
    Frame f;
    bool timed_out = true;
    EXPECT_FALSE(recv_frame(p.b.get(), f, Clock::now() + 1s, &timed_out));
    EXPECT_FALSE(timed_out);
  }
  {
    SocketPair p;
    Frame f;
    bool timed_out = false;
    auto started = Clock::now();
    EXPECT_FALSE(recv_frame(p.b.get(), f, Clock::now() + 100ms, &timed_out));
    EXPECT_TRUE(timed_out);
    EXPECT_GE(Clock::now() - started, 100ms);
  }
  {
    // A frame cut short by the peer's exit.
    SocketPair p;
    const char partial[] = {20, 0, 0, 0, 0, 0, 0, 0, '{', '"'};
    ASSERT_EQ(::write(p.a.get(), partial, sizeof partial), static_cast<ssize_t>(sizeof partial));
    p.a.reset();
    Frame f;
    try {
      recv_frame(p.b.get(), f, Clock::now() + 1s);
      ADD_FAILURE() << "a truncated frame was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kUnavailable);
    }
  }
  {
    // Writing to a peer that is gone is UNAVAILABLE, not SIGPIPE.
    SocketPair p;
    p.b.reset();
    try {
      send_frame(p.a.get(), json{{"type", "x"}}, std::string(1 << 20, 'x'));
      ADD_FAILURE() << "a write to a closed peer succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kUnavailable);
    }
  }
}

}  // namespace
}  // namespace dsec::agent::fncall
