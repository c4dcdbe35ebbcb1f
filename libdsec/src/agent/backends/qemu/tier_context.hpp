// What a QEMU tier's backend (microvm or vm) shares with its sandboxes and its pool: the node's QEMU, the tier's
// settings, the microvm tier's guest kernel and initramfs, where VMs keep their files, the cgroup driver, the uids
// QEMU runs as, the templates.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>

#include "agent/backends/container/cgroup.hpp"
#include "agent/backends/qemu/microvm/guest_kernel.hpp"
#include "agent/backends/qemu/vm_template.hpp"
#include "agent/backends/qemu/writable_disk.hpp"
#include "agent/config.hpp"
#include "agent/network/node_network.hpp"
#include "agent/node/host_id_pool.hpp"
#include "agent/node/qos/kernel_qos.hpp"

namespace dsec::agent::qemu {

constexpr std::uint32_t kQemuPids = 256;  // QEMU's threads: vCPUs, I/O, RCU, workers

// The two QEMU tiers: their kind and how their guests boot.
enum class Tier {
  kMicrovm,  // a microvm machine, the node's guest kernel, dsec-init as pid 1
  kVm,       // a q35 machine with a screen, the image's own kernel and init (systemd), dsec-init as its service
};

struct BackendContext {
  AgentConfig config;
  Tier tier;
  std::string kind;         // "microvm" or "vm"
  QemuTierConfig settings;  // config.microvm or config.vm
  std::string qemu;
  microvm::GuestKernel kernel;        // microvm: the node's guest kernel
  std::filesystem::path initramfs;    // microvm: dsec-init and the guest kernel's modules
  std::filesystem::path init_binary;  // dsec-init (a full VM's initramfs is made per image kernel)
  std::uint32_t tsc_khz = 0;
  std::filesystem::path work_dir;  // <run dir>/.<kind>: the initramfs, probes, pooled VMs' sockets and logs
  // <home>/<kind>/<cgroup name>: what is large and must be on local disk (never a tmpfs /run): writable disks,
  // saved state of sleeping VMs, templates' files, full VMs' kernels; a directory per sandbox, per template and per
  // pooled VM.
  std::filesystem::path data_dir;
  std::unique_ptr<container::CgroupDriver> cgroups;
  qemu::WritableDisks disks;
  HostIdPool uids;
  std::uint32_t host_cores = 1;
  std::uint64_t host_memory = 0;
  std::atomic<std::uint32_t> vms{0};  // sandboxes' VMs running now
  qemu::TemplateCache templates;
  std::shared_ptr<network::NodeNetwork> network;  // full VMs: ports for VNC screens (null: none)
  // Classes of service (docs/qos.md): what the kernel gives them and the CPUs reserved for latency sandboxes.
  qos::KernelQos kernel_qos;
  qos::CpuReservation cpus;

  BackendContext(const AgentConfig& c, Tier t)
      : config(c),
        tier(t),
        kind(t == Tier::kVm ? "vm" : "microvm"),
        settings(t == Tier::kVm ? c.vm : c.microvm),
        data_dir(c.home / kind / c.cgroup_name),
        disks(data_dir / "disks"),
        uids(settings.uid_base, settings.uid_count, 1, t == Tier::kVm ? "full VM uids" : "microVM uids"),
        templates(kind) {}
};

}  // namespace dsec::agent::qemu
