// The busybox tree: a tiny system from the host's static busybox binary. make_debootstrap_tree lives in
// debootstrap.cpp.
#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "image/fs_tree.hpp"
#include "image/process.hpp"
#include "image/rootfs_builders.hpp"

namespace dsec::image {
namespace fs = std::filesystem;
namespace {

constexpr std::string_view kPasswd =
    "root:x:0:0:root:/root:/bin/sh\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n";
constexpr std::string_view kGroup =
    "root:x:0:\n"
    "nogroup:x:65534:\n";
constexpr std::string_view kHosts =
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n";

template <typename Ehdr, typename Phdr>
bool has_interpreter(int fd, const std::string& path) {
  Ehdr eh{};
  if (::pread(fd, &eh, sizeof eh, 0) != static_cast<ssize_t>(sizeof eh))
    throw Error(Code::kFailedPrecondition, fmt::format("{} is not an ELF executable (short header)", path));
  if (eh.e_phentsize != sizeof(Phdr))
    throw Error(Code::kFailedPrecondition, fmt::format("{} has an unexpected ELF program header size", path));
  for (unsigned i = 0; i < eh.e_phnum; ++i) {
    Phdr ph{};
    off_t off = static_cast<off_t>(eh.e_phoff + i * sizeof(Phdr));
    if (::pread(fd, &ph, sizeof ph, off) != static_cast<ssize_t>(sizeof ph))
      throw Error(Code::kFailedPrecondition, fmt::format("{} has a truncated ELF program header table", path));
    if (ph.p_type == PT_INTERP) return true;
  }
  return false;
}

// FAILED_PRECONDITION unless `path` is an ELF executable that needs no dynamic loader: an image that holds only the
// binary has no libc for it.
void require_static_elf(const fs::path& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) {
    int err = errno;
    throw Error(err == ENOENT ? Code::kFailedPrecondition : code_for_errno(err),
                fmt::format("{}: {} (install Debian's busybox-static: apt-get install busybox-static)", path.string(),
                            std::strerror(err)));
  }
  unsigned char ident[EI_NIDENT] = {};
  if (::pread(fd.get(), ident, sizeof ident, 0) != EI_NIDENT || std::memcmp(ident, ELFMAG, SELFMAG) != 0)
    throw Error(Code::kFailedPrecondition, fmt::format("{} is not an ELF executable", path.string()));
  bool dynamic = ident[EI_CLASS] == ELFCLASS64 ? has_interpreter<Elf64_Ehdr, Elf64_Phdr>(fd.get(), path.string())
                                               : has_interpreter<Elf32_Ehdr, Elf32_Phdr>(fd.get(), path.string());
  if (dynamic)
    throw Error(Code::kFailedPrecondition,
                fmt::format("{} is dynamically linked; a busybox image needs the static build "
                            "(apt-get install busybox-static)",
                            path.string()));
}

void make_dir(const fs::path& p, mode_t mode) {
  if (::mkdir(p.c_str(), mode) != 0 && errno != EEXIST) throw_errno_fmt(errno, "mkdir {}", p.string());
  // mkdir's mode passes through the umask; the image needs the exact one (1777 for /tmp).
  if (::chmod(p.c_str(), mode) != 0) throw_errno_fmt(errno, "chmod {}", p.string());
}

void write_file(const fs::path& p, std::string_view content, mode_t mode) {
  UniqueFd fd(::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode));
  if (!fd) throw_errno_fmt(errno, "create {}", p.string());
  std::size_t done = 0;
  while (done < content.size()) {
    ssize_t n = retry_eintr([&] { return ::write(fd.get(), content.data() + done, content.size() - done); });
    if (n < 0) throw_errno_fmt(errno, "write {}", p.string());
    done += static_cast<std::size_t>(n);
  }
  if (::fchmod(fd.get(), mode) != 0) throw_errno_fmt(errno, "chmod {}", p.string());
}

void make_symlink(const std::string& target, const fs::path& link) {
  if (::symlink(target.c_str(), link.c_str()) != 0) throw_errno_fmt(errno, "symlink {} -> {}", link.string(), target);
}

bool valid_applet(std::string_view name) {
  if (name.empty() || name == "." || name == ".." || name == "busybox") return false;
  for (char c : name)
    if (c == '/' || c == '\0' || static_cast<unsigned char>(c) <= ' ') return false;
  return true;
}

}  // namespace

std::string make_busybox_tree(const fs::path& dest, const fs::path& busybox, std::vector<std::string>& notes) {
  require_static_elf(busybox);
  ProcessResult applets = run_process({busybox.string(), "--list"});
  if (!applets.ok())
    throw Error(Code::kFailedPrecondition,
                fmt::format("{} --list {}: {}", busybox.string(), applets.status_text(), applets.tail()));

  const fs::path& root = dest;
  if (::mkdir(root.c_str(), 0755) != 0) throw_errno_fmt(errno, "mkdir {}", root.string());
  make_dir(root, 0755);
  for (const char* d : {"bin", "etc", "usr", "var", "root", "tmp", "proc", "dev", "sys", "run"}) {
    mode_t mode = 0755;
    if (std::string_view(d) == "tmp") mode = 01777;
    if (std::string_view(d) == "root") mode = 0700;
    if (std::string_view(d) == "proc" || std::string_view(d) == "sys") mode = 0555;
    make_dir(root / d, mode);
  }
  make_dir(root / "var/tmp", 01777);
  // One directory of programs; the usual other places point at it, so "#!/usr/bin/env sh" works.
  make_symlink("bin", root / "sbin");
  make_symlink("../bin", root / "usr/bin");
  make_symlink("../bin", root / "usr/sbin");

  std::error_code ec;
  fs::copy_file(busybox, root / "bin/busybox", ec);
  if (ec) throw Error(code_for_errno(ec.value()), fmt::format("copy {}: {}", busybox.string(), ec.message()));
  if (::chmod((root / "bin/busybox").c_str(), 0755) != 0) throw_errno(errno, "chmod bin/busybox");

  std::size_t count = 0;
  std::istringstream lines(applets.out);
  for (std::string applet; std::getline(lines, applet);) {
    if (!valid_applet(applet)) continue;
    make_symlink("busybox", root / "bin" / applet);
    ++count;
  }
  if (!fs::is_symlink(root / "bin/sh"))
    throw Error(Code::kFailedPrecondition, fmt::format("{} has no sh applet", busybox.string()));

  write_file(root / "etc/passwd", kPasswd, 0644);
  write_file(root / "etc/group", kGroup, 0644);
  write_file(root / "etc/hosts", kHosts, 0644);
  // Mount points: the sandbox runtime binds its own over these.
  write_file(root / "etc/hostname", "", 0644);
  write_file(root / "etc/resolv.conf", "", 0644);

  notes.push_back(fmt::format("{} applets linked to /bin/busybox", count));
  return fmt::format("busybox-static {}", busybox.string());
}

}  // namespace dsec::image
