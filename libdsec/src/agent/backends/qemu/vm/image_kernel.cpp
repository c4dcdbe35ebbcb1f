#include "agent/backends/qemu/vm/image_kernel.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <system_error>

#include "agent/backends/qemu/initramfs.hpp"
#include "common/sandbox_tree.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "image/store/digest.hpp"

namespace dsec::agent::vm {
namespace {

namespace fs = std::filesystem;

constexpr std::size_t kMaxKernelBytes = 128u << 20;
constexpr std::size_t kMaxModuleBytes = 64u << 20;
constexpr std::size_t kMaxModulesDepBytes = 16u << 20;
constexpr const char* kHowToGet =
    "a full VM boots the image's own kernel: build the image with --include "
    "linux-image-amd64,systemd-sysv";

// A module's name as the kernel knows it: the file's stem, '-' and '_' alike.
std::string module_name(std::string_view path) {
  std::size_t slash = path.rfind('/');
  std::string_view file = slash == std::string_view::npos ? path : path.substr(slash + 1);
  std::size_t dot = file.find(".ko");
  std::string name(file.substr(0, dot));
  for (char& c : name)
    if (c == '-') c = '_';
  return name;
}

// modules.dep of the image: name -> (its path below /lib/modules/<release>, the names it depends on). Lines that do
// not parse are skipped (the text is the image's).
struct ModuleEntry {
  std::string path;
  std::vector<std::string> depends;
};
std::map<std::string, ModuleEntry> parse_modules_dep(std::string_view text) {
  std::map<std::string, ModuleEntry> out;
  while (!text.empty()) {
    std::size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text = nl == std::string_view::npos ? std::string_view() : text.substr(nl + 1);
    std::size_t colon = line.find(':');
    if (colon == std::string_view::npos || colon == 0) continue;
    std::string_view path = line.substr(0, colon);
    if (path.find("..") != std::string_view::npos || path.front() == '/') continue;
    ModuleEntry e{std::string(path), {}};
    std::string_view deps = line.substr(colon + 1);
    while (!deps.empty()) {
      std::size_t start = deps.find_first_not_of(' ');
      if (start == std::string_view::npos) break;
      deps = deps.substr(start);
      std::size_t end = deps.find(' ');
      e.depends.push_back(module_name(deps.substr(0, end)));
      deps = end == std::string_view::npos ? std::string_view() : deps.substr(end);
    }
    out.emplace(module_name(path), std::move(e));
  }
  return out;
}

void write_whole(const fs::path& path, std::string_view data) {
  UniqueFd fd(retry_eintr([&] { return ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644); }));
  if (!fd) throw_errno_fmt(errno, "create {}", path.string());
  std::size_t done = 0;
  while (done < data.size()) {
    ssize_t n = retry_eintr([&] { return ::write(fd.get(), data.data() + done, data.size() - done); });
    if (n < 0) throw_errno_fmt(errno, "write {}", path.string());
    done += static_cast<std::size_t>(n);
  }
}

// Reads a file of the image, naming the image's file (and what to do) when it is missing.
std::string read_image_file(files::SandboxTree& tree, const std::string& path, std::size_t max_bytes) {
  try {
    return tree.read_file(path, max_bytes);
  } catch (const Error& e) {
    if (e.code() == Code::kNotFound)
      throw Error(Code::kFailedPrecondition, fmt::format("the image has no {} ({})", path, kHowToGet));
    throw Error(e.code(), fmt::format("the image's {}: {}", path, e.what()));
  }
}

}  // namespace

const std::vector<std::string>& boot_modules() {
  static const std::vector<std::string> kModules = {"crc32c_generic", "virtio_pci", "virtio_blk", "virtio_console",
                                                    "erofs",          "overlay",    "ext4"};
  return kModules;
}

std::string bzimage_release(std::string_view image) {
  // The x86 boot protocol's setup header: "HdrS" at 0x202, and at 0x20e the offset (from 0x200) of a NUL-ended
  // version string, "6.1.0-50-amd64 (debian-kernel@lists.debian.org) #1 SMP ...".
  if (image.size() < 0x210 || image.substr(0x202, 4) != "HdrS")
    throw Error(Code::kInvalidArgument, "the image's kernel is not a bzImage (no boot protocol header)");
  std::size_t at = 0x200 + (static_cast<unsigned char>(image[0x20e]) | (static_cast<unsigned char>(image[0x20f]) << 8));
  if (at >= image.size()) throw Error(Code::kInvalidArgument, "the image's kernel names no version");
  std::string_view version = image.substr(at, std::min<std::size_t>(256, image.size() - at));
  version = version.substr(0, version.find_first_of(std::string_view(" \0", 2)));
  if (version.empty() || version.find('/') != std::string_view::npos || version.find("..") != std::string_view::npos)
    throw Error(Code::kInvalidArgument, "the image's kernel names no usable release");
  for (char c : version)
    if (static_cast<unsigned char>(c) < 0x21 || static_cast<unsigned char>(c) > 0x7e)
      throw Error(Code::kInvalidArgument, "the image's kernel names no usable release");
  return std::string(version);
}

ImageBoot prepare_image_boot(const fs::path& root, const fs::path& init_binary, const fs::path& cache_dir) {
  UniqueFd root_fd(::open(root.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
  if (!root_fd) throw_errno_fmt(errno, "open the image's root {}", root.string());
  files::SandboxTree tree(std::move(root_fd));
  const std::string kernel = read_image_file(tree, "/vmlinuz", kMaxKernelBytes);
  ImageBoot boot;
  boot.release = bzimage_release(kernel);
  const std::string modules_root = "/lib/modules/" + boot.release;
  const std::string dep_text = read_image_file(tree, modules_root + "/modules.dep", kMaxModulesDepBytes);
  auto deps = parse_modules_dep(dep_text);

  // The modules the boot needs and all they depend on, read from the image.
  std::map<std::string, std::string> wanted;  // name -> contents
  std::vector<std::string> stack(boot_modules().begin(), boot_modules().end());
  std::set<std::string> seen;
  std::string builtin = [&] {
    try {
      return tree.read_file(modules_root + "/modules.builtin", kMaxModulesDepBytes);
    } catch (const Error&) {
      return std::string();
    }
  }();
  while (!stack.empty()) {
    std::string name = stack.back();
    stack.pop_back();
    if (!seen.insert(name).second) continue;
    auto it = deps.find(name);
    if (it == deps.end()) continue;  // built in, or absent: module_load_order below says which
    for (const auto& d : it->second.depends) stack.push_back(d);
    if (it->second.path.size() < 3 || it->second.path.compare(it->second.path.size() - 3, 3, ".ko") != 0)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("the image's module {} is compressed ({}); a full VM's boot loads plain .ko files", name,
                              it->second.path));
    wanted[name] = read_image_file(tree, modules_root + "/" + it->second.path, kMaxModuleBytes);
  }

  // The key: the kernel, the modules and dsec-init (a new dsec-init makes a new initramfs).
  std::string material = image::sha256_digest(kernel) + image::sha256_file(init_binary);
  for (const auto& [name, bytes] : wanted) material += name + image::sha256_digest(bytes);
  boot.key = image::sha256_digest(material).substr(7, 16);  // after "sha256:"
  const fs::path dir = cache_dir / (boot.release + "-" + boot.key);
  boot.kernel = dir / "vmlinuz";
  boot.initramfs = dir / "initramfs.cpio";

  static std::mutex mu;  // one maker per agent; a made directory is complete (renamed into place)
  std::lock_guard lock(mu);
  std::error_code ec;
  if (fs::exists(boot.initramfs, ec)) return boot;
  const fs::path tmp = cache_dir / (".new-" + boot.key);
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp / "modules", ec);
  if (ec) throw Error(Code::kInternal, fmt::format("mkdir {}: {}", tmp.string(), ec.message()));
  try {
    write_whole(tmp / "vmlinuz", kernel);
    for (const auto& [name, bytes] : wanted) write_whole(tmp / "modules" / (name + ".ko"), bytes);
    if (!builtin.empty()) write_whole(tmp / "modules" / "modules.builtin", builtin);
    auto order = qemu::module_load_order(tmp / "modules", boot_modules(), {}, kHowToGet);
    qemu::write_initramfs(tmp / "initramfs.cpio", init_binary, order);
    fs::remove_all(tmp / "modules");
    fs::rename(tmp, dir);
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  return boot;
}

}  // namespace dsec::agent::vm
