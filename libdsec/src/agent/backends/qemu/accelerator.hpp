// Which accelerator a QEMU tier's VMs get: KVM where QEMU's unprivileged uid can open /dev/kvm and KVM really runs
// the guest (the backend boots one to see), TCG otherwise; never QEMU's "kvm:tcg", which would hide which one ran.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>

namespace dsec::agent::qemu {

// Whether a process of another uid than /dev/kvm's owner, with no supplementary group but perhaps the device's own,
// can open /dev/kvm read-write, from the device's stat; `group` is the group to give QEMU for it.
struct KvmAccess {
  bool usable = false;
  std::optional<gid_t> group;
  std::string reason;  // why not, when not usable
};
KvmAccess kvm_access(const struct stat& device);
// The same for the host's /dev/kvm ("no /dev/kvm" when it has none).
KvmAccess host_kvm_access();

// What the backend chose and why: KVM when it is usable and its probe boot answered; else TCG with the reason
// (the access problem, or the probe's failure, with a note when the host's KVM is kvm_pvm). `wanted` is the value of
// the tier's accelerator option, `flag` that option's name (e.g. "--microvm-accelerator"), which the reason and
// `unavailable` quote. Wanted "kvm": the backend is unavailable instead of falling back.
struct AcceleratorChoice {
  bool kvm = false;
  std::string reason;
  std::string unavailable;
};
AcceleratorChoice choose_accelerator(std::string_view flag, const std::string& wanted, const KvmAccess& access,
                                     const std::string& probe_failure, bool probe_ran, bool host_is_pvm);

}  // namespace dsec::agent::qemu
