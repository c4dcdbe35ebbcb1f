// The QEMU command line of one VM of a QEMU tier (a microvm machine, or a q35 one with a screen), and the guest
// kernel's command line. Pure: no I/O, nothing is opened or checked on disk; every input is validated
// (INVALID_ARGUMENT naming the field) and every value that QEMU splits at commas is escaped (',' -> ',,').
//
// What QEMU 7.2 (Debian 1:7.2+dfsg-7+deb12u18) was checked to accept, by running it
// (tests/unit/agent/backends/qemu/qemu_command_test.cpp):
//  - chardev socket with fd=N of a LISTENING unix socket and server=on,wait=off, for both the QMP monitor and the
//    agent's virtserialport. The caller binds and listens before it starts QEMU, so it can connect at once (the
//    connection waits in the backlog until QEMU accepts). It should close its own copy of the listening socket after
//    the spawn: while it holds one, a connection to a dead QEMU waits forever instead of failing with ECONNRESET.
//  - the console through "chardev file,path=...,append=on": path may be /proc/self/fd/N (QEMU re-opens the file) or
//    /dev/fdset/S (-add-fd; the fd in the set must be opened O_WRONLY, as QEMU asks for write-only and matches the
//    access mode exactly: an O_RDWR fd is refused with "Permission denied"). With append=on QEMU never truncates.
//    A file console grows without bound while the guest writes: the other choice is a ring buffer in QEMU's memory
//    (console_ringbuf_bytes) read with QMP "ringbuf-read".
//  - memory-backend-file with mem-path=/proc/self/fd/N (a memfd or a file), share=on or off. NOT /dev/fdset/S:
//    QEMU opens mem-path with plain open() ("can't open backing store /dev/fdset/3 for guest RAM").
//  - -kernel and -initrd given as /proc/self/fd/N; not /dev/fdset/S ("could not open kernel file"). Neither they nor
//    -append are split at commas, so they are passed as they are.
//  - -add-fd takes its descriptor over: the original number is closed (and reused: "/proc/self/fd/8: No such device
//    or address" when a socket got it). So one descriptor is either an fd set member or a /proc/self/fd/N path,
//    never both; qemu_argv refuses /proc/self/fd/N of any fd it hands QEMU (fds, the QMP and agent sockets).
//  - -blockdev filename=/dev/fdset/S: the set needs an fd of the matching access mode (O_RDONLY for a read-only
//    device, O_RDWR for a writable one). raw with offset=/size=, read-only=on, file.locking=off; writable devices with
//    discard=unmap,detect-zeroes=unmap; qcow2.
//  - -cpu max and -cpu qemu64 both boot the Debian 6.1 cloud kernel under TCG; max (the default for TCG here) offers
//    the guest more of the ISA (7.2's TCG max has SSE4.2, POPCNT, AVX, AVX2; no AVX-512). KVM uses -cpu host.
//  - -sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny with all of the above, and
//    "migrate" / "migrate-incoming" to fd:<name> after "getfd" (a snapshot file), x-ignore-shared included.
//  - q35 with smm=off,vmport=off,i8042=off and memory-backend=ram, the same -kernel/-initrd/-append, the devices'
//    -pci forms, a VGA (xres, yres, vgamem_mb) or virtio-gpu-pci screen with -display none -vnc none, and qemu-xhci
//    with usb-kbd and usb-tablet (then the tablet is the only mouse: i8042=off leaves no PS/2 one).
//
// The argv, in order: binary, -name, -nodefaults -no-user-config, -nographic -display none (no screen) or -display
// none -vnc none (a screen), -no-reboot, -sandbox, -machine microvm,... | q35,..., -accel kvm | tcg,tb-size=N, -cpu,
// -smp, -m, -object memory-backend-file, -kernel [-initrd] -append, -add-fd..., the QMP chardev and -mon, the console
// chardev and -serial, the agent's virtio-serial, each disk's -blockdev and virtio-blk -device, the balloon, the
// screen's -device, the USB controller, keyboard and tablet, [-S], [-incoming defer]. Devices are virtio-*-device
// (virtio-mmio) on microvm and virtio-*-pci on q35.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::agent::qemu {

enum class Accelerator { kKvm, kTcg };

// The machine QEMU emulates: microvm (virtio-mmio devices, no PCI, no firmware, no screen) or q35 (PCI devices,
// firmware, a screen and USB input if asked for).
enum class Machine { kMicrovm, kQ35 };

// The guest's screen (q35 only). None: no display device at all.
struct DisplaySpec {
  enum class Kind { kNone, kVga, kVirtioGpu };
  Kind kind = Kind::kNone;
  // The resolution the screen offers the guest (its EDID's preferred mode).
  std::uint32_t width = 1024;
  std::uint32_t height = 768;
  // VGA's video memory in MiB: a power of two, large enough for width x height x 4 bytes.
  std::uint32_t vgamem_mb = 16;
};

// A screen of `width` x `height` on `kind`, with video memory for two frames of it (at least 16 MiB).
DisplaySpec make_display(DisplaySpec::Kind kind, std::uint32_t width, std::uint32_t height);

// One virtio-blk disk: a -blockdev node and its -device.
struct BlockDevice {
  std::string node_name;  // QEMU node name: a letter, then letters, digits, '-', '.', '_' (at most 31)
  std::string filename;   // a path or "/dev/fdset/S" (S must be among QemuSpec::fds)
  bool read_only = true;
  std::uint64_t offset = 0;    // raw only: where the disk starts in the file
  std::uint64_t size = 0;      // raw only: its length; 0 = to the end of the file
  std::string serial;          // the guest sees /dev/disk/by-id/virtio-<serial>; at most 20 of [A-Za-z0-9._-]; optional
  std::string format = "raw";  // "raw" or "qcow2"
};

// An inherited descriptor given to QEMU as a member of an fd set: -add-fd fd=N,set=S. "/dev/fdset/S" then names it.
struct FdSetMember {
  int fd = -1;
  int fdset_id = 0;
};

struct QemuSpec {
  std::string name;    // the sandbox id: -name <name>,debug-threads=on
  std::string binary;  // qemu-system-x86_64's path: argv[0]
  Machine machine = Machine::kMicrovm;
  Accelerator accelerator = Accelerator::kKvm;
  std::uint32_t tcg_tb_size_mib = 32;  // TCG's translation cache (per VM, in host memory)
  std::string cpu_model;               // empty: "host" under KVM, "max" under TCG

  std::uint32_t vcpus = 1;
  std::uint64_t memory_bytes = 0;  // rounded up to a MiB
  // Guest RAM is a memory-backend-file (id "ram") on this path, e.g. "/proc/self/fd/7" (never /dev/fdset); empty:
  // anonymous memory (memory-backend-ram), whose pages the guest never wrote cost nothing even when read.
  std::string memory_path;
  bool memory_share = true;  // true for a VM of its own; false for a copy-on-write clone of a frozen template

  std::string kernel;  // paths, e.g. "/proc/self/fd/8"
  std::string initrd;  // optional
  std::string kernel_cmdline;

  std::vector<BlockDevice> block_devices;
  std::vector<FdSetMember> fds;

  int qmp_listen_fd = -1;    // a listening unix socket for the QMP monitor (required)
  int agent_listen_fd = -1;  // a listening unix socket for the guest agent's port "dsec.agent"; -1: no agent channel

  // The guest console (ttyS0): a file QEMU appends to ("/proc/self/fd/N" or "/dev/fdset/S"), or else a ring buffer
  // of this many bytes (a power of two) inside QEMU, chardev id "console"; neither: the console goes nowhere.
  std::string console_path;
  std::uint64_t console_ringbuf_bytes = 0;

  bool balloon = true;        // virtio-balloon with free page reporting
  DisplaySpec display;        // q35 only
  bool usb_input = false;     // q35 only: an xHCI controller with a USB keyboard and tablet (absolute pointer)
  bool start_paused = false;  // -S
  bool incoming = false;      // -incoming defer: restore from a snapshot with migrate-incoming
};

// The argv (argv[0] = spec.binary). INVALID_ARGUMENT naming the field for a bad spec.
std::vector<std::string> qemu_argv(const QemuSpec& spec);

// ',' -> ',,': a value as QEMU's option syntax (QemuOpts and keyval) reads it back.
std::string qemu_opt_escape(std::string_view value);

struct CmdlineOptions {
  // dsec_guest=<this> tells dsec-init, the initramfs's /init, which life it leads: "1", the guest's pid 1 serving the
  // agent (the microvm tier); otherwise a mode init_main knows. Required; letters, digits and . _ -.
  std::string guest_mode;
  Accelerator accelerator = Accelerator::kKvm;
  // TCG only, and required there: the guest's TSC rate in kHz, given as tsc_early_khz= so the kernel need not
  // calibrate it. Under TCG the guest TSC runs at the host's TSC rate, so this is the host's (e.g. from the host
  // kernel's "tsc: Refined TSC clocksource calibration" or cpuid leaf 0x15/0x16).
  std::uint32_t tsc_khz = 0;
  // Appended after dsec's words, in order: "key" or "key=value", no spaces, quotes, backslashes or control characters.
  // A later word of the same key overrides for most kernel parameters (e.g. loglevel=7 to debug a boot).
  std::vector<std::string> extra;
};

// "console=ttyS0 quiet loglevel=3 panic=-1 reboot=t rdinit=/init dsec_guest=<guest_mode>" [+ "tsc_early_khz=K
// tsc=reliable" under TCG] + the extra words. INVALID_ARGUMENT for a bad mode or word, a missing tsc_khz under TCG,
// or a line longer than the x86 kernel takes (2047 bytes).
std::string kernel_cmdline(const CmdlineOptions& options);

}  // namespace dsec::agent::qemu
