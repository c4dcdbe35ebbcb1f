// The QEMU tiers' backend: every sandbox one QEMU process with its own kernel, the image's EROFS layers attached
// read-only as virtio-blk disks (lazily streamed like a container's), a writable ext4 disk on local disk stacked
// over them with overlayfs inside the guest, and dsec-init inside serving exec, files, processes and sessions over
// a virtio-serial port: the same API and errors as containers. Two tiers share it:
// - microvm (docs/microvm.md): a microvm machine booting the node's small guest kernel, dsec-init as pid 1;
// - vm (docs/vm.md): a q35 machine with a screen and USB input, booting the image's own kernel and init (systemd),
//   dsec-init as its service; create returns once the system has started.
#pragma once

#include <memory>
#include <string>

#include "agent/backends/backend.hpp"
#include "agent/config.hpp"

namespace dsec::agent {
namespace network {
class NodeNetwork;
}

// What a QEMU tier runs on, for GET /v1/node: the accelerator it chose (probed at start), why not KVM, the guest
// kernel. `ready` is false while the probe runs; `unavailable` says why the backend cannot create anything.
struct QemuTierStatus {
  bool ready = false;
  std::string accelerator;         // "kvm" or "tcg" once probed
  std::string accelerator_reason;  // why this one (e.g. why KVM was not usable)
  std::string kernel;              // microvm: the guest kernel's release
  std::string unavailable;         // empty when VMs can be made
  double probe_boot_seconds = 0;   // KVM: how long the probe's boot took, QEMU start to the guest's first answer
  std::uint32_t vms = 0;           // running VMs
  // Pre-booted pools (vm_pool.hpp): VMs kept per shape, waiting now, shapes pooled, creates served from a pool,
  // creates of a pooled shape that found it empty, pooled VMs that could not be made.
  std::uint32_t pool_size = 0;
  std::uint32_t pool_ready = 0;
  std::uint32_t pool_shapes = 0;
  std::uint64_t pool_claims = 0;
  std::uint64_t pool_misses = 0;
  std::uint64_t pool_failures = 0;
  // Templates kept now, the guest RAM they hold, templates dropped for the memory budget so far.
  std::uint32_t templates = 0;
  std::uint64_t template_bytes = 0;
  std::uint64_t template_evictions = 0;
};
using MicroVmStatus = QemuTierStatus;

class QemuBackend : public Backend {
 public:
  virtual QemuTierStatus status() const = 0;
};
using MicroVmBackend = QemuBackend;

// FAILED_PRECONDITION (naming what is missing: QEMU, the guest kernel, dsec-init, root) when this node cannot run
// the tier's VMs; the accelerator probe then runs in the background.
std::unique_ptr<QemuBackend> make_microvm_backend(const AgentConfig& config);
// `network` (may be null) gives full VMs' VNC screens their ports.
std::unique_ptr<QemuBackend> make_vm_backend(const AgentConfig& config,
                                             std::shared_ptr<network::NodeNetwork> network = nullptr);

// Why this node cannot run microVMs (QEMU or the guest kernel missing), or "" when it has what they need; cheap.
std::string microvm_unavailable_reason(const AgentConfig& config);

}  // namespace dsec::agent
