#include "agent/node/swap.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/swap.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

namespace dsec::agent {
namespace {

namespace fs = std::filesystem;

constexpr std::uint64_t kMinSwapBytes = 1ull << 20;
constexpr int kZramPriority = 100;  // above a swap file's default (negative) priority: zram fills first
constexpr const char* kZramControl = "/sys/class/zram-control";

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw_errno_fmt(errno ? errno : ENOENT, "read {}", path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string trimmed(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

void write_text(const std::string& path, std::string_view value) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CLOEXEC));
  if (!fd) throw_errno_fmt(errno, "open {}", path);
  if (retry_eintr([&] { return ::write(fd.get(), value.data(), value.size()); }) < 0)
    throw_errno_fmt(errno, "write {} to {}", value, path);
}

std::size_t page_size() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }

std::string mib(std::uint64_t bytes) { return fmt::format("{} MiB", bytes >> 20); }

void put_u32(std::string& page, std::size_t at, std::uint32_t v) { std::memcpy(page.data() + at, &v, 4); }
std::uint32_t get_u32(std::string_view page, std::size_t at) {
  std::uint32_t v = 0;
  std::memcpy(&v, page.data() + at, 4);
  return v;
}

// Offsets in the first page of a swap area (union swap_header in the kernel's include/linux/swap.h).
constexpr std::size_t kInfoOffset = 1024;  // bootbits
constexpr std::size_t kVersionAt = kInfoOffset;
constexpr std::size_t kLastPageAt = kInfoOffset + 4;
constexpr std::size_t kBadPagesAt = kInfoOffset + 8;
constexpr std::size_t kUuidAt = kInfoOffset + 12;
constexpr std::size_t kLabelAt = kUuidAt + 16;
constexpr std::string_view kMagic = "SWAPSPACE2";

void random_uuid(unsigned char (&uuid)[16]) {
  if (::getrandom(uuid, sizeof uuid, 0) != static_cast<ssize_t>(sizeof uuid)) throw_errno(errno, "getrandom");
  uuid[6] = static_cast<unsigned char>((uuid[6] & 0x0f) | 0x40);  // version 4
  uuid[8] = static_cast<unsigned char>((uuid[8] & 0x3f) | 0x80);  // RFC 4122 variant
}

void write_header(int fd, const std::string& path, std::uint64_t bytes, std::string_view label) {
  unsigned char uuid[16];
  random_uuid(uuid);
  std::string header = make_swap_header(bytes, page_size(), label, uuid);
  if (retry_eintr([&] { return ::pwrite(fd, header.data(), header.size(), 0); }) != static_cast<ssize_t>(header.size()))
    throw_errno_fmt(errno, "write the swap header of {}", path);
  if (::fsync(fd) != 0) throw_errno_fmt(errno, "fsync {}", path);
}

SwapHeader read_header(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return {};
  std::string page(page_size(), '\0');
  ssize_t n = retry_eintr([&] { return ::pread(fd.get(), page.data(), page.size(), 0); });
  if (n != static_cast<ssize_t>(page.size())) return {};
  return parse_swap_header(page);
}

// Fills the file with zeros (every block written: no holes, no unwritten extents).
void write_zeros(int fd, const std::string& path, std::uint64_t bytes) {
  if (::ftruncate(fd, 0) != 0) throw_errno_fmt(errno, "truncate {}", path);
  const std::string block(1 << 20, '\0');
  std::uint64_t done = 0;
  while (done < bytes) {
    std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(block.size(), bytes - done));
    ssize_t w = retry_eintr([&] { return ::pwrite(fd, block.data(), n, static_cast<off_t>(done)); });
    if (w < 0) {
      if (errno == ENOSPC || errno == EDQUOT)
        throw Error(Code::kResourceExhausted,
                    fmt::format("swap file {}: no room on its disk for {}", path, mib(bytes)));
      throw_errno_fmt(errno, "write zeros to {}", path);
    }
    done += static_cast<std::uint64_t>(w);
  }
}

void set_nocow(int fd) {
  // btrfs holds a swap file only when it is not copy-on-write; the flag must be set while the file is empty.
  int flags = 0;
  if (::ioctl(fd, FS_IOC_GETFLAGS, &flags) == 0) {
    flags |= FS_NOCOW_FL;
    ::ioctl(fd, FS_IOC_SETFLAGS, &flags);
  }
}

bool same_file(const std::string& a, const struct stat& b) {
  struct stat st {};
  return ::stat(a.c_str(), &st) == 0 && st.st_dev == b.st_dev && st.st_ino == b.st_ino;
}

}  // namespace

SwapTotals parse_meminfo_swap(std::string_view meminfo) {
  SwapTotals t;
  std::istringstream in{std::string(meminfo)};
  std::string key;
  std::uint64_t kib = 0;
  std::string unit;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    if (!(fields >> key >> kib)) continue;
    if (key == "SwapTotal:") t.total_bytes = kib << 10;
    else if (key == "SwapFree:") t.free_bytes = kib << 10;
  }
  return t;
}

SwapTotals read_swap_totals() {
  try {
    return parse_meminfo_swap(read_text("/proc/meminfo"));
  } catch (const Error&) {
    return {};
  }
}

std::vector<ActiveSwap> parse_proc_swaps(std::string_view text) {
  std::vector<ActiveSwap> out;
  std::istringstream in{std::string(text)};
  std::string line;
  bool header = true;
  while (std::getline(in, line)) {
    if (header) {  // "Filename  Type  Size  Used  Priority"
      header = false;
      if (line.rfind("Filename", 0) == 0) continue;
    }
    std::istringstream fields(line);
    ActiveSwap s;
    std::string path;
    std::uint64_t size_kib = 0, used_kib = 0;
    if (!(fields >> path >> s.type >> size_kib >> used_kib >> s.priority)) continue;
    // The kernel escapes spaces, tabs, newlines and backslashes in the path as \ooo.
    for (std::size_t i = 0; i < path.size(); ++i) {
      if (path[i] == '\\' && i + 3 < path.size() &&
          path.substr(i + 1, 3).find_first_not_of("01234567") == std::string::npos) {
        s.path += static_cast<char>(std::stoi(path.substr(i + 1, 3), nullptr, 8));
        i += 3;
      } else {
        s.path += path[i];
      }
    }
    s.size_bytes = size_kib << 10;
    s.used_bytes = used_kib << 10;
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<ActiveSwap> read_proc_swaps() { return parse_proc_swaps(read_text("/proc/swaps")); }

std::string make_swap_header(std::uint64_t bytes, std::size_t page, std::string_view label,
                             const unsigned char (&uuid)[16]) {
  if (page < kLabelAt + 16 + kMagic.size()) throw Error(Code::kInvalidArgument, fmt::format("page size {}", page));
  std::uint64_t pages = bytes / page;
  if (pages < 10 || pages - 1 > 0xffffffffull)
    throw Error(Code::kInvalidArgument, fmt::format("a swap area of {} bytes is too small or too large", bytes));
  std::string header(page, '\0');
  put_u32(header, kVersionAt, 1);
  put_u32(header, kLastPageAt, static_cast<std::uint32_t>(pages - 1));
  put_u32(header, kBadPagesAt, 0);
  std::memcpy(header.data() + kUuidAt, uuid, 16);
  std::memcpy(header.data() + kLabelAt, label.data(), std::min<std::size_t>(label.size(), 16));
  std::memcpy(header.data() + page - kMagic.size(), kMagic.data(), kMagic.size());
  return header;
}

SwapHeader parse_swap_header(std::string_view page) {
  SwapHeader h;
  if (page.size() < kLabelAt + 16 + kMagic.size()) return h;
  if (page.substr(page.size() - kMagic.size()) != kMagic || get_u32(page, kVersionAt) != 1) return h;
  h.valid = true;
  h.pages = static_cast<std::uint64_t>(get_u32(page, kLastPageAt)) + 1;
  std::string_view label = page.substr(kLabelAt, 16);
  h.label = std::string(label.substr(0, label.find('\0')));
  return h;
}

SwapFilesystem swap_filesystem(const fs::path& dir) {
  struct statfs st {};
  if (::statfs(dir.c_str(), &st) != 0) throw_errno_fmt(errno, "statfs {}", dir.string());
  struct Known {
    unsigned long magic;
    const char* name;
    bool can_hold_swap;
  };
  static constexpr Known kKnown[] = {
      {0xEF53, "ext4", true},         {0x58465342, "xfs", true},    {0x9123683E, "btrfs", true},
      {0xF2F52010, "f2fs", true},     {0x01021994, "tmpfs", false}, {0x858458f6, "ramfs", false},
      {0x794c7630, "overlay", false}, {0x65735546, "fuse", false},  {0x6969, "nfs", false},
      {0xFF534D42, "cifs", false},    {0xFE534D42, "smb2", false},  {0x73717368, "squashfs", false},
      {0xE0F5E1E2, "erofs", false},   {0x2FC12FC1, "zfs", false},   {0x01021997, "9p", false},
      {0x00C36400, "ceph", false},    {0x9fa0, "proc", false},      {0x62656572, "sysfs", false},
  };
  auto magic = static_cast<unsigned long>(st.f_type) & 0xffffffffUL;
  for (const auto& k : kKnown)
    if (k.magic == magic) return SwapFilesystem{k.name, k.can_hold_swap};
  return SwapFilesystem{fmt::format("0x{:x}", magic), true};
}

NodeSwap::NodeSwap(const SwapOptions& options) {
  if (options.label.size() > 16) throw Error(Code::kInvalidArgument, "swap label: at most 16 bytes");
  try {
    if (options.zram_bytes > 0) setup_zram(options);
    if (!options.file.empty()) setup_file(options);
  } catch (...) {
    turn_off();
    throw;
  }
}

NodeSwap::~NodeSwap() { turn_off(); }

namespace {

// The directory of swap file `file`, made when missing; its filesystem, which can hold swap.
SwapFilesystem swap_file_dir(const fs::path& file) {
  const std::string path = file.string();
  std::error_code ec;
  fs::create_directories(file.parent_path(), ec);
  if (ec)
    throw Error(Code::kFailedPrecondition,
                fmt::format("swap file {}: mkdir {}: {}", path, file.parent_path().string(), ec.message()));
  SwapFilesystem where = swap_filesystem(file.parent_path());
  if (!where.can_hold_swap)
    throw Error(Code::kFailedPrecondition,
                fmt::format("swap file {}: its directory is on {}, which cannot hold swap; put it on a local disk "
                            "filesystem (ext4, xfs, btrfs)",
                            path, where.name));
  return where;
}

// swapon of the file at `path` (open as `fd`, its header written; `zeroed`: every block written already).
void swap_on_file(int fd, const std::string& path, std::uint64_t bytes, std::string_view label,
                  const std::string& filesystem, bool zeroed) {
  if (::swapon(path.c_str(), 0) == 0) return;
  int err = errno;
  if (err == EPERM) throw_errno_fmt(err, "swapon {} (needs CAP_SYS_ADMIN)", path);
  if (err != EINVAL || zeroed)
    throw_errno_fmt(err, "swapon {} (a swap file on {}; the filesystem may not support swap files)", path, filesystem);
  // Some filesystems refuse preallocated (unwritten) extents for swap: write every block and try once more.
  write_zeros(fd, path, bytes);
  write_header(fd, path, bytes, label);
  if (::swapon(path.c_str(), 0) != 0)
    throw_errno_fmt(errno, "swapon {} (a swap file on {}; the filesystem may not support swap files)", path,
                    filesystem);
}

}  // namespace

void NodeSwap::setup_file(const SwapOptions& o) {
  const std::string path = o.file.string();
  if (!o.file.is_absolute())
    throw Error(Code::kInvalidArgument, fmt::format("--swap-file: '{}' is not an absolute path", path));
  if (o.file_bytes < kMinSwapBytes)
    throw Error(Code::kInvalidArgument,
                fmt::format("--swap-size: a swap file needs at least 1Mi (got {} bytes)", o.file_bytes));
  const std::uint64_t bytes = o.file_bytes / page_size() * page_size();
  SwapFilesystem where = swap_file_dir(o.file);

  struct stat st {};
  const bool exists = ::lstat(path.c_str(), &st) == 0;
  if (!exists && errno != ENOENT) throw_errno_fmt(errno, "stat {}", path);
  if (exists && !S_ISREG(st.st_mode))
    throw Error(Code::kFailedPrecondition, fmt::format("swap file {}: exists and is not a regular file", path));

  if (exists) {
    for (const auto& active : read_proc_swaps()) {
      if (!same_file(active.path, st)) continue;
      // On already: an agent that did not shut down cleanly left it (its label says so), or someone else's swap.
      SwapHeader h = read_header(path);
      Area area{path, h.valid && h.label == o.label};
      areas_.push_back(area);
      summary_.push_back(
          fmt::format("swap file {} ({}) was already on; {}", path, mib(active.size_bytes),
                      area.owned ? "made by dsecd: turned off at shutdown" : "not made by dsecd: left on at shutdown"));
      if (active.size_bytes + page_size() != bytes && active.size_bytes != bytes)
        log_warn("swap file {} is on with {}, not the {} asked for; it is used as it is", path, mib(active.size_bytes),
                 mib(bytes));
      return;
    }
  }

  bool reuse = false;
  if (exists && st.st_size > 0) {
    SwapHeader h = read_header(path);
    if (!h.valid)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("swap file {}: exists and is not a swap area; remove it or give another path", path));
    // The same size with every block allocated: used as it is (a new header only).
    reuse = static_cast<std::uint64_t>(st.st_size) == bytes && h.pages * page_size() == bytes &&
            static_cast<std::uint64_t>(st.st_blocks) * 512 >= bytes;
  }

  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) throw_errno_fmt(errno, "open {}", path);
  if (::fchmod(fd.get(), 0600) != 0) throw_errno_fmt(errno, "chmod 600 {}", path);
  bool zeroed = false;
  if (!reuse) {
    if (::ftruncate(fd.get(), 0) != 0) throw_errno_fmt(errno, "truncate {}", path);
    if (where.name == "btrfs") set_nocow(fd.get());
    if (::fallocate(fd.get(), 0, 0, static_cast<off_t>(bytes)) != 0) {
      if (errno == ENOSPC || errno == EDQUOT)
        throw Error(Code::kResourceExhausted,
                    fmt::format("swap file {}: no room on its disk for {}", path, mib(bytes)));
      if (errno != EOPNOTSUPP) throw_errno_fmt(errno, "fallocate {} bytes for {}", bytes, path);
      write_zeros(fd.get(), path, bytes);  // a filesystem without fallocate: write every block
      zeroed = true;
    }
  }
  write_header(fd.get(), path, bytes, o.label);
  swap_on_file(fd.get(), path, bytes, o.label, where.name, zeroed);
  areas_.push_back(Area{path, true});
  summary_.push_back(fmt::format("swap file {} ({} on {}) {}; turned off at shutdown", path, mib(bytes), where.name,
                                 reuse ? "reused" : "made"));
}

void NodeSwap::setup_zram(const SwapOptions& o) {
  if (o.zram_bytes < kMinSwapBytes)
    throw Error(Code::kInvalidArgument, fmt::format("--zram-size: at least 1Mi (got {} bytes)", o.zram_bytes));
  Area area;
  std::error_code ec;
  if (fs::exists(fmt::format("{}/hot_add", kZramControl), ec)) {
    // A device of its own, so that another agent or user of zram0 is never disturbed.
    std::string id = trimmed(read_text(fmt::format("{}/hot_add", kZramControl)));
    try {
      area.zram_id = std::stoi(id);
    } catch (const std::exception&) {
      throw Error(Code::kInternal, fmt::format("{}/hot_add answered '{}'", kZramControl, id));
    }
    area.zram_added = true;
  } else if (fs::exists("/sys/block/zram0", ec)) {
    std::string disksize = trimmed(read_text("/sys/block/zram0/disksize"));
    bool swapped = false;
    for (const auto& s : read_proc_swaps()) swapped |= s.path == "/dev/zram0";
    if (disksize != "0" || swapped)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("zram0 is in use (disksize {}{}) and this kernel cannot add another zram device",
                              disksize, swapped ? ", a swap area" : ""));
    area.zram_id = 0;
  } else {
    throw Error(Code::kFailedPrecondition, "no zram device: the kernel has no zram module loaded (modprobe zram)");
  }
  area.path = fmt::format("/dev/zram{}", area.zram_id);
  areas_.push_back(area);  // from here on, turn_off() resets (and removes) it
  Area& added = areas_.back();
  const std::string sys = fmt::format("/sys/block/zram{}", added.zram_id);

  // "lzo lzo-rle [lz4] zstd": the bracketed one is in use.
  std::string offered = read_text(sys + "/comp_algorithm");
  std::vector<std::string> algorithms;
  std::istringstream words(offered);
  for (std::string w; words >> w;) {
    if (w.front() == '[' && w.back() == ']') w = w.substr(1, w.size() - 2);
    algorithms.push_back(w);
  }
  auto offers = [&](const std::string& a) {
    return std::find(algorithms.begin(), algorithms.end(), a) != algorithms.end();
  };
  std::string algorithm = o.zram_algorithm;
  if (!algorithm.empty() && !offers(algorithm))
    throw Error(Code::kInvalidArgument,
                fmt::format("--zram-algorithm: the kernel's zram offers {}, not '{}'", trimmed(offered), algorithm));
  if (algorithm.empty() && offers("lz4")) algorithm = "lz4";
  if (!algorithm.empty()) write_text(sys + "/comp_algorithm", algorithm);
  write_text(sys + "/disksize", std::to_string(o.zram_bytes));

  // devtmpfs makes the node; wait for it.
  struct stat st {};
  for (int i = 0; i < 200 && !(::stat(added.path.c_str(), &st) == 0 && S_ISBLK(st.st_mode)); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!S_ISBLK(st.st_mode))
    throw Error(Code::kFailedPrecondition, fmt::format("{} did not appear (is devtmpfs mounted on /dev?)", added.path));
  {
    UniqueFd fd(::open(added.path.c_str(), O_WRONLY | O_CLOEXEC));
    if (!fd) throw_errno_fmt(errno, "open {}", added.path);
    write_header(fd.get(), added.path, o.zram_bytes, o.label);
  }
  // Discard frees a zram page as soon as its swap slot is free.
  int flags = SWAP_FLAG_PREFER | (kZramPriority & SWAP_FLAG_PRIO_MASK) | SWAP_FLAG_DISCARD;
  if (::swapon(added.path.c_str(), flags) != 0) {
    int err = errno;
    throw_errno_fmt(err, "swapon {}{}", added.path, err == EPERM ? " (needs CAP_SYS_ADMIN)" : "");
  }
  added.owned = true;
  summary_.push_back(fmt::format("zram swap {} ({}, {}, priority {}) made; removed at shutdown", added.path,
                                 mib(o.zram_bytes), algorithm.empty() ? "default compression" : algorithm,
                                 kZramPriority));
}

void NodeSwap::turn_off() noexcept {
  while (!areas_.empty()) {
    Area area = areas_.back();
    areas_.pop_back();
    try {
      if (area.owned) {
        auto started = std::chrono::steady_clock::now();
        if (::swapoff(area.path.c_str()) != 0 && errno != EINVAL)  // EINVAL: not on (any more)
          throw_errno_fmt(errno, "swapoff {}", area.path);
        log_info("swap {} turned off ({:.1f} s)", area.path,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
      }
      if (area.zram_id >= 0) {
        const std::string sys = fmt::format("/sys/block/zram{}", area.zram_id);
        for (int i = 0;; ++i) {
          try {
            write_text(sys + "/reset", "1");
            break;
          } catch (const Error&) {
            if (i >= 50) throw;  // EBUSY while the device is still being released
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
        }
        if (area.zram_added) write_text(fmt::format("{}/hot_remove", kZramControl), std::to_string(area.zram_id));
      }
    } catch (const std::exception& e) {
      log_warn("turning swap {} off: {}", area.path, e.what());
    }
  }
}

}  // namespace dsec::agent
