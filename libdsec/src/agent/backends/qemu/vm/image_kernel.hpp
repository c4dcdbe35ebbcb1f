// What a full VM boots: the image's own kernel, with an initramfs of dsec-init and the kernel modules it needs to
// build the root from the image's layers (guest_boot.cpp in dsec-init). The image is untrusted (a snapshot may carry
// a kernel written by code inside a sandbox), so its files are read with the files API's rules: every path resolved
// inside the image's root (openat2 RESOLVE_IN_ROOT), only regular files, sizes capped; what is taken from it is
// copied into the agent's own cache before QEMU or the initramfs writer sees it.
//
// The kernel is /vmlinuz (the link Debian's linux-base keeps to /boot/vmlinuz-<release>), a bzImage whose header
// names its release; the modules are /lib/modules/<release>/..., found through its modules.dep: virtio over PCI,
// virtio-blk, virtio-console, EROFS, overlayfs and ext4 (with crc32c first, which ext4's checksums look up by name
// and an initramfs has no modprobe to load). What the booted system needs beyond those (the display, USB input) its
// own udev loads from the image.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace dsec::agent::vm {

struct ImageBoot {
  std::filesystem::path kernel;     // the bzImage, in the cache
  std::filesystem::path initramfs;  // dsec-init and the modules, in the cache
  std::string release;              // the kernel's release ("6.1.0-50-amd64")
  std::string key;                  // identifies kernel, modules and init together (templates are made per key)
};

// The modules a full VM's initramfs loads, in this order where they do not depend on each other.
const std::vector<std::string>& boot_modules();

// The kernel and initramfs for an image whose root is `root` (a directory: the image's layers as one tree), made
// once per key under `cache_dir` and reused after. `init_binary` is dsec-init. FAILED_PRECONDITION naming what is
// missing when the image has no kernel (/vmlinuz: "include linux-image-amd64") or lacks a module the boot needs;
// INVALID_ARGUMENT for a kernel that is not a bzImage.
ImageBoot prepare_image_boot(const std::filesystem::path& root, const std::filesystem::path& init_binary,
                             const std::filesystem::path& cache_dir);

// The release a bzImage's header names (the first word of its kernel_version string); INVALID_ARGUMENT when `image`
// is not a bzImage.
std::string bzimage_release(std::string_view image);

}  // namespace dsec::agent::vm
