// cgroup v1: one hierarchy per controller. A sandbox gets a group in each of cpu, memory, pids and freezer under
// <hierarchy>/<name>/<id>; exec groups live in the pids hierarchy only, which is enough to find every process of an
// exec. v1 has no cgroup.kill: a group is emptied by forbidding forks (pids.max = 0) and killing what is listed until
// nothing is, each process through a pidfd checked to still be in the group.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <string_view>
#include <thread>

#include <fmt/format.h>

#include "agent/backends/container/cgroup.hpp"
#include "agent/backends/container/process_identity.hpp"
#include "common/cgroupfs.hpp"
#include "common/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::container {
namespace {

namespace fs = std::filesystem;

// The controllers dsec uses, and where the host mounts each (from /proc/self/mounts). cpuacct is set only for a
// driver with cpu accounting, and only when it is a hierarchy of its own (co-mounted with cpu, the cpu groups have
// its files already).
struct Hierarchies {
  std::string cpu, memory, pids, freezer, cpuacct;
  std::string cpuset;  // only while CPUs are reserved for latency sandboxes (CgroupDriver::reserve_cpus)
  // Every hierarchy a sandbox has a group in: pids first (where its processes are found and killed).
  std::vector<const std::string*> all() const {
    std::vector<const std::string*> out{&pids, &freezer, &cpu, &memory};
    if (!cpuacct.empty()) out.push_back(&cpuacct);
    if (!cpuset.empty()) out.push_back(&cpuset);
    return out;
  }
};

Hierarchies find_hierarchies(bool cpu_accounting) {
  auto mounts = cgroup_v1_mounts();
  auto at = [&](const char* controller) {
    auto it = mounts.find(controller);
    return it == mounts.end() ? std::string() : it->second;
  };
  Hierarchies h;
  h.cpu = at("cpu");
  h.memory = at("memory");
  h.pids = at("pids");
  h.freezer = at("freezer");
  if (cpu_accounting && at("cpuacct") != h.cpu) h.cpuacct = at("cpuacct");
  return h;
}

// A sleeping sandbox's anonymous memory and page cache are pushed out alike (100: equal weight; the lowered limit
// takes both in the end); an awake sandbox's memory never goes to swap through its own limit and only as a last
// resort through the host's reclaim (0).
constexpr int kSleepingSwappiness = 100;
constexpr int kAwakeSwappiness = 0;
constexpr std::uint64_t kMinReclaimStep = 256 << 10;
constexpr std::uint64_t kMaxReclaimStep = 64 << 20;
constexpr std::uint64_t kReclaimFloor = 1 << 20;

int pidfd_open(int pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }
int pidfd_send_signal(int pidfd, int sig) {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0));
}

// Kills every process listed in dir/cgroup.procs and in its child groups but `spare`, until none is left (or ~2 s
// pass).
void kill_group_tree(const std::string& pids_root, const std::string& dir, pid_t spare = 0) {
  std::string rel = dir.substr(pids_root.size());
  try {
    write_cgroup_file(dir + "/pids.max", "0");
  } catch (const Error&) {
  }
  for (int round = 0; round < 400; ++round) {
    std::vector<int> pids;
    std::error_code ec;
    if (!fs::exists(dir, ec)) return;
    for (const auto& p : read_pids(dir + "/cgroup.procs")) pids.push_back(p);
    for (const auto& entry : fs::recursive_directory_iterator(dir, ec))
      if (entry.is_directory())
        for (const auto& p : read_pids(entry.path().string() + "/cgroup.procs")) pids.push_back(p);
    std::erase(pids, static_cast<int>(spare));
    if (pids.empty()) {
      // A group left holding the spared process alone forks again once it is placed elsewhere.
      if (spare) try {
          write_cgroup_file(dir + "/pids.max", "max");
        } catch (const Error&) {
        }
      return;
    }
    for (int pid : pids) {
      UniqueFd pfd(pidfd_open(pid));
      if (!pfd) continue;  // already gone
      if (process_in_cgroup(pid, rel, "v1")) pidfd_send_signal(pfd.get(), SIGKILL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void make_dir(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) throw_errno_fmt(errno, "mkdir {}", dir);
}

void remove_tree(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) return;
  std::vector<std::string> dirs;
  for (const auto& entry : fs::recursive_directory_iterator(dir, ec))
    if (entry.is_directory()) dirs.push_back(entry.path().string());
  // Deepest first.
  std::sort(dirs.begin(), dirs.end(), [](const auto& a, const auto& b) { return a.size() > b.size(); });
  for (const auto& d : dirs) ::rmdir(d.c_str());
  for (int i = 0; i < 200; ++i) {
    if (::rmdir(dir.c_str()) == 0 || errno == ENOENT) return;
    if (errno != EBUSY) throw_errno_fmt(errno, "rmdir {}", dir);
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  throw_errno_fmt(EBUSY, "rmdir {}", dir);
}

class SandboxCgroupV1 final : public SandboxCgroup {
 public:
  SandboxCgroupV1(const Hierarchies& h, const std::string& rel) : h_(h), rel_(rel) {}
  ~SandboxCgroupV1() override {
    try {
      destroy();
    } catch (...) {
    }
  }

  std::string dir(const std::string& hierarchy) const { return hierarchy + rel_; }

  std::vector<UniqueFd> open_procs() override {
    std::vector<UniqueFd> fds;
    for (const auto* root : h_.all()) {
      std::string path = dir(*root) + "/cgroup.procs";
      fds.emplace_back(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
      if (!fds.back()) throw_errno_fmt(errno, "open {}", path);
    }
    return fds;
  }

  std::vector<UniqueFd> create_exec_group(const std::string& name) override {
    std::string d = dir(h_.pids) + "/" + name;
    make_dir(d);
    {
      std::lock_guard lock(mu_);
      exec_groups_.insert(name);
    }
    std::vector<UniqueFd> fds;
    fds.emplace_back(::open((d + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC));
    if (!fds.back()) throw_errno_fmt(errno, "open {}/cgroup.procs", d);
    return fds;
  }

  void kill_exec_group(const std::string& name) override {
    kill_group_tree(h_.pids, dir(h_.pids) + "/" + name, spare_.load());
  }

  bool place_in_exec_group(const std::string& name, pid_t pid) override {
    std::string d = dir(h_.pids) + "/" + name;
    make_dir(d);
    {
      std::lock_guard lock(mu_);
      exec_groups_.insert(name);
    }
    try {
      write_cgroup_file(d + "/cgroup.procs", std::to_string(pid));
    } catch (...) {
      std::lock_guard lock(mu_);
      ended_groups_.insert(name);  // removed with the next release, being empty
      throw;
    }
    return true;
  }

  void spare(pid_t pid) override { spare_.store(pid); }

  void end_exec_group(const std::string& name) override {
    std::lock_guard lock(mu_);
    if (exec_groups_.count(name)) ended_groups_.insert(name);
  }

  void release_exec_group(const std::string& name) override {
    std::lock_guard lock(mu_);
    release_ended_groups(dir(h_.pids), name, exec_groups_, ended_groups_);
  }

  void destroy() override {
    std::lock_guard lock(mu_);
    if (destroyed_) return;
    // Frozen processes do not die of SIGKILL under the v1 freezer: let them run first.
    try {
      write_cgroup_file(dir(h_.freezer) + "/freezer.state", "THAWED");
    } catch (const Error&) {
    }
    unthrottle();
    kill_group_tree(h_.pids, dir(h_.pids));
    for (const auto* root : h_.all()) remove_tree(dir(*root));
    destroyed_ = true;
  }

  void limit_cpu(double cores) override {
    write_cgroup_file(dir(h_.cpu) + "/cpu.cfs_quota_us",
                      std::to_string(std::max(static_cast<long long>(cores * 100000), 1000LL)));
  }

  void unthrottle() override {
    try {
      write_cgroup_file(dir(h_.cpu) + "/cpu.cfs_quota_us", "-1");
    } catch (const Error&) {
    }
  }

  void freeze() override { set_freezer("FROZEN"); }
  void thaw() override { set_freezer("THAWED"); }

  // Lowers memory.limit_in_bytes toward the usage, in steps of at most kMaxReclaimStep that halve when the kernel
  // cannot get under one (it answers EBUSY once a reclaim pass frees nothing): page cache is dropped, anonymous
  // memory goes to swap where the host has some. Each write costs the time to push one step out, so the deadline is
  // looked at often enough.
  bool reclaim_memory(std::chrono::steady_clock::time_point deadline) override {
    const std::string mem = dir(h_.memory);
    std::lock_guard lock(mu_);
    if (!saved_limit_.empty()) return false;
    saved_limit_ = read_cgroup_file(mem + "/memory.limit_in_bytes");
    while (!saved_limit_.empty() && std::isspace(static_cast<unsigned char>(saved_limit_.back())))
      saved_limit_.pop_back();
    set_swappiness(kSleepingSwappiness);
    UniqueFd fd(::open((mem + "/memory.limit_in_bytes").c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd) throw_errno_fmt(errno, "open {}/memory.limit_in_bytes", mem);
    std::uint64_t usage = memory_current();
    std::uint64_t step = std::clamp(usage / 2, kMinReclaimStep, kMaxReclaimStep);
    while (usage > kReclaimFloor && step >= kMinReclaimStep) {
      if (std::chrono::steady_clock::now() >= deadline) return true;
      std::uint64_t target = usage > step + kReclaimFloor ? usage - step : kReclaimFloor;
      std::string value = std::to_string(target);
      if (retry_eintr([&] { return ::write(fd.get(), value.data(), value.size()); }) < 0) {
        if (errno != EBUSY) throw_errno_fmt(errno, "write {} to {}/memory.limit_in_bytes", value, mem);
        step /= 2;  // the kernel could not get under it: a smaller step
      }
      usage = memory_current();
    }
    return false;
  }

  void restore_memory() override {
    std::lock_guard lock(mu_);
    set_swappiness(kAwakeSwappiness);
    if (saved_limit_.empty()) return;
    write_cgroup_file(dir(h_.memory) + "/memory.limit_in_bytes", saved_limit_);
    saved_limit_.clear();
  }

  // The sum of memory.stat's hierarchical counts (total_<key>: the group and its exec groups below).
  std::uint64_t memory_stat_total(std::initializer_list<std::string_view> keys) {
    std::uint64_t sum = 0;
    try {
      std::istringstream in(read_cgroup_file(dir(h_.memory) + "/memory.stat"));
      std::string k;
      std::uint64_t v;
      while (in >> k >> v)
        for (std::string_view key : keys)
          if (k.size() == key.size() + 6 && k.rfind("total_", 0) == 0 && k.compare(6, key.size(), key) == 0) sum += v;
    } catch (...) {
    }
    return sum;
  }

  std::uint64_t swap_current() override { return memory_stat_total({"swap"}); }

  bool rename(const std::string& id) override {
    std::lock_guard lock(mu_);
    const std::string to = rel_.substr(0, rel_.rfind('/') + 1) + id;
    std::vector<const std::string*> done;
    for (const auto* root : h_.all()) {
      if (::rename((*root + rel_).c_str(), (*root + to).c_str()) == 0) {
        done.push_back(root);
        continue;
      }
      const int err = errno;
      for (const auto* back : done) ::rename((*back + to).c_str(), (*back + rel_).c_str());
      throw_errno_fmt(err, "rename cgroup {}{} to {}", *root, rel_, id);
    }
    rel_ = to;
    return true;
  }

  std::uint64_t refaults() override {
    return memory_stat_total({"workingset_refault_anon", "workingset_refault_file"});
  }

  std::uint64_t memory_current() override {
    try {
      return std::stoull(read_cgroup_file(dir(h_.memory) + "/memory.usage_in_bytes"));
    } catch (...) {
      return 0;
    }
  }

  bool frozen() override {
    // THAWED, FREEZING or FROZEN.
    return read_cgroup_file(dir(h_.freezer) + "/freezer.state").rfind("THAWED", 0) != 0;
  }

  std::string path() const override { return rel_; }

  std::vector<std::string> exec_groups() override { return child_groups(dir(h_.pids)); }

  void adopt_exec_group(const std::string& name, bool kill) override {
    {
      std::lock_guard lock(mu_);
      exec_groups_.insert(name);
    }
    if (kill) kill_exec_group(name);
    release_exec_group(name);
  }

  void set_restore_limit(std::uint64_t bytes) override {
    std::lock_guard lock(mu_);
    saved_limit_ = std::to_string(bytes);
  }

  std::uint64_t oom_kills() override {
    try {
      std::istringstream in(read_cgroup_file(dir(h_.memory) + "/memory.oom_control"));
      std::string k;
      std::uint64_t v;
      while (in >> k >> v)
        if (k == "oom_kill") return v;
    } catch (...) {
    }
    return 0;
  }

  std::uint64_t memory_peak() override {
    try {
      return std::stoull(read_cgroup_file(dir(h_.memory) + "/memory.max_usage_in_bytes"));
    } catch (...) {
      return 0;
    }
  }

  void reset_memory_peak() override { write_cgroup_file(dir(h_.memory) + "/memory.max_usage_in_bytes", "0"); }

  double cpu_usage_seconds() override {
    const std::string& acct = h_.cpuacct.empty() ? h_.cpu : h_.cpuacct;
    try {
      return static_cast<double>(std::stoull(read_cgroup_file(dir(acct) + "/cpuacct.usage"))) / 1e9;
    } catch (...) {
      return 0;
    }
  }

  bool has_processes() override {
    const std::string top = dir(h_.pids);
    if (!read_pids(top + "/cgroup.procs").empty()) return true;
    std::error_code ec;
    for (const auto& entry : fs::recursive_directory_iterator(top, ec))
      if (entry.is_directory() && !read_pids(entry.path().string() + "/cgroup.procs").empty()) return true;
    return false;
  }

  // memory.memsw.limit_in_bytes may never be below memory.limit_in_bytes: raise it first, lower it last.
  void set_limits(std::uint64_t memory_bytes, std::uint32_t pids) override {
    const std::string mem = dir(h_.memory);
    auto write_limit = [&](const std::string& file) {
      UniqueFd fd(::open((mem + "/" + file).c_str(), O_WRONLY | O_CLOEXEC));
      if (!fd) {
        if (errno == ENOENT && file == "memory.memsw.limit_in_bytes") return;  // no swap accounting
        throw_errno_fmt(errno, "open {}/{}", mem, file);
      }
      std::string value = std::to_string(memory_bytes);
      if (retry_eintr([&] { return ::write(fd.get(), value.data(), value.size()); }) < 0) {
        if (errno == EBUSY)
          throw Error(
              Code::kResourceExhausted,
              fmt::format("{}/{}: more than {} bytes are charged and cannot be reclaimed", mem, file, memory_bytes));
        throw_errno_fmt(errno, "write {} to {}/{}", value, mem, file);
      }
    };
    std::uint64_t now = 0;
    try {
      now = std::stoull(read_cgroup_file(mem + "/memory.limit_in_bytes"));
    } catch (...) {
    }
    if (memory_bytes >= now) {
      write_limit("memory.memsw.limit_in_bytes");
      write_limit("memory.limit_in_bytes");
    } else {
      write_limit("memory.limit_in_bytes");
      write_limit("memory.memsw.limit_in_bytes");
    }
    write_cgroup_file(dir(h_.pids) + "/pids.max", std::to_string(pids));
  }

 private:
  void set_freezer(const char* state) {
    const std::string path = dir(h_.freezer) + "/freezer.state";
    write_cgroup_file(path, state);
    for (int i = 0; i < 1000; ++i) {
      std::string now = read_cgroup_file(path);
      if (now.rfind(state, 0) == 0) return;
      // FREEZING: some task has not stopped yet; writing again retries it.
      if (i % 20 == 19) write_cgroup_file(path, state);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    throw Error(Code::kDeadlineExceeded, fmt::format("{}: not {} after 5 s", path, state));
  }

  void set_swappiness(int value) {
    try {
      write_cgroup_file(dir(h_.memory) + "/memory.swappiness", std::to_string(value));
    } catch (const Error& e) {
      log_warn("{}/memory.swappiness: {}", dir(h_.memory), e.what());
    }
  }

  Hierarchies h_;
  std::string saved_limit_;  // the memory limit reclaim_memory() lowered, until restore_memory()
  std::string rel_;          // "/<name>/<id>"
  std::mutex mu_;
  std::set<std::string> exec_groups_;   // every exec group that exists
  std::set<std::string> ended_groups_;  // those whose exec has ended: removed once empty
  bool destroyed_ = false;
  std::atomic<pid_t> spare_{0};
};

class CgroupV1Driver final : public CgroupDriver {
 public:
  CgroupV1Driver(std::string name, bool cpu_accounting) : h_(find_hierarchies(cpu_accounting)), name_(std::move(name)) {
    if (!h_.cpuacct.empty()) make_dir(h_.cpuacct + "/" + name_);
    for (auto [root, what] :
         {std::pair{&h_.cpu, "cpu"}, {&h_.memory, "memory"}, {&h_.pids, "pids"}, {&h_.freezer, "freezer"}}) {
      if (root->empty())
        throw Error(Code::kFailedPrecondition,
                    fmt::format("no cgroup v1 hierarchy with the {} controller is mounted, and /sys/fs/cgroup is not "
                                "cgroup v2: the container backend needs one or the other",
                                what));
      make_dir(*root + "/" + name_);
    }
    cpu_idle_ = ::access((h_.cpu + "/" + name_ + "/cpu.idle").c_str(), F_OK) == 0;
    // Batch sandboxes' cpu groups live apart, under <cpu>/<name>.batch/<name>/<id>: an idle group yields at once
    // only to its siblings, so the idle group must sit beside the agent, the trainer and the other sandboxes' common
    // group at the top of the hierarchy for a waking agent thread or latency sandbox to preempt batch work at once
    // (inside <name> it would yield to latency sandboxes only, and <name> as a whole would still compete with the
    // agent at full weight).
    if (cpu_idle_) {
      batch_cpu_ = h_.cpu + "/" + name_ + ".batch";
      make_dir(batch_cpu_);
      write_cgroup_file(batch_cpu_ + "/cpu.idle", "1");
      make_dir(batch_cpu_ + "/" + name_);
    }
    // Children of the agent's groups inherit hierarchical memory accounting.
    try {
      write_cgroup_file(h_.memory + "/" + name_ + "/memory.use_hierarchy", "1");
    } catch (const Error&) {
    }
  }

  std::string version() const override { return "v1"; }
  bool cpu_idle() const override { return cpu_idle_; }

  std::unique_ptr<SandboxCgroup> create(const std::string& id, const Resources& r) override {
    std::string rel = "/" + name_ + "/" + id;
    const Hierarchies h = r.priority == Priority::kBatch ? batch_hierarchies() : h_;
    for (const auto* root : h.all()) {
      std::string d = *root + rel;
      if (::mkdir(d.c_str(), 0755) != 0) throw_errno_fmt(errno, "mkdir {}", d);
    }
    auto group = std::make_unique<SandboxCgroupV1>(h, rel);
    std::string mem = h_.memory + rel;
    write_cgroup_file(mem + "/memory.limit_in_bytes", std::to_string(r.memory_bytes));
    try {
      write_cgroup_file(mem + "/memory.memsw.limit_in_bytes", std::to_string(r.memory_bytes));
    } catch (const Error&) {
      // no swap accounting on this host
    }
    // Awake, the sandbox stays out of swap; sleep raises it (reclaim_memory).
    try {
      write_cgroup_file(mem + "/memory.swappiness", std::to_string(kAwakeSwappiness));
    } catch (const Error&) {
    }
    write_cgroup_file(h.cpu + rel + "/cpu.cfs_period_us", "100000");
    group->limit_cpu(r.cpu);
    // The class of service (docs/qos.md): CPU weight, and for batch a soft limit the kernel reclaims down to first
    // under memory pressure (v1 has no memory.low or memory.high). A batch sandbox's tasks run SCHED_IDLE (set on
    // its init, spawn.cpp), which orders them only among themselves; cpu.idle (Linux 5.15+, in v1's cpu controller
    // too) makes the group idle-scheduled against every other group. It comes after cpu.shares: the kernel then
    // refuses a weight for the group.
    write_cgroup_file(h.cpu + rel + "/cpu.shares", std::to_string(cpu_weight_v1(r.priority)));
    if (r.priority == Priority::kBatch) {
      try {
        write_cgroup_file(mem + "/memory.soft_limit_in_bytes", std::to_string(r.memory_bytes / 2));
      } catch (const Error&) {
      }
      if (cpu_idle_) write_cgroup_file(h.cpu + rel + "/cpu.idle", "1");
    }
    write_cgroup_file(h_.pids + rel + "/pids.max", std::to_string(r.pids));
    if (!h_.cpuset.empty())
      write_cgroup_file(h_.cpuset + rel + "/cpuset.cpus",
                        r.priority == Priority::kLatency ? latency_cpus_ : shared_cpus_);
    return group;
  }

  void reserve_cpus(const std::string& latency, const std::string& shared) override {
    auto mounts = cgroup_v1_mounts();
    auto it = mounts.find("cpuset");
    if (it == mounts.end())
      throw Error(Code::kFailedPrecondition,
                  "no cgroup v1 hierarchy with the cpuset controller is mounted: CPUs cannot be reserved for latency "
                  "sandboxes (dsecd --latency-cpus none)");
    const std::string top = it->second + "/" + name_;
    make_dir(top);
    // A new v1 cpuset group has no CPUs and no memory nodes: the agent's group takes its parent's, and every group
    // below it starts with its parent's (cgroup.clone_children, which new groups inherit).
    for (const char* file : {"cpuset.cpus", "cpuset.mems"})
      write_cgroup_file(top + "/" + file, read_cgroup_file(it->second + "/" + file));
    write_cgroup_file(top + "/cgroup.clone_children", "1");
    h_.cpuset = it->second;
    latency_cpus_ = latency;
    shared_cpus_ = shared;
  }

  void remove_empty_groups() override {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(h_.pids + "/" + name_, ec)) {
      if (!entry.is_directory()) continue;
      bool empty = read_pids(entry.path().string() + "/cgroup.procs").empty();
      for (const auto& sub : fs::recursive_directory_iterator(entry.path(), ec))
        if (sub.is_directory()) empty = empty && read_pids(sub.path().string() + "/cgroup.procs").empty();
      if (!empty) continue;
      std::string id = entry.path().filename().string();
      std::vector<std::string> roots{batch_cpu_};
      for (const auto* root : h_.all()) roots.push_back(*root);
      for (const auto& root : roots) {
        if (root.empty()) continue;
        try {
          remove_tree(fmt::format("{}/{}/{}", root, name_, id));
        } catch (const Error&) {
        }
      }
    }
  }

  void remove_subtree_if_empty() override {
    for (const auto* root : h_.all()) ::rmdir((*root + "/" + name_).c_str());
    if (!batch_cpu_.empty()) {
      ::rmdir((batch_cpu_ + "/" + name_).c_str());
      ::rmdir(batch_cpu_.c_str());
    }
  }

  void remove_sandbox_groups(const std::string& id) override {
    const std::string rel = "/" + name_ + "/" + id;
    SandboxCgroupV1(h_, rel).destroy();
    if (!batch_cpu_.empty()) remove_tree(batch_cpu_ + rel);
  }

  std::unique_ptr<SandboxCgroup> adopt(const std::string& path) override {
    check_adoptable_path(path);
    // A batch sandbox's cpu group is under <name>.batch.
    struct stat st {};
    Hierarchies h = !batch_cpu_.empty() && ::stat((batch_cpu_ + path).c_str(), &st) == 0 ? batch_hierarchies() : h_;
    for (const auto* root : {&h.cpu, &h.memory, &h.pids, &h.freezer})
      if (::stat((*root + path).c_str(), &st) != 0) throw_errno_fmt(errno, "cgroup {}{}", *root, path);
    // A sandbox made before CPUs were reserved has no cpuset group: it keeps running where it ran.
    if (!h.cpuset.empty() && ::stat((h.cpuset + path).c_str(), &st) != 0) h.cpuset.clear();
    return std::make_unique<SandboxCgroupV1>(h, path);
  }

 private:
  // Where a batch sandbox's groups are: the same but for cpu (and cpuacct where the two share a hierarchy).
  Hierarchies batch_hierarchies() const {
    Hierarchies h = h_;
    if (!batch_cpu_.empty()) h.cpu = batch_cpu_;
    return h;
  }

  Hierarchies h_;
  std::string name_;
  std::string latency_cpus_, shared_cpus_;
  bool cpu_idle_ = false;
  std::string batch_cpu_;  // <cpu>/<name>.batch, of cpu.idle 1; empty where the kernel has no cpu.idle
};

}  // namespace

std::unique_ptr<CgroupDriver> make_cgroup_v1_driver(const std::string& /*root_mount*/, const std::string& name,
                                                    bool cpu_accounting) {
  return std::make_unique<CgroupV1Driver>(name, cpu_accounting);
}

}  // namespace dsec::agent::container
