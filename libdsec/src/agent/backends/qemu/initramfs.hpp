// The initramfs a QEMU tier's guest kernel boots with: dsec-init as /init and the kernel modules the guest needs, in
// load order (dependencies first, read from each module's ELF .modinfo), so that init can insmod them before it
// mounts anything. Also the host's TSC rate, which a guest under TCG is told on its kernel command line.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::agent::qemu {

// A kernel module's `name=` (or, without one, the file's stem) and `depends=`, read from its ELF .modinfo section.
// INVALID_ARGUMENT for a file that is not an ELF64 relocatable with a .modinfo section (a compressed .ko.xz or .ko.zst
// included: decompress it first).
struct ModuleInfo {
  std::string name;
  std::vector<std::string> depends;
};
ModuleInfo read_module_info(const std::filesystem::path& ko);

// The files to load, dependencies first, for the wanted module names (names with '-' and '_' are the same). The
// directory's modules are its *.ko files, known by their file stems; a module listed in <modules_dir>/modules.builtin
// (the kernel's list) is built in and needs no file. The `optional` modules are loaded too when they and their
// dependencies are present, and skipped otherwise; any other module absent from `modules_dir` (or a directory that
// cannot be read) is FAILED_PRECONDITION naming it, its message ending with "; <remedy>" when a remedy (how to get the
// modules) is given; a dependency cycle is INVALID_ARGUMENT.
std::vector<std::filesystem::path> module_load_order(const std::filesystem::path& modules_dir,
                                                     const std::vector<std::string>& wanted,
                                                     const std::vector<std::string>& optional = {},
                                                     std::string_view remedy = {});

// Writes an uncompressed cpio "newc" archive to `out` (through out.tmp, renamed into place): init = init_binary
// (0755); directories dev proc sys tmp run mnt newroot lib lib/dsec lib/dsec/modules; dev/console (char 5,1) and
// dev/null (char 1,3) so the kernel can open the console before devtmpfs is mounted; and
// lib/dsec/modules/NN-<name>.ko (0644) for each module in the given order, NN = 00, 01, ... so that the directory's
// names sorted are the load order. Names carry no leading '/', as the kernel's own gen_init_cpio writes them. Owner
// root:root, mtime 0, inode numbers by position: the same inputs give the same bytes.
void write_initramfs(const std::filesystem::path& out, const std::filesystem::path& init_binary,
                     const std::vector<std::filesystem::path>& modules);

// The host's TSC frequency in kHz, measured once (rdtsc against CLOCK_MONOTONIC_RAW over ~20 ms, median of 3) and
// cached: under TCG the guest's TSC runs at the host's rate, and a guest with no reference clock to calibrate it
// against (QEMU's microvm machine under TCG: the guest hangs at boot) is given it as tsc_early_khz=<this>.
// UNIMPLEMENTED on a host that is not x86-64.
std::uint64_t host_tsc_khz();

}  // namespace dsec::agent::qemu
