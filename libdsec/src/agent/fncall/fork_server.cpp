#include "agent/fncall/fork_server.hpp"

#include <fcntl.h>
#include <linux/capability.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "agent/backends/container/spawn.hpp"
#include "agent/fncall/wire.hpp"
#include "common/syscall.hpp"
#include "dsec/fncall.hpp"

namespace dsec::agent::fncall {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr const char* kPython = "/usr/bin/python3";
// The zygote imports its modules before it answers; a large one (numpy) read lazily from a remote store may take
// a while the first time.
constexpr auto kHelloTimeout = std::chrono::seconds(120);
constexpr auto kReadyTimeout = std::chrono::seconds(10);
// The server's own group: the zygote and the parents of its calls (each call's child has a group of its own).
constexpr std::uint64_t kServerMemory = 1ull << 30;
constexpr std::uint32_t kServerPids = 64;
constexpr std::uint32_t kCallOpenFiles = 1024;
// The compile step's processes (cc1, as, ld) need a few pids beyond the program's own.
constexpr std::uint32_t kCompilePids = 64;
// Emptied call groups a server keeps for its next calls (of each kind).
constexpr std::size_t kMaxSpareGroups = 4;

std::pair<UniqueFd, UniqueFd> socket_pair() {
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) throw_errno(errno, "socketpair");
  return {UniqueFd(fds[0]), UniqueFd(fds[1])};
}

json compile_commands() {
  return json{{"c", {"gcc", "-O2", "-pipe", "-o", "{binary}", "{source}", "-lm"}},
              {"cpp", {"g++", "-O2", "-pipe", "-o", "{binary}", "{source}"}}};
}

// The host's GPU device nodes: each twice, as a node nobody may open where programs look for it, and usable in
// a directory only root can enter, from where a call given the GPU binds it over the first one.
void add_gpu_nodes(container::RootfsPlan& plan, const std::vector<DeviceNode>& gpu_nodes) {
  using Kind = container::RootfsStep::Kind;
  const char* hidden = plan.keep(plan.root + "/dev/.dsec-gpu");
  plan.steps.push_back({Kind::kMkdir, nullptr, hidden, nullptr, 0, nullptr, 0700, 0, false});
  for (const auto& node : gpu_nodes) {
    plan.steps.push_back({Kind::kMknod, nullptr, plan.keep(plan.root + "/dev/.dsec-gpu/" + node.name), nullptr, 0,
                          nullptr, 0666, node.dev, false});
    plan.steps.push_back(
        {Kind::kMknod, nullptr, plan.keep(plan.root + "/dev/" + node.name), nullptr, 0, nullptr, 0, node.dev, false});
  }
}

// The zygote (python3 running zygote_script()) as the init of its sandbox, listening on `listen_fd`.
container::SpawnedInit spawn_zygote(Runtime& rt, const ForkServerParams& params, container::RootfsPlan& plan,
                                    int netns_fd, const std::vector<UniqueFd>& procs, int listen_fd,
                                    const container::UserNamespaces::Namespace* userns) {
  const std::string script(zygote_script());
  const char* argv[] = {"python3", "-I", "-B", "-c", script.c_str(), nullptr};
  const char* envp[] = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG=C.UTF-8", "HOME=/",
                        nullptr};
  container::SpawnRequest req;
  req.rootfs = &plan;
  req.hostname = "fncall";
  req.netns_fd = netns_fd;
  for (const auto& fd : procs) req.cgroup_procs_fds.push_back(fd.get());
  req.listen_fd = listen_fd;
  auto prog = rt.server_filter.fprog();
  req.seccomp = &prog;
  req.cap_last_cap = rt.cap_last_cap;
  req.open_files = 4096;
  req.exec_path = kPython;
  req.exec_argv = argv;
  req.exec_envp = envp;
  req.keep_capabilities = (1ull << CAP_SYS_ADMIN) | (1ull << CAP_SETUID) | (1ull << CAP_SETGID);
  if (userns) req.userns_fd = userns->fd.get();
  try {
    return container::spawn_init(req);
  } catch (const Error& e) {
    if (std::string_view(e.what()).find(fmt::format("exec {}", kPython)) != std::string_view::npos)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("image {} cannot serve function calls: its fork servers run {}, which the image does "
                              "not have ({})",
                              params.image, kPython, e.what()));
    throw;
  }
}

}  // namespace

std::unique_ptr<ForkServer> ForkServer::start(Runtime& rt, const ForkServerParams& params) {
  std::unique_ptr<ForkServer> server(new ForkServer(rt, params.id));
  ForkServer& s = *server;
  s.run_dir_ = rt.run_dir / params.id;
  if (::mkdir(s.run_dir_.c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}", s.run_dir_.string());
  for (const char* sub : {"rw", "root"})
    if (::mkdir((s.run_dir_ / sub).c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}/{}", s.run_dir_.string(), sub);

  Resources resources;
  resources.cpu = std::max(1u, rt.cores);
  resources.memory_bytes = kServerMemory;
  resources.pids = kServerPids;
  resources.disk_bytes = 1 << 20;
  s.cgroup_ = rt.cgroups->create(params.id, resources);
  std::vector<UniqueFd> procs = s.cgroup_->open_procs();
  s.netns_ = rt.netns->take();
  auto [agent_end, zygote_end] = socket_pair();

  std::vector<std::string> layers;
  for (auto it = params.layers.rbegin(); it != params.layers.rend(); ++it) layers.push_back(it->string());
  if (layers.empty()) throw Error(Code::kInvalidArgument, fmt::format("image {} has no layers", params.image));
  // Its own user namespace when the node has them and the layers can be idmapped; its processes' /proc shows each
  // user only its own processes (a call sees neither the zygote nor children armed for other calls).
  std::optional<container::UserNamespaces::Namespace> userns;
  if (rt.userns && rt.userns->enabled() &&
      std::all_of(params.layers.begin(), params.layers.end(),
                  [&](const fs::path& layer) { return rt.userns->can_idmap(layer); })) {
    userns.emplace(rt.userns->take());
    s.userns_first_ = userns->first;  // given back by kill(), also when the start fails below
  }
  container::RootfsOptions options;
  options.read_only_root = true;
  if (userns) options.userns_first = userns->first;
  options.proc_options = "hidepid=invisible";
  container::RootfsPlan plan = container::plan_rootfs(s.run_dir_.string(), layers, resources, options);
  if (!rt.gpu_nodes.empty()) add_gpu_nodes(plan, rt.gpu_nodes);

  container::SpawnedInit init =
      spawn_zygote(rt, params, plan, s.netns_.get(), procs, zygote_end.get(), userns ? &*userns : nullptr);
  s.pid_ = init.pid;
  s.pidfd_ = std::move(init.pidfd);
  s.ctl_ = std::move(agent_end);
  zygote_end.reset();

  s.greet(params);
  return server;
}

void ForkServer::greet(const ForkServerParams& params) {
  Runtime& rt = runtime_;
  json hello_init{{"type", "init"},
                  {"language", params.language},
                  {"uid", rt.config.uid},
                  {"gid", rt.config.gid},
                  {"preload", params.language == "python" ? rt.config.python_preload : std::vector<std::string>{}},
                  {"seccomp", rt.call_filter_base64},
                  {"nofile", kCallOpenFiles},
                  {"compile", compile_commands()}};
  send_frame(ctl_.get(), hello_init);
  Frame hello;
  bool timed_out = false;
  if (!recv_frame(ctl_.get(), hello, Clock::now() + kHelloTimeout, &timed_out))
    throw Error(Code::kUnavailable,
                fmt::format("fork server {} ({} over {}): the zygote {} before it was ready", params.id,
                            params.language, params.image, timed_out ? "did not answer" : "exited"));
  if (hello.type() == "fatal")
    throw Error(Code::kFailedPrecondition, fmt::format("image {} cannot serve function calls: {}", params.image,
                                                       hello.text("message", "zygote failed")));
  if (hello.type() != "hello")
    throw Error(Code::kInternal, fmt::format("fork server {}: unexpected first message '{}'", params.id, hello.type()));
  if (auto f = hello.header.find("failed"); f != hello.header.end() && f->is_object())
    for (auto& [name, why] : f->items()) preload_failures_.push_back(fmt::format("{} ({})", name, why.dump()));
}

ForkServer::~ForkServer() {
  try {
    kill();
  } catch (...) {
  }
}

// The limits a call's group starts with: the default request's (the compiler's, for the group a compile runs in),
// so that most calls need no change.
static GroupLimits starting_limits(const FnCallConfig& config, bool run, bool compiles) {
  const FnCallRequest defaults;
  if (compiles && !run) return {config.compile_memory_bytes, kCompilePids};
  return {defaults.memory_bytes, defaults.pids};
}

std::unique_ptr<container::SandboxCgroup> ForkServer::take_group(bool run, bool compiles, GroupLimits& limits) {
  {
    std::lock_guard lock(spare_mu_);
    auto& spares = run ? spare_run_ : spare_;
    if (!spares.empty()) {
      SpareGroup g = std::move(spares.back());
      spares.pop_back();
      limits = g.limits;
      return std::move(g.group);
    }
  }
  limits = starting_limits(runtime_.config, run, compiles);
  Resources resources;
  resources.cpu = runtime_.config.call_cpu;
  resources.memory_bytes = limits.memory_bytes;
  resources.pids = limits.pids;
  return runtime_.cgroups->create(fmt::format("{}-c{}{}", id_, runtime_.next_id.fetch_add(1), run ? "-run" : ""),
                                  resources);
}

void ForkServer::keep_group(std::unique_ptr<container::SandboxCgroup> group, GroupLimits limits, bool run,
                            bool compiles) {
  try {
    if (group->has_processes()) {
      group->destroy();
      return;
    }
    GroupLimits start = starting_limits(runtime_.config, run, compiles);
    if (limits.memory_bytes != start.memory_bytes || limits.pids != start.pids) {
      group->set_limits(start.memory_bytes, start.pids);
      limits = start;
    }
    // What the last call left charged (its page cache) stays, reclaimable; it is counted out of the next call's
    // peak rather than reclaimed now (memory.force_empty costs more than the rest of a call's work together).
    group->reset_memory_peak();
    limits.charged_before = group->memory_current();
    std::lock_guard lock(spare_mu_);
    auto& spares = run ? spare_run_ : spare_;
    if (!spares_closed_ && spares.size() < kMaxSpareGroups) {
      spares.push_back({std::move(group), limits});
      return;
    }
  } catch (const std::exception&) {
  }
  try {
    group->destroy();
  } catch (const std::exception&) {
  }
}

void ForkServer::recycle(Slot slot) {
  // The child is gone already (or ends now); its mounts go with the namespace.
  if (slot.pidfd) ::syscall(SYS_pidfd_send_signal, slot.pidfd.get(), SIGKILL, nullptr, 0);
  slot.sock.reset();
  slot.pidfd.reset();
  slot.mount_ns.reset();
  const bool compiles = static_cast<bool>(slot.run_cgroup);
  if (slot.cgroup) keep_group(std::move(slot.cgroup), slot.limits, false, compiles);
  if (slot.run_cgroup) keep_group(std::move(slot.run_cgroup), slot.run_limits, true, compiles);
}

Slot ForkServer::arm(bool run_group) {
  Slot slot;
  slot.cgroup = take_group(false, run_group, slot.limits);
  if (run_group) slot.run_cgroup = take_group(true, run_group, slot.run_limits);
  std::vector<UniqueFd> procs = slot.cgroup->open_procs();
  auto [agent_end, child_end] = socket_pair();
  std::vector<int> fds{child_end.get()};
  for (const auto& fd : procs) fds.push_back(fd.get());
  {
    std::lock_guard lock(ctl_mu_);
    if (!ctl_) throw Error(Code::kUnavailable, fmt::format("fork server {} was stopped", id_));
    send_frame(ctl_.get(), json{{"type", "arm"}}, {}, fds);
  }
  child_end.reset();
  procs.clear();
  Frame ready;
  bool timed_out = false;
  if (!recv_frame(agent_end.get(), ready, Clock::now() + kReadyTimeout, &timed_out))
    throw Error(Code::kUnavailable, fmt::format("fork server {}: a call's child {}", id_,
                                                timed_out ? "was not ready in time" : "ended before it was ready"));
  if (ready.type() == "failed")
    throw Error(Code::kInternal, fmt::format("fork server {}: a call's child failed at {}: {}", id_,
                                             ready.text("stage", "?"), ready.text("message", "?")));
  if (ready.type() != "ready" || ready.fds.size() != 2)
    throw Error(Code::kInternal,
                fmt::format("fork server {}: unexpected message '{}' from a call's child", id_, ready.type()));
  slot.sock = std::move(agent_end);
  slot.pidfd = std::move(ready.fds[0]);
  slot.mount_ns = std::move(ready.fds[1]);
  return slot;
}

bool ForkServer::alive() const {
  if (!pidfd_) return false;
  pollfd p{pidfd_.get(), POLLIN, 0};
  return ::poll(&p, 1, 0) == 0;
}

void ForkServer::kill() {
  std::lock_guard lock(kill_mu_);
  if (killed_) return;
  killed_ = true;
  {
    std::lock_guard ctl(ctl_mu_);
    ctl_.reset();
  }
  if (pidfd_) {
    // The zygote is pid 1 of the server's pid namespace: everything in it (its calls' parents and, in namespaces
    // below, their children) dies with it, and the kernel reports its exit after all of them are gone.
    ::syscall(SYS_pidfd_send_signal, pidfd_.get(), SIGKILL, nullptr, 0);
    siginfo_t info{};
    while (::waitid(static_cast<idtype_t>(P_PIDFD), static_cast<id_t>(pidfd_.get()), &info, WEXITED) != 0 &&
           errno == EINTR) {
    }
    pidfd_.reset();
  }
  {
    std::lock_guard spare(spare_mu_);
    spares_closed_ = true;
    for (auto* spares : {&spare_, &spare_run_}) {
      for (auto& g : *spares) g.group->destroy();
      spares->clear();
    }
  }
  if (cgroup_) cgroup_->destroy();
  netns_.reset();
  if (userns_first_ && runtime_.userns) runtime_.userns->give_back(*userns_first_);
  userns_first_.reset();
  std::error_code ec;
  if (!run_dir_.empty()) fs::remove_all(run_dir_, ec);
}

}  // namespace dsec::agent::fncall
