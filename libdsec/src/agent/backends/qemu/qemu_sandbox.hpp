// A QEMU tier's sandbox (microvm or vm): one QEMU process (VmInstance) with its cgroup, uid, writable disk and
// directories, serving exec and files through dsec-init inside the guest, sleeping by saving the VM to local disk,
// forking by freezing it into a template its copies start from; a full VM's screen through QEMU's monitor.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "agent/backends/backend.hpp"
#include "agent/backends/container/cgroup.hpp"
#include "agent/backends/qemu/tier_context.hpp"
#include "agent/backends/qemu/vm_instance.hpp"
#include "agent/backends/qemu/vm_template.hpp"

namespace dsec::agent::qemu {

// A running VM frozen for its copies: its RAM sealed, its device state and disk in files.
class QemuForkSource final : public ForkSource {
 public:
  QemuForkSource(TemplatePtr t, VmBootSpec boot) : frozen(std::move(t)), parent_boot(std::move(boot)) {}
  TemplatePtr frozen;
  VmBootSpec parent_boot;
};

// The sandbox `id` around a VM that runs (or, with `sleeping`, whose saved state is in its data directory). `boot`
// says how its QEMU was started (a wake or a fork starts the next one the same way); the sandbox owns the uid, the
// cgroup and both directories from now on and releases them when it is destroyed or its VM stops by itself.
std::unique_ptr<BackendSandbox> make_qemu_sandbox(BackendContext& shared, std::string id, SandboxSpec spec,
                                                  std::filesystem::path run_dir, std::uint32_t uid,
                                                  std::unique_ptr<container::SandboxCgroup> cgroup, VmBootSpec boot,
                                                  std::unique_ptr<VmInstance> vm, bool sleeping = false);

}  // namespace dsec::agent::qemu
