#include "image/erofs_meta.hpp"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <set>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

namespace dsec::image {
namespace fs = std::filesystem;
namespace {

// linux/fs/erofs/erofs_fs.h
constexpr std::uint64_t kSuperblockOffset = 1024;
constexpr std::uint32_t kMagic = 0xE0F5E1E2;
constexpr std::size_t kCompactInodeSize = 32;
constexpr std::size_t kExtendedInodeSize = 64;
constexpr std::size_t kXattrIbodyHeaderSize = 12;
constexpr std::size_t kXattrEntrySize = 4;
constexpr std::size_t kDirentSize = 12;
constexpr unsigned kLayoutFlatPlain = 0;
constexpr unsigned kLayoutFlatInline = 2;
constexpr std::size_t kMaxDepth = 4096;
constexpr std::uint64_t kMaxEntries = 64u << 20;

std::uint16_t le16(const unsigned char* p) { return static_cast<std::uint16_t>(p[0] | (p[1] << 8)); }
std::uint32_t le32(const unsigned char* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}
std::uint64_t le64(const unsigned char* p) { return le32(p) | (static_cast<std::uint64_t>(le32(p + 4)) << 32); }

std::string_view xattr_prefix(unsigned index) {
  switch (index) {
    case 1:
      return "user.";
    case 2:
      return "system.posix_acl_access";
    case 3:
      return "system.posix_acl_default";
    case 4:
      return "trusted.";
    case 5:
      return "lustre.";
    case 6:
      return "security.";
    default:
      return {};
  }
}

struct Inode {
  std::uint64_t offset = 0;  // of the inode in the image
  std::size_t inode_size = 0;
  std::size_t xattr_size = 0;
  unsigned layout = 0;
  std::uint32_t mode = 0;
  std::uint32_t nlink = 0;
  std::uint64_t size = 0;
  std::uint32_t raw_blkaddr = 0;
};

class ErofsReader {
 public:
  ErofsReader(const fs::path& path, std::uint64_t meta_bytes) : path_(path) {
    fd_.reset(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd_) throw_errno_fmt(errno, "open {}", path.string());
    struct stat st {};
    if (::fstat(fd_.get(), &st) != 0) throw_errno_fmt(errno, "stat {}", path.string());
    limit_ = static_cast<std::uint64_t>(st.st_size);
    if (meta_bytes > 0 && meta_bytes < limit_) limit_ = meta_bytes;
    std::string sb = read(kSuperblockOffset, 128);
    auto* p = reinterpret_cast<const unsigned char*>(sb.data());
    if (le32(p) != kMagic) bad("no EROFS superblock");
    blkszbits_ = p[12];
    if (blkszbits_ < 9 || blkszbits_ > 16) bad(fmt::format("block size 2^{}", blkszbits_));
    root_nid_ = le16(p + 14);
    meta_blkaddr_ = le32(p + 40);
    xattr_blkaddr_ = le32(p + 44);
  }

  std::vector<ErofsEntry> entries() {
    std::vector<ErofsEntry> out;
    walk(root_nid_, "", 0, out);
    return out;
  }

 private:
  [[noreturn]] void bad(std::string_view why) const {
    throw Error(Code::kDataLoss, fmt::format("{} is not a readable EROFS image: {}", path_.string(), why));
  }

  std::string read(std::uint64_t offset, std::size_t length) const {
    if (offset > limit_ || length > limit_ - offset)
      bad(fmt::format("bytes {}..{} lie past its metadata ({} bytes)", offset, offset + length, limit_));
    std::string out(length, '\0');
    std::size_t done = 0;
    while (done < length) {
      ssize_t n = retry_eintr(
          [&] { return ::pread(fd_.get(), out.data() + done, length - done, static_cast<off_t>(offset + done)); });
      if (n < 0) throw_errno_fmt(errno, "read {}", path_.string());
      if (n == 0) bad("it ends early");
      done += static_cast<std::size_t>(n);
    }
    return out;
  }

  std::uint64_t block_size() const { return std::uint64_t{1} << blkszbits_; }

  Inode inode(std::uint64_t nid) const {
    Inode in;
    in.offset = static_cast<std::uint64_t>(meta_blkaddr_) * block_size() + nid * 32;
    std::string head = read(in.offset, kCompactInodeSize);
    auto* p = reinterpret_cast<const unsigned char*>(head.data());
    const std::uint16_t format = le16(p);
    const bool extended = format & 1;
    in.layout = (format >> 1) & 7;
    const std::uint16_t icount = le16(p + 2);
    in.xattr_size = icount ? kXattrIbodyHeaderSize + std::size_t{4} * (icount - 1u) : 0;
    in.mode = le16(p + 4);
    if (extended) {
      std::string full = read(in.offset, kExtendedInodeSize);
      auto* q = reinterpret_cast<const unsigned char*>(full.data());
      in.inode_size = kExtendedInodeSize;
      in.size = le64(q + 8);
      in.raw_blkaddr = le32(q + 16);
      in.nlink = le32(q + 44);
    } else {
      in.inode_size = kCompactInodeSize;
      in.nlink = le16(p + 6);
      in.size = le32(p + 8);
      in.raw_blkaddr = le32(p + 16);
    }
    return in;
  }

  // One xattr entry at `p` (at most `room` bytes); returns its aligned size.
  std::size_t xattr_entry(const unsigned char* p, std::size_t room,
                          std::vector<std::pair<std::string, std::string>>& out) const {
    if (room < kXattrEntrySize) bad("an xattr entry past its inode");
    const unsigned name_len = p[0];
    const unsigned index = p[1];
    const unsigned value_size = le16(p + 2);
    const std::size_t size = (kXattrEntrySize + name_len + value_size + 3) & ~std::size_t{3};
    if (kXattrEntrySize + name_len + value_size > room) bad("an xattr entry past its inode");
    if (index & 0x80)
      throw Error(Code::kUnimplemented,
                  fmt::format("{}: xattrs with long name prefixes (erofs-utils 1.7 and later) are not read here",
                              path_.string()));
    std::string_view prefix = xattr_prefix(index);
    if (prefix.empty()) bad(fmt::format("xattr name index {}", index));
    std::string name(prefix);
    name.append(reinterpret_cast<const char*>(p + kXattrEntrySize), name_len);
    std::string value(reinterpret_cast<const char*>(p + kXattrEntrySize + name_len), value_size);
    out.emplace_back(std::move(name), std::move(value));
    return size;
  }

  std::vector<std::pair<std::string, std::string>> xattrs(const Inode& in) const {
    std::vector<std::pair<std::string, std::string>> out;
    if (in.xattr_size == 0) return out;
    if (in.xattr_size < kXattrIbodyHeaderSize) bad("a short xattr body");
    std::string body = read(in.offset + in.inode_size, in.xattr_size);
    auto* p = reinterpret_cast<const unsigned char*>(body.data());
    const unsigned shared = p[4];
    std::size_t at = kXattrIbodyHeaderSize + std::size_t{4} * shared;
    if (at > body.size()) bad("more shared xattrs than fit in the xattr body");
    for (unsigned i = 0; i < shared; ++i) {
      const std::uint32_t id = le32(p + kXattrIbodyHeaderSize + std::size_t{4} * i);
      const std::uint64_t where = static_cast<std::uint64_t>(xattr_blkaddr_) * block_size() + std::uint64_t{id} * 4;
      // An entry is at most 4 + 255 + 65535 bytes; read its head, then all of it.
      std::string head = read(where, kXattrEntrySize);
      auto* h = reinterpret_cast<const unsigned char*>(head.data());
      std::string entry = read(where, kXattrEntrySize + h[0] + le16(h + 2));
      xattr_entry(reinterpret_cast<const unsigned char*>(entry.data()), entry.size(), out);
    }
    while (at + kXattrEntrySize <= body.size()) at += xattr_entry(p + at, body.size() - at, out);
    return out;
  }

  // The directory's data, one piece per block (dirents never cross a block).
  std::vector<std::string> directory_blocks(const Inode& in) const {
    if (in.layout != kLayoutFlatPlain && in.layout != kLayoutFlatInline)
      bad(fmt::format("a directory with data layout {}", in.layout));
    const std::uint64_t bs = block_size();
    const std::uint64_t nblocks = (in.size + bs - 1) / bs;
    const std::uint64_t on_disk = in.layout == kLayoutFlatInline && nblocks > 0 ? nblocks - 1 : nblocks;
    std::vector<std::string> out;
    for (std::uint64_t b = 0; b < on_disk; ++b) {
      std::uint64_t len = std::min(bs, in.size - b * bs);
      out.push_back(read((static_cast<std::uint64_t>(in.raw_blkaddr) + b) * bs, static_cast<std::size_t>(len)));
    }
    if (on_disk < nblocks)
      out.push_back(read(in.offset + in.inode_size + in.xattr_size, static_cast<std::size_t>(in.size - on_disk * bs)));
    return out;
  }

  void walk(std::uint64_t nid, const std::string& path, std::size_t depth, std::vector<ErofsEntry>& out) {
    if (depth > kMaxDepth) bad("directories nested deeper than 4096");
    if (out.size() > kMaxEntries) bad("more than 64 Mi entries");
    Inode in = inode(nid);
    ErofsEntry e;
    e.path = path;
    e.nid = nid;
    e.mode = in.mode;
    e.nlink = in.nlink;
    e.xattrs = xattrs(in);
    out.push_back(std::move(e));
    if (!S_ISDIR(in.mode)) return;
    if (!dirs_seen_.insert(nid).second) bad(fmt::format("directory {} appears twice", path.empty() ? "/" : path));
    for (const std::string& block : directory_blocks(in)) {
      auto* p = reinterpret_cast<const unsigned char*>(block.data());
      if (block.size() < kDirentSize) bad("a directory block without entries");
      const std::size_t first_name = le16(p + 8);
      const std::size_t count = first_name / kDirentSize;
      if (count == 0 || first_name > block.size() || first_name % kDirentSize != 0) bad("a malformed directory block");
      for (std::size_t i = 0; i < count; ++i) {
        const unsigned char* d = p + i * kDirentSize;
        const std::size_t start = le16(d + 8);
        const std::size_t end = i + 1 < count ? le16(d + kDirentSize + 8) : block.size();
        if (start > end || end > block.size() || start < first_name) bad("a directory entry's name out of its block");
        std::string_view name(block.data() + start, end - start);
        if (i + 1 == count) name = name.substr(0, ::strnlen(name.data(), name.size()));
        if (name.empty() || name.find('/') != std::string_view::npos || name.find('\0') != std::string_view::npos)
          bad("a malformed name in a directory");
        if (name == "." || name == "..") continue;
        walk(le64(d), path.empty() ? std::string(name) : path + "/" + std::string(name), depth + 1, out);
      }
    }
  }

  fs::path path_;
  UniqueFd fd_;
  std::uint64_t limit_ = 0;
  unsigned blkszbits_ = 12;
  std::uint64_t root_nid_ = 0;
  std::uint32_t meta_blkaddr_ = 0;
  std::uint32_t xattr_blkaddr_ = 0;
  std::set<std::uint64_t> dirs_seen_;
};

// The parent directory of `rel` below `root`, never through a symlink, and the last component.
std::pair<UniqueFd, std::string> open_parent(int root, const std::string& rel) {
  std::size_t slash = rel.rfind('/');
  std::string dir = slash == std::string::npos ? "." : rel.substr(0, slash);
  std::string name = slash == std::string::npos ? rel : rel.substr(slash + 1);
  open_how how{};
  how.flags = O_PATH | O_DIRECTORY | O_CLOEXEC;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
  int fd = static_cast<int>(retry_eintr([&] { return ::syscall(SYS_openat2, root, dir.c_str(), &how, sizeof how); }));
  if (fd < 0) throw_errno_fmt(errno, "open {} in the extracted layer", dir);
  return {UniqueFd(fd), std::move(name)};
}

}  // namespace

std::vector<ErofsEntry> read_erofs_entries(const fs::path& image, std::uint64_t meta_bytes) {
  ErofsReader reader(image, meta_bytes);
  return reader.entries();
}

ErofsRestoreStats restore_erofs_metadata(const fs::path& image, std::uint64_t meta_bytes, const fs::path& tree) {
  ErofsRestoreStats stats;
  std::vector<ErofsEntry> entries = read_erofs_entries(image, meta_bytes);
  UniqueFd root(::open(tree.c_str(), O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
  if (!root) throw_errno_fmt(errno, "open {}", tree.string());
  std::map<std::uint64_t, std::string> first_name;  // nid of a hard-linked file -> its first path
  for (const ErofsEntry& e : entries) {
    if (S_ISREG(e.mode) && e.nlink > 1) {
      auto [it, fresh] = first_name.emplace(e.nid, e.path);
      if (!fresh) {
        auto [dir, name] = open_parent(root.get(), e.path);
        auto [from_dir, from_name] = open_parent(root.get(), it->second);
        // Relinking changes the directory's times, which fsck.erofs set from the image: they are put back.
        struct stat dir_st {};
        if (::fstat(dir.get(), &dir_st) != 0) throw_errno_fmt(errno, "stat the directory of {}", e.path);
        if (::unlinkat(dir.get(), name.c_str(), 0) != 0 && errno != ENOENT)
          throw_errno_fmt(errno, "replace {} in the extracted layer", e.path);
        if (::linkat(from_dir.get(), from_name.c_str(), dir.get(), name.c_str(), 0) != 0)
          throw_errno_fmt(errno, "link {} to {} in the extracted layer", e.path, it->second);
        const struct timespec times[2] = {dir_st.st_atim, dir_st.st_mtim};
        const std::string dir_path = fmt::format("/proc/self/fd/{}", dir.get());
        if (::utimensat(AT_FDCWD, dir_path.c_str(), times, 0) != 0)
          throw_errno_fmt(errno, "set the times of the directory of {}", e.path);
        ++stats.hard_links;
        continue;  // a link shares its first name's xattrs
      }
    }
    // fsck.erofs chowns after it chmods, which clears set-user-ID and set-group-ID bits: the mode is set again.
    if ((e.mode & (S_ISUID | S_ISGID)) && !S_ISLNK(e.mode)) {
      int rc = 0;
      if (e.path.empty()) {
        rc = ::chmod(fmt::format("/proc/self/fd/{}", root.get()).c_str(), e.mode & 07777);
      } else {
        auto [dir, name] = open_parent(root.get(), e.path);
        rc = ::fchmodat(dir.get(), name.c_str(), e.mode & 07777, 0);
      }
      if (rc != 0) throw_errno_fmt(errno, "chmod {} in the extracted layer", e.path.empty() ? "/" : e.path);
      ++stats.modes;
    }
    if (e.xattrs.empty()) continue;
    std::string target;
    UniqueFd dir;
    if (e.path.empty()) {
      target = fmt::format("/proc/self/fd/{}", root.get());
    } else {
      auto [d, name] = open_parent(root.get(), e.path);
      dir = std::move(d);
      target = fmt::format("/proc/self/fd/{}/{}", dir.get(), name);
    }
    for (const auto& [key, value] : e.xattrs) {
      // The root through its descriptor's magic link (followed); any other entry by name (a symlink not followed).
      int rc = e.path.empty() ? ::setxattr(target.c_str(), key.c_str(), value.data(), value.size(), 0)
                              : ::lsetxattr(target.c_str(), key.c_str(), value.data(), value.size(), 0);
      if (rc != 0)
        throw_errno_fmt(errno, "set xattr {} on {} in the extracted layer", key, e.path.empty() ? "/" : e.path);
      ++stats.xattrs;
    }
  }
  return stats;
}

}  // namespace dsec::image
