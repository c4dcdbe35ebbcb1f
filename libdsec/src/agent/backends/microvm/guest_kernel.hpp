// The microVM backend's guest kernel and its initramfs. The kernel is Debian's linux-image-cloud-amd64, unpacked by
// scripts/guest-kernel.sh into /var/cache/dsec/guest-kernel/<release>/ (vmlinux, vmlinuz, config, release, and a flat
// modules/ directory), with `current` pointing at the newest. QEMU's microvm machine boots vmlinux directly (its PVH
// entry); the initramfs written here carries dsec's init and the modules the guest needs, in load order, so init can
// insmod them before it mounts anything.
#pragma once

#include <cstdint>
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

// A kernel module's `name=` (or, without one, the file's stem) and `depends=`, read from its ELF .modinfo section.
// INVALID_ARGUMENT for a file that is not an ELF64 relocatable with a .modinfo section (a compressed .ko.xz or .ko.zst
// included: decompress it first, as scripts/guest-kernel.sh does).
struct ModuleInfo {
  std::string name;
  std::vector<std::string> depends;
};
ModuleInfo read_module_info(const std::filesystem::path& ko);

// The files to load, dependencies first, for the wanted module names (names with '-' and '_' are the same). The
// directory's modules are its *.ko files, known by their file stems; a module listed in <modules_dir>/modules.builtin
// (the kernel's list, as the script copies it) is built in and needs no file. The `optional` modules are loaded too
// when they and their dependencies are present, and skipped otherwise; any other module absent from `modules_dir` is
// FAILED_PRECONDITION naming it; a dependency cycle is INVALID_ARGUMENT.
std::vector<std::filesystem::path> module_load_order(const std::filesystem::path& modules_dir,
                                                     const std::vector<std::string>& wanted,
                                                     const std::vector<std::string>& optional = {});

// Writes an uncompressed cpio "newc" archive to `out` (through out.tmp, renamed into place): init = init_binary
// (0755); directories dev proc sys tmp run mnt newroot lib lib/dsec lib/dsec/modules; dev/console (char 5,1) and
// dev/null (char 1,3) so the kernel can open the console before devtmpfs is mounted; and
// lib/dsec/modules/NN-<name>.ko (0644) for each module in the given order, NN = 00, 01, ... so that the directory's
// names sorted are the load order. Names carry no leading '/', as the kernel's own gen_init_cpio writes them. Owner
// root:root, mtime 0, inode numbers by position: the same inputs give the same bytes.
void write_initramfs(const std::filesystem::path& out, const std::filesystem::path& init_binary,
                     const std::vector<std::filesystem::path>& modules);

// The modules dsec's guest loads: virtio_mmio virtio_blk virtio_console virtio_balloon erofs overlay (their
// dependencies follow from module_load_order); virtio_rng is optional.
const std::vector<std::string>& guest_modules();
const std::vector<std::string>& optional_guest_modules();

// The host's TSC frequency in kHz, measured once (rdtsc against CLOCK_MONOTONIC_RAW over ~20 ms, median of 3) and
// cached: under TCG the guest's TSC runs at the host's rate, and QEMU microvm under TCG has no reference clock to
// calibrate it against (the guest hangs at boot), so the kernel command line passes tsc_early_khz=<this>.
// UNIMPLEMENTED on a host that is not x86-64.
std::uint64_t host_tsc_khz();

}  // namespace dsec::agent::microvm
