#include "peers.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/magic.h>
#include <sched.h>
#include <spawn.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <system_error>

#include "common/syscall.hpp"
#include "dsec/error.hpp"
#include "host.hpp"
#include "image/layer_files.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"

extern char** environ;

namespace dsec::bench {
namespace {

namespace fs = std::filesystem;

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exit status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("killed by signal {}", WTERMSIG(status));
  return fmt::format("wait status {}", status);
}

// Runs a short command and returns its first line of standard output ("" when it cannot run).
std::string first_output_line(const std::string& command) {
  std::string out;
  if (FILE* p = ::popen(command.c_str(), "r")) {
    char buf[256];
    if (std::fgets(buf, sizeof buf, p)) out = buf;
    ::pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

}  // namespace

UniqueFd make_crun_mount_namespace(std::string& note) {
  constexpr const char* kControllers = "/sys/fs/cgroup/unified/cgroup.controllers";
  struct statfs root {
  }, unified{};
  bool hybrid = ::statfs("/sys/fs/cgroup", &root) == 0 && root.f_type != CGROUP2_SUPER_MAGIC &&
                ::statfs("/sys/fs/cgroup/unified", &unified) == 0 && unified.f_type == CGROUP2_SUPER_MAGIC;
  if (!hybrid) return {};
  std::string controllers = read_text_file(kControllers);
  while (!controllers.empty() && (controllers.back() == '\n' || controllers.back() == ' ')) controllers.pop_back();
  if (controllers.empty()) return {};

  UniqueFd host(::open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC));
  if (!host) {
    note = fmt::format("crun: cannot open /proc/self/ns/mnt: {}", std::strerror(errno));
    return {};
  }
  if (::unshare(CLONE_NEWNS) != 0) {
    note = fmt::format("crun: cannot make a mount namespace for it: {}", std::strerror(errno));
    return {};
  }
  UniqueFd made;
  std::string failure;
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_SLAVE, nullptr) != 0) {
    failure = fmt::format("make / a slave: {}", std::strerror(errno));
  } else if (::mount("/dev/null", kControllers, nullptr, MS_BIND, nullptr) != 0) {
    failure = fmt::format("bind /dev/null over {}: {}", kControllers, std::strerror(errno));
  } else {
    made.reset(::open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC));
    if (!made) failure = fmt::format("open the new /proc/self/ns/mnt: {}", std::strerror(errno));
  }
  // Back to the host's namespace whatever happened: dsec-bench and the agent it starts live there.
  if (::setns(host.get(), CLONE_NEWNS) != 0)
    throw_errno(errno, "return to the host mount namespace after preparing crun's");
  if (!failure.empty()) {
    note = fmt::format("crun: cannot prepare its mount namespace ({})", failure);
    return {};
  }
  note = fmt::format(
      "crun 1.8 refuses hybrid cgroup hosts whose cgroup2 mount has controllers (here: {}); dsec-bench runs crun in "
      "a private mount namespace where {} reads empty, so crun manages its cgroups in the v1 hierarchies",
      controllers, kControllers);
  return made;
}

namespace {

class MountedPeerRoot final : public PeerRoot {
 public:
  MountedPeerRoot(std::unique_ptr<image::BlobStore> store, const image::Manifest& manifest, const fs::path& scratch)
      : store_(std::move(store)), mounted_(*store_, manifest, scratch) {}
  const fs::path& root() const override { return mounted_.root(); }

 private:
  std::unique_ptr<image::BlobStore> store_;
  image::MountedImage mounted_;
};

}  // namespace

std::unique_ptr<PeerRoot> mount_image_rootfs(const std::string& home, const std::string& image,
                                             const fs::path& scratch) {
  auto store = image::open_directory_store(fs::path(home) / "store");
  image::ResolvedManifest m;
  try {
    m = image::fetch_manifest(*store, image::parse_reference(image));
  } catch (const Error& e) {
    if (e.code() != Code::kNotFound) throw;
    throw Error(Code::kNotFound, fmt::format("{} (build it: dsec image build {} --from busybox-static --home {}; or "
                                             "give the peers a root with --rootfs DIR)",
                                             e.what(), image, home));
  }
  return std::make_unique<MountedPeerRoot>(std::move(store), m.manifest, scratch);
}

Peers::Peers(const Options& options, const fs::path& rootfs, fs::path work_dir, UniqueFd crun_mnt_ns,
             std::vector<std::string>& notes)
    : rootfs_(fs::absolute(rootfs)),
      work_dir_(std::move(work_dir)),
      bundle_dir_(work_dir_ / "bundle"),
      crun_state_(work_dir_ / "crun-state"),
      crun_log_(work_dir_ / "crun.log"),
      bwrap_log_(work_dir_ / "bwrap.log"),
      crun_mnt_ns_(std::move(crun_mnt_ns)),
      crun_prefix_(fmt::format("dsec-bench-{}-", ::getpid())) {
  fs::create_directories(work_dir_);
  null_fd_.reset(::open("/dev/null", O_RDWR | O_CLOEXEC));
  if (!null_fd_) throw_errno(errno, "open /dev/null");
  crun_log_fd_.reset(::open(crun_log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  if (!crun_log_fd_) throw_errno_fmt(errno, "open {}", crun_log_.string());
  bwrap_log_fd_.reset(::open(bwrap_log_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
  if (!bwrap_log_fd_) throw_errno_fmt(errno, "open {}", bwrap_log_.string());

  // The host's copy of what the sandboxes run as `true`: the root's /bin/true with its symlinks resolved inside
  // the root.
  fs::path t = rootfs_ / "bin" / "true";
  std::error_code ec;
  fs::path resolved = t;
  for (int hops = 0; hops < 8 && fs::is_symlink(resolved, ec); ++hops) {
    fs::path target = fs::read_symlink(resolved, ec);
    resolved = target.is_absolute() ? rootfs_ / target.relative_path() : resolved.parent_path() / target;
  }
  if (!fs::is_regular_file(resolved, ec) || ::access(resolved.c_str(), X_OK) != 0)
    throw Error(Code::kFailedPrecondition,
                fmt::format("{} does not lead to an executable file in the root {}", t.string(), rootfs_.string()));
  host_binary_ = resolved.lexically_normal().string();

  auto wanted = [&](const std::string& name) {
    for (const auto& p : options.peers)
      if (p == name) return true;
    return false;
  };
  auto fail = [&](const std::string& name, const std::string& why) {
    if (options.peers_explicit) throw Error(Code::kFailedPrecondition, fmt::format("peer {}: {}", name, why));
    notes.push_back(fmt::format("{} left out: {}", name, why));
  };

  if (wanted("crun")) {
    if (::access("/usr/bin/crun", X_OK) != 0 && first_output_line("command -v crun").empty()) {
      fail("crun", "not installed (apt-get install crun)");
    } else {
      try {
        write_bundle();
        crun_run();
        crun_ok_ = true;
      } catch (const Error& e) {
        fail("crun", e.what());
      }
    }
  }
  if (wanted("bwrap")) {
    if (::access("/usr/bin/bwrap", X_OK) != 0 && first_output_line("command -v bwrap").empty()) {
      fail("bwrap", "not installed (apt-get install bubblewrap)");
    } else {
      try {
        bwrap_run();
        bwrap_ok_ = true;
      } catch (const Error& e) {
        fail("bwrap", e.what());
      }
    }
  }
}

Peers::~Peers() {
  std::error_code ec;
  fs::remove_all(bundle_dir_, ec);
  fs::remove_all(crun_state_, ec);
}

void Peers::write_bundle() {
  fs::create_directories(bundle_dir_);
  fs::remove(bundle_dir_ / "config.json");
  int status = run({"crun", "spec", "--bundle", bundle_dir_.string()}, crun_log_fd_.get(), -1);
  if (status != 0)
    throw Error(Code::kInternal, fmt::format("crun spec: {}: {}", describe_status(status), log_tail(crun_log_)));
  fs::path config = bundle_dir_ / "config.json";
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text_file(config.string()));
  } catch (const std::exception& e) {
    throw Error(Code::kInternal, fmt::format("crun spec wrote an unreadable {}: {}", config.string(), e.what()));
  }
  j["process"]["terminal"] = false;
  j["process"]["args"] = {"true"};
  j["root"]["path"] = rootfs_.string();
  j["root"]["readonly"] = true;
  auto& namespaces = j["linux"]["namespaces"];
  bool has_net = false;
  for (const auto& ns : namespaces) has_net |= ns.value("type", "") == "network";
  if (!has_net) namespaces.push_back({{"type", "network"}});
  std::ofstream out(config);
  out << j.dump(1) << "\n";
  if (!out) throw Error(Code::kInternal, fmt::format("cannot write {}", config.string()));
}

int Peers::run(const std::vector<std::string>& argv, int log_fd, int mnt_ns) const {
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = -1;
  if (mnt_ns < 0) {
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, null_fd_.get(), 0);
    posix_spawn_file_actions_adddup2(&actions, null_fd_.get(), 1);
    posix_spawn_file_actions_adddup2(&actions, log_fd, 2);
    int rc = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    if (rc != 0) throw_errno_fmt(rc, "spawn {}", argv[0]);
  } else {
    // posix_spawn cannot enter a namespace; a vfork child can, before it execs (it has its own fs context).
    std::string path = argv[0].find('/') == std::string::npos ? "/usr/bin/" + argv[0] : argv[0];
    int null_fd = null_fd_.get();
    pid = ::vfork();
    if (pid == 0) {
      if (::setns(mnt_ns, CLONE_NEWNS) != 0) ::_exit(126);
      ::dup2(null_fd, 0);
      ::dup2(null_fd, 1);
      ::dup2(log_fd, 2);
      ::execve(path.c_str(), args.data(), environ);
      ::_exit(127);
    }
    if (pid < 0) throw_errno_fmt(errno, "vfork for {}", argv[0]);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw_errno_fmt(errno, "wait for {}", argv[0]);
  }
  return status;
}

std::string Peers::log_tail(const fs::path& log) const {
  std::string text = read_text_file(log.string());
  if (text.size() > 600) text = "..." + text.substr(text.size() - 600);
  while (!text.empty() && text.back() == '\n') text.pop_back();
  return text.empty() ? "(no output)" : text;
}

void Peers::crun_run() {
  std::string id = crun_prefix_ + std::to_string(crun_seq_.fetch_add(1));
  int status = run({"crun", "--root", crun_state_.string(), "run", "--bundle", bundle_dir_.string(), id},
                   crun_log_fd_.get(), crun_mnt_ns_.get());
  if (status != 0) {
    run({"crun", "--root", crun_state_.string(), "delete", "-f", id}, crun_log_fd_.get(), crun_mnt_ns_.get());
    throw Error(Code::kInternal, fmt::format("crun run {}: {}: {}", id, describe_status(status), log_tail(crun_log_)));
  }
}

void Peers::bwrap_run() {
  int status =
      run({"bwrap", "--unshare-all", "--ro-bind", rootfs_.string(), "/", "--proc", "/proc", "--dev", "/dev", "true"},
          bwrap_log_fd_.get(), -1);
  if (status != 0)
    throw Error(Code::kInternal, fmt::format("bwrap: {}: {}", describe_status(status), log_tail(bwrap_log_)));
}

void Peers::host_spawn() {
  char arg0[] = "true";
  char* argv[] = {arg0, nullptr};
  pid_t pid = -1;
  int rc = ::posix_spawn(&pid, host_binary_.c_str(), nullptr, nullptr, argv, environ);
  if (rc != 0) throw_errno_fmt(rc, "spawn {}", host_binary_);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) throw_errno_fmt(errno, "wait for {}", host_binary_);
  }
  if (status != 0)
    throw Error(Code::kInternal, fmt::format("{} (as true) on the host: {}", host_binary_, describe_status(status)));
}

std::string Peers::crun_version() const { return first_output_line("crun --version 2>/dev/null"); }

std::string Peers::bwrap_version() const { return first_output_line("bwrap --version 2>/dev/null"); }

}  // namespace dsec::bench
