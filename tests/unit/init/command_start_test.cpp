// How dsec-init starts a command (agent/init/command_start): the cgroup it starts in. Given a cgroup2 group's
// directory, the command is born there (clone3 with CLONE_INTO_CGROUP), with no move; where the clone cannot start
// it there, the cgroup.procs descriptor beside it is written instead; a command that cannot start still reports why.
// Runs on any host with a cgroup2 mount (pure v2 hosts, and the unified mount of hybrid ones); skips without one.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "init/command_start.hpp"

namespace dsec {
namespace {

using init::start_command;
using init::StartRequest;
using init_protocol::FailStage;

// Where cgroup2 is mounted on this host ("" when nowhere).
std::string cgroup2_mount() {
  std::ifstream in("/proc/self/mounts");
  std::string dev, dir, type, rest;
  while (in >> dev >> dir >> type && std::getline(in, rest))
    if (type == "cgroup2") return dir;
  return "";
}

// The path of `pid`'s group on the cgroup2 hierarchy (its "0::" line).
std::string unified_group_of(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/cgroup");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("0::", 0) == 0) return line.substr(3);
  return "";
}

class CommandStart : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "making cgroups needs root";
    mount_ = cgroup2_mount();
    if (mount_.empty()) GTEST_SKIP() << "this host mounts no cgroup2 hierarchy";
    base_ = "/dsec-command-start-" + std::to_string(getpid());
    ASSERT_EQ(::mkdir((mount_ + base_).c_str(), 0755), 0) << std::strerror(errno);
    sigemptyset(&mask_);
  }
  void TearDown() override {
    for (auto it = made_.rbegin(); it != made_.rend(); ++it) ::rmdir((mount_ + *it).c_str());
    if (!base_.empty()) ::rmdir((mount_ + base_).c_str());
  }

  // A new group below the test's own; returns its path on the hierarchy.
  std::string make_group(const std::string& name) {
    std::string path = base_ + "/" + name;
    EXPECT_EQ(::mkdir((mount_ + path).c_str(), 0755), 0) << std::strerror(errno);
    made_.push_back(path);
    return path;
  }
  int open_dir(const std::string& path) { return ::open((mount_ + path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); }
  int open_procs(const std::string& path) {
    return ::open((mount_ + path + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC);
  }

  // Starts `sleep 30` with /dev/null as its streams and the given cgroup descriptors; returns its pid.
  pid_t start_sleep(std::vector<int> group_fds, int& err, FailStage& stage, const char* cwd = "/") {
    StartRequest req;
    req.argv = {"/bin/sleep", "30"};
    req.cwd = cwd;
    int null = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    req.fds = {null, ::dup(null), ::dup(null)};
    req.fds.insert(req.fds.end(), group_fds.begin(), group_fds.end());
    pid_t pid = start_command(req, mask_, err, stage);
    init::close_all(req.fds);
    return pid;
  }
  static void end(pid_t pid) {
    ::kill(pid, SIGKILL);
    int status;
    ::waitpid(pid, &status, 0);
  }

  std::string mount_, base_;
  std::vector<std::string> made_;
  sigset_t mask_;
};

TEST_F(CommandStart, AGroupsDirectoryStartsTheCommandInIt) {
  std::string group = make_group("x1");
  int err = 0;
  FailStage stage{};
  pid_t pid = start_sleep({open_dir(group), open_procs(group)}, err, stage);
  ASSERT_GT(pid, 0) << std::strerror(err);
  EXPECT_EQ(unified_group_of(pid), group);
  EXPECT_EQ(getsid(pid), pid);  // it leads a session of its own, as before
  end(pid);
}

TEST_F(CommandStart, TheDirectoryAloneIsEnough) {
  std::string group = make_group("x2");
  int err = 0;
  FailStage stage{};
  pid_t pid = start_sleep({open_dir(group)}, err, stage);
  ASSERT_GT(pid, 0) << std::strerror(err);
  EXPECT_EQ(unified_group_of(pid), group);
  end(pid);
}

TEST_F(CommandStart, WhereTheCloneIsRefusedTheProcsDescriptorIsWritten) {
  // A removed group's directory: the clone into it fails (the group is dead), and the start falls back to the
  // cgroup.procs descriptor, here another group's.
  std::string gone = make_group("gone");
  std::string fallback = make_group("fallback");
  int dir = open_dir(gone);
  ASSERT_GE(dir, 0);
  ASSERT_EQ(::rmdir((mount_ + gone).c_str()), 0);
  int err = 0;
  FailStage stage{};
  pid_t pid = start_sleep({dir, open_procs(fallback)}, err, stage);
  ASSERT_GT(pid, 0) << std::strerror(err);
  EXPECT_EQ(unified_group_of(pid), fallback);
  end(pid);
}

TEST_F(CommandStart, WithNoGroupItCannotJoinTheStartFailsAtTheCgroupStage) {
  std::string gone = make_group("gone2");
  int dir = open_dir(gone);
  int procs = open_procs(gone);
  ASSERT_EQ(::rmdir((mount_ + gone).c_str()), 0);
  int err = 0;
  FailStage stage{};
  pid_t pid = start_sleep({dir, procs}, err, stage);
  EXPECT_EQ(pid, -1);
  EXPECT_EQ(stage, FailStage::kCgroup);
  EXPECT_NE(err, 0);
}

TEST_F(CommandStart, AFailureAfterTheCloneIsReportedWithItsStage) {
  // The child born in the group fails at chdir: the parent learns errno and stage through the shared memory, as
  // with vfork, and no process is left.
  std::string group = make_group("x3");
  int err = 0;
  FailStage stage{};
  pid_t pid = start_sleep({open_dir(group)}, err, stage, "/no/such/directory");
  EXPECT_EQ(pid, -1);
  EXPECT_EQ(stage, FailStage::kChdir);
  EXPECT_EQ(err, ENOENT);
  std::ifstream procs(mount_ + group + "/cgroup.procs");
  std::string left((std::istreambuf_iterator<char>(procs)), {});
  EXPECT_EQ(left, "");
}

TEST_F(CommandStart, ManyStartsInARowEachLandInTheirGroup) {
  // The clone's child stack is reused from start to start.
  for (int i = 0; i < 20; ++i) {
    std::string group = make_group("r" + std::to_string(i));
    int err = 0;
    FailStage stage{};
    pid_t pid = start_sleep({open_dir(group), open_procs(group)}, err, stage);
    ASSERT_GT(pid, 0) << std::strerror(err);
    EXPECT_EQ(unified_group_of(pid), group);
    end(pid);
  }
}

}  // namespace
}  // namespace dsec
