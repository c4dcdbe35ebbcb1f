// What the microvm backend shares with its sandboxes and its pool: the node's QEMU, guest kernel and initramfs,
// where VMs keep their files, the cgroup driver, the uids QEMU runs as, the templates.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "agent/backends/container/cgroup.hpp"
#include "agent/backends/microvm/guest_kernel.hpp"
#include "agent/backends/qemu/vm_template.hpp"
#include "agent/backends/qemu/writable_disk.hpp"
#include "agent/config.hpp"
#include "agent/host_id_pool.hpp"

namespace dsec::agent::microvm {

constexpr std::uint32_t kQemuPids = 256;  // QEMU's threads: vCPUs, I/O, RCU, workers

struct BackendContext {
  AgentConfig config;
  std::string qemu;
  GuestKernel kernel;
  std::filesystem::path initramfs;
  std::uint32_t tsc_khz = 0;
  std::filesystem::path work_dir;  // <run dir>/.microvm: the initramfs, probes, pooled VMs' sockets and logs
  // <home>/microvm/<cgroup name>: what is large and must be on local disk (never a tmpfs /run): writable disks,
  // saved state of sleeping VMs, templates' files; a directory per sandbox, per template and per pooled VM.
  std::filesystem::path data_dir;
  std::unique_ptr<container::CgroupDriver> cgroups;
  qemu::WritableDisks disks;
  HostIdPool uids;
  std::uint32_t host_cores = 1;
  std::uint64_t host_memory = 0;
  std::atomic<std::uint32_t> vms{0};  // sandboxes' VMs running now
  qemu::TemplateCache templates;

  explicit BackendContext(const AgentConfig& c)
      : config(c),
        data_dir(c.home / "microvm" / c.cgroup_name),
        disks(data_dir / "disks"),
        uids(c.microvm.uid_base, c.microvm.uid_count, 1, "microVM uids"),
        templates("microvm") {}
};

}  // namespace dsec::agent::microvm
