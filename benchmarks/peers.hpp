// dsec's peers on this machine, run as their users run them: `crun run` of an OCI bundle, `bwrap` of a root
// directory, and a plain posix_spawn of a static binary. All three use the same busybox root as dsec's image.
#pragma once

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench.hpp"
#include "common/unique_fd.hpp"

namespace dsec::bench {

// crun (1.8 in Debian 12) refuses to start anything on a hybrid cgroup host whose cgroup2 mount has a controller
// (here: hugetlb, which no v1 hierarchy claims): "cgroups in hybrid mode not supported". It reads that verdict from
// /sys/fs/cgroup/unified/cgroup.controllers. This makes a private mount namespace, a slave of the host's, where that
// one file reads empty, and returns it (an fd of /proc/self/ns/mnt) for crun to run in; crun then manages its
// cgroups in the v1 hierarchies as on any v1 host. dsec-bench itself stays in the host's namespace.
//
// Must run before any thread exists (unshare(CLONE_NEWNS) needs an unshared fs context). Returns an empty fd and
// sets `note` to why when the host needs no workaround, or when the workaround cannot be made.
UniqueFd make_crun_mount_namespace(std::string& note);

// An image of the store <home>/store as one read-only directory for the peers: its layers read from the store and
// mounted (EROFS, stacked with overlayfs) under `scratch`, unmounted when this is destroyed. NOT_FOUND when the image
// is missing (with how to build it).
class PeerRoot {
 public:
  virtual ~PeerRoot() = default;
  virtual const std::filesystem::path& root() const = 0;
};
std::unique_ptr<PeerRoot> mount_image_rootfs(const std::string& home, const std::string& image,
                                             const std::filesystem::path& scratch);

class Peers {
 public:
  // `rootfs`: the busybox root; `work_dir`: where the OCI bundle and crun's state go (created). A peer named in
  // options.peers that cannot run on this host is dropped with a note, or is an error when --peers was explicit.
  Peers(const Options& options, const std::filesystem::path& rootfs, std::filesystem::path work_dir,
        UniqueFd crun_mnt_ns, std::vector<std::string>& notes);
  ~Peers();
  Peers(const Peers&) = delete;
  Peers& operator=(const Peers&) = delete;

  bool has_crun() const noexcept { return crun_ok_; }
  bool has_bwrap() const noexcept { return bwrap_ok_; }
  const std::filesystem::path& rootfs() const noexcept { return rootfs_; }
  // The static binary behind /bin/true in the root, run on the host as "true".
  const std::string& host_binary() const noexcept { return host_binary_; }

  // One whole `crun run` (create, start, `true`, exit, delete). Thread-safe; throws on a non-zero exit.
  void crun_run();
  // One `bwrap --unshare-all --ro-bind <rootfs> / --proc /proc --dev /dev true`. Thread-safe.
  void bwrap_run();
  // posix_spawn of host_binary() with argv ["true"], and wait. Thread-safe.
  void host_spawn();

  std::string crun_version() const;
  std::string bwrap_version() const;

 private:
  void write_bundle();
  // Runs argv to completion (stdin and stdout /dev/null, stderr appended to `log`), in mount namespace `mnt_ns`
  // when it is open. Returns the wait status.
  int run(const std::vector<std::string>& argv, int log_fd, int mnt_ns) const;
  std::string log_tail(const std::filesystem::path& log) const;

  std::filesystem::path rootfs_;
  std::filesystem::path work_dir_;
  std::filesystem::path bundle_dir_;
  std::filesystem::path crun_state_;
  std::filesystem::path crun_log_, bwrap_log_;
  UniqueFd crun_log_fd_, bwrap_log_fd_, null_fd_;
  UniqueFd crun_mnt_ns_;
  std::string host_binary_;
  bool crun_ok_ = false, bwrap_ok_ = false;
  std::atomic<unsigned long> crun_seq_{0};
  std::string crun_prefix_;
};

}  // namespace dsec::bench
