// The QEMU tiers' command-line builder (qemu/qemu_command) and QMP client (qemu/qmp).
// The client is driven first by a fake QMP server on a socketpair (greeting, capabilities, replies matched by id with
// events and late replies in between, split and merged reads, error replies, a closed socket, time-outs, fd passing),
// then against a real QEMU: "-M none" over a unix socket, and the builder's full microvm argv (paused, its block
// devices and memory as QEMU sees them, booted to the kernel's panic with the console in a file, and a snapshot saved
// and restored through -incoming defer). Tests that need qemu-system-x86_64 or a guest kernel skip and say why.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "agent/backends/qemu/qemu_command.hpp"
#include "agent/backends/qemu/qmp.hpp"
#include "agent/backends/qemu/screen.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "error_test_util.hpp"

namespace dsec::agent::qemu {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using std::chrono::milliseconds;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;

// --- helpers ---

// The index of `word` in argv (or -1), and the word after it.
long index_of(const std::vector<std::string>& argv, std::string_view word, std::size_t from = 0) {
  for (std::size_t i = from; i < argv.size(); ++i) {
    if (argv[i] == word) return static_cast<long>(i);
  }
  return -1;
}
std::string value_after(const std::vector<std::string>& argv, std::string_view flag) {
  long i = index_of(argv, flag);
  return i >= 0 && static_cast<std::size_t>(i) + 1 < argv.size() ? argv[i + 1] : std::string("<missing>");
}
// Every value given to `flag`, in order.
std::vector<std::string> values_of(const std::vector<std::string>& argv, std::string_view flag) {
  std::vector<std::string> out;
  for (std::size_t i = 0; i + 1 < argv.size(); ++i) {
    if (argv[i] == flag) out.push_back(argv[i + 1]);
  }
  return out;
}

class TempDir {
 public:
  TempDir() {
    std::string t = (fs::temp_directory_path() / "dsec-qemu-XXXXXX").string();
    if (!::mkdtemp(t.data())) throw std::runtime_error("mkdtemp");
    path_ = t;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// --- the command line ---

QemuSpec typical_spec(Accelerator accel) {
  QemuSpec s;
  s.name = "sb-1234";
  s.binary = "/usr/bin/qemu-system-x86_64";
  s.accelerator = accel;
  s.vcpus = 2;
  s.memory_bytes = (512ull << 20) - 5;  // rounds up to 512 MiB
  s.memory_path = "/proc/self/fd/7";
  s.memory_share = true;
  s.kernel = "/proc/self/fd/8";
  s.initrd = "/proc/self/fd/9";
  s.kernel_cmdline = "console=ttyS0 quiet";
  s.fds = {{10, 3}, {11, 4}, {12, 5}};
  s.block_devices = {
      {"base", "/dev/fdset/3", true, 4096, 1 << 20, "dsec-base", "raw"},
      {"scratch", "/var/lib/dsec/vm/sb-1234/scratch.img", false, 0, 0, "dsec-scratch", "raw"},
      {"img", "/dev/fdset/4", true, 0, 0, "", "qcow2"},
  };
  s.qmp_listen_fd = 13;
  s.agent_listen_fd = 14;
  s.console_path = "/dev/fdset/5";
  s.balloon = true;
  return s;
}

// A VM as the microvm backend starts one (vm_instance.cpp: guest RAM, kernel and initramfs as /proc/self/fd paths,
// the sockets, the console and every disk in fd sets, no balloon), under TCG.
QemuSpec microvm_backend_spec() {
  QemuSpec s;
  s.name = "sb-0123456789abcdef";
  s.binary = "/usr/bin/qemu-system-x86_64";
  s.accelerator = Accelerator::kTcg;
  s.vcpus = 2;
  s.memory_bytes = 256ull << 20;
  s.memory_path = "/proc/self/fd/3";
  s.kernel = "/proc/self/fd/4";
  s.initrd = "/proc/self/fd/5";
  s.qmp_listen_fd = 6;
  s.agent_listen_fd = 7;
  s.fds = {{8, 1}, {9, 2}, {10, 3}, {11, 4}};
  s.console_path = "/dev/fdset/1";
  s.block_devices = {{"layer0", "/dev/fdset/2", true, 0, 0, "dsec-layer-0", "raw"},
                     {"layer0data", "/dev/fdset/3", true, 0, 0, "dsec-data-0", "raw"},
                     {"disk", "/dev/fdset/4", false, 0, 0, "dsec-disk", "raw"}};
  s.balloon = false;
  CmdlineOptions c;
  c.guest_mode = "1";
  c.accelerator = Accelerator::kTcg;
  c.tsc_khz = 2445453;
  s.kernel_cmdline = kernel_cmdline(c);
  return s;
}

// The microvm argv word for word, as it was before the q35 machine, screens and USB input existed: a change here
// changes every microVM (and a template or saved VM restores only into the same devices).
const std::vector<std::string> kMicrovmBackendArgv = {
    "/usr/bin/qemu-system-x86_64",
    "-name",
    "sb-0123456789abcdef,debug-threads=on",
    "-nodefaults",
    "-no-user-config",
    "-nographic",
    "-display",
    "none",
    "-no-reboot",
    "-sandbox",
    "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny",
    "-machine",
    "microvm,x-option-roms=off,pic=off,isa-serial=on,rtc=on,acpi=on,memory-backend=ram",
    "-accel",
    "tcg,tb-size=32",
    "-cpu",
    "max",
    "-smp",
    "2",
    "-m",
    "256M",
    "-object",
    "memory-backend-file,id=ram,size=256M,mem-path=/proc/self/fd/3,share=on",
    "-kernel",
    "/proc/self/fd/4",
    "-initrd",
    "/proc/self/fd/5",
    "-append",
    "console=ttyS0 quiet loglevel=3 panic=-1 reboot=t rdinit=/init dsec_guest=1 tsc_early_khz=2445453 "
    "tsc=reliable",
    "-add-fd",
    "fd=8,set=1",
    "-add-fd",
    "fd=9,set=2",
    "-add-fd",
    "fd=10,set=3",
    "-add-fd",
    "fd=11,set=4",
    "-chardev",
    "socket,id=qmp,fd=6,server=on,wait=off",
    "-mon",
    "chardev=qmp,mode=control",
    "-chardev",
    "file,id=console,path=/dev/fdset/1,append=on",
    "-serial",
    "chardev:console",
    "-device",
    "virtio-serial-device,max_ports=2",
    "-chardev",
    "socket,id=agent,fd=7,server=on,wait=off",
    "-device",
    "virtserialport,chardev=agent,name=dsec.agent",
    "-blockdev",
    "driver=raw,node-name=layer0,read-only=on,file.driver=file,file.filename=/dev/fdset/2,"
    "file.locking=off",
    "-device",
    "virtio-blk-device,drive=layer0,serial=dsec-layer-0",
    "-blockdev",
    "driver=raw,node-name=layer0data,read-only=on,file.driver=file,file.filename=/dev/fdset/3,"
    "file.locking=off",
    "-device",
    "virtio-blk-device,drive=layer0data,serial=dsec-data-0",
    "-blockdev",
    "driver=raw,node-name=disk,discard=unmap,detect-zeroes=unmap,file.driver=file,"
    "file.filename=/dev/fdset/4,file.locking=off",
    "-device",
    "virtio-blk-device,drive=disk,serial=dsec-disk"};

TEST(QemuCommand, MicrovmArgvIsUnchanged) {
  EXPECT_EQ(qemu_argv(microvm_backend_spec()), kMicrovmBackendArgv);
  // Spelled out, the defaults are the microvm machine without a screen or USB.
  QemuSpec explicit_spec = microvm_backend_spec();
  explicit_spec.machine = Machine::kMicrovm;
  explicit_spec.display = DisplaySpec{DisplaySpec::Kind::kNone, 1920, 1080, 64};
  explicit_spec.usb_input = false;
  EXPECT_EQ(qemu_argv(explicit_spec), kMicrovmBackendArgv);
}

// q35 without a screen: the microvm argv but for the machine line and the virtio devices' bus (PCI).
TEST(QemuCommand, Q35IsTheMicrovmArgvOnPci) {
  QemuSpec s = microvm_backend_spec();
  s.machine = Machine::kQ35;
  s.balloon = true;
  std::vector<std::string> want = kMicrovmBackendArgv;
  for (auto& w : want) {
    if (w.starts_with("microvm,")) w = "q35,memory-backend=ram,smm=off,vmport=off,i8042=off";
    for (const char* dev : {"virtio-serial", "virtio-blk"}) {
      if (w.starts_with(std::string(dev) + "-device")) w = std::string(dev) + "-pci" + w.substr(strlen(dev) + 7);
    }
  }
  want.insert(want.end(), {"-device", "virtio-balloon-pci,free-page-reporting=on"});
  EXPECT_EQ(qemu_argv(s), want);
  auto argv = qemu_argv(s);
  EXPECT_GE(index_of(argv, "-nographic"), 0);
  EXPECT_EQ(index_of(argv, "-vnc"), -1);
}

TEST(QemuCommand, Q35ScreensAndUsbInput) {
  QemuSpec s = microvm_backend_spec();
  s.machine = Machine::kQ35;
  s.display = {DisplaySpec::Kind::kVga, 1280, 800, 16};
  s.usb_input = true;
  s.start_paused = true;
  auto argv = qemu_argv(s);
  // A screen: no -nographic, no window and no VNC server of QEMU's own; viewers handed to it give a password.
  EXPECT_EQ(index_of(argv, "-nographic"), -1);
  EXPECT_EQ(std::vector<std::string>(argv.begin() + 3, argv.begin() + 10),
            (std::vector<std::string>{"-nodefaults", "-no-user-config", "-display", "none", "-vnc", "none,password=on",
                                      "-no-reboot"}));
  EXPECT_EQ(value_after(argv, "-machine"), "q35,memory-backend=ram,smm=off,vmport=off,i8042=off");
  // The screen and the USB devices come after the disks, before -S.
  std::vector<std::string> devices = values_of(argv, "-device");
  ASSERT_GE(devices.size(), 4u);
  EXPECT_THAT(std::vector<std::string>(devices.end() - 4, devices.end()),
              ElementsAre("VGA,id=video0,xres=1280,yres=800,vgamem_mb=16", "qemu-xhci,id=xhci", "usb-kbd,bus=xhci.0",
                          "usb-tablet,bus=xhci.0"));
  EXPECT_EQ(argv.back(), "-S");

  s.display = {DisplaySpec::Kind::kVirtioGpu, 1920, 1080, 16};
  s.usb_input = false;
  argv = qemu_argv(s);
  EXPECT_EQ(values_of(argv, "-device").back(), "virtio-gpu-pci,id=video0,xres=1920,yres=1080");
  EXPECT_EQ(value_after(argv, "-vnc"), "none,password=on");
  for (const auto& d : values_of(argv, "-device")) EXPECT_THAT(d, ::testing::Not(HasSubstr("usb")));

  // USB input without a screen (a keyboard for a headless guest) keeps -nographic.
  s.display = {};
  s.usb_input = true;
  argv = qemu_argv(s);
  EXPECT_GE(index_of(argv, "-nographic"), 0);
  EXPECT_THAT(values_of(argv, "-device"), ::testing::Contains("usb-tablet,bus=xhci.0"));
}

TEST(QemuCommand, ScreenValidationNamesTheField) {
  struct Case {
    const char* field;
    void (*mutate)(QemuSpec&);
  };
  const Case cases[] = {
      // microvm has no PCI: no screen, no xHCI.
      {"display", [](QemuSpec& s) { s.machine = Machine::kMicrovm, s.display.kind = DisplaySpec::Kind::kVga; }},
      {"display", [](QemuSpec& s) { s.machine = Machine::kMicrovm, s.display.kind = DisplaySpec::Kind::kVirtioGpu; }},
      {"usb_input", [](QemuSpec& s) { s.machine = Machine::kMicrovm, s.display = {}, s.usb_input = true; }},
      {"display.width", [](QemuSpec& s) { s.display.width = 0; }},
      {"display.height", [](QemuSpec& s) { s.display.height = 20000; }},
      {"display.vgamem_mb", [](QemuSpec& s) { s.display.vgamem_mb = 0; }},
      {"display.vgamem_mb", [](QemuSpec& s) { s.display.vgamem_mb = 24; }},
      {"display.vgamem_mb", [](QemuSpec& s) { s.display.vgamem_mb = 1024; }},
      // 1920 x 1080 x 4 bytes is more than 4 MiB.
      {"display.vgamem_mb",
       [](QemuSpec& s) {
         s.display = {DisplaySpec::Kind::kVga, 1920, 1080, 4};
       }},
  };
  for (const Case& c : cases) {
    QemuSpec s = microvm_backend_spec();
    s.machine = Machine::kQ35;
    s.display = {DisplaySpec::Kind::kVga, 1024, 768, 16};
    c.mutate(s);
    EXPECT_CODE_MSG(qemu_argv(s), Code::kInvalidArgument, fmt::format("QemuSpec.{}:", c.field)) << c.field;
  }
  // virtio-gpu has no vgamem_mb: whatever it says is not checked.
  QemuSpec gpu = microvm_backend_spec();
  gpu.machine = Machine::kQ35;
  gpu.display = {DisplaySpec::Kind::kVirtioGpu, 3840, 2160, 0};
  EXPECT_CODE(qemu_argv(gpu), Code::kOk);
}

TEST(QemuCommand, TypicalTcgArgv) {
  auto argv = qemu_argv(typical_spec(Accelerator::kTcg));
  ASSERT_FALSE(argv.empty());
  EXPECT_EQ(argv[0], "/usr/bin/qemu-system-x86_64");
  EXPECT_EQ(value_after(argv, "-name"), "sb-1234,debug-threads=on");
  for (const char* flag : {"-nodefaults", "-no-user-config", "-nographic", "-no-reboot"}) {
    EXPECT_GE(index_of(argv, flag), 0) << flag;
  }
  EXPECT_EQ(value_after(argv, "-display"), "none");
  EXPECT_EQ(value_after(argv, "-sandbox"), "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny");
  EXPECT_EQ(value_after(argv, "-machine"),
            "microvm,x-option-roms=off,pic=off,isa-serial=on,rtc=on,acpi=on,memory-backend=ram");
  EXPECT_EQ(value_after(argv, "-accel"), "tcg,tb-size=32");
  EXPECT_EQ(value_after(argv, "-cpu"), "max");
  EXPECT_EQ(value_after(argv, "-smp"), "2");
  EXPECT_EQ(value_after(argv, "-m"), "512M");
  EXPECT_EQ(value_after(argv, "-object"), "memory-backend-file,id=ram,size=512M,mem-path=/proc/self/fd/7,share=on");
  EXPECT_EQ(value_after(argv, "-kernel"), "/proc/self/fd/8");
  EXPECT_EQ(value_after(argv, "-initrd"), "/proc/self/fd/9");
  EXPECT_EQ(value_after(argv, "-append"), "console=ttyS0 quiet");
  EXPECT_THAT(values_of(argv, "-add-fd"), ElementsAre("fd=10,set=3", "fd=11,set=4", "fd=12,set=5"));
  EXPECT_THAT(values_of(argv, "-chardev"),
              ElementsAre("socket,id=qmp,fd=13,server=on,wait=off", "file,id=console,path=/dev/fdset/5,append=on",
                          "socket,id=agent,fd=14,server=on,wait=off"));
  EXPECT_EQ(value_after(argv, "-mon"), "chardev=qmp,mode=control");
  EXPECT_EQ(value_after(argv, "-serial"), "chardev:console");
  EXPECT_THAT(values_of(argv, "-blockdev"),
              ElementsAre("driver=raw,node-name=base,offset=4096,size=1048576,read-only=on,file.driver=file,"
                          "file.filename=/dev/fdset/3,file.locking=off",
                          "driver=raw,node-name=scratch,discard=unmap,detect-zeroes=unmap,file.driver=file,"
                          "file.filename=/var/lib/dsec/vm/sb-1234/scratch.img,file.locking=off",
                          "driver=qcow2,node-name=img,read-only=on,file.driver=file,file.filename=/dev/fdset/4,"
                          "file.locking=off"));
  EXPECT_THAT(values_of(argv, "-device"),
              ElementsAre("virtio-serial-device,max_ports=2", "virtserialport,chardev=agent,name=dsec.agent",
                          "virtio-blk-device,drive=base,serial=dsec-base",
                          "virtio-blk-device,drive=scratch,serial=dsec-scratch", "virtio-blk-device,drive=img",
                          "virtio-balloon-device,free-page-reporting=on"));
  EXPECT_EQ(index_of(argv, "-S"), -1);
  EXPECT_EQ(index_of(argv, "-incoming"), -1);
  EXPECT_EQ(index_of(argv, "-pidfile"), -1);
  // Every -add-fd comes before the first use of /dev/fdset.
  EXPECT_LT(index_of(argv, "-add-fd"), index_of(argv, "-chardev"));
}

TEST(QemuCommand, TypicalKvmArgvAndOptions) {
  QemuSpec s = typical_spec(Accelerator::kKvm);
  s.memory_share = false;
  s.balloon = false;
  s.start_paused = true;
  s.incoming = true;
  s.initrd.clear();
  s.agent_listen_fd = -1;
  s.console_path.clear();
  s.console_ringbuf_bytes = 1 << 16;
  auto argv = qemu_argv(s);
  EXPECT_EQ(value_after(argv, "-accel"), "kvm");
  EXPECT_EQ(value_after(argv, "-cpu"), "host");
  EXPECT_EQ(value_after(argv, "-object"), "memory-backend-file,id=ram,size=512M,mem-path=/proc/self/fd/7,share=off");
  EXPECT_EQ(index_of(argv, "-initrd"), -1);
  EXPECT_GE(index_of(argv, "-S"), 0);
  EXPECT_EQ(value_after(argv, "-incoming"), "defer");
  EXPECT_THAT(values_of(argv, "-chardev"),
              ElementsAre("socket,id=qmp,fd=13,server=on,wait=off", "ringbuf,id=console,size=65536"));
  EXPECT_EQ(value_after(argv, "-serial"), "chardev:console");
  for (const auto& d : values_of(argv, "-device")) {
    EXPECT_THAT(d, ::testing::Not(HasSubstr("balloon")));
    EXPECT_THAT(d, ::testing::Not(HasSubstr("virtserialport")));
  }
  for (const auto& w : argv) EXPECT_THAT(w, ::testing::Not(HasSubstr("kvm:tcg")));

  s.cpu_model = "Skylake-Server";
  s.console_ringbuf_bytes = 0;  // no console at all
  argv = qemu_argv(s);
  EXPECT_EQ(value_after(argv, "-cpu"), "Skylake-Server");
  EXPECT_EQ(index_of(argv, "-serial"), -1);

  QemuSpec t = typical_spec(Accelerator::kTcg);
  t.tcg_tb_size_mib = 256;
  t.memory_bytes = 1;  // one byte is a MiB
  argv = qemu_argv(t);
  EXPECT_EQ(value_after(argv, "-accel"), "tcg,tb-size=256");
  EXPECT_EQ(value_after(argv, "-m"), "1M");
}

TEST(QemuCommand, CommasInValuesAreDoubled) {
  EXPECT_EQ(qemu_opt_escape("a,b,,c"), "a,,b,,,,c");
  EXPECT_EQ(qemu_opt_escape("plain=x"), "plain=x");
  QemuSpec s = typical_spec(Accelerator::kTcg);
  s.name = "sb,1";
  s.memory_path = "/run/dsec/ram,1";
  s.console_path = "/var/log/dsec/con,sole.log";
  s.kernel = "/boot/vmlinux,1";  // -kernel, -append are not split at commas: left alone
  s.kernel_cmdline = "a=1,2";
  s.block_devices = {{"d", "/img/a,b.raw", false, 0, 0, "", "raw"}};
  auto argv = qemu_argv(s);
  EXPECT_EQ(value_after(argv, "-name"), "sb,,1,debug-threads=on");
  EXPECT_EQ(value_after(argv, "-object"), "memory-backend-file,id=ram,size=512M,mem-path=/run/dsec/ram,,1,share=on");
  EXPECT_THAT(values_of(argv, "-chardev"),
              ::testing::Contains("file,id=console,path=/var/log/dsec/con,,sole.log,append=on"));
  EXPECT_EQ(value_after(argv, "-kernel"), "/boot/vmlinux,1");
  EXPECT_EQ(value_after(argv, "-append"), "a=1,2");
  EXPECT_THAT(value_after(argv, "-blockdev"), HasSubstr("file.filename=/img/a,,b.raw,file.locking=off"));
}

TEST(QemuCommand, ValidationNamesTheField) {
  struct Case {
    const char* field;
    void (*mutate)(QemuSpec&);
  };
  const Case cases[] = {
      {"vcpus", [](QemuSpec& s) { s.vcpus = 0; }},
      {"vcpus", [](QemuSpec& s) { s.vcpus = 1000; }},
      {"memory_bytes", [](QemuSpec& s) { s.memory_bytes = 0; }},
      {"name", [](QemuSpec& s) { s.name.clear(); }},
      {"binary", [](QemuSpec& s) { s.binary.clear(); }},
      {"tcg_tb_size_mib", [](QemuSpec& s) { s.tcg_tb_size_mib = 0; }},
      {"memory_path", [](QemuSpec& s) { s.memory_path = "/dev/fdset/3"; }},
      {"memory_path", [](QemuSpec& s) { s.memory_path = "/tmp/ram\nx"; }},
      {"kernel", [](QemuSpec& s) { s.kernel.clear(); }},
      {"initrd", [](QemuSpec& s) { s.initrd = "/dev/fdset/4"; }},
      {"kernel_cmdline", [](QemuSpec& s) { s.kernel_cmdline = "a\nb"; }},
      {"kernel_cmdline", [](QemuSpec& s) { s.kernel_cmdline = std::string(3000, 'x'); }},
      {"qmp_listen_fd", [](QemuSpec& s) { s.qmp_listen_fd = -1; }},
      {"qmp_listen_fd", [](QemuSpec& s) { s.qmp_listen_fd = 2; }},
      {"agent_listen_fd", [](QemuSpec& s) { s.agent_listen_fd = 13; }},  // the QMP socket's
      {"fds[1].fd", [](QemuSpec& s) { s.fds[1].fd = 10; }},
      {"fds[0].fdset_id", [](QemuSpec& s) { s.fds[0].fdset_id = -1; }},
      {"console_path", [](QemuSpec& s) { s.console_path = "/dev/fdset/9"; }},  // not among fds
      {"console_path", [](QemuSpec& s) { s.console_ringbuf_bytes = 4096; }},
      {"console_ringbuf_bytes", [](QemuSpec& s) { s.console_path.clear(), s.console_ringbuf_bytes = 1000; }},
      {"cpu_model", [](QemuSpec& s) { s.cpu_model = "max,+avx512f"; }},
      // A descriptor QEMU takes in another role cannot be re-opened through /proc/self/fd (-add-fd closes it).
      {"console_path", [](QemuSpec& s) { s.console_path = "/proc/self/fd/12"; }},
      {"memory_path", [](QemuSpec& s) { s.memory_path = "/proc/self/fd/13"; }},
      {"kernel", [](QemuSpec& s) { s.kernel = "/proc/self/fd/10"; }},
      {"block_devices[1].filename", [](QemuSpec& s) { s.block_devices[1].filename = "/proc/self/fd/14"; }},
      {"block_devices[1].filename", [](QemuSpec& s) { s.block_devices[1].filename = "/img/a\nb"; }},
      {"block_devices[1].filename", [](QemuSpec& s) { s.block_devices[1].filename = "/dev/fdset/x"; }},
      {"block_devices[0].node_name", [](QemuSpec& s) { s.block_devices[0].node_name = "1base"; }},
      {"block_devices[0].node_name", [](QemuSpec& s) { s.block_devices[0].node_name = "a,b"; }},
      {"block_devices[2].node_name", [](QemuSpec& s) { s.block_devices[2].node_name = "base"; }},
      {"block_devices[1].format", [](QemuSpec& s) { s.block_devices[1].format = "vmdk"; }},
      {"block_devices[2].offset", [](QemuSpec& s) { s.block_devices[2].offset = 512; }},
      {"block_devices[0].serial", [](QemuSpec& s) { s.block_devices[0].serial = "has,comma"; }},
      {"block_devices[0].serial", [](QemuSpec& s) { s.block_devices[0].serial = std::string(21, 's'); }},
      {"block_devices[1].serial", [](QemuSpec& s) { s.block_devices[1].serial = "dsec-base"; }},
  };
  for (const Case& c : cases) {
    QemuSpec s = typical_spec(Accelerator::kTcg);
    c.mutate(s);
    EXPECT_CODE_MSG(qemu_argv(s), Code::kInvalidArgument, fmt::format("QemuSpec.{}:", c.field)) << c.field;
  }
  QemuSpec ok = typical_spec(Accelerator::kTcg);
  EXPECT_CODE(qemu_argv(ok), Code::kOk);
}

TEST(QemuCmdline, DsecWordsTcgClockAndExtras) {
  CmdlineOptions pid1;
  pid1.guest_mode = "1";
  EXPECT_EQ(kernel_cmdline(pid1), "console=ttyS0 quiet loglevel=3 panic=-1 reboot=t rdinit=/init dsec_guest=1");
  CmdlineOptions tcg;
  tcg.guest_mode = "1";
  tcg.accelerator = Accelerator::kTcg;
  tcg.tsc_khz = 2445453;
  tcg.extra = {"dsec.vsock=0", "nokaslr", "loglevel=7"};
  EXPECT_EQ(kernel_cmdline(tcg),
            "console=ttyS0 quiet loglevel=3 panic=-1 reboot=t rdinit=/init dsec_guest=1 tsc_early_khz=2445453 "
            "tsc=reliable dsec.vsock=0 nokaslr loglevel=7");

  CmdlineOptions no_tsc;
  no_tsc.guest_mode = "1";
  no_tsc.accelerator = Accelerator::kTcg;
  EXPECT_CODE_MSG(kernel_cmdline(no_tsc), Code::kInvalidArgument, "tsc_khz");

  for (std::string bad : {"a b", "a=\"b\"", "x='1'", "", "=v", "-- init", "--", "k=v\n", "a\\b", "ke;y=1", "k=\x7f"}) {
    CmdlineOptions o;
    o.guest_mode = "1";
    o.extra = {"ok=1", bad};
    EXPECT_CODE_MSG(kernel_cmdline(o), Code::kInvalidArgument, "extra[1]") << "'" << bad << "'";
  }
  CmdlineOptions too_long;
  too_long.guest_mode = "1";
  too_long.extra = {"x=" + std::string(2100, 'y')};
  EXPECT_CODE(kernel_cmdline(too_long), Code::kInvalidArgument);
}

// dsec_guest= says which life dsec-init leads: the mode is the caller's, checked like a parameter's name.
TEST(QemuCmdline, GuestModeIsRequiredAndChecked) {
  CmdlineOptions boot;
  boot.guest_mode = "boot";
  boot.extra = {"console=tty0"};
  EXPECT_EQ(kernel_cmdline(boot),
            "console=ttyS0 quiet loglevel=3 panic=-1 reboot=t rdinit=/init dsec_guest=boot console=tty0");
  EXPECT_CODE_MSG(kernel_cmdline({}), Code::kInvalidArgument, "CmdlineOptions.guest_mode: required");
  for (std::string bad : {"a b", "1 init=/bin/sh", "x=y", "b\\oot", "boot\n", "\"1\""}) {
    CmdlineOptions o;
    o.guest_mode = bad;
    EXPECT_CODE_MSG(kernel_cmdline(o), Code::kInvalidArgument, "CmdlineOptions.guest_mode") << "'" << bad << "'";
  }
}

// --- the QMP client against a fake server ---

constexpr std::string_view kGreeting =
    R"({"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7}, "package": ""}, "capabilities": ["oob"]}})"
    "\r\n";

// The server's end of a socketpair, speaking QMP by hand.
class FakeQmp {
 public:
  FakeQmp() {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) throw std::runtime_error("socketpair");
    client_end_ = UniqueFd(sv[0]);
    server_ = UniqueFd(sv[1]);
  }
  UniqueFd take_client_end() { return std::move(client_end_); }

  void send(std::string_view data) {
    while (!data.empty()) {
      ssize_t n = ::send(server_.get(), data.data(), data.size(), MSG_NOSIGNAL);
      if (n <= 0) throw std::runtime_error("fake qmp: send");
      data.remove_prefix(static_cast<std::size_t>(n));
    }
  }
  // Greeting and the reply to qmp_capabilities (always id 1), so the client's constructor returns at once.
  void script_handshake() {
    send(kGreeting);
    send(R"({"return": {}, "id": 1})"
         "\r\n");
  }
  // The next request the client sent, with any fds that came with it.
  json read_request(std::vector<UniqueFd>* fds = nullptr) {
    for (;;) {
      auto nl = in_.find('\n');
      if (nl != std::string::npos) {
        std::string line = in_.substr(0, nl);
        in_.erase(0, nl + 1);
        return json::parse(line);
      }
      pollfd p{server_.get(), POLLIN, 0};
      if (::poll(&p, 1, 5000) != 1) throw std::runtime_error("fake qmp: no request");
      char buf[4096];
      alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 8)];
      iovec iov{buf, sizeof buf};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      ssize_t n = ::recvmsg(server_.get(), &msg, MSG_CMSG_CLOEXEC);
      if (n <= 0) throw std::runtime_error("fake qmp: client closed");
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
          if (fds) fds->emplace_back(fd);
          else ::close(fd);
        }
      }
      in_.append(buf, static_cast<std::size_t>(n));
    }
  }
  void close() { server_.reset(); }
  // Wakes a thread blocked in read_request (it then throws) without closing the descriptor under it.
  void hang_up() { ::shutdown(server_.get(), SHUT_RDWR); }

 private:
  UniqueFd client_end_;
  UniqueFd server_;
  std::string in_;
};

std::string reply(std::uint64_t id, const json& value) { return json{{"return", value}, {"id", id}}.dump() + "\r\n"; }
std::string event(std::string_view name) {
  return json{{"event", name}, {"timestamp", {{"seconds", 1}, {"microseconds", 2}}}, {"data", json::object()}}.dump() +
         "\r\n";
}
std::vector<std::string> names(const std::vector<json>& events) {
  std::vector<std::string> out;
  for (const auto& e : events) out.push_back(e.value("event", "?"));
  return out;
}

Clock::time_point soon() { return Clock::now() + std::chrono::seconds(5); }

TEST(QemuQmpFake, GreetingAndCapabilities) {
  FakeQmp server;
  server.script_handshake();
  QmpClient qmp(server.take_client_end(), soon());
  EXPECT_EQ(qmp.greeting()["version"]["qemu"]["major"], 7);
  json caps = server.read_request();
  EXPECT_EQ(caps, (json{{"execute", "qmp_capabilities"}, {"id", 1}}));  // no "arguments" when there are none
  EXPECT_GE(qmp.fd(), 0);

  server.send(reply(2, {{"status", "prelaunch"}, {"running", false}}));
  EXPECT_EQ(qmp_status(qmp), "prelaunch");
  EXPECT_EQ(server.read_request(), (json{{"execute", "query-status"}, {"id", 2}}));

  server.send(reply(3, json::object()));
  qmp.execute("device_del", {{"id", "blk1"}});
  EXPECT_EQ(server.read_request(), (json{{"execute", "device_del"}, {"id", 3}, {"arguments", {{"id", "blk1"}}}}));
}

TEST(QemuQmpFake, RepliesMatchedByIdWithEventsAndLateRepliesBetween) {
  FakeQmp server;
  server.script_handshake();
  QmpClient qmp(server.take_client_end(), soon());
  // All in one write: an event, a late reply to an earlier request, another event, ours, and an event after it.
  server.send(event("STOP") + reply(99, "stale") + event("RESUME") + reply(2, {{"answer", 42}}) + event("BLOCK_JOB"));
  EXPECT_EQ(qmp.execute("query-answer"), (json{{"answer", 42}}));
  EXPECT_THAT(names(qmp.take_events()), ElementsAre("STOP", "RESUME", "BLOCK_JOB"));
  EXPECT_TRUE(qmp.take_events().empty());

  // Separate reads: a reply with an old id (ours is 3 now), an event, then ours.
  std::thread t([&] {
    server.send(reply(2, "old"));  // id 2 again: not ours (we are 3)
    std::this_thread::sleep_for(milliseconds(20));
    server.send(event("SHUTDOWN"));
    std::this_thread::sleep_for(milliseconds(20));
    server.send(reply(3, "mine"));
  });
  EXPECT_EQ(qmp.execute("x"), "mine");
  t.join();
  EXPECT_EQ(qmp.wait_event("SHUTDOWN", milliseconds(0))["event"], "SHUTDOWN");
}

TEST(QemuQmpFake, MessagesSplitAcrossReadsAndBareNewlines) {
  FakeQmp server;
  server.script_handshake();
  QmpClient qmp(server.take_client_end(), soon());
  std::string data =
      event("A") + "\n" + R"({"id": 2, "return": {"s": "split, {braces} and \"quotes\"\n"}})" + "\n" + event("B");
  data.erase(std::remove(data.begin(), data.end(), '\r'), data.end());  // "\n" alone ends a message too
  std::thread t([&] {
    for (char c : data) {
      server.send(std::string_view(&c, 1));
      if (c == ',' || c == ':') std::this_thread::sleep_for(milliseconds(1));
    }
  });
  EXPECT_EQ(qmp.execute("x")["s"], "split, {braces} and \"quotes\"\n");
  t.join();
  EXPECT_EQ(qmp.wait_event("B", milliseconds(1000))["event"], "B");
  EXPECT_THAT(names(qmp.take_events()), ElementsAre("A"));
}

TEST(QemuQmpFake, ErrorRepliesBecomeCodes) {
  FakeQmp server;
  server.script_handshake();
  QmpClient qmp(server.take_client_end(), soon());
  server.send(R"({"id": 2, "error": {"class": "DeviceNotFound", "desc": "Device 'blk9' not found"}})"
              "\r\n");
  try {
    qmp.execute("device_del", {{"id", "blk9"}});
    FAIL() << "no error";
  } catch (const QmpError& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
    EXPECT_EQ(e.error_class(), "DeviceNotFound");
    EXPECT_THAT(e.what(), HasSubstr("Device 'blk9' not found"));
    EXPECT_THAT(e.what(), HasSubstr("device_del"));
  }
  server.send(R"({"id": 3, "error": {"class": "GenericError", "desc": "Parameter 'uri' is missing"}})"
              "\r\n");
  EXPECT_CODE_MSG(qmp.execute("migrate"), Code::kFailedPrecondition, "Parameter 'uri' is missing");
  server.send(R"({"id": 4, "error": {"class": "CommandNotFound", "desc": "The command x has not been found"}})"
              "\r\n");
  EXPECT_CODE(qmp.execute("x"), Code::kNotFound);
  // An error without an id (QEMU could not parse the request) answers the request in flight.
  server.send(R"({"error": {"class": "GenericError", "desc": "JSON parse error"}})"
              "\r\n");
  EXPECT_CODE_MSG(qmp.execute("y"), Code::kFailedPrecondition, "JSON parse error");
  EXPECT_EQ(code_for_qmp_error_class("KVMMissingCap"), Code::kFailedPrecondition);
  EXPECT_EQ(code_for_qmp_error_class("SomethingNew"), Code::kFailedPrecondition);
  // Still in step afterwards.
  server.send(reply(6, 1));
  EXPECT_EQ(qmp.execute("z"), 1);
  EXPECT_CODE(qmp.execute("w", json::array()), Code::kInvalidArgument);
  EXPECT_CODE(qmp.execute(""), Code::kInvalidArgument);
}

TEST(QemuQmpFake, ClosedSocketIsUnavailableButQueuedEventsRemain) {
  // QEMU answers, then goes away (as after "quit"): the answer and what came before it are read.
  {
    FakeQmp server;
    server.script_handshake();
    QmpClient qmp(server.take_client_end(), soon());
    std::thread t([&] {
      server.read_request();  // qmp_capabilities
      server.read_request();  // quit
      server.send(event("SHUTDOWN") + reply(2, "last words"));
      server.close();
    });
    EXPECT_EQ(qmp.execute("quit"), "last words");
    t.join();
    EXPECT_CODE_MSG(qmp.execute("query-status"), Code::kUnavailable, "quer");
    EXPECT_CODE(qmp.execute("query-status"), Code::kUnavailable);  // and stays so
    EXPECT_EQ(qmp.wait_event("SHUTDOWN", milliseconds(10))["event"], "SHUTDOWN");
    EXPECT_CODE_MSG(qmp.wait_event("RESET", milliseconds(10)), Code::kUnavailable, "closed");
    EXPECT_TRUE(qmp.take_events().empty());
  }
  // QEMU dies with the request unread (the send fails, or the read is reset): UNAVAILABLE, yet the events it had
  // sent are still there to take.
  {
    FakeQmp server;
    server.script_handshake();
    QmpClient qmp(server.take_client_end(), soon());
    server.send(event("GUEST_PANICKED") + event("SHUTDOWN"));
    server.close();
    EXPECT_CODE(qmp.execute("query-status"), Code::kUnavailable);
    EXPECT_EQ(qmp.wait_event("SHUTDOWN", milliseconds(10))["event"], "SHUTDOWN");
    EXPECT_THAT(names(qmp.take_events()), ElementsAre("GUEST_PANICKED"));
    EXPECT_CODE(qmp.wait_event("RESET", milliseconds(10)), Code::kUnavailable);
  }

  // Closed before the greeting.
  FakeQmp early;
  early.close();
  EXPECT_CODE(QmpClient(early.take_client_end(), soon()), Code::kUnavailable);
}

TEST(QemuQmpFake, TimeoutsAndLateRepliesDropped) {
  FakeQmp server;
  server.script_handshake();
  QmpClient qmp(server.take_client_end(), soon());
  auto t0 = Clock::now();
  EXPECT_CODE_MSG(qmp.execute("slow", json::object(), milliseconds(50)), Code::kDeadlineExceeded, "slow");
  auto took = Clock::now() - t0;
  EXPECT_GE(took, milliseconds(50));
  EXPECT_LT(took, milliseconds(1000));
  // The late reply to "slow" (id 2) then ours (id 3).
  server.send(reply(2, "late") + reply(3, "fresh"));
  EXPECT_EQ(qmp.execute("next"), "fresh");

  t0 = Clock::now();
  EXPECT_CODE_MSG(qmp.wait_event("NEVER", milliseconds(30)), Code::kDeadlineExceeded, "NEVER");
  EXPECT_GE(Clock::now() - t0, milliseconds(30));

  // No greeting at all.
  FakeQmp mute;
  t0 = Clock::now();
  EXPECT_CODE(QmpClient(mute.take_client_end(), Clock::now() + milliseconds(40)), Code::kDeadlineExceeded);
  EXPECT_LT(Clock::now() - t0, milliseconds(1000));
}

TEST(QemuQmpFake, WaitEventTakesQueuedThenWaits) {
  FakeQmp server;
  server.script_handshake();
  QmpClient qmp(server.take_client_end(), soon());
  server.send(event("A") + event("B") + event("A") + reply(2, json::object()));
  qmp.execute("cont");
  EXPECT_EQ(qmp.wait_event("B", milliseconds(0))["event"], "B");
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(30));
    server.send(event("C") + event("RESET"));
  });
  EXPECT_EQ(qmp.wait_event("RESET", milliseconds(2000))["event"], "RESET");
  t.join();
  EXPECT_THAT(names(qmp.take_events()), ElementsAre("A", "A", "C"));
}

TEST(QemuQmpFake, FdsTravelWithTheCommand) {
  FakeQmp server;
  server.script_handshake();
  QmpClient qmp(server.take_client_end(), soon());
  server.read_request();  // qmp_capabilities
  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd rd(p[0]), wr(p[1]);
  server.send(reply(2, json::object()));
  qmp.execute_with_fds("getfd", {{"fdname", "snap"}}, {wr.get()});
  std::vector<UniqueFd> got;
  json req = server.read_request(&got);
  EXPECT_EQ(req["execute"], "getfd");
  EXPECT_EQ(req["arguments"]["fdname"], "snap");
  ASSERT_EQ(got.size(), 1u);
  ASSERT_EQ(::write(got[0].get(), "x", 1), 1);  // the server's copy is the pipe's write end
  char c = 0;
  ASSERT_EQ(::read(rd.get(), &c, 1), 1);
  EXPECT_EQ(c, 'x');
  std::vector<int> too_many(dsec::kMaxFdsPerMessage + 1, wr.get());
  EXPECT_CODE(qmp.execute_with_fds("add-fd", json::object(), too_many), Code::kInvalidArgument);
}

TEST(QemuQmpFake, GarbageIsInternal) {
  FakeQmp server;
  server.script_handshake();
  QmpClient qmp(server.take_client_end(), soon());
  server.send("this is not json\r\n");
  EXPECT_CODE(qmp.execute("x"), Code::kInternal);
  FakeQmp wrong;
  wrong.send(reply(1, json::object()));  // a reply where the greeting should be
  EXPECT_CODE(QmpClient(wrong.take_client_end(), soon()), Code::kInternal);
}

TEST(QemuQmpFake, WaitMigration) {
  FakeQmp server;
  server.script_handshake();
  QmpClient qmp(server.take_client_end(), soon());
  server.send(reply(2, json::object()) + reply(3, {{"status", "setup"}}) + reply(4, {{"status", "active"}}) +
              event("MIGRATION") + reply(5, {{"status", "completed"}}));
  qmp_wait_migration(qmp, milliseconds(2000));
  EXPECT_THAT(names(qmp.take_events()), ElementsAre("MIGRATION"));

  server.send(reply(6, {{"status", "active"}}) + reply(7, {{"status", "failed"}, {"error-desc", "No space left"}}));
  EXPECT_CODE_MSG(qmp_wait_migration(qmp, milliseconds(2000)), Code::kInternal, "No space left");

  server.send(reply(8, {{"status", "cancelled"}}));
  EXPECT_CODE(qmp_wait_migration(qmp, milliseconds(2000)), Code::kCancelled);

  // Always active: the deadline, with the last status named. Replies for every poll, from a thread.
  std::atomic<bool> stop{false};
  std::thread t([&] {
    while (!stop) {
      try {
        json request = server.read_request();  // the unanswered ones first: their replies are stale, dropped
        server.send(reply(request["id"].get<std::uint64_t>(), {{"status", "active"}}));
      } catch (...) {
        return;
      }
    }
  });
  auto t0 = Clock::now();
  EXPECT_CODE_MSG(qmp_wait_migration(qmp, milliseconds(40)), Code::kDeadlineExceeded, "active");
  EXPECT_LT(Clock::now() - t0, milliseconds(1000));
  stop = true;
  server.hang_up();
  t.join();
}

TEST(QemuQmpConnect, RetriesUntilTheSocketListens) {
  TempDir dir;
  fs::path sock = dir.path() / "qmp.sock";
  // Nothing there until the deadline: DEADLINE_EXCEEDED naming the path.
  auto t0 = Clock::now();
  EXPECT_CODE_MSG(QmpClient::connect(sock, Clock::now() + milliseconds(30)), Code::kDeadlineExceeded, sock.string());
  EXPECT_GE(Clock::now() - t0, milliseconds(30));
  EXPECT_CODE(QmpClient::connect(dir.path() / std::string(200, 'x'), soon()), Code::kInvalidArgument);

  // The socket appears (bound, not yet listening: ECONNREFUSED; then listening) 30 ms after the client starts.
  std::thread server([&] {
    std::this_thread::sleep_for(milliseconds(30));
    UniqueFd l(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, sock.c_str());
    ASSERT_EQ(::bind(l.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    std::this_thread::sleep_for(milliseconds(20));
    ASSERT_EQ(::listen(l.get(), 1), 0);
    UniqueFd c(::accept4(l.get(), nullptr, nullptr, SOCK_CLOEXEC));
    ASSERT_TRUE(c);
    std::string hello = std::string(kGreeting) + R"({"return": {}, "id": 1})"
                                                 "\r\n";
    ASSERT_EQ(::send(c.get(), hello.data(), hello.size(), MSG_NOSIGNAL), static_cast<ssize_t>(hello.size()));
    char buf[256];
    (void)::recv(c.get(), buf, sizeof buf, 0);  // the capabilities request
  });
  QmpClient qmp = QmpClient::connect(sock, soon());
  EXPECT_EQ(qmp.greeting()["version"]["qemu"]["minor"], 2);
  server.join();
}

// --- against a real QEMU ---

std::optional<fs::path> find_qemu() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "/usr/bin:/bin");
  std::string d;
  while (std::getline(dirs, d, ':')) {
    fs::path p = fs::path(d) / "qemu-system-x86_64";
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return std::nullopt;
}

std::optional<fs::path> find_guest_kernel() {
  for (const char* p : {"/var/cache/dsec/guest-kernel/current/vmlinux"}) {
    if (::access(p, R_OK) == 0) return fs::path(p);
  }
  return std::nullopt;
}

// A QEMU process: started with argv, inheriting exactly `keep` (beyond stdio), stdout and stderr into `log`.
// Killed (SIGKILL) and reaped on destruction unless it has been waited for.
class QemuProcess {
 public:
  QemuProcess(const std::vector<std::string>& argv, const std::vector<int>& keep, const fs::path& log) : log_(log) {
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0) throw std::runtime_error("open log");
    pid_ = ::fork();
    if (pid_ == 0) {
      int devnull = ::open("/dev/null", O_RDONLY);
      ::dup2(devnull, 0);
      ::dup2(out, 1);
      ::dup2(out, 2);
      for (int fd : keep) ::fcntl(fd, F_SETFD, 0);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::close(out);
    if (pid_ < 0) throw std::runtime_error("fork");
  }
  ~QemuProcess() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  // The exit status (as waitpid's), or nullopt if it is still running after `timeout`.
  std::optional<int> wait(milliseconds timeout) {
    auto deadline = Clock::now() + timeout;
    for (;;) {
      int status = 0;
      pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) {
        pid_ = -1;
        return status;
      }
      if (Clock::now() >= deadline) return std::nullopt;
      std::this_thread::sleep_for(milliseconds(5));
    }
  }
  std::string log() const {
    std::ifstream f(log_);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }

 private:
  pid_t pid_ = -1;
  fs::path log_;
};

std::string read_file(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

UniqueFd listen_unix(const fs::path& path) {
  UniqueFd l(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (::bind(l.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(l.get(), 4) != 0) {
    throw std::runtime_error("bind/listen " + path.string());
  }
  return l;
}

UniqueFd open_fd(const fs::path& p, int flags) {
  UniqueFd fd(::open(p.c_str(), flags | O_CLOEXEC, 0644));
  if (!fd) throw std::runtime_error("open " + p.string());
  return fd;
}

TEST(QemuQmpReal, QueryStatusVersionErrorsFdsAndQuit) {
  auto qemu = find_qemu();
  if (!qemu) GTEST_SKIP() << "qemu-system-x86_64 is not installed";
  TempDir dir;
  fs::path sock = dir.path() / "qmp.sock";
  QemuProcess proc({qemu->string(), "-M", "none", "-nodefaults", "-no-user-config", "-display", "none", "-qmp",
                    fmt::format("unix:{},server=on,wait=off", sock.string())},
                   {}, dir.path() / "qemu.log");
  QmpClient qmp = QmpClient::connect(sock, Clock::now() + std::chrono::seconds(10));  // retries until QEMU listens
  EXPECT_EQ(qmp.greeting()["version"]["qemu"]["major"].get<int>(), 7) << qmp.greeting().dump();
  EXPECT_EQ(qmp_status(qmp), "running");
  json v = qmp.execute("query-version");
  EXPECT_TRUE(v.contains("qemu") && v["qemu"].contains("minor")) << v.dump();

  try {
    qmp.execute("no-such-command");
    FAIL() << "no error";
  } catch (const QmpError& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
    EXPECT_EQ(e.error_class(), "CommandNotFound");
    EXPECT_THAT(e.what(), HasSubstr("no-such-command"));
  }
  EXPECT_CODE(qmp.execute("device_del", {{"id", "nope"}}), Code::kNotFound);
  EXPECT_CODE_MSG(qmp.execute("query-status", {{"bogus", 1}}), Code::kFailedPrecondition, "bogus");

  int p[2];
  ASSERT_EQ(::pipe2(p, O_CLOEXEC), 0);
  UniqueFd rd(p[0]), wr(p[1]);
  EXPECT_EQ(qmp.execute_with_fds("getfd", {{"fdname", "probe"}}, {wr.get()}), json::object());
  EXPECT_EQ(qmp.execute("closefd", {{"fdname", "probe"}}), json::object());
  EXPECT_CODE(qmp.execute("closefd", {{"fdname", "probe"}}), Code::kFailedPrecondition);
  EXPECT_CODE(qmp.execute("getfd", {{"fdname", "nofd"}}), Code::kFailedPrecondition);

  EXPECT_EQ(qmp.execute("quit"), json::object());
  json shutdown = qmp.wait_event("SHUTDOWN", milliseconds(5000));
  EXPECT_EQ(shutdown["data"]["reason"], "host-qmp-quit");
  auto status = proc.wait(milliseconds(5000));
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << proc.log();
  EXPECT_CODE(qmp.execute("query-status", json::object(), milliseconds(2000)), Code::kUnavailable);
}

// Connects to the rig's QMP socket; when QEMU is gone instead, fails the test with what QEMU said.
QmpClient connect_or_explain(const fs::path& sock, QemuProcess& proc, const std::vector<std::string>& argv) {
  try {
    return QmpClient::connect(sock, Clock::now() + std::chrono::seconds(10));
  } catch (const Error& e) {
    proc.wait(milliseconds(2000));
    throw std::runtime_error(fmt::format("{}\nargv: {}\nqemu said: {}", e.what(), fmt::join(argv, " "), proc.log()));
  }
}

// A VM the way a backend starts one: every resource an inherited fd, the argv from qemu_argv.
struct VmRig {
  TempDir dir;
  UniqueFd ram, kernel, qmp_listen, agent_listen, console, base, img;
  std::vector<int> keep;
  QemuSpec spec;
  fs::path qmp_path, console_path;

  // `ram_fd`: guest RAM to map (the template of a clone); -1: a new memfd.
  VmRig(const fs::path& qemu, const fs::path& vmlinux, bool with_qcow2, int ram_fd = -1,
        Machine machine = Machine::kMicrovm) {
    qmp_path = dir.path() / "qmp.sock";
    console_path = dir.path() / "console.log";
    ram = UniqueFd(ram_fd >= 0 ? ::fcntl(ram_fd, F_DUPFD_CLOEXEC, 3) : ::memfd_create("dsec-ram", MFD_CLOEXEC));
    if (!ram || (ram_fd < 0 && ::ftruncate(ram.get(), 128 << 20) != 0)) throw std::runtime_error("memfd");
    kernel = open_fd(vmlinux, O_RDONLY);
    qmp_listen = listen_unix(qmp_path);
    agent_listen = listen_unix(dir.path() / "agent.sock");
    console = open_fd(console_path, O_WRONLY | O_CREAT | O_TRUNC);  // the fd set's member must be write-only
    {
      std::ofstream(dir.path() / "base.img").put('\0');
      fs::resize_file(dir.path() / "base.img", 8 << 20);
      std::ofstream(dir.path() / "scratch,1.img").put('\0');
      fs::resize_file(dir.path() / "scratch,1.img", 4 << 20);
    }
    base = open_fd(dir.path() / "base.img", O_RDONLY);  // read-only device: an O_RDONLY member

    spec.name = "sb-test,1";
    spec.binary = qemu.string();
    spec.machine = machine;
    spec.accelerator = Accelerator::kTcg;
    spec.vcpus = 1;
    spec.memory_bytes = 128 << 20;
    spec.memory_path = fmt::format("/proc/self/fd/{}", ram.get());
    spec.kernel = fmt::format("/proc/self/fd/{}", kernel.get());
    CmdlineOptions cmdline;
    cmdline.guest_mode = "1";
    cmdline.accelerator = Accelerator::kTcg;
    cmdline.tsc_khz = 2000000;
    cmdline.extra = {"loglevel=7"};  // overrides dsec's loglevel=3: the boot shows on the console
    spec.kernel_cmdline = kernel_cmdline(cmdline);
    spec.fds = {{base.get(), 3}, {console.get(), 4}};
    spec.block_devices = {{"base", "/dev/fdset/3", true, 1 << 20, 4 << 20, "dsec-base", "raw"},
                          {"scratch", (dir.path() / "scratch,1.img").string(), false, 0, 0, "dsec-scratch", "raw"}};
    if (with_qcow2) {
      fs::path q = dir.path() / "img.qcow2";
      std::string cmd = fmt::format("qemu-img create -q -f qcow2 '{}' 16M", q.string());
      if (std::system(cmd.c_str()) == 0) {
        img = open_fd(q, O_RDONLY);
        spec.fds.push_back({img.get(), 5});
        spec.block_devices.push_back({"img", "/dev/fdset/5", true, 0, 0, "", "qcow2"});
      }
    }
    spec.qmp_listen_fd = qmp_listen.get();
    spec.agent_listen_fd = agent_listen.get();
    spec.console_path = "/dev/fdset/4";
    spec.balloon = true;
    keep = {ram.get(), kernel.get(), qmp_listen.get(), agent_listen.get(), console.get(), base.get()};
    if (img) keep.push_back(img.get());
  }
  // Starts QEMU on qemu_argv(spec) and connects to its QMP (failing the test with what QEMU said when it cannot).
  // After the spawn the parent's copies of the listening sockets go: a connection to a dead QEMU then fails instead
  // of waiting forever.
  QmpClient start() {
    std::vector<std::string> argv = qemu_argv(spec);
    proc.emplace(argv, keep, dir.path() / "qemu.log");
    qmp_listen.reset();
    agent_listen.reset();
    return connect_or_explain(qmp_path, *proc, argv);
  }

  std::optional<QemuProcess> proc;  // last: killed before the directory goes
};

// Lets the rig's paused guest run to its kernel's panic (with no initrd it panics at once: panic=-1, reboot=t) and
// -no-reboot end QEMU; the console, which went to the file through the fd set, is returned.
std::string boot_to_panic(QmpClient& qmp, VmRig& rig) {
  QemuProcess& proc = *rig.proc;
  qmp.execute("cont");
  json shutdown = qmp.wait_event("SHUTDOWN", milliseconds(60000));
  EXPECT_EQ(shutdown["data"]["guest"], true) << shutdown.dump();
  auto status = proc.wait(milliseconds(5000));
  EXPECT_TRUE(status && WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << proc.log();
  std::string console = read_file(rig.console_path);
  EXPECT_THAT(console, HasSubstr("Kernel panic")) << console.substr(0, 4000);
  EXPECT_EQ(proc.log(), "") << "QEMU complained";
  return console;
}

TEST(QemuRealArgv, StartsPausedWithItsDevicesThenBootsToTheConsole) {
  auto qemu = find_qemu();
  if (!qemu) GTEST_SKIP() << "qemu-system-x86_64 is not installed";
  auto vmlinux = find_guest_kernel();
  if (!vmlinux) {
    GTEST_SKIP() << "no guest kernel (/var/cache/dsec/guest-kernel/current/vmlinux): QEMU loads "
                    "-kernel at machine init, so the microvm argv cannot be checked without one";
  }
  VmRig rig(*qemu, *vmlinux, /*with_qcow2=*/true);
  rig.spec.start_paused = true;
  std::optional<QmpClient> qmp;
  qmp.emplace(rig.start());
  EXPECT_EQ(qmp_status(*qmp), "prelaunch");
  EXPECT_EQ(qmp->execute("query-name")["name"], "sb-test,1");

  // The block devices as QEMU sees them: names, drivers, read-only flags, and the comma in the file name intact.
  std::map<std::string, json> nodes;
  for (auto& n : qmp->execute("query-named-block-nodes")) nodes[n["node-name"].get<std::string>()] = n;
  ASSERT_TRUE(nodes.count("base") && nodes.count("scratch")) << qmp->execute("query-named-block-nodes").dump();
  EXPECT_EQ(nodes["base"]["drv"], "raw");
  EXPECT_EQ(nodes["base"]["ro"], true);
  EXPECT_EQ(nodes["scratch"]["ro"], false);
  EXPECT_EQ(nodes["scratch"]["file"], (rig.dir.path() / "scratch,1.img").string());
  EXPECT_EQ(nodes["scratch"]["detect_zeroes"], "unmap");
  if (rig.img) {
    EXPECT_EQ(nodes["img"]["drv"], "qcow2");
  }
  json mem = qmp->execute("query-memdev");
  ASSERT_EQ(mem.size(), 1u) << mem.dump();
  EXPECT_EQ(mem[0]["size"], 128 << 20);
  EXPECT_EQ(mem[0]["share"], true);
  json balloon = qmp->execute("query-balloon");
  EXPECT_EQ(balloon["actual"], 128 << 20);

  std::string console = boot_to_panic(*qmp, rig);
  EXPECT_THAT(console, HasSubstr("tsc_early_khz=2000000")) << console.substr(0, 4000);
}

// The console in a ring buffer inside QEMU (bounded, whatever the guest writes), read over QMP.
TEST(QemuRealArgv, RingBufferConsoleReadOverQmp) {
  auto qemu = find_qemu();
  if (!qemu) GTEST_SKIP() << "qemu-system-x86_64 is not installed";
  auto vmlinux = find_guest_kernel();
  if (!vmlinux) GTEST_SKIP() << "no guest kernel (/var/cache/dsec/guest-kernel/current/vmlinux)";
  VmRig rig(*qemu, *vmlinux, false);
  rig.spec.console_path.clear();
  rig.spec.console_ringbuf_bytes = 1 << 16;
  rig.spec.block_devices.clear();
  rig.spec.balloon = false;
  rig.spec.agent_listen_fd = -1;
  QmpClient qmp = rig.start();
  EXPECT_EQ(qmp_status(qmp), "running");  // not paused this time
  std::string console;
  auto deadline = Clock::now() + std::chrono::seconds(20);
  while (console.find("Linux version") == std::string::npos && Clock::now() < deadline) {
    console +=
        qmp.execute("ringbuf-read", {{"device", "console"}, {"size", 1 << 16}, {"format", "utf8"}}).get<std::string>();
    std::this_thread::sleep_for(milliseconds(5));
  }
  EXPECT_THAT(console, HasSubstr("Linux version"));
  qmp.execute("quit");
  ASSERT_TRUE(rig.proc->wait(milliseconds(5000)).has_value());
  EXPECT_EQ(rig.proc->log(), "");
}

// A q35 machine with a 1280x800 VGA screen and USB input, to be started paused.
std::unique_ptr<VmRig> paused_q35_with_a_screen(const fs::path& qemu, const fs::path& vmlinux) {
  auto rig = std::make_unique<VmRig>(qemu, vmlinux, false, -1, Machine::kQ35);
  rig->spec.display = {DisplaySpec::Kind::kVga, 1280, 800, 16};
  rig->spec.usb_input = true;
  rig->spec.start_paused = true;
  return rig;
}

// q35 with a VGA screen and USB input, the way the full VM tier will start one: QEMU takes the argv, shows the
// devices on PCI, offers the tablet as the only mouse (no PS/2 controller), and boots the kernel (through SeaBIOS)
// to its panic, the console in the file as on microvm.
TEST(QemuRealArgv, Q35WithAScreenAndUsbInputBootsToTheConsole) {
  auto qemu = find_qemu();
  if (!qemu) GTEST_SKIP() << "qemu-system-x86_64 is not installed";
  auto vmlinux = find_guest_kernel();
  if (!vmlinux) GTEST_SKIP() << "no guest kernel (/var/cache/dsec/guest-kernel/current/vmlinux)";
  auto rig_holder = paused_q35_with_a_screen(*qemu, *vmlinux);
  VmRig& rig = *rig_holder;
  QmpClient qmp = rig.start();
  EXPECT_EQ(qmp_status(qmp), "prelaunch");

  std::map<std::string, int> classes;  // PCI device classes by description, counted
  json buses = qmp.execute("query-pci");
  for (const auto& bus : buses)
    for (const auto& d : bus["devices"]) ++classes[d["class_info"].value("desc", "?")];
  EXPECT_EQ(classes["VGA controller"], 1) << buses.dump();
  EXPECT_EQ(classes["USB controller"], 1) << buses.dump();
  EXPECT_EQ(classes["SCSI controller"], 2) << buses.dump();  // virtio-blk-pci, one a disk
  std::vector<std::string> mice;
  for (const auto& m : qmp.execute("query-mice")) mice.push_back(m["name"].get<std::string>());
  EXPECT_THAT(mice, ElementsAre("QEMU HID Tablet"));
  std::map<std::string, json> nodes;
  for (auto& n : qmp.execute("query-named-block-nodes")) nodes[n["node-name"].get<std::string>()] = n;
  EXPECT_TRUE(nodes.count("base") && nodes.count("scratch"));

  std::string console = boot_to_panic(qmp, rig);
  EXPECT_THAT(console, HasSubstr("dsec_guest=1")) << console.substr(0, 4000);
}

// The screen of such a VM (agent/backends/qemu/screen): a screenshot is a PNG of the display's size that QEMU writes
// into a memfd it is handed (no file of the node), before the guest runs and again once SeaBIOS has drawn on it (a
// different picture); input events go in while it runs and are refused, as FAILED_PRECONDITION, while it is stopped.
TEST(QemuRealArgv, Q35ScreenshotsAndInput) {
  auto qemu = find_qemu();
  if (!qemu) GTEST_SKIP() << "qemu-system-x86_64 is not installed";
  auto vmlinux = find_guest_kernel();
  if (!vmlinux) GTEST_SKIP() << "no guest kernel (/var/cache/dsec/guest-kernel/current/vmlinux)";
  auto rig_holder = paused_q35_with_a_screen(*qemu, *vmlinux);
  VmRig& rig = *rig_holder;
  QmpClient qmp = rig.start();
  std::string before = screenshot_png(qmp, milliseconds(10000));
  EXPECT_GT(png_size(before).first, 0u);
  // Stopped (not started yet): input is refused, saying why.
  try {
    send_input(qmp, key_press_events(parse_key_combo("a")), milliseconds(5000));
    ADD_FAILURE() << "a stopped VM took input";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition) << e.what();
  }
  // Running (SeaBIOS, then the kernel, which panics after a second or two): every kind of input is taken.
  qmp.execute("cont");
  send_input(qmp, pointer_move_events(1279, 799, 1280, 800), milliseconds(5000));
  send_input(qmp, click_events("left", 2), milliseconds(5000));
  send_input(qmp, scroll_events(-3), milliseconds(5000));
  for (const auto& press : text_to_key_presses("Hi!\n")) send_input(qmp, key_press_events(press), milliseconds(5000));
  send_input(qmp, key_press_events(parse_key_combo("ctrl+alt+F2")), milliseconds(5000));
  // SeaBIOS draws on the screen: the next screenshots differ from the first; stopped there, before the panic.
  std::string after = before;
  auto deadline = Clock::now() + std::chrono::seconds(20);
  while (after == before && Clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(50));
    after = screenshot_png(qmp, milliseconds(10000));
  }
  qmp.execute("stop");
  EXPECT_NE(after, before) << "the display never changed once the VM ran";
  // However many screenshots that took, QEMU holds one fd set for them, and none of their descriptors once it has run
  // (the one of the screenshot taken while stopped included).
  std::size_t sets_with_fds = 0, sets = 0;
  for (const auto& set : qmp.execute("query-fdsets")) {
    ++sets;
    if (set["fdset-id"] == 4096 && !set["fds"].empty()) ++sets_with_fds;
  }
  EXPECT_EQ(sets_with_fds, 0u) << qmp.execute("query-fdsets").dump();
  EXPECT_LE(sets, 1u + rig.spec.fds.size());
  EXPECT_GT(png_size(after).first, 0u);
  EXPECT_GT(png_size(after).second, 0u);
  qmp.execute("quit");
  rig.proc->wait(milliseconds(5000));
}

// A VM made without a display (a microvm) has no screenshot: FAILED_PRECONDITION, not an internal error.
TEST(QemuRealArgv, AScreenshotOfAVmWithoutADisplayIsRefused) {
  auto qemu = find_qemu();
  if (!qemu) GTEST_SKIP() << "qemu-system-x86_64 is not installed";
  auto vmlinux = find_guest_kernel();
  if (!vmlinux) GTEST_SKIP() << "no guest kernel (/var/cache/dsec/guest-kernel/current/vmlinux)";
  VmRig rig(*qemu, *vmlinux, false);
  rig.spec.start_paused = true;
  QmpClient qmp = rig.start();
  const std::size_t fdsets = qmp.execute("query-fdsets").size();  // the rig's own (disks, console)
  for (int i = 0; i < 3; ++i) {
    EXPECT_CODE_MSG(screenshot_png(qmp, milliseconds(10000)), Code::kFailedPrecondition, "no screen");
  }
  // Screenshots share one fd set in QEMU, however many are taken.
  EXPECT_LE(qmp.execute("query-fdsets").size(), fdsets + 1) << qmp.execute("query-fdsets").dump();
  qmp.execute("quit");
  rig.proc->wait(milliseconds(5000));
}

// A hash of a memfd's contents (mapped, not copied).
std::size_t memfd_hash(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw std::runtime_error("fstat");
  void* p = ::mmap(nullptr, st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) throw std::runtime_error("mmap");
  std::size_t h = std::hash<std::string_view>{}(std::string_view(static_cast<const char*>(p), st.st_size));
  ::munmap(p, st.st_size);
  return h;
}

// The clone path: a VM boots a little, is paused and saved with x-ignore-shared (its RAM stays in the memfd, only
// device state goes to the file); a second QEMU maps that memfd copy-on-write (share=off), restores the state
// through -incoming defer, and carries on booting from where the first stopped, leaving the memfd untouched.
TEST(QemuRealArgv, CloneRestoredThroughIncomingDeferOnCopyOnWriteRam) {
  auto qemu = find_qemu();
  if (!qemu) GTEST_SKIP() << "qemu-system-x86_64 is not installed";
  auto vmlinux = find_guest_kernel();
  if (!vmlinux) GTEST_SKIP() << "no guest kernel (/var/cache/dsec/guest-kernel/current/vmlinux)";
  TempDir state_dir;
  fs::path state = state_dir.path() / "vm.state";
  const json ignore_shared = {{"capabilities", {{{"capability", "x-ignore-shared"}, {"state", true}}}}};

  UniqueFd template_ram;
  {
    VmRig rig(*qemu, *vmlinux, false);
    rig.spec.start_paused = true;
    QmpClient qmp = rig.start();
    qmp.execute("cont");
    // Into the kernel's boot (its first line on the console), well before its panic.
    auto booting = Clock::now() + std::chrono::seconds(20);
    while (read_file(rig.console_path).find("Linux version") == std::string::npos && Clock::now() < booting) {
      std::this_thread::sleep_for(milliseconds(5));
    }
    qmp.execute("stop");
    qmp.wait_event("STOP", milliseconds(2000));
    EXPECT_EQ(qmp_status(qmp), "paused");
    qmp.execute("migrate-set-capabilities", ignore_shared);
    UniqueFd out = open_fd(state, O_WRONLY | O_CREAT | O_TRUNC);
    qmp.execute_with_fds("getfd", {{"fdname", "snap"}}, {out.get()});
    qmp.execute("migrate", {{"uri", "fd:snap"}});
    qmp_wait_migration(qmp, milliseconds(10000));
    EXPECT_EQ(qmp_status(qmp), "postmigrate");
    qmp.execute("quit");
    ASSERT_TRUE(rig.proc->wait(milliseconds(5000)).has_value()) << rig.proc->log();
    std::string console = read_file(rig.console_path);
    EXPECT_THAT(console, HasSubstr("Linux version"));
    EXPECT_THAT(console, ::testing::Not(HasSubstr("Kernel panic")));
    template_ram = std::move(rig.ram);
  }
  ASSERT_GT(fs::file_size(state), 0u);
  EXPECT_LT(fs::file_size(state), 8u << 20) << "RAM went into the state file despite x-ignore-shared";
  const std::size_t template_hash = memfd_hash(template_ram.get());

  VmRig rig(*qemu, *vmlinux, false, template_ram.get());
  // The other way to name the file; then the fd must not be in an fd set too (QEMU's -add-fd takes it over).
  rig.spec.console_path = fmt::format("/proc/self/fd/{}", rig.console.get());
  rig.spec.fds = {{rig.base.get(), 3}};
  rig.spec.incoming = true;
  rig.spec.start_paused = true;
  rig.spec.memory_share = false;
  QmpClient qmp = rig.start();
  EXPECT_EQ(qmp_status(qmp), "inmigrate");
  qmp.execute("migrate-set-capabilities", ignore_shared);
  UniqueFd in = open_fd(state, O_RDONLY);
  qmp.execute_with_fds("getfd", {{"fdname", "snap"}}, {in.get()});
  qmp.execute("migrate-incoming", {{"uri", "fd:snap"}});
  qmp_wait_migration(qmp, milliseconds(10000));
  auto deadline = Clock::now() + std::chrono::seconds(5);
  std::string s;
  while ((s = qmp_status(qmp)) == "inmigrate" && Clock::now() < deadline) std::this_thread::sleep_for(milliseconds(2));
  EXPECT_EQ(s, "paused");  // -S: restored, waiting for cont
  EXPECT_EQ(qmp.execute("query-memdev")[0]["share"], false);

  qmp.execute("cont");
  json shutdown = qmp.wait_event("SHUTDOWN", milliseconds(30000));
  EXPECT_EQ(shutdown["data"]["guest"], true) << shutdown.dump();
  ASSERT_TRUE(rig.proc->wait(milliseconds(5000)).has_value());
  std::string console = read_file(rig.console_path);
  EXPECT_THAT(console, HasSubstr("Kernel panic")) << console.substr(0, 4000);
  EXPECT_EQ(console.find("Linux version"), std::string::npos) << "the clone booted afresh instead of resuming";
  EXPECT_EQ(memfd_hash(template_ram.get()), template_hash) << "the clone wrote through to its template";
  EXPECT_EQ(rig.proc->log(), "");
}

}  // namespace
}  // namespace dsec::agent::qemu
