#include "agent/backends/qemu/microvm/guest_kernel.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <system_error>

#include "agent/backends/qemu/initramfs.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::microvm {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kDefaultDir = "/var/cache/dsec/guest-kernel";
constexpr std::string_view kHowToGet =
    "run scripts/guest-kernel.sh as root to unpack Debian's linux-image-cloud-amd64 into /var/cache/dsec/guest-kernel "
    "(or point dsecd --microvm-kernel at a kernel)";

// Up to `n` bytes from the start of a file ("" when it cannot be read).
std::string read_prefix(const fs::path& path, std::size_t n) {
  UniqueFd fd(retry_eintr([&] { return ::open(path.c_str(), O_RDONLY | O_CLOEXEC); }));
  if (!fd) return {};
  std::string out(n, '\0');
  std::size_t got = 0;
  while (got < n) {
    ssize_t r = retry_eintr([&] { return ::pread(fd.get(), out.data() + got, n - got, static_cast<off_t>(got)); });
    if (r <= 0) break;
    got += static_cast<std::size_t>(r);
  }
  out.resize(got);
  return out;
}

std::string trim(std::string s) {
  auto not_space = [](unsigned char c) { return !std::isspace(c); };
  s.erase(s.begin(), std::find_if(s.begin(), s.end(), not_space));
  s.erase(std::find_if(s.rbegin(), s.rend(), not_space).base(), s.end());
  return s;
}

bool is_dir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}
bool is_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

// A release file's one line; "" when there is none (or it is too long to be one).
std::string read_release_file(const fs::path& p) {
  constexpr std::size_t kMaxBytes = 4096;
  if (!is_file(p)) return {};
  std::string text = read_prefix(p, kMaxBytes + 1);
  return text.size() > kMaxBytes ? std::string() : trim(std::move(text));
}

template <typename T>
T load(std::string_view bytes, std::size_t offset) {
  T v;
  std::memcpy(&v, bytes.data() + offset, sizeof v);
  return v;
}

// The x86 boot protocol's header of a bzImage: "HdrS" at 0x202.
bool is_bzimage(std::string_view head) { return head.size() >= 0x210 && head.substr(0x202, 4) == "HdrS"; }
bool is_elf(std::string_view head) {
  return head.size() >= 4 && head.substr(0, 4) ==
                                 "\x7f"
                                 "ELF";
}

// The release in a bzImage's kernel_version string ("6.1.0-57-cloud-amd64 (debian-kernel@...) #1 SMP ..."), or "".
std::string bzimage_release(std::string_view head) {
  if (!is_bzimage(head)) return {};
  auto offset = load<std::uint16_t>(head, 0x20e);
  if (offset == 0) return {};
  std::size_t at = std::size_t{offset} + 0x200;
  if (at >= head.size()) return {};
  std::string_view rest = head.substr(at);
  return std::string(rest.substr(0, std::min(rest.find(' '), rest.find('\0'))));
}

// A kernel file as a GuestKernel, with the modules and release found beside it.
GuestKernel kernel_file(const fs::path& kernel, const fs::path& layout_dir) {
  std::string head = read_prefix(kernel, 0x4000);
  if (!is_elf(head) && !is_bzimage(head))
    throw Error(
        Code::kFailedPrecondition,
        fmt::format("microVM guest kernel {} is neither an ELF vmlinux nor a bzImage; {}", kernel.string(), kHowToGet));
  GuestKernel k;
  k.kernel = kernel;
  if (is_dir(layout_dir / "modules")) k.modules_dir = layout_dir / "modules";
  k.release = read_release_file(layout_dir / "release");
  if (k.release.empty()) k.release = bzimage_release(head);
  return k;
}

}  // namespace

fs::path default_guest_kernel_dir() {
  const char* env = std::getenv("DSEC_GUEST_KERNEL_DIR");
  if (env != nullptr && *env != '\0') return fs::path(env);
  return fs::path(kDefaultDir);
}

GuestKernel find_guest_kernel(const fs::path& configured) {
  fs::path where = configured.empty() ? default_guest_kernel_dir() / "current" : configured;
  std::error_code ec;
  auto status = fs::status(where, ec);
  if (ec || !fs::exists(status)) {
    if (configured.empty())
      throw Error(
          Code::kFailedPrecondition,
          fmt::format("the microVM backend has no guest kernel: {} does not exist; {}", where.string(), kHowToGet));
    throw Error(Code::kFailedPrecondition, fmt::format("microVM guest kernel {} (--microvm-kernel) does not exist; {}",
                                                       where.string(), kHowToGet));
  }
  if (fs::is_directory(status)) {
    for (const char* name : {"vmlinux", "vmlinuz"}) {
      if (is_file(where / name)) return kernel_file(where / name, where);
    }
    throw Error(Code::kFailedPrecondition,
                fmt::format("microVM guest kernel directory {} has neither vmlinux nor vmlinuz; {}", where.string(),
                            kHowToGet));
  }
  if (!fs::is_regular_file(status))
    throw Error(Code::kFailedPrecondition, fmt::format("microVM guest kernel {} is neither a file nor a directory; {}",
                                                       where.string(), kHowToGet));
  return kernel_file(where, where.parent_path());
}

const std::vector<std::string>& guest_modules() {
  static const std::vector<std::string> kModules = {"virtio_mmio",    "virtio_blk", "virtio_console",
                                                    "virtio_balloon", "erofs",      "overlay"};
  return kModules;
}

const std::vector<std::string>& optional_guest_modules() {
  static const std::vector<std::string> kModules = {"virtio_rng"};
  return kModules;
}

std::vector<fs::path> guest_module_files(const GuestKernel& kernel) {
  if (kernel.modules_dir.empty()) return {};
  return qemu::module_load_order(kernel.modules_dir, guest_modules(), optional_guest_modules(), kHowToGet);
}

}  // namespace dsec::agent::microvm
