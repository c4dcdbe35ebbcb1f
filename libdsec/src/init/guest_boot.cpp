// dsec-init as the initramfs /init of a full VM (`dsec_guest=boot`): builds the root from the image's layers and
// hands it to the image's own init (systemd), with dsec-init set up as one of its services.
//
// The kernel command line names the layout (`dsec_root=`, guest_protocol's root word: the writable disk's serial,
// then each layer's): the layers are mounted read-only as EROFS, the disk as ext4, overlayfs stacks them, exactly as
// a microVM's root (guest_system). Then, before the switch:
//   - a tmpfs for the system's /run, with dsec's part in /run/dsec (0700): the layers' and the writable disk's
//     mounts move there (the service captures the upper directory for snapshots), and a copy of this binary, so the
//     guest agent always matches the node's agent, and nothing of dsec lands in the image or its writable layer;
//   - the unit that starts it (`/run/systemd/system/dsec-guest.service`, wanted by sysinit.target: a runtime unit,
//     gone at the next boot), with Delegate=yes for the cgroups of its commands;
// and /dev, /proc and /sys move into the new root, which becomes `/`, and /sbin/init is exec'd as pid 1. systemd
// keeps API file systems that are mounted already, /run among them.
//
// A root that cannot be built or an image without /sbin/init powers the VM off with the reason on the console,
// which the agent quotes in the create's error.
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common/wire/guest_protocol.hpp"
#include "dsec/error.hpp"
#include "init/guest_system.hpp"
#include "init/init_main.hpp"

namespace dsec::init {
namespace {

constexpr const char* kUnit =
    "# Written by dsec at boot: the guest agent, serving the node's agent on the virtio-serial port dsec.agent.\n"
    "[Unit]\n"
    "Description=dsec guest agent\n"
    "DefaultDependencies=no\n"
    "Before=sysinit.target\n"
    "\n"
    "[Service]\n"
    "Environment=dsec_guest=service\n"
    "ExecStart=/run/dsec/dsec-init\n"
    "Delegate=yes\n"
    "KillMode=process\n"
    "Restart=always\n"
    "RestartSec=100ms\n"
    "OOMScoreAdjust=-1000\n";

[[noreturn]] void power_off(const std::string& why) {
  log_line(why + ": powering off");
  ::sync();
  ::reboot(RB_POWER_OFF);
  for (;;) ::pause();
}

void check(bool ok, const std::string& what) {
  if (!ok) throw Error(Code::kFailedPrecondition, "guest boot: " + what + ": " + errno_text(errno));
}

void write_file(const std::string& path, std::string_view text, mode_t mode) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  check(fd >= 0, "create " + path);
  bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  check(ok, "write " + path);
}

void copy_file(const char* from, const std::string& to, mode_t mode) {
  int in = ::open(from, O_RDONLY | O_CLOEXEC);
  check(in >= 0, std::string("open ") + from);
  int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  check(out >= 0, "create " + to);
  char buf[65536];
  ssize_t n;
  while ((n = ::read(in, buf, sizeof buf)) > 0)
    check(::write(out, buf, static_cast<std::size_t>(n)) == n, "write " + to);
  ::close(in);
  ::close(out);
  check(n == 0, std::string("read ") + from);
}

void make_dirs(const std::string& path, mode_t mode) {
  for (std::size_t at = path.find('/', 1);; at = path.find('/', at + 1)) {
    std::string part = path.substr(0, at);
    if (::mkdir(part.c_str(), mode) != 0 && errno != EEXIST) check(false, "mkdir " + part);
    if (at == std::string::npos) break;
  }
}

// What stays of the boot in the new root's /run: dsec's mounts, its binary and its unit.
void prepare_run(std::size_t layers) {
  check(::mount("tmpfs", "/newroot/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755") == 0, "mount /run");
  make_dirs("/newroot/run/dsec", 0700);
  ::chmod("/newroot/run/dsec", 0700);
  make_dirs("/newroot/run/dsec/rw", 0755);
  check(::mount("/rw", "/newroot/run/dsec/rw", nullptr, MS_MOVE, nullptr) == 0, "move /rw");
  for (std::size_t i = 0; i < layers; ++i) {
    std::string from = "/layers/" + std::to_string(i), to = "/newroot/run/dsec/layers/" + std::to_string(i);
    make_dirs(to, 0755);
    check(::mount(from.c_str(), to.c_str(), nullptr, MS_MOVE, nullptr) == 0, "move " + from);
  }
  copy_file("/init", "/newroot/run/dsec/dsec-init", 0700);
  make_dirs("/newroot/run/systemd/system/sysinit.target.wants", 0755);
  write_file("/newroot/run/systemd/system/dsec-guest.service", kUnit, 0644);
  check(::symlink("../dsec-guest.service", "/newroot/run/systemd/system/sysinit.target.wants/dsec-guest.service") == 0,
        "link the unit into sysinit.target");
}

}  // namespace

int run_guest_boot() {
  mount_api_file_systems();
  int console = ::open("/dev/console", O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (console >= 0) {
    ::dup2(console, 0);
    ::dup2(console, 1);
    ::dup2(console, 2);
    ::close(console);
  }
  load_modules();
  const char* word = std::getenv("dsec_root");
  if (!word) power_off("no dsec_root= on the kernel command line");
  try {
    guest_protocol::Setup setup = guest_protocol::decode_root_word(word);
    build_overlay_root(setup);
    ::mkdir("/newroot/run", 0755);
    prepare_run(setup.layers.size());
    enter_new_root();
    // Looked up inside the new root: /sbin/init is an absolute symbolic link (to /lib/systemd/systemd).
    struct stat st {};
    if (::stat("/sbin/init", &st) != 0)
      power_off("the image has no /sbin/init (a full VM boots the image's own init: include systemd-sysv)");
  } catch (const std::exception& e) {
    power_off(e.what());
  }
  char init[] = "/sbin/init";
  char* argv[] = {init, nullptr};
  ::execv(init, argv);
  power_off(std::string("exec /sbin/init: ") + errno_text(errno));
}

}  // namespace dsec::init
