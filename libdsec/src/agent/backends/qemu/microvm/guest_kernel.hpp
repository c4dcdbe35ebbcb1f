// The microVM backend's guest kernel and the modules its initramfs (qemu/initramfs) carries. The kernel is Debian's
// linux-image-cloud-amd64, unpacked by scripts/guest-kernel.sh into /var/cache/dsec/guest-kernel/<release>/ (vmlinux,
// vmlinuz, config, release, and a flat modules/ directory), with `current` pointing at the newest. QEMU's microvm
// machine boots vmlinux directly (its PVH entry).
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace dsec::agent::microvm {

struct GuestKernel {
  std::filesystem::path kernel;       // vmlinux (ELF, PVH entry) or a bzImage
  std::filesystem::path modules_dir;  // flat directory of .ko files; empty when the kernel needs none
  std::string release;                // "6.1.0-57-cloud-amd64", or "" when unknown
};

// Where the kernel is: `configured` (dsecd --microvm-kernel: a kernel file, or a directory laid out as the script's
// <release>/ directory: vmlinux, else vmlinuz; modules/; release) or, when empty, <default_dir>/current. For a kernel
// file given alone, modules come from a "modules" directory beside it when there is one, and the release from a
// "release" file beside it (else, for a bzImage, from its header).
// Throws FAILED_PRECONDITION with a message saying what is missing and how to get it (scripts/guest-kernel.sh).
GuestKernel find_guest_kernel(const std::filesystem::path& configured);
// $DSEC_GUEST_KERNEL_DIR, or /var/cache/dsec/guest-kernel.
std::filesystem::path default_guest_kernel_dir();

// The modules dsec's guest loads: virtio_mmio virtio_blk virtio_console virtio_balloon erofs overlay (their
// dependencies follow from qemu::module_load_order); virtio_rng is optional.
const std::vector<std::string>& guest_modules();
const std::vector<std::string>& optional_guest_modules();

// The files of those modules in `kernel`'s modules directory, in load order, for qemu::write_initramfs; none for a
// kernel without one. A missing module is FAILED_PRECONDITION saying how to get the guest kernel's modules.
std::vector<std::filesystem::path> guest_module_files(const GuestKernel& kernel);

}  // namespace dsec::agent::microvm
