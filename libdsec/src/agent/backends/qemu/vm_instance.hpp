// One running VM of a QEMU tier: its QEMU process, its QMP monitor and the line to dsec-init inside
// (guest::GuestChannel).
//
// Everything QEMU reads comes as descriptors the agent opened (guest RAM, kernel, initramfs, the image's layer
// files, the writable disk, the console log, two listening sockets), so QEMU's own uid needs access to no file of
// the node. The sockets are bound in the sandbox's run directory, where a restarted agent finds them again.
//
// Guest RAM is a memfd the agent holds too (memory-backend-file share=on over /proc/self/fd/N): its pages are
// QEMU's, charged to the sandbox's cgroup, and the agent can save, seal or map them for sleep, snapshots and forks.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "agent/backends/qemu/guest/guest_channel.hpp"
#include "agent/backends/qemu/qemu_command.hpp"
#include "agent/backends/qemu/qmp.hpp"
#include "agent/backends/qemu/vm_process.hpp"
#include "agent/backends/qemu/vm_template.hpp"
#include "agent/images/layers/layer_image.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::qemu {

using Clock = std::chrono::steady_clock;

struct VmBootSpec {
  std::string id;                 // the sandbox id (QEMU's -name)
  std::filesystem::path run_dir;  // exists; qmp.sock, agent.sock, console.log, qemu.log go here
  std::string qemu;
  Accelerator accelerator = Accelerator::kTcg;
  std::uint32_t tcg_tb_size_mib = 32;
  std::uint32_t tsc_khz = 0;
  std::uint32_t vcpus = 1;
  std::uint64_t memory_bytes = 256ull << 20;
  std::filesystem::path kernel;
  std::filesystem::path initrd;
  std::vector<layers::LayerImage> layers;  // lowest first; none: the guest boots without a root (the probe)
  std::filesystem::path disk;              // the writable disk; required with layers
  uid_t uid = 0;
  gid_t gid = 0;
  std::optional<gid_t> kvm_group;
  std::vector<int> cgroup_procs;  // joined by QEMU before it runs
  std::string hostname;
  // A full system (the vm tier): a q35 machine booting the image's own kernel and init (`kernel` and `initrd` from
  // vm::prepare_image_boot). dsec-init builds the root at boot from the kernel command line's root word, so no
  // kSetup follows the hello, and then answers as a service of the image's init, which takes a while to start it:
  // the hello is repeated until the deadline.
  bool full_system = false;
  qemu::DisplaySpec display;  // a screen (full systems only)
  bool usb_input = false;     // a USB keyboard and tablet (full systems only)
  bool sched_idle = false;    // a batch sandbox's QEMU runs SCHED_IDLE, every thread of it (docs/qos.md)
};

// A VM started from saved state instead of booted: QEMU's device state (a migration stream in a file) and where its
// RAM comes from.
struct VmRestore {
  std::filesystem::path state_file;
  // A frozen template's sealed RAM, mapped privately (copy-on-write): the stream holds no RAM (saved with
  // ignore_shared). Null: the stream holds the RAM, loaded into anonymous memory of the VM's own (pages the guest
  // never wrote stay unallocated), or, with `into_memfd`, into a memfd (every page gets allocated: QEMU reads each
  // page it loads a zero for; punch_zero_pages() gives them back) so the VM can be frozen afterwards.
  GuestMemory template_memory;
  bool into_memfd = false;
  // Stay stopped once loaded (no guest runs, nothing greets it): to save it again at once.
  bool paused = false;
};

class VmInstance {
 public:
  // Starts QEMU and waits until dsec-init inside answers (and, with layers, has made its root), all before
  // `deadline`. A guest that stays silent is DEADLINE_EXCEEDED; a QEMU that exits or a guest that fails its setup
  // is UNAVAILABLE or FAILED_PRECONDITION; each message ends with the guest console's and QEMU's last lines. On any
  // failure the QEMU is killed.
  static std::unique_ptr<VmInstance> boot(const VmBootSpec& spec, Clock::time_point deadline);
  // Starts QEMU from saved state (the same devices as the VM it was saved from) and waits until dsec-init inside
  // answers the hello that renews its clock, entropy and hostname. The guest's processes go on where they were.
  static std::unique_ptr<VmInstance> restore(const VmBootSpec& spec, const VmRestore& from, Clock::time_point deadline);
  // Takes over a QEMU an earlier run of the agent started (after a restart): `pidfd` names it (checked by the
  // caller), its QMP and agent sockets are connected again at their paths in the run directory, and the guest is
  // greeted (which ends the execs the old agent ran: nobody can read their output any more). The guest's RAM comes
  // back from QEMU's own descriptor 3 (its own memfd, or the template a clone maps; `clone` says which).
  static std::unique_ptr<VmInstance> attach(const std::string& id, const std::filesystem::path& run_dir, pid_t pid,
                                            UniqueFd pidfd, bool clone, const std::string& hostname,
                                            Clock::time_point deadline);

  // The VM becomes sandbox `id` (a pooled VM claimed by a create): its run directory has been moved to `run_dir`,
  // and its guest is greeted again, as `hostname`, with a fresh clock and entropy. Only while nothing else uses it.
  void become(const std::string& id, const std::filesystem::path& run_dir, const std::string& hostname,
              Clock::time_point deadline);

  // Stops the guest and writes QEMU's device state (and, unless `ignore_shared`, the guest's RAM) to `state_file`.
  // The guest stays stopped; end this QEMU afterwards. With ignore_shared the RAM stays in memory(): freeze it
  // (seal it) before anything maps it for a clone.
  void save(const std::filesystem::path& state_file, bool ignore_shared, std::chrono::milliseconds timeout);
  // Gives back the pages of the VM's memfd that hold only zeros (call while the guest is stopped).
  std::uint64_t punch_zero_pages();
  // The guest's RAM when it is a memfd of its own (null for a clone, whose RAM is a private mapping of its template,
  // and for a VM restored into anonymous memory).
  const GuestMemory& memory() const noexcept { return memory_; }
  const GuestMemory& template_memory() const noexcept { return template_; }

  ~VmInstance();
  VmInstance(const VmInstance&) = delete;
  VmInstance& operator=(const VmInstance&) = delete;

  // The line to dsec-init (not for a VM restored paused).
  guest::GuestChannel& guest() {
    if (!guest_) throw Error(Code::kFailedPrecondition, "this VM is stopped: nothing inside answers");
    return *guest_;
  }
  pid_t pid() const noexcept { return process_.pid; }
  int pidfd() const noexcept { return process_.pidfd.get(); }
  const std::filesystem::path& run_dir() const noexcept { return run_dir_; }
  // QEMU has exited.
  bool exited() const;
  // Kills QEMU and waits for it (idempotent).
  void kill();
  // "console: ...\nqemu: ..." from the last lines of both logs, for error messages.
  std::string last_words() const;
  // Runs a QMP command (one at a time).
  nlohmann::json qmp(std::string_view command, const nlohmann::json& arguments = nlohmann::json::object());
  // Runs `fn` with the QMP connection to itself (for exchanges of several commands: a screenshot's fd passing).
  template <typename F>
  auto with_qmp(F&& fn) -> decltype(fn(std::declval<QmpClient&>())) {
    std::lock_guard lock(qmp_mu_);
    if (!qmp_) throw Error(Code::kUnavailable, "this VM has no QMP connection");
    return fn(*qmp_);
  }

 private:
  VmInstance() = default;
  static std::unique_ptr<VmInstance> start(const VmBootSpec& spec, const VmRestore* from, Clock::time_point deadline);
  void load_state(const UniqueFd& state, bool ignore_shared, bool paused, Clock::time_point deadline);
  // `repeat`: ask again until one hello is answered (a restored guest, or a full system whose init starts the guest
  // agent late).
  void greet(const std::string& hostname, Clock::time_point deadline, bool repeat);

  std::string id_;
  std::filesystem::path run_dir_;
  qemu::VmProcess process_;
  GuestMemory memory_;    // this VM's own RAM (shared with QEMU)
  GuestMemory template_;  // or the template its RAM is a copy-on-write view of
  std::mutex qmp_mu_;
  std::optional<qemu::QmpClient> qmp_;
  std::unique_ptr<guest::GuestChannel> guest_;
  bool killed_ = false;
  bool adopted_ = false;
};

// Freezes a running VM into a template in `dir` (created): saves its device state without RAM, ends its QEMU, seals
// its RAM, and keeps its writable disk `disk` as the template's (moved when it is in `dir` already as "disk", else
// copied). The VM must be one with RAM of its own (not a clone); it is gone afterwards.
TemplatePtr freeze_vm(VmInstance& vm, std::string key, const std::filesystem::path& dir,
                      const std::filesystem::path& disk, std::uint64_t memory_bytes);

// A unix stream socket bound at `path` (replacing a stale one) and listening.
UniqueFd listen_unix(const std::filesystem::path& path);
// A connection to the unix socket at `path`.
UniqueFd connect_unix(const std::filesystem::path& path);

}  // namespace dsec::agent::qemu
