// cgroup v2: one group per sandbox under /sys/fs/cgroup/<name>/, with memory.max, cpu.max and pids.max; exec groups
// are children without controllers of their own (the sandbox's limits cover them), killed with cgroup.kill.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <thread>

#include <fcntl.h>

#include "agent/backends/container/cgroup.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::container {
namespace {

namespace fs = std::filesystem;

constexpr std::uint64_t kMaxReclaimStep = 64 << 20;
constexpr std::uint64_t kReclaimFloor = 1 << 20;

bool populated(const std::string& dir) {
  try {
    return read_cgroup_file(dir + "/cgroup.events").find("populated 1") != std::string::npos;
  } catch (const Error&) {
    return false;
  }
}

void kill_and_wait(const std::string& dir) {
  try {
    write_cgroup_file(dir + "/cgroup.kill", "1");
  } catch (const Error& e) {
    if (e.code() == Code::kNotFound) return;
    throw;
  }
  for (int i = 0; i < 400 && populated(dir); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

std::uint64_t stat_field(const std::string& text, std::string_view key) {
  std::istringstream in(text);
  std::string k;
  std::uint64_t v;
  while (in >> k >> v)
    if (k == key) return v;
  return 0;
}

class SandboxCgroupV2 final : public SandboxCgroup {
 public:
  SandboxCgroupV2(std::string dir, std::string path) : dir_(std::move(dir)), path_(std::move(path)) {}
  ~SandboxCgroupV2() override {
    try {
      destroy();
    } catch (...) {
    }
  }

  std::vector<UniqueFd> open_procs() override {
    std::vector<UniqueFd> fds;
    fds.emplace_back(::open((dir_ + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC));
    if (!fds.back()) throw_errno_fmt(errno, "open {}/cgroup.procs", dir_);
    return fds;
  }

  std::vector<UniqueFd> create_exec_group(const std::string& name) override {
    std::string dir = dir_ + "/" + name;
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) throw_errno_fmt(errno, "mkdir {}", dir);
    {
      std::lock_guard lock(mu_);
      exec_groups_.insert(name);
    }
    // The command is born in the group (clone3 with CLONE_INTO_CGROUP on the directory), which needs its init to
    // be allowed to write the group's cgroup.procs; the descriptor opened here is the fallback where it is not.
    if (joiner_ && ::chown((dir + "/cgroup.procs").c_str(), *joiner_, static_cast<gid_t>(-1)) != 0)
      throw_errno_fmt(errno, "chown {}/cgroup.procs", dir);
    std::vector<UniqueFd> fds;
    fds.emplace_back(::open((dir + "/cgroup.procs").c_str(), O_WRONLY | O_CLOEXEC));
    if (!fds.back()) throw_errno_fmt(errno, "open {}/cgroup.procs", dir);
    fds.emplace_back(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fds.back()) throw_errno_fmt(errno, "open {}", dir);
    return fds;
  }

  // A start into an exec group by the sandbox's init needs write access to cgroup.procs of the exec group and of
  // their common ancestor, the sandbox's group (the kernel's delegation rule). Init in a user namespace is not the
  // host's root: those files are given to its host uid, as a delegated subtree's are. Nothing inside the sandbox
  // can reach them (it mounts no cgroupfs), and the sandbox's limits and its parent stay root's.
  void let_join_as(uid_t uid) override {
    if (::chown((dir_ + "/cgroup.procs").c_str(), uid, static_cast<gid_t>(-1)) != 0)
      throw_errno_fmt(errno, "chown {}/cgroup.procs", dir_);
    joiner_ = uid;
  }

  void kill_exec_group(const std::string& name) override { kill_and_wait(dir_ + "/" + name); }

  void release_exec_group(const std::string& name) override {
    std::lock_guard lock(mu_);
    release_ended_groups(dir_, name, exec_groups_, ended_groups_);
  }

  void destroy() override {
    std::lock_guard lock(mu_);
    if (destroyed_) return;
    unthrottle();
    kill_and_wait(dir_);
    std::error_code ec;
    if (fs::exists(dir_, ec)) {
      for (const auto& child : fs::directory_iterator(dir_, ec))
        if (child.is_directory()) ::rmdir(child.path().c_str());
      if (::rmdir(dir_.c_str()) != 0 && errno != ENOENT) throw_errno_fmt(errno, "rmdir {}", dir_);
    }
    destroyed_ = true;
  }

  void limit_cpu(double cores) override {
    write_cgroup_file(dir_ + "/cpu.max",
                      fmt::format("{} 100000", std::max(static_cast<long long>(cores * 100000), 1000LL)));
  }

  void unthrottle() override {
    try {
      write_cgroup_file(dir_ + "/cpu.max", "max 100000");
    } catch (const Error&) {
    }
  }

  void freeze() override {
    write_cgroup_file(dir_ + "/cgroup.freeze", "1");
    wait_frozen(true);
  }

  void thaw() override {
    write_cgroup_file(dir_ + "/cgroup.freeze", "0");
    wait_frozen(false);
  }

  // Lets the sandbox use swap, then asks memory.reclaim for at most kMaxReclaimStep at a time until it answers
  // EAGAIN (it could not get all it was asked: nothing more to release) or the deadline passes.
  bool reclaim_memory(std::chrono::steady_clock::time_point deadline) override {
    set_swap_max("max");
    UniqueFd fd(::open((dir_ + "/memory.reclaim").c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd) throw_errno_fmt(errno, "open {}/memory.reclaim", dir_);
    for (;;) {
      std::uint64_t current = memory_current();
      if (current <= kReclaimFloor) return false;
      if (std::chrono::steady_clock::now() >= deadline) return true;
      std::string value = std::to_string(std::min(current, kMaxReclaimStep));
      if (retry_eintr([&] { return ::write(fd.get(), value.data(), value.size()); }) < 0) {
        if (errno == EAGAIN) return false;
        throw_errno_fmt(errno, "write {} to {}/memory.reclaim", value, dir_);
      }
    }
  }

  void restore_memory() override { set_swap_max("0"); }

  std::uint64_t swap_current() override {
    try {
      return std::stoull(read_cgroup_file(dir_ + "/memory.swap.current"));
    } catch (...) {
      return 0;
    }
  }

  bool rename(const std::string&) override { return false; }  // cgroup2 has no rename

  std::uint64_t refaults() override {
    std::uint64_t sum = 0;
    try {
      std::istringstream in(read_cgroup_file(dir_ + "/memory.stat"));
      std::string k;
      std::uint64_t v;
      while (in >> k >> v)
        if (k == "workingset_refault_anon" || k == "workingset_refault_file") sum += v;
    } catch (...) {
    }
    return sum;
  }

  std::uint64_t memory_current() override {
    try {
      return std::stoull(read_cgroup_file(dir_ + "/memory.current"));
    } catch (...) {
      return 0;
    }
  }

  bool frozen() override { return read_cgroup_file(dir_ + "/cgroup.freeze").starts_with('1'); }

  std::string path() const override { return path_; }

  std::vector<std::string> exec_groups() override { return child_groups(dir_); }

  void adopt_exec_group(const std::string& name, bool kill) override {
    {
      std::lock_guard lock(mu_);
      exec_groups_.insert(name);
    }
    if (kill) kill_exec_group(name);
    release_exec_group(name);
  }

  void set_restore_limit(std::uint64_t) override {}  // v2 never lowers the limit

  std::uint64_t oom_kills() override {
    try {
      return stat_field(read_cgroup_file(dir_ + "/memory.events"), "oom_kill");
    } catch (...) {
      return 0;
    }
  }

  // memory.peak (Linux 5.19+) counts from the group's creation: a reset only remembers where to start from, and
  // the peak after it is the larger of that point's charge and what memory.peak says when it rose later.
  std::uint64_t memory_peak() override {
    std::uint64_t peak = 0;
    try {
      peak = std::stoull(read_cgroup_file(dir_ + "/memory.peak"));
    } catch (...) {
      return memory_current();
    }
    std::lock_guard lock(mu_);
    return peak > peak_at_reset_ ? peak : std::max(current_at_reset_, memory_current());
  }

  void reset_memory_peak() override {
    std::uint64_t peak = 0;
    try {
      peak = std::stoull(read_cgroup_file(dir_ + "/memory.peak"));
    } catch (...) {
    }
    std::uint64_t current = memory_current();
    std::lock_guard lock(mu_);
    peak_at_reset_ = peak;
    current_at_reset_ = current;
  }

  double cpu_usage_seconds() override {
    try {
      return static_cast<double>(stat_field(read_cgroup_file(dir_ + "/cpu.stat"), "usage_usec")) / 1e6;
    } catch (...) {
      return 0;
    }
  }

  bool has_processes() override { return populated(dir_); }

  // v2 takes a lower memory.max at once and reclaims, or OOM-kills inside the group, to get under it.
  void set_limits(std::uint64_t memory_bytes, std::uint32_t pids) override {
    write_cgroup_file(dir_ + "/memory.max", std::to_string(memory_bytes));
    write_cgroup_file(dir_ + "/pids.max", std::to_string(pids));
  }

 private:
  // An awake sandbox has memory.swap.max 0: it never goes to swap. Hosts without swap accounting lack the file.
  void set_swap_max(const char* value) {
    std::error_code ec;
    if (!fs::exists(dir_ + "/memory.swap.max", ec)) return;
    write_cgroup_file(dir_ + "/memory.swap.max", value);
  }

  void wait_frozen(bool frozen) {
    const std::string want = frozen ? "frozen 1" : "frozen 0";
    for (int i = 0; i < 1000; ++i) {
      if (read_cgroup_file(dir_ + "/cgroup.events").find(want) != std::string::npos) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    throw Error(Code::kDeadlineExceeded, fmt::format("{}: not {} after 5 s", dir_, frozen ? "frozen" : "thawed"));
  }

  std::string dir_;
  std::string path_;  // dir_ below the cgroup2 mount: "/<name>/<id>"
  std::mutex mu_;
  std::set<std::string> exec_groups_;   // every exec group that exists
  std::set<std::string> ended_groups_;  // those whose exec has ended: removed once empty
  bool destroyed_ = false;
  std::optional<uid_t> joiner_;                             // let_join_as
  std::uint64_t peak_at_reset_ = 0, current_at_reset_ = 0;  // see memory_peak()
};

class CgroupV2Driver final : public CgroupDriver {
 public:
  CgroupV2Driver(std::string mount, const std::string& name) : mount_(std::move(mount)), root_(mount_ + "/" + name) {
    std::string available = read_cgroup_file(mount_ + "/cgroup.controllers");
    for (const char* c : {"cpu", "memory", "pids"}) {
      std::istringstream in(available);
      std::string word;
      bool found = false;
      while (in >> word) found |= word == c;
      if (!found)
        throw Error(Code::kFailedPrecondition,
                    fmt::format("cgroup v2 at {} lacks the {} controller (have: {})", mount_, c, available));
    }
    write_cgroup_file(mount_ + "/cgroup.subtree_control", "+cpu +memory +pids");
    if (::mkdir(root_.c_str(), 0755) != 0 && errno != EEXIST) throw_errno_fmt(errno, "mkdir {}", root_);
    write_cgroup_file(root_ + "/cgroup.subtree_control", "+cpu +memory +pids");
    cpu_idle_ = ::access((root_ + "/cpu.idle").c_str(), F_OK) == 0;
    // Batch sandboxes live apart, under <mount>/<name>.batch/<id>, a group of cpu.idle 1: an idle group yields at
    // once only to its siblings, so it must sit beside the agent's, the trainer's and the other sandboxes' groups for
    // their waking threads to preempt batch work at once.
    if (cpu_idle_) {
      batch_root_ = root_ + ".batch";
      if (::mkdir(batch_root_.c_str(), 0755) != 0 && errno != EEXIST) throw_errno_fmt(errno, "mkdir {}", batch_root_);
      write_cgroup_file(batch_root_ + "/cgroup.subtree_control", "+cpu +memory +pids");
      write_cgroup_file(batch_root_ + "/cpu.idle", "1");
    }
  }

  std::string version() const override { return "v2"; }
  bool cpu_idle() const override { return cpu_idle_; }

  std::unique_ptr<SandboxCgroup> create(const std::string& id, const Resources& r) override {
    std::string dir = (r.priority == Priority::kBatch && !batch_root_.empty() ? batch_root_ : root_) + "/" + id;
    if (::mkdir(dir.c_str(), 0755) != 0) throw_errno_fmt(errno, "mkdir {}", dir);
    auto group = std::make_unique<SandboxCgroupV2>(dir, dir.substr(mount_.size()));
    write_cgroup_file(dir + "/memory.max", std::to_string(r.memory_bytes));
    try {
      write_cgroup_file(dir + "/memory.swap.max", "0");
    } catch (const Error&) {
      // no swap accounting on this host: nothing to limit
    }
    group->limit_cpu(r.cpu);
    // The class of service (docs/qos.md): CPU weight; latency's memory protected from reclaim (memory.low); batch
    // throttled at 90% of its limit (memory.high) and idle-scheduled as a group (cpu.idle, Linux 5.15+; its tasks
    // run SCHED_IDLE anyway, set on its init).
    write_cgroup_file(dir + "/cpu.weight", std::to_string(cpu_weight_v2(r.priority)));
    if (r.priority == Priority::kLatency) write_cgroup_file(dir + "/memory.low", std::to_string(r.memory_bytes));
    if (r.priority == Priority::kBatch) {
      write_cgroup_file(dir + "/memory.high", std::to_string(r.memory_bytes / 10 * 9));
      if (cpu_idle_) write_cgroup_file(dir + "/cpu.idle", "1");
    }
    write_cgroup_file(dir + "/pids.max", std::to_string(r.pids));
    if (!latency_cpus_.empty())
      write_cgroup_file(dir + "/cpuset.cpus", r.priority == Priority::kLatency ? latency_cpus_ : shared_cpus_);
    return group;
  }

  void reserve_cpus(const std::string& latency, const std::string& shared) override {
    std::istringstream available(read_cgroup_file(mount_ + "/cgroup.controllers"));
    std::string word;
    bool found = false;
    while (available >> word) found |= word == "cpuset";
    if (!found)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("cgroup v2 at {} lacks the cpuset controller: CPUs cannot be reserved for latency "
                              "sandboxes (dsecd --latency-cpus none)",
                              mount_));
    write_cgroup_file(mount_ + "/cgroup.subtree_control", "+cpuset");
    write_cgroup_file(root_ + "/cgroup.subtree_control", "+cpuset");
    if (!batch_root_.empty()) write_cgroup_file(batch_root_ + "/cgroup.subtree_control", "+cpuset");
    latency_cpus_ = latency;
    shared_cpus_ = shared;
  }

  void remove_empty_groups() override {
    std::error_code ec;
    for (const auto* top : {&root_, &batch_root_}) {
      if (top->empty()) continue;
      for (const auto& entry : fs::directory_iterator(*top, ec)) {
        if (!entry.is_directory() || populated(entry.path())) continue;
        for (const auto& child : fs::directory_iterator(entry.path(), ec))
          if (child.is_directory()) ::rmdir(child.path().c_str());
        ::rmdir(entry.path().c_str());
      }
    }
  }

  void remove_subtree_if_empty() override {
    ::rmdir(root_.c_str());
    if (!batch_root_.empty()) ::rmdir(batch_root_.c_str());
  }

  void remove_sandbox_groups(const std::string& id) override {
    for (const auto* top : {&root_, &batch_root_}) {
      std::error_code ec;
      if (top->empty() || !fs::exists(*top + "/" + id, ec)) continue;
      SandboxCgroupV2(*top + "/" + id, top->substr(mount_.size()) + "/" + id).destroy();
    }
  }

  std::unique_ptr<SandboxCgroup> adopt(const std::string& path) override {
    check_adoptable_path(path);
    struct stat st {};
    if (::stat((mount_ + path).c_str(), &st) != 0) throw_errno_fmt(errno, "cgroup {}{}", mount_, path);
    return std::make_unique<SandboxCgroupV2>(mount_ + path, path);
  }

 private:
  std::string mount_;
  std::string root_;
  std::string batch_root_;                  // <root_>.batch, of cpu.idle 1; empty where the kernel has no cpu.idle
  std::string latency_cpus_, shared_cpus_;  // reserve_cpus
  bool cpu_idle_ = false;
};

}  // namespace

std::unique_ptr<CgroupDriver> make_cgroup_v2_driver(const std::string& root_mount, const std::string& name) {
  return std::make_unique<CgroupV2Driver>(root_mount, name);
}

}  // namespace dsec::agent::container
