// dsec-bench cgroup-join: a kernel floor under every container create. A new sandbox's first process joins its
// cgroups by writing "0" to their cgroup.procs (dsec's runtime and crun both do). That write takes the cgroup
// threadgroup rwsem for writing, which can wait for an RCU grace period when no writer came by lately. This times
// the joins of a fresh process into fresh groups, in the hierarchies dsec's runtime uses on this host, after idle
// gaps of rising length.
#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "bench.hpp"
#include "common/cgroupfs.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

namespace dsec::bench {
namespace {

namespace fs = std::filesystem;

constexpr int kMaxHierarchies = 4;

// The hierarchies a sandbox joins on this host, as dsec's runtime picks them: the unified one on a cgroup2 host,
// else the v1 cpu, memory, pids and freezer hierarchies.
std::vector<std::string> join_hierarchies(std::string& layout) {
  struct statfs st {};
  if (::statfs("/sys/fs/cgroup", &st) == 0 && st.f_type == CGROUP2_SUPER_MAGIC) {
    layout = "v2: /sys/fs/cgroup";
    return {"/sys/fs/cgroup"};
  }
  std::vector<std::string> found(kMaxHierarchies);
  const char* names[kMaxHierarchies] = {"cpu", "memory", "pids", "freezer"};
  auto mounts = cgroup_v1_mounts();
  for (int i = 0; i < kMaxHierarchies; ++i)
    if (auto it = mounts.find(names[i]); it != mounts.end()) found[i] = it->second;
  for (int i = 0; i < kMaxHierarchies; ++i)
    if (found[i].empty())
      throw Error(Code::kFailedPrecondition, fmt::format("no cgroup v1 hierarchy with the {} controller", names[i]));
  layout = "v1: cpu, memory, pids, freezer";
  return found;
}

double now_ms() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) / 1e6;
}

// One fresh process joins one fresh group in each hierarchy; returns the time of each write in ms.
std::vector<double> join_once(const std::vector<std::string>& parents, int index) {
  std::vector<std::string> dirs;
  for (const auto& p : parents) {
    std::string d = fmt::format("{}/g{}", p, index);
    if (::mkdir(d.c_str(), 0755) != 0) throw_errno_fmt(errno, "mkdir {}", d);
    dirs.push_back(d);
  }
  std::vector<UniqueFd> procs;
  for (const auto& d : dirs) {
    procs.emplace_back(::open((d + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC));
    if (!procs.back()) throw_errno_fmt(errno, "open {}/cgroup.procs", d);
  }
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw_errno(errno, "pipe2");
  UniqueFd rd(fds[0]), wr(fds[1]);
  std::vector<int> raw;
  raw.reserve(procs.size());
  for (const auto& p : procs) raw.push_back(p.get());

  pid_t pid = ::fork();
  if (pid == 0) {
    // Only syscalls here: the parent has threads.
    double took[kMaxHierarchies] = {};
    for (std::size_t i = 0; i < raw.size(); ++i) {
      double t0 = now_ms();
      if (::write(raw[i], "0", 1) != 1) ::_exit(1);
      took[i] = now_ms() - t0;
    }
    ::write(wr.get(), took, sizeof(double) * raw.size());
    ::_exit(0);
  }
  if (pid < 0) throw_errno(errno, "fork");
  wr.reset();
  std::vector<double> took(raw.size());
  ssize_t got = retry_eintr([&] { return ::read(rd.get(), took.data(), sizeof(double) * took.size()); });
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  for (const auto& d : dirs) ::rmdir(d.c_str());
  if (got != static_cast<ssize_t>(sizeof(double) * took.size()) || status != 0)
    throw Error(Code::kInternal, "cgroup join probe: the child could not join its groups");
  return took;
}

}  // namespace

CgroupJoinResult run_cgroup_join(const Options& options) {
  CgroupJoinResult result;
  std::vector<std::string> roots = join_hierarchies(result.layout);
  std::vector<std::string> parents;
  for (const auto& r : roots) {
    std::string p = fmt::format("{}/dsec-bench-probe-{}", r, ::getpid());
    if (::mkdir(p.c_str(), 0755) != 0 && errno != EEXIST) throw_errno_fmt(errno, "mkdir {}", p);
    parents.push_back(p);
  }
  struct RemoveParents {
    const std::vector<std::string>& dirs;
    ~RemoveParents() {
      for (const auto& d : dirs) ::rmdir(d.c_str());
    }
  } remove{parents};

  result.samples = std::min<std::size_t>(options.n, 50);
  int index = 0;
  for (int gap : {0, 10, 50}) {
    CgroupJoinPoint point;
    point.gap_ms = gap;
    for (std::size_t i = 0; i < result.samples + 3; ++i) {
      if (gap) std::this_thread::sleep_for(std::chrono::milliseconds(gap));
      std::vector<double> took = join_once(parents, index++);
      if (i < 3) continue;
      point.first.add(took.front());
      double sum = 0;
      for (double t : took) sum += t;
      point.all.add(sum);
    }
    result.points.push_back(std::move(point));
  }
  return result;
}

}  // namespace dsec::bench
