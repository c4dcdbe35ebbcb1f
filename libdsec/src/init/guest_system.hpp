// The guest's system, as dsec-init sets it up in a virtual machine: its API file systems, the kernel modules the
// initramfs carries, the virtio devices it finds by name (the agent's port, the disks by serial), and the root it
// builds from the image's layers: each layer's EROFS read-only, the writable disk's ext4, overlayfs over them.
//
// Shared by the two ways a VM boots: the microVM's dsec-init stays pid 1 and builds the root when the agent's kSetup
// asks (guest_init.cpp); a full VM's initramfs builds it from the kernel command line and hands the root to the
// image's own init (guest_boot.cpp).
#pragma once

#include <chrono>
#include <map>
#include <set>
#include <string>
#include <string_view>

#include "common/wire/guest_protocol.hpp"

namespace dsec::init {

// Where a full VM's boot stage leaves dsec's part of the system for the guest agent's service (guest_boot.cpp).
inline constexpr const char* kServiceDisk = "/run/dsec/rw";  // the writable disk's ext4
inline constexpr const char* kServiceUpper = "/run/dsec/rw/upper";

void log_line(const std::string& line);  // "dsec-init: <line>" on stderr (the console, or a service's journal)
std::string errno_text(int err);
// The first 512 bytes of a small file (sysfs, procfs), trailing newlines and NULs cut; empty when unreadable.
std::string read_small_file(const std::string& path);
bool write_small_file(const std::string& path, std::string_view value);
// Mounts (making the target directory first); a failure other than EBUSY is logged, not fatal.
void mount_or_log(const char* source, const char* target, const char* type, unsigned long flags, const char* data);
// devtmpfs on /dev, proc on /proc, sysfs on /sys: what an initramfs's init starts with.
void mount_api_file_systems();
// Loads the initramfs's modules in the order of their names, then removes the files (their memory is the guest's).
void load_modules();
// The /dev node of the virtio-serial port named `name`, waiting for it to appear; empty after the wait.
std::string find_port(const char* name, std::chrono::milliseconds wait);
// /dev/vdX by virtio-blk serial, waiting until all wanted serials are there (or the wait passes).
std::map<std::string, std::string> find_disks(const std::set<std::string>& serials, std::chrono::milliseconds wait);
// The guest's only network: loopback, up (as a container's namespace has it).
void loopback_up();

// Builds the root `setup` names at /newroot: layer i's EROFS at /layers/<i> (with its data device where it has one),
// the writable disk's ext4 at /rw (upper and work directories in it), overlayfs over them at /newroot. Throws
// FAILED_PRECONDITION (RESOURCE_EXHAUSTED for a full disk) naming the step that failed.
void build_overlay_root(const guest_protocol::Setup& setup);
// Moves /dev, /proc and /sys into /newroot, makes /newroot the root (MS_MOVE and chroot) and enters it.
void enter_new_root();

}  // namespace dsec::init
