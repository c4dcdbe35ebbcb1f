#include "init/guest_system.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "dsec/error.hpp"

namespace dsec::init {

using Clock = std::chrono::steady_clock;

constexpr const char* kModulesDir = "/lib/dsec/modules";

void log_line(const std::string& line) {
  std::string out = "dsec-init: " + line + "\n";
  (void)::write(2, out.data(), out.size());
}

std::string errno_text(int err) { return std::strerror(err); }

std::string read_small_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  char buf[512];
  ssize_t n = ::read(fd, buf, sizeof buf);
  ::close(fd);
  if (n <= 0) return {};
  std::string s(buf, static_cast<std::size_t>(n));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s;
}

bool write_small_file(const std::string& path, std::string_view value) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  bool ok = ::write(fd, value.data(), value.size()) == static_cast<ssize_t>(value.size());
  ::close(fd);
  return ok;
}

void mount_or_log(const char* source, const char* target, const char* type, unsigned long flags, const char* data) {
  ::mkdir(target, 0755);
  if (::mount(source, target, type, flags, data) != 0 && errno != EBUSY)
    log_line(std::string("mount ") + type + " on " + target + ": " + errno_text(errno));
}

// Loads the initramfs's modules in the order of their names, then removes the files (their memory is the guest's).
void load_modules() {
  DIR* dir = ::opendir(kModulesDir);
  if (!dir) return;
  std::vector<std::string> names;
  while (dirent* d = ::readdir(dir))
    if (std::strstr(d->d_name, ".ko")) names.emplace_back(d->d_name);
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    std::string path = std::string(kModulesDir) + "/" + name;
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    if (::syscall(SYS_finit_module, fd, "", 0) != 0 && errno != EEXIST)
      log_line("load module " + name + ": " + errno_text(errno));
    ::close(fd);
    ::unlink(path.c_str());
  }
}

// The /dev node of the virtio-serial port named `name`, waiting for it to appear; empty after the wait.
std::string find_port(const char* name, std::chrono::milliseconds wait) {
  auto until = Clock::now() + wait;
  for (;;) {
    if (DIR* dir = ::opendir("/sys/class/virtio-ports")) {
      std::string found;
      while (dirent* d = ::readdir(dir)) {
        if (d->d_name[0] == '.') continue;
        if (read_small_file(std::string("/sys/class/virtio-ports/") + d->d_name + "/name") == name) {
          found = std::string("/dev/") + d->d_name;
          break;
        }
      }
      ::closedir(dir);
      if (!found.empty() && ::access(found.c_str(), F_OK) == 0) return found;
    }
    if (Clock::now() >= until) return {};
    ::usleep(2000);
  }
}

// /dev/vdX by virtio-blk serial, waiting until all wanted serials are there.
std::map<std::string, std::string> find_disks(const std::set<std::string>& serials, std::chrono::milliseconds wait) {
  auto until = Clock::now() + wait;
  for (;;) {
    std::map<std::string, std::string> found;
    if (DIR* dir = ::opendir("/sys/block")) {
      while (dirent* d = ::readdir(dir)) {
        if (std::strncmp(d->d_name, "vd", 2) != 0) continue;
        std::string serial = read_small_file(std::string("/sys/block/") + d->d_name + "/serial");
        if (serials.count(serial)) found[serial] = std::string("/dev/") + d->d_name;
      }
      ::closedir(dir);
    }
    bool complete = found.size() == serials.size();
    for (const auto& [serial, dev] : found)
      if (::access(dev.c_str(), F_OK) != 0) complete = false;
    if (complete || Clock::now() >= until) return found;
    ::usleep(2000);
  }
}

// The guest's only network: loopback, up (as a container's namespace has it).
void loopback_up() {
  int sock = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (sock < 0) return;
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  if (::ioctl(sock, SIOCGIFFLAGS, &ifr) == 0) {
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (::ioctl(sock, SIOCSIFFLAGS, &ifr) != 0) log_line("bring loopback up: " + errno_text(errno));
  }
  ::close(sock);
}

namespace {

[[noreturn]] void fail_setup(int err, const std::string& what) {
  throw Error(err == ENOSPC ? Code::kResourceExhausted : Code::kFailedPrecondition,
              "guest setup: " + what + (err ? ": " + errno_text(err) : std::string()));
}

}  // namespace

void mount_api_file_systems() {
  mount_or_log("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
  mount_or_log("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr);
  mount_or_log("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, nullptr);
}

void build_overlay_root(const guest_protocol::Setup& s) {
  std::set<std::string> serials{s.disk_serial};
  for (const auto& l : s.layers) {
    serials.insert(l.serial);
    if (!l.data_serial.empty()) serials.insert(l.data_serial);
  }
  auto disks = find_disks(serials, std::chrono::seconds(10));
  for (const auto& serial : serials)
    if (!disks.count(serial)) fail_setup(0, "no virtio-blk disk with serial " + serial);
  std::string lower;
  for (std::size_t i = 0; i < s.layers.size(); ++i) {
    std::string dir = "/layers/" + std::to_string(i);
    ::mkdir("/layers", 0755);
    ::mkdir(dir.c_str(), 0755);
    std::string options;
    if (!s.layers[i].data_serial.empty()) options = "device=" + disks[s.layers[i].data_serial];
    if (::mount(disks[s.layers[i].serial].c_str(), dir.c_str(), "erofs", MS_RDONLY | MS_NODEV,
                options.empty() ? nullptr : options.c_str()) != 0) {
      const int err = errno;
      std::string what = "mount layer " + std::to_string(i);
      what.append(" (EROFS on ").append(disks[s.layers[i].serial]).append(")");
      fail_setup(err, what);
    }
    // overlayfs lists the top layer first
    if (lower.empty()) {
      lower = dir;
    } else {
      lower.insert(0, 1, ':');
      lower.insert(0, dir);
    }
  }
  ::mkdir("/rw", 0755);
  if (::mount(disks[s.disk_serial].c_str(), "/rw", "ext4", MS_NOATIME | MS_NODEV, nullptr) != 0)
    fail_setup(errno, "mount the writable disk (ext4 on " + disks[s.disk_serial] + ")");
  ::mkdir("/rw/upper", 0755);
  ::mkdir("/rw/work", 0755);
  ::mkdir("/newroot", 0755);
  std::string options = "lowerdir=" + (lower.empty() ? std::string("/rw/empty") : lower) +
                        ",upperdir=/rw/upper,workdir=/rw/work,metacopy=off,redirect_dir=off";
  if (lower.empty()) ::mkdir("/rw/empty", 0755);
  if (::mount("overlay", "/newroot", "overlay", MS_NODEV, options.c_str()) != 0) fail_setup(errno, "mount overlay");
}

void enter_new_root() {
  for (const char* d : {"/newroot/dev", "/newroot/proc", "/newroot/sys", "/newroot/tmp"}) ::mkdir(d, 0755);
  for (const char* d : {"/dev", "/proc", "/sys"}) {
    std::string target = std::string("/newroot") + d;
    if (::mount(d, target.c_str(), nullptr, MS_MOVE, nullptr) != 0) fail_setup(errno, std::string("move ") + d);
  }
  if (::chdir("/newroot") != 0) fail_setup(errno, "chdir /newroot");
  if (::mount(".", "/", nullptr, MS_MOVE, nullptr) != 0) fail_setup(errno, "move the overlay to /");
  if (::chroot(".") != 0) fail_setup(errno, "chroot");
  if (::chdir("/") != 0) fail_setup(errno, "chdir /");
}

}  // namespace dsec::init
