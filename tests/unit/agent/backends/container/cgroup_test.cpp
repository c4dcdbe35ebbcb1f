// The container backend's cgroup drivers against the host's real cgroup filesystem: limits land in the kernel's
// files, an exec group holds a process tree that kill_exec_group ends (setsid children included), destroy removes
// every group. Runs with whichever driver the host calls for (v1 here, v2 on pure cgroup v2 hosts); the other
// version's test skips itself and says why. Needs root.
#include <fcntl.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "abandon.hpp"
#include "agent/backends/container/cgroup.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::container {
namespace {

namespace fs = std::filesystem;

bool host_is_v2() {
  struct statfs st {};
  return ::statfs("/sys/fs/cgroup", &st) == 0 && st.f_type == CGROUP2_SUPER_MAGIC;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

// Forks a process that joins the group through `procs` (as an exec's command does) and then starts a setsid'd
// grandchild, so the tree outgrows the child's session. Returns the child's pid.
pid_t start_tree(int procs) {
  pid_t pid = ::fork();
  if (pid == 0) {
    if (::write(procs, "0", 1) != 1) ::_exit(3);
    if (::fork() == 0) {
      ::setsid();
      ::pause();
      ::_exit(0);
    }
    ::pause();
    ::_exit(0);
  }
  return pid;
}

bool dead(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto paren = stat.rfind(')');
  return stat.empty() || (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'Z');
}

class CgroupDriverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to create cgroups";
    name_ = "dsec-unit-" + std::to_string(::getpid());
  }
  std::string name_;
};

void exercise(CgroupDriver& driver, const std::string& name,
              const std::function<std::string(const std::string&)>& file) {
  Resources r;
  r.cpu = 0.5;
  r.memory_bytes = 64ull << 20;
  r.pids = 77;
  auto group = driver.create("sb1", r);
  EXPECT_EQ(trim(file("pids.max")), "77");
  if (driver.version() == "v2") {
    EXPECT_EQ(trim(file("memory.max")), std::to_string(64ull << 20));
    EXPECT_EQ(trim(file("cpu.max")), "50000 100000");
  } else {
    EXPECT_EQ(trim(file("memory.limit_in_bytes")), std::to_string(64ull << 20));
    EXPECT_EQ(trim(file("cpu.cfs_quota_us")), "50000");
    EXPECT_EQ(trim(file("memory.swappiness")), "0") << "an awake sandbox may go to swap";
  }
  // The same id twice is refused: two sandboxes never share a group.
  EXPECT_THROW(driver.create("sb1", r), Error);

  auto fds = group->create_exec_group("x0");
  ASSERT_EQ(fds.size(), 1u);
  pid_t child = start_tree(fds[0].get());
  // Wait until both processes are in the group.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  std::string procs_path = driver.version() == "v2" ? "/sys/fs/cgroup/" + name + "/sb1/x0/cgroup.procs"
                                                    : "/sys/fs/cgroup/pids/" + name + "/sb1/x0/cgroup.procs";
  while (read_pids(procs_path).size() < 2 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  auto members = read_pids(procs_path);
  ASSERT_EQ(members.size(), 2u);

  group->kill_exec_group("x0");
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  for (int pid : members) {
    // The setsid'd grandchild was re-parented to the host's init: dead means gone or a zombie awaiting its reaper.
    bool gone = false;
    for (int i = 0; i < 200 && !gone; ++i) {
      gone = dead(pid);
      if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_TRUE(gone) << "process " << pid << " of the killed exec group survived";
  }
  // A group whose exec is still starting is empty too, and must survive another exec's clean-up.
  auto starting = group->create_exec_group("x1");
  const fs::path starting_dir = fs::path(procs_path).parent_path().parent_path() / "x1";
  group->release_exec_group("x0");
  EXPECT_FALSE(fs::exists(fs::path(procs_path).parent_path()));
  EXPECT_TRUE(fs::exists(starting_dir)) << "an exec group still in use was removed";
  starting.clear();
  group->release_exec_group("x1");
  EXPECT_FALSE(fs::exists(starting_dir));

  group->destroy();
  group->destroy();  // idempotent
  EXPECT_FALSE(fs::exists(fs::path(procs_path).parent_path().parent_path()));
  driver.remove_subtree_if_empty();
}

TEST_F(CgroupDriverTest, V1LimitsExecGroupsAndDestroy) {
  if (host_is_v2()) GTEST_SKIP() << "this host runs pure cgroup v2; the v1 driver has no hierarchies to drive";
  auto driver = make_cgroup_v1_driver("/sys/fs/cgroup", name_);
  ASSERT_EQ(driver->version(), "v1");
  auto file = [&](const std::string& f) {
    std::string controller = f.rfind("memory", 0) == 0 ? "memory" : f.rfind("cpu", 0) == 0 ? "cpu" : "pids";
    std::ifstream in("/sys/fs/cgroup/" + controller + "/" + name_ + "/sb1/" + f);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  exercise(*driver, name_, file);
  for (const char* c : {"cpu", "memory", "pids", "freezer"})
    EXPECT_FALSE(fs::exists("/sys/fs/cgroup/" + std::string(c) + "/" + name_)) << c;
}

TEST_F(CgroupDriverTest, V2LimitsExecGroupsAndDestroy) {
  if (!host_is_v2())
    GTEST_SKIP() << "/sys/fs/cgroup is not a cgroup2 mount here (this host binds cpu, memory and pids to cgroup v1 "
                    "hierarchies); the v2 driver is exercised on pure cgroup v2 hosts";
  auto driver = make_cgroup_v2_driver("/sys/fs/cgroup", name_);
  ASSERT_EQ(driver->version(), "v2");
  auto file = [&](const std::string& f) {
    std::ifstream in("/sys/fs/cgroup/" + name_ + "/sb1/" + f);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  exercise(*driver, name_, file);
  EXPECT_FALSE(fs::exists("/sys/fs/cgroup/" + name_));
}

TEST_F(CgroupDriverTest, RemoveEmptyGroupsLeavesPopulatedOnesAlone) {
  auto driver = make_cgroup_driver(name_);
  auto busy = driver->create("busy", Resources{});
  auto idle = driver->create("idle", Resources{});
  auto fds = busy->open_procs();
  pid_t child = ::fork();
  if (child == 0) {
    for (auto& fd : fds)
      if (::write(fd.get(), "0", 1) != 1) ::_exit(3);
    ::pause();
    ::_exit(0);
  }
  std::string pids_root = driver->version() == "v2" ? "/sys/fs/cgroup/" + name_ : "/sys/fs/cgroup/pids/" + name_;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (read_pids(pids_root + "/busy/cgroup.procs").empty() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  // A second agent with the same subtree name starts: it must not touch the first one's live sandbox.
  auto other = make_cgroup_driver(name_);
  other->remove_empty_groups();
  EXPECT_TRUE(fs::exists(pids_root + "/busy"));
  EXPECT_FALSE(fs::exists(pids_root + "/idle"));
  EXPECT_EQ(::kill(child, 0), 0) << "the live sandbox's process was killed";
  other->remove_sandbox_groups("busy");
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status));
  EXPECT_FALSE(fs::exists(pids_root + "/busy"));
  busy.reset();
  idle.reset();
  driver->remove_subtree_if_empty();
}

// After an agent restart: a second driver takes a sandbox's groups over as the first left them (frozen, with exec
// groups of ended and of cut-short execs), kills the cut-short exec's processes, keeps the background ones, puts
// back the memory limit it is told, and destroys them all in the end.
TEST_F(CgroupDriverTest, ASecondDriverTakesASandboxsGroupsOver) {
  Resources r;
  r.memory_bytes = 64ull << 20;
  auto first = make_cgroup_driver(name_);
  auto group = first->create("sb1", r);
  const std::string path = group->path();
  EXPECT_EQ(path, "/" + name_ + "/sb1");
  auto start_in = [&](const std::string& exec) {
    auto fds = group->create_exec_group(exec);
    pid_t pid = ::fork();
    if (pid == 0) {
      if (::write(fds[0].get(), "0", 1) != 1) ::_exit(3);
      ::pause();
      ::_exit(0);
    }
    return pid;
  };
  pid_t background = start_in("x0");  // an ended exec's background process
  pid_t cut_short = start_in("x3");   // an exec in flight when the agent died
  const std::string pids_dir = first->version() == "v2" ? "/sys/fs/cgroup" + path : "/sys/fs/cgroup/pids" + path;
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while ((read_pids(pids_dir + "/x0/cgroup.procs").empty() || read_pids(pids_dir + "/x3/cgroup.procs").empty()) &&
         std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  group->freeze();
  test::abandon(std::move(group));  // the first agent dies: nothing of it runs its clean-up

  auto second = make_cgroup_driver(name_);
  EXPECT_THROW(second->adopt("/" + name_ + "/../x"), Error);
  try {
    second->adopt("/" + name_ + "/nope");
    ADD_FAILURE() << "adopted groups that do not exist";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound) << e.what();
  }
  auto adopted = second->adopt(path);
  EXPECT_EQ(adopted->path(), path);
  EXPECT_TRUE(adopted->frozen());
  adopted->thaw();
  EXPECT_FALSE(adopted->frozen());
  auto execs = adopted->exec_groups();
  std::sort(execs.begin(), execs.end());
  EXPECT_EQ(execs, (std::vector<std::string>{"x0", "x3"}));
  adopted->adopt_exec_group("x3", true);
  int status = 0;
  ASSERT_EQ(::waitpid(cut_short, &status, 0), cut_short);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_FALSE(fs::exists(pids_dir + "/x3"));
  adopted->adopt_exec_group("x0", false);
  EXPECT_EQ(::kill(background, 0), 0) << "a background process of an ended exec was killed";
  EXPECT_TRUE(fs::exists(pids_dir + "/x0"));  // still populated

  adopted->set_restore_limit(32ull << 20);
  adopted->restore_memory();
  if (second->version() == "v1") {
    std::ifstream in("/sys/fs/cgroup/memory" + path + "/memory.limit_in_bytes");
    std::string limit;
    in >> limit;
    EXPECT_EQ(limit, std::to_string(32ull << 20));
  }

  ::kill(background, SIGKILL);
  ASSERT_EQ(::waitpid(background, &status, 0), background);
  adopted->release_exec_group("x0");  // an ended exec's group goes once empty
  EXPECT_FALSE(fs::exists(pids_dir + "/x0"));
  adopted->destroy();
  EXPECT_FALSE(fs::exists(pids_dir));
  second->remove_subtree_if_empty();
}

}  // namespace
}  // namespace dsec::agent::container

namespace dsec::agent::container {
namespace {

// Sleep's building blocks on the host's driver: a frozen group's process stops counting, its page cache goes, the
// lowered limit comes back, a thawed one counts again, and a group destroyed while frozen still dies.
TEST_F(CgroupDriverTest, FreezeReclaimThawAndDestroyWhileFrozen) {
  auto driver = make_cgroup_driver(name_);
  Resources r;
  r.memory_bytes = 256ull << 20;
  auto group = driver->create("sleepy", r);
  auto fds = group->open_procs();
  auto* counter = static_cast<std::atomic<std::uint64_t>*>(
      ::mmap(nullptr, sizeof(std::atomic<std::uint64_t>), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(counter, MAP_FAILED);
  new (counter) std::atomic<std::uint64_t>(0);
  const std::string scratch = "/var/tmp/" + name_ + "-cache";
  pid_t child = ::fork();
  if (child == 0) {
    for (auto& fd : fds)
      if (::write(fd.get(), "0", 1) != 1) ::_exit(3);
    // 32 MiB of page cache charged to the group.
    int out = ::open(scratch.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    std::string block(1 << 20, 'x');
    for (int i = 0; i < 32; ++i)
      if (::write(out, block.data(), block.size()) != static_cast<ssize_t>(block.size())) ::_exit(4);
    ::close(out);
    counter->store(1);
    for (;;) {
      counter->fetch_add(1);
      ::usleep(1000);
    }
  }
  ASSERT_GT(child, 0);
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (counter->load() < 10 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_GE(counter->load(), 10u) << "the child never started counting";
  const std::uint64_t before = group->memory_current();
  EXPECT_GE(before, 24ull << 20) << "the page cache the child wrote is not charged to its group";

  group->freeze();
  std::uint64_t frozen_at = counter->load();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(counter->load(), frozen_at) << "a frozen process went on counting";
  // A deadline that has passed stops it before the first step: nothing released, and it says so.
  EXPECT_TRUE(group->reclaim_memory(std::chrono::steady_clock::now()));
  EXPECT_GE(group->memory_current() + (4ull << 20), before);
  group->restore_memory();
  EXPECT_FALSE(group->reclaim_memory(std::chrono::steady_clock::now() + std::chrono::seconds(30)));
  const std::uint64_t after = group->memory_current();
  EXPECT_LT(after + (16ull << 20), before) << "reclaim released too little: " << before << " -> " << after;
  // While it sleeps it may use swap; awake it may not (v1 memory.swappiness, v2 memory.swap.max).
  auto memory_file = [&](const std::string& f) {
    std::ifstream in(driver->version() == "v1" ? "/sys/fs/cgroup/memory/" + name_ + "/sleepy/" + f
                                               : "/sys/fs/cgroup/" + name_ + "/sleepy/" + f);
    std::string v;
    in >> v;
    return v;
  };
  if (driver->version() == "v1") {
    EXPECT_LT(std::stoull(memory_file("memory.limit_in_bytes")), r.memory_bytes);
    EXPECT_EQ(memory_file("memory.swappiness"), "100");
  } else if (fs::exists("/sys/fs/cgroup/" + name_ + "/sleepy/memory.swap.max")) {
    EXPECT_EQ(memory_file("memory.swap.max"), "max");
  }
  group->restore_memory();
  if (driver->version() == "v1") {
    EXPECT_EQ(std::stoull(memory_file("memory.limit_in_bytes")), r.memory_bytes);
    EXPECT_EQ(memory_file("memory.swappiness"), "0");
  } else if (fs::exists("/sys/fs/cgroup/" + name_ + "/sleepy/memory.swap.max")) {
    EXPECT_EQ(memory_file("memory.swap.max"), "0");
  }
  group->thaw();
  until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (counter->load() < frozen_at + 10 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_GE(counter->load(), frozen_at + 10) << "the thawed process does not count";

  // Destroyed while frozen: the process still dies.
  group->freeze();
  group->destroy();
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  ::munmap(counter, sizeof(std::atomic<std::uint64_t>));
  ::unlink(scratch.c_str());
  driver->remove_subtree_if_empty();
}

}  // namespace
}  // namespace dsec::agent::container
