#include "agent/backends/qemu/qemu_command.hpp"

#include <algorithm>
#include <charconv>
#include <set>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::agent::qemu {

namespace {

constexpr std::uint64_t kMiB = 1u << 20;
constexpr std::size_t kMaxKernelCmdline = 2047;  // x86 COMMAND_LINE_SIZE (2048) with its NUL
constexpr std::uint32_t kMaxVcpus = 255;
constexpr std::string_view kFdsetPrefix = "/dev/fdset/";

[[noreturn]] void invalid(std::string_view field, std::string_view why) {
  throw Error(Code::kInvalidArgument, fmt::format("QemuSpec.{}: {}", field, why));
}

bool has_control_char(std::string_view s) {
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) return true;
  }
  return false;
}

// A string QEMU gets in one argv word: not empty, no newline, NUL or other control character.
void check_text(std::string_view field, std::string_view value) {
  if (value.empty()) invalid(field, "must not be empty");
  if (has_control_char(value)) invalid(field, "contains a control character (newline, NUL, ...)");
}

// The set id of "/dev/fdset/S", or -1 when `path` is not such a name.
long fdset_of(std::string_view path) {
  if (path.substr(0, kFdsetPrefix.size()) != kFdsetPrefix) return -1;
  std::string_view digits = path.substr(kFdsetPrefix.size());
  long id = -1;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), id);
  if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty() || id < 0) return -2;
  return id;
}

// The N of "/proc/self/fd/N", or -1.
int proc_fd_of(std::string_view path) {
  constexpr std::string_view kPrefix = "/proc/self/fd/";
  if (path.substr(0, kPrefix.size()) != kPrefix) return -1;
  std::string_view digits = path.substr(kPrefix.size());
  int fd = -1;
  auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), fd);
  if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty()) return -1;
  return fd;
}

// A path QEMU re-opens must not be /proc/self/fd/N of a descriptor QEMU takes in another role: -add-fd closes the
// original (so N is gone, or reused: QEMU 7.2 said ENXIO for the socket it found there), and a socket cannot be
// re-opened at all.
void check_not_taken(std::string_view field, std::string_view path, const std::set<int>& taken) {
  int fd = proc_fd_of(path);
  if (fd >= 0 && taken.count(fd)) {
    invalid(field, fmt::format("'{}' is fd {}, which QEMU also gets in fds or as a socket", path, fd));
  }
}

void check_path(std::string_view field, std::string_view path, const std::set<int>& fdsets) {
  check_text(field, path);
  long set = fdset_of(path);
  if (set == -2) invalid(field, fmt::format("'{}' is not /dev/fdset/<number>", path));
  if (set >= 0 && !fdsets.count(static_cast<int>(set))) {
    invalid(field, fmt::format("'{}' names fd set {}, which is not among fds", path, set));
  }
}

bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
// [A-Za-z0-9._-]: what node names, serials and kernel parameter names are made of.
bool is_name_char(char c) { return is_alpha(c) || (c >= '0' && c <= '9') || c == '-' || c == '.' || c == '_'; }
bool all_name_chars(std::string_view s) { return std::all_of(s.begin(), s.end(), is_name_char); }

// QEMU's node names (block.c): a letter first, then letters, digits, '-', '.', '_'; at most 31 bytes.
bool valid_node_name(std::string_view n) { return !n.empty() && n.size() <= 31 && is_alpha(n[0]) && all_name_chars(n); }

// virtio-blk's ID field: at most 20 bytes.
bool valid_serial(std::string_view s) { return s.size() <= 20 && all_name_chars(s); }

std::string blockdev_options(const BlockDevice& d) {
  std::string o = fmt::format("driver={},node-name={}", d.format, d.node_name);
  if (d.offset != 0) o += fmt::format(",offset={}", d.offset);
  if (d.size != 0) o += fmt::format(",size={}", d.size);
  if (d.read_only) {
    o += ",read-only=on";
  } else {
    o += ",discard=unmap,detect-zeroes=unmap";
  }
  // No image locks: the agent alone decides which VM opens which file (a read-only base is shared by many).
  o += fmt::format(",file.driver=file,file.filename={},file.locking=off", qemu_opt_escape(d.filename));
  return o;
}

void check_display(const QemuSpec& spec) {
  const DisplaySpec& d = spec.display;
  if (d.kind == DisplaySpec::Kind::kNone) return;
  if (spec.machine != Machine::kQ35) invalid("display", "a screen needs machine q35 (microvm has no PCI)");
  constexpr std::uint32_t kMaxSide = 16384;
  for (auto [field, side] :
       {std::pair<std::string_view, std::uint32_t>{"display.width", d.width}, {"display.height", d.height}}) {
    if (side < 1 || side > kMaxSide) invalid(field, fmt::format("{} is not in [1, {}]", side, kMaxSide));
  }
  if (d.kind != DisplaySpec::Kind::kVga) return;
  if (d.vgamem_mb < 1 || d.vgamem_mb > 512 || (d.vgamem_mb & (d.vgamem_mb - 1)) != 0) {
    invalid("display.vgamem_mb", fmt::format("{} is not a power of two up to 512", d.vgamem_mb));
  }
  const std::uint64_t frame = std::uint64_t{d.width} * d.height * 4;
  if (frame > std::uint64_t{d.vgamem_mb} * kMiB) {
    invalid("display.vgamem_mb", fmt::format("{} MiB does not hold a {}x{} frame of 32-bit pixels ({} bytes)",
                                             d.vgamem_mb, d.width, d.height, frame));
  }
}

void check_fd(std::string_view field, int fd, std::set<int>& seen) {
  if (fd < 3) invalid(field, fmt::format("fd {} is not an inherited descriptor (must be >= 3)", fd));
  if (!seen.insert(fd).second) invalid(field, fmt::format("fd {} is given twice", fd));
}

}  // namespace

std::string qemu_opt_escape(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    out += c;
    if (c == ',') out += ',';
  }
  return out;
}

DisplaySpec make_display(DisplaySpec::Kind kind, std::uint32_t width, std::uint32_t height) {
  DisplaySpec d;
  d.kind = kind;
  d.width = width;
  d.height = height;
  const std::uint64_t two_frames = 2ull * width * height * 4;
  while (std::uint64_t{d.vgamem_mb} << 20 < two_frames && d.vgamem_mb < 512) d.vgamem_mb *= 2;
  return d;
}

namespace {

// The spec's checks, field by field (INVALID_ARGUMENT naming the field).
void check_machine(const QemuSpec& spec) {
  check_text("name", spec.name);
  check_text("binary", spec.binary);
  if (spec.vcpus < 1 || spec.vcpus > kMaxVcpus) {
    invalid("vcpus", fmt::format("{} is not in [1, {}]", spec.vcpus, kMaxVcpus));
  }
  if (spec.memory_bytes == 0) invalid("memory_bytes", "must be > 0");
  if (spec.memory_bytes > (std::uint64_t{1} << 50)) invalid("memory_bytes", "is absurdly large");
  if (spec.accelerator == Accelerator::kTcg && (spec.tcg_tb_size_mib < 1 || spec.tcg_tb_size_mib > 65536)) {
    invalid("tcg_tb_size_mib", fmt::format("{} is not in [1, 65536]", spec.tcg_tb_size_mib));
  }
  if (!spec.cpu_model.empty()) {
    check_text("cpu_model", spec.cpu_model);
    if (spec.cpu_model.find(',') != std::string::npos) invalid("cpu_model", "must be a bare model name");
  }
  check_display(spec);
  if (spec.usb_input && spec.machine != Machine::kQ35) invalid("usb_input", "needs machine q35 (microvm has no PCI)");
}

// The descriptors QEMU takes over (fd sets, sockets), each once: fills `seen_fds`, returns the fd set ids.
std::set<int> check_descriptors(const QemuSpec& spec, std::set<int>& seen_fds) {
  std::set<int> fdsets;
  for (std::size_t i = 0; i < spec.fds.size(); ++i) {
    const FdSetMember& m = spec.fds[i];
    check_fd(fmt::format("fds[{}].fd", i), m.fd, seen_fds);
    if (m.fdset_id < 0) invalid(fmt::format("fds[{}].fdset_id", i), "must be >= 0");
    fdsets.insert(m.fdset_id);
  }
  if (spec.qmp_listen_fd < 0) invalid("qmp_listen_fd", "required (a listening unix socket)");
  check_fd("qmp_listen_fd", spec.qmp_listen_fd, seen_fds);
  if (spec.agent_listen_fd >= 0) check_fd("agent_listen_fd", spec.agent_listen_fd, seen_fds);

  return fdsets;
}

// The files QEMU opens by name (memory, kernel, initrd, console), none of them a descriptor it also takes over.
void check_files(const QemuSpec& spec, const std::set<int>& seen_fds, const std::set<int>& fdsets) {
  for (auto [field, path] : {std::pair<std::string_view, std::string_view>{"memory_path", spec.memory_path},
                             {"kernel", spec.kernel},
                             {"initrd", spec.initrd},
                             {"console_path", spec.console_path}}) {
    check_not_taken(field, path, seen_fds);
  }
  for (std::size_t i = 0; i < spec.block_devices.size(); ++i) {
    check_not_taken(fmt::format("block_devices[{}].filename", i), spec.block_devices[i].filename, seen_fds);
  }
  if (!spec.memory_path.empty()) {
    check_text("memory_path", spec.memory_path);
    if (fdset_of(spec.memory_path) != -1) {
      invalid("memory_path", "QEMU opens mem-path with open(2), so /dev/fdset does not work: use /proc/self/fd/N");
    }
  }
  check_text("kernel", spec.kernel);
  if (fdset_of(spec.kernel) != -1) invalid("kernel", "/dev/fdset does not work for -kernel: use /proc/self/fd/N");
  if (!spec.initrd.empty()) {
    check_text("initrd", spec.initrd);
    if (fdset_of(spec.initrd) != -1) invalid("initrd", "/dev/fdset does not work for -initrd: use /proc/self/fd/N");
  }
  check_text("kernel_cmdline", spec.kernel_cmdline);
  if (spec.kernel_cmdline.size() > kMaxKernelCmdline) {
    invalid("kernel_cmdline",
            fmt::format("{} bytes, the kernel takes at most {}", spec.kernel_cmdline.size(), kMaxKernelCmdline));
  }

  if (!spec.console_path.empty() && spec.console_ringbuf_bytes != 0) {
    invalid("console_path", "give console_path or console_ringbuf_bytes, not both");
  }
  if (!spec.console_path.empty()) check_path("console_path", spec.console_path, fdsets);
  const std::uint64_t ring = spec.console_ringbuf_bytes;
  if (ring != 0 && ((ring & (ring - 1)) != 0 || ring > (1u << 30))) {
    invalid("console_ringbuf_bytes", fmt::format("{} is not a power of two up to 1 GiB", spec.console_ringbuf_bytes));
  }
}

void check_block_devices(const QemuSpec& spec, const std::set<int>& fdsets) {
  std::set<std::string> node_names;
  std::set<std::string> serials;
  for (std::size_t i = 0; i < spec.block_devices.size(); ++i) {
    const BlockDevice& d = spec.block_devices[i];
    std::string f = fmt::format("block_devices[{}]", i);
    if (!valid_node_name(d.node_name)) {
      invalid(f + ".node_name",
              fmt::format("'{}' is not a letter followed by at most 30 of [A-Za-z0-9._-]", d.node_name));
    }
    if (!node_names.insert(d.node_name).second) {
      invalid(f + ".node_name", fmt::format("'{}' is used twice", d.node_name));
    }
    check_path(f + ".filename", d.filename, fdsets);
    if (d.format != "raw" && d.format != "qcow2") {
      invalid(f + ".format", fmt::format("'{}' is not raw or qcow2", d.format));
    }
    if (d.format != "raw" && (d.offset != 0 || d.size != 0)) invalid(f + ".offset", "offset and size are for raw only");
    if (!valid_serial(d.serial)) {
      invalid(f + ".serial", fmt::format("'{}' is not at most 20 of [A-Za-z0-9._-]", d.serial));
    }
    if (!d.serial.empty() && !serials.insert(d.serial).second) {
      invalid(f + ".serial", fmt::format("'{}' is used twice", d.serial));
    }
  }
}

// virtio devices: on the virtio-mmio transport (microvm) or on PCI (q35).
std::string virtio(const QemuSpec& spec, std::string_view device) {
  return fmt::format("virtio-{}-{}", device, spec.machine == Machine::kQ35 ? "pci" : "device");
}

// The machine: QEMU's own settings, the accelerator, CPUs and memory, the kernel, the monitor and the console.
void add_machine(std::vector<std::string>& a, const QemuSpec& spec) {
  const bool kvm = spec.accelerator == Accelerator::kKvm;
  const bool q35 = spec.machine == Machine::kQ35;
  const bool screen = spec.display.kind != DisplaySpec::Kind::kNone;
  const std::uint64_t mib = (spec.memory_bytes + kMiB - 1) / kMiB;
  auto add = [&a](std::initializer_list<std::string> words) { a.insert(a.end(), words); };

  a.push_back(spec.binary);
  add({"-name", fmt::format("{},debug-threads=on", qemu_opt_escape(spec.name))});
  add({"-nodefaults", "-no-user-config"});
  // A screen is a device only: no window, and no VNC server of QEMU's own listening.
  // No VNC server of its own: the agent hands it viewers' connections, which must give the password it sets.
  if (screen) add({"-display", "none", "-vnc", "none,password=on"});
  else add({"-nographic", "-display", "none"});
  a.push_back("-no-reboot");
  add({"-sandbox", "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"});
  // q35: no SMM (SeaBIOS does not use it), no VMware port and no PS/2 controller (input is USB when asked for).
  add({"-machine", q35 ? "q35,memory-backend=ram,smm=off,vmport=off,i8042=off"
                       : "microvm,x-option-roms=off,pic=off,isa-serial=on,rtc=on,acpi=on,memory-backend=ram"});
  add({"-accel", kvm ? std::string("kvm") : fmt::format("tcg,tb-size={}", spec.tcg_tb_size_mib)});
  add({"-cpu", !spec.cpu_model.empty() ? spec.cpu_model : std::string(kvm ? "host" : "max")});
  add({"-smp", std::to_string(spec.vcpus)});
  add({"-m", fmt::format("{}M", mib)});
  if (spec.memory_path.empty()) add({"-object", fmt::format("memory-backend-ram,id=ram,size={}M", mib)});
  else
    add({"-object", fmt::format("memory-backend-file,id=ram,size={}M,mem-path={},share={}", mib,
                                qemu_opt_escape(spec.memory_path), spec.memory_share ? "on" : "off")});
  // -kernel, -initrd and -append are taken whole (not split at commas): no escaping.
  add({"-kernel", spec.kernel});
  if (!spec.initrd.empty()) add({"-initrd", spec.initrd});
  add({"-append", spec.kernel_cmdline});

  for (const FdSetMember& m : spec.fds) add({"-add-fd", fmt::format("fd={},set={}", m.fd, m.fdset_id)});

  add({"-chardev", fmt::format("socket,id=qmp,fd={},server=on,wait=off", spec.qmp_listen_fd)});
  add({"-mon", "chardev=qmp,mode=control"});

  if (!spec.console_path.empty()) {
    add({"-chardev", fmt::format("file,id=console,path={},append=on", qemu_opt_escape(spec.console_path))});
    add({"-serial", "chardev:console"});
  } else if (spec.console_ringbuf_bytes != 0) {
    add({"-chardev", fmt::format("ringbuf,id=console,size={}", spec.console_ringbuf_bytes)});
    add({"-serial", "chardev:console"});
  }
}

// The devices: the agent's port, the disks, the balloon, the screen and its input.
void add_devices(std::vector<std::string>& a, const QemuSpec& spec) {
  auto add = [&a](std::initializer_list<std::string> words) { a.insert(a.end(), words); };
  auto virtio = [&spec](std::string_view device) { return qemu::virtio(spec, device); };
  if (spec.agent_listen_fd >= 0) {
    add({"-device", virtio("serial") + ",max_ports=2"});
    add({"-chardev", fmt::format("socket,id=agent,fd={},server=on,wait=off", spec.agent_listen_fd)});
    add({"-device", "virtserialport,chardev=agent,name=dsec.agent"});
  }

  for (const BlockDevice& d : spec.block_devices) {
    add({"-blockdev", blockdev_options(d)});
    add({"-device", d.serial.empty() ? fmt::format("{},drive={}", virtio("blk"), d.node_name)
                                     : fmt::format("{},drive={},serial={}", virtio("blk"), d.node_name, d.serial)});
  }

  if (spec.balloon) add({"-device", virtio("balloon") + ",free-page-reporting=on"});
  const DisplaySpec& d = spec.display;
  if (d.kind == DisplaySpec::Kind::kVga) {
    add({"-device", fmt::format("VGA,id=video0,xres={},yres={},vgamem_mb={}", d.width, d.height, d.vgamem_mb)});
  } else if (d.kind == DisplaySpec::Kind::kVirtioGpu) {
    add({"-device", fmt::format("virtio-gpu-pci,id=video0,xres={},yres={}", d.width, d.height)});
  }
  if (spec.usb_input) {
    add({"-device", "qemu-xhci,id=xhci"});
    add({"-device", "usb-kbd,bus=xhci.0"});
    add({"-device", "usb-tablet,bus=xhci.0"});
  }
  if (spec.start_paused) a.push_back("-S");
  if (spec.incoming) add({"-incoming", "defer"});
}

}  // namespace

std::vector<std::string> qemu_argv(const QemuSpec& spec) {
  check_machine(spec);
  std::set<int> seen_fds;
  const std::set<int> fdsets = check_descriptors(spec, seen_fds);
  check_files(spec, seen_fds, fdsets);
  check_block_devices(spec, fdsets);
  std::vector<std::string> a;
  add_machine(a, spec);
  add_devices(a, spec);
  return a;
}

std::string kernel_cmdline(const CmdlineOptions& options) {
  auto bad = [](std::string_view field, std::string_view why) {
    throw Error(Code::kInvalidArgument, fmt::format("CmdlineOptions.{}: {}", field, why));
  };
  if (options.guest_mode.empty()) bad("guest_mode", "required");
  if (!all_name_chars(options.guest_mode)) {
    bad("guest_mode", fmt::format("'{}' is not [A-Za-z0-9._-]", options.guest_mode));
  }
  std::string line = "console=ttyS0 quiet loglevel=3 panic=-1 reboot=t rdinit=/init dsec_guest=" + options.guest_mode;
  if (options.accelerator == Accelerator::kTcg) {
    // Under TCG a guest may have no reliable clock to calibrate the TSC against (microvm has none): give it the rate.
    if (options.tsc_khz == 0) bad("tsc_khz", "required under TCG");
    line += fmt::format(" tsc_early_khz={} tsc=reliable", options.tsc_khz);
  }
  for (std::size_t i = 0; i < options.extra.size(); ++i) {
    const std::string& w = options.extra[i];
    std::string field = fmt::format("extra[{}]", i);
    if (w.empty()) bad(field, "is empty");
    auto eq = w.find('=');
    if (eq == 0) bad(field, fmt::format("'{}' has no key", w));
    for (std::size_t j = 0; j < w.size(); ++j) {
      unsigned char c = static_cast<unsigned char>(w[j]);
      if (c <= 0x20 || c >= 0x7f || c == '"' || c == '\'' || c == '\\') {
        bad(field, fmt::format("'{}' contains a space, quote, backslash or non-printable character", w));
      }
      // The key: letters, digits and . _ - (the kernel treats - and _ alike); no "--" (that starts init's args).
      if (j < (eq == std::string::npos ? w.size() : eq) && !is_name_char(static_cast<char>(c))) {
        bad(field, fmt::format("'{}' has a key that is not [A-Za-z0-9._-]", w));
      }
    }
    if (w[0] == '-') bad(field, fmt::format("'{}' starts with '-'", w));
    line += ' ';
    line += w;
  }
  if (line.size() > kMaxKernelCmdline) {
    bad("extra",
        fmt::format("the command line is {} bytes, the kernel takes at most {}", line.size(), kMaxKernelCmdline));
  }
  return line;
}

}  // namespace dsec::agent::qemu
