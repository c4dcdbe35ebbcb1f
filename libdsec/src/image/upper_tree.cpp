#include "image/upper_tree.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <map>
#include <utility>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

namespace dsec::image {
namespace {

constexpr std::string_view kOverlayPrefix = "trusted.overlay.";
constexpr std::string_view kOpaque = "trusted.overlay.opaque";
constexpr std::size_t kMaxNotes = 20;
constexpr std::size_t kCopyBuffer = 1u << 20;

using Xattrs = std::vector<std::pair<std::string, std::string>>;

// A path as messages show it: bytes that are not printable ASCII escaped, so odd names stay readable.
std::string shown(std::string_view rel) {
  std::string out = "/";
  for (unsigned char c : rel) {
    if (c >= 0x20 && c < 0x7f && c != '\\') out.push_back(static_cast<char>(c));
    else out += fmt::format("\\x{:02x}", c);
  }
  return out;
}

[[noreturn]] void throw_write_errno(int err, std::string_view what) {
  if (err == ENOSPC || err == EDQUOT)
    throw Error(Code::kResourceExhausted, fmt::format("{}: the disk is full ({})", what, std::strerror(err)), false);
  throw_errno(err, what);
}

std::string proc_path(int dir_fd, const std::string& name) { return fmt::format("/proc/self/fd/{}/{}", dir_fd, name); }

// Lists and reads the xattrs of an open file (fd >= 0) or of `path` without following a symlink.
Xattrs read_xattrs(int fd, const std::string& path, std::string_view rel) {
  auto list = [&](char* buf, std::size_t size) {
    return fd >= 0 ? ::flistxattr(fd, buf, size) : ::llistxattr(path.c_str(), buf, size);
  };
  auto get = [&](const char* name, void* buf, std::size_t size) {
    return fd >= 0 ? ::fgetxattr(fd, name, buf, size) : ::lgetxattr(path.c_str(), name, buf, size);
  };
  Xattrs out;
  std::string names;
  for (;;) {
    ssize_t n = list(nullptr, 0);
    if (n < 0) {
      if (errno == ENOTSUP) return out;
      throw_errno_fmt(errno, "list the xattrs of {}", shown(rel));
    }
    if (n == 0) return out;
    names.resize(static_cast<std::size_t>(n));
    n = list(names.data(), names.size());
    if (n >= 0) {
      names.resize(static_cast<std::size_t>(n));
      break;
    }
    if (errno != ERANGE) throw_errno_fmt(errno, "list the xattrs of {}", shown(rel));
  }
  for (std::size_t at = 0; at < names.size();) {
    std::string name = names.c_str() + at;
    at += name.size() + 1;
    if (name.empty()) continue;
    std::string value;
    for (;;) {
      ssize_t n = get(name.c_str(), nullptr, 0);
      if (n < 0) {
        if (errno == ENODATA) break;
        throw_errno_fmt(errno, "read xattr {} of {}", name, shown(rel));
      }
      value.resize(static_cast<std::size_t>(n));
      n = get(name.c_str(), value.data(), value.size());
      if (n >= 0) {
        value.resize(static_cast<std::size_t>(n));
        out.emplace_back(std::move(name), std::move(value));
        break;
      }
      if (errno != ERANGE) throw_errno_fmt(errno, "read xattr {} of {}", name, shown(rel));
    }
  }
  return out;
}

class UpperCopier {
 public:
  UpperCopier(const UpperTreeLimits& limits, std::vector<std::string>& notes) : limits_(limits), notes_(notes) {}

  UpperTreeStats run(int upper_fd, const std::filesystem::path& dest) {
    UniqueFd src(::openat(upper_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!src) throw_errno(errno, "open the upper directory");
    struct stat st {};
    if (::fstat(src.get(), &st) != 0) throw_errno(errno, "stat the upper directory");
    dev_ = st.st_dev;
    if (::mkdir(dest.c_str(), 0700) != 0) throw_write_errno(errno, fmt::format("mkdir {}", dest.string()));
    UniqueFd out(::open(dest.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
    if (!out) throw_errno_fmt(errno, "open {}", dest.string());
    dest_root_ = out.get();
    copy_directory(src.get(), out.get(), "");
    Xattrs xattrs = read_xattrs(src.get(), {}, "");
    finish(out.get(), -1, {}, st, filter(xattrs, st, "", /*root=*/true));
    if (skipped_notes_ > kMaxNotes)
      notes_.push_back(fmt::format("... {} sockets or device nodes left out in all", skipped_notes_));
    return stats_;
  }

 private:
  // The xattrs a layer keeps. Throws for the overlay xattrs that put a file's data or name in a lower layer.
  Xattrs filter(const Xattrs& in, const struct stat& st, std::string_view rel, bool root = false) {
    Xattrs out;
    for (const auto& [name, value] : in) {
      if (!std::string_view(name).starts_with(kOverlayPrefix)) {
        out.emplace_back(name, value);
        continue;
      }
      if (name == kOpaque) {
        // "y": the directory replaced the image's. The root is never opaque (there is nothing above it to hide).
        if (S_ISDIR(st.st_mode) && value == "y" && !root) {
          out.emplace_back(name, value);
          ++stats_.opaque_directories;
        }
        continue;
      }
      if (name == "trusted.overlay.metacopy" || name == "trusted.overlay.redirect")
        throw Error(Code::kFailedPrecondition,
                    fmt::format("{} carries {}: the overlay was mounted with metacopy or redirect_dir on, so its "
                                "upper directory does not hold the whole file; it cannot be taken as a layer",
                                shown(rel), name));
      // origin, impure, nlink, upper, uuid, ...: overlayfs's bookkeeping for this mount only.
    }
    return out;
  }

  void check_path(const std::string& rel) {
    if (rel.size() > limits_.max_path_bytes)
      throw Error(Code::kResourceExhausted,
                  fmt::format("{}...: a path longer than {} bytes cannot go into a layer", shown(rel.substr(0, 200)),
                              limits_.max_path_bytes),
                  false);
  }

  void skip(const std::string& rel, std::string_view what) {
    ++stats_.skipped;
    if (++skipped_notes_ <= kMaxNotes) notes_.push_back(fmt::format("left out {} ({})", shown(rel), what));
  }

  // Copies the entries of the directory `src` into `out` (both open); metadata of each entry after its contents.
  void copy_directory(int src, int out, const std::string& rel_dir) {
    UniqueFd listing(::openat(src, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!listing) throw_errno_fmt(errno, "open {}", shown(rel_dir));
    DIR* dir = ::fdopendir(listing.get());
    if (!dir) throw_errno_fmt(errno, "read {}", shown(rel_dir));
    listing.release();
    struct CloseDir {
      DIR* d;
      ~CloseDir() { ::closedir(d); }
    } close_dir{dir};
    std::vector<std::string> names;
    errno = 0;
    while (dirent* e = ::readdir(dir)) {
      std::string_view n = e->d_name;
      if (n != "." && n != "..") names.emplace_back(n);
      errno = 0;
    }
    if (errno != 0) throw_errno_fmt(errno, "read {}", shown(rel_dir));
    for (const std::string& name : names) {
      std::string rel = rel_dir;
      if (!rel.empty()) rel += '/';
      rel += name;
      copy_entry(src, out, name, rel);
    }
  }

  void copy_entry(int src_dir, int out_dir, const std::string& name, const std::string& rel) {
    check_path(rel);
    struct stat st {};
    if (::fstatat(src_dir, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
      if (errno == ENOENT) return;  // gone meanwhile (the files API may write while the sandbox is frozen)
      throw_errno_fmt(errno, "stat {}", shown(rel));
    }
    if (st.st_dev != dev_) {
      skip(rel, "a mount point");
      return;
    }
    const mode_t type = st.st_mode & S_IFMT;
    switch (type) {
      case S_IFDIR: {
        UniqueFd sub(::openat(src_dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        if (!sub) throw_errno_fmt(errno, "open {}", shown(rel));
        if (::mkdirat(out_dir, name.c_str(), 0700) != 0) throw_write_errno(errno, fmt::format("mkdir {}", shown(rel)));
        UniqueFd sub_out(::openat(out_dir, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
        if (!sub_out) throw_errno_fmt(errno, "open the copy of {}", shown(rel));
        ++stats_.entries;
        ++stats_.directories;
        copy_directory(sub.get(), sub_out.get(), rel);
        Xattrs xattrs = filter(read_xattrs(sub.get(), {}, rel), st, rel);
        finish(sub_out.get(), -1, {}, st, xattrs);
        return;
      }
      case S_IFREG:
        copy_file(src_dir, out_dir, name, rel, st);
        return;
      case S_IFLNK: {
        std::string target(static_cast<std::size_t>(st.st_size) + 1, '\0');
        ssize_t n = ::readlinkat(src_dir, name.c_str(), target.data(), target.size());
        if (n < 0) throw_errno_fmt(errno, "read symlink {}", shown(rel));
        target.resize(static_cast<std::size_t>(n));
        if (::symlinkat(target.c_str(), out_dir, name.c_str()) != 0)
          throw_write_errno(errno, fmt::format("symlink {}", shown(rel)));
        ++stats_.entries;
        ++stats_.symlinks;
        stats_.file_bytes += target.size();
        break;
      }
      case S_IFCHR:
        if (st.st_rdev != makedev(0, 0)) {
          skip(rel, fmt::format("character device {}:{}", major(st.st_rdev), minor(st.st_rdev)));
          return;
        }
        if (::mknodat(out_dir, name.c_str(), S_IFCHR | (st.st_mode & 07777), makedev(0, 0)) != 0)
          throw_write_errno(errno, fmt::format("make the whiteout {}", shown(rel)));
        ++stats_.entries;
        ++stats_.whiteouts;
        break;
      case S_IFIFO:
        if (::mkfifoat(out_dir, name.c_str(), st.st_mode & 07777) != 0)
          throw_write_errno(errno, fmt::format("mkfifo {}", shown(rel)));
        ++stats_.entries;
        ++stats_.fifos;
        break;
      case S_IFSOCK:
        skip(rel, "a socket");
        return;
      default:
        skip(rel, "a block device");
        return;
    }
    // Symlinks, whiteouts and FIFOs: their metadata through their names (opening them is no use or would block).
    Xattrs xattrs = filter(read_xattrs(-1, proc_path(src_dir, name), rel), st, rel);
    finish(-1, out_dir, name, st, xattrs);
  }

  void copy_file(int src_dir, int out_dir, const std::string& name, const std::string& rel, const struct stat& st) {
    if (st.st_nlink > 1) {
      auto it = links_.find(st.st_ino);
      if (it != links_.end()) {
        if (::linkat(dest_root_, it->second.c_str(), out_dir, name.c_str(), 0) != 0)
          throw_write_errno(errno, fmt::format("link {} to {}", shown(rel), shown(it->second)));
        ++stats_.entries;
        ++stats_.hard_links;
        return;
      }
    }
    stats_.file_bytes += static_cast<std::uint64_t>(st.st_size);
    if (stats_.file_bytes > limits_.max_file_bytes)
      throw Error(Code::kResourceExhausted,
                  fmt::format("the files add up to more than {} bytes (sparse files counted whole), more than a "
                              "layer may hold here (at {})",
                              limits_.max_file_bytes, shown(rel)),
                  false);
    UniqueFd in(::openat(src_dir, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
    if (!in) throw_errno_fmt(errno, "open {}", shown(rel));
    UniqueFd out(::openat(out_dir, name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!out) throw_write_errno(errno, fmt::format("create the copy of {}", shown(rel)));
    copy_data(in.get(), out.get(), static_cast<off_t>(st.st_size), rel);
    ++stats_.entries;
    ++stats_.files;
    Xattrs xattrs = filter(read_xattrs(in.get(), {}, rel), st, rel);
    finish(out.get(), -1, {}, st, xattrs);
    if (st.st_nlink > 1) links_.emplace(st.st_ino, rel);
  }

  // The data of `in` into `out`, extent by extent: holes are skipped and stay holes.
  void copy_data(int in, int out, off_t size, const std::string& rel) {
    off_t pos = 0;
    while (pos < size) {
      off_t data = ::lseek(in, pos, SEEK_DATA);
      if (data < 0) {
        if (errno == ENXIO) break;  // only a hole is left
        if (errno != EINVAL && errno != ENOTSUP) throw_errno_fmt(errno, "seek in {}", shown(rel));
        data = pos;  // no SEEK_DATA here: the rest is data
      }
      if (data >= size) break;
      off_t hole = ::lseek(in, data, SEEK_HOLE);
      if (hole < 0 || hole > size) hole = size;
      copy_range(in, out, data, hole - data, rel);
      pos = hole;
    }
    if (::ftruncate(out, size) != 0) throw_write_errno(errno, fmt::format("size the copy of {}", shown(rel)));
  }

  void copy_range(int in, int out, off_t at, off_t length, const std::string& rel) {
    off_t from = at, to = at;
    off_t left = length;
    while (left > 0 && !plain_copy_) {
      ssize_t n = ::copy_file_range(in, &from, out, &to, static_cast<std::size_t>(left), 0);
      if (n > 0) {
        left -= n;
        stats_.data_bytes += static_cast<std::uint64_t>(n);
        continue;
      }
      if (n == 0) return;  // the file shrank meanwhile
      if (errno == EINTR) continue;
      if (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) {
        plain_copy_ = true;  // another filesystem (tmpfs to disk): sendfile, else read and write
        break;
      }
      throw_write_errno(errno, fmt::format("copy {}", shown(rel)));
    }
    // sendfile moves the pages in the kernel: one copy instead of two through a buffer.
    while (left > 0 && !no_sendfile_) {
      if (::lseek(out, to, SEEK_SET) < 0) throw_errno_fmt(errno, "seek in the copy of {}", shown(rel));
      ssize_t n = ::sendfile(out, in, &from, static_cast<std::size_t>(std::min<off_t>(left, 1 << 30)));
      if (n > 0) {
        left -= n;
        to += n;
        stats_.data_bytes += static_cast<std::uint64_t>(n);
        continue;
      }
      if (n == 0) return;
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) {
        no_sendfile_ = true;
        break;
      }
      throw_write_errno(errno, fmt::format("copy {}", shown(rel)));
    }
    if (left <= 0) return;
    if (buffer_.empty()) buffer_.resize(kCopyBuffer);
    while (left > 0) {
      ssize_t n = retry_eintr([&] {
        return ::pread(in, buffer_.data(), std::min<std::size_t>(buffer_.size(), static_cast<std::size_t>(left)), from);
      });
      if (n < 0) throw_errno_fmt(errno, "read {}", shown(rel));
      if (n == 0) return;
      for (ssize_t done = 0; done < n;) {
        ssize_t w =
            retry_eintr([&] { return ::pwrite(out, buffer_.data() + done, static_cast<std::size_t>(n - done), to); });
        if (w < 0) throw_write_errno(errno, fmt::format("write the copy of {}", shown(rel)));
        done += w;
        to += w;
      }
      from += n;
      left -= n;
      stats_.data_bytes += static_cast<std::uint64_t>(n);
    }
  }

  // Owner, mode, xattrs and times of a copied entry: through its descriptor (fd >= 0), else by name in `dir_fd`.
  // Owner first: chown clears set-id bits. Times last: setting xattrs does not touch them, but be plain about it.
  void finish(int fd, int dir_fd, const std::string& name, const struct stat& st, const Xattrs& xattrs) {
    const std::string what = name.empty() ? "a copied entry" : name;
    if (fd >= 0) {
      if (::fchown(fd, st.st_uid, st.st_gid) != 0) throw_errno_fmt(errno, "chown {}", what);
      if (::fchmod(fd, st.st_mode & 07777) != 0) throw_errno_fmt(errno, "chmod {}", what);
      for (const auto& [key, value] : xattrs)
        if (::fsetxattr(fd, key.c_str(), value.data(), value.size(), 0) != 0)
          throw_write_errno(errno, fmt::format("set xattr {}", key));
      const struct timespec times[2] = {st.st_atim, st.st_mtim};
      if (::futimens(fd, times) != 0) throw_errno_fmt(errno, "set the times of {}", what);
      return;
    }
    if (::fchownat(dir_fd, name.c_str(), st.st_uid, st.st_gid, AT_SYMLINK_NOFOLLOW) != 0)
      throw_errno_fmt(errno, "chown {}", what);
    if (!S_ISLNK(st.st_mode) && ::fchmodat(dir_fd, name.c_str(), st.st_mode & 07777, 0) != 0)
      throw_errno_fmt(errno, "chmod {}", what);
    const std::string path = proc_path(dir_fd, name);
    for (const auto& [key, value] : xattrs)
      if (::lsetxattr(path.c_str(), key.c_str(), value.data(), value.size(), 0) != 0)
        throw_write_errno(errno, fmt::format("set xattr {}", key));
    const struct timespec times[2] = {st.st_atim, st.st_mtim};
    if (::utimensat(dir_fd, name.c_str(), times, AT_SYMLINK_NOFOLLOW) != 0)
      throw_errno_fmt(errno, "set the times of {}", what);
  }

  const UpperTreeLimits& limits_;
  std::vector<std::string>& notes_;
  UpperTreeStats stats_;
  dev_t dev_ = 0;
  int dest_root_ = -1;
  std::map<ino_t, std::string> links_;  // inode of a multiply linked file -> where its first name was copied
  std::size_t skipped_notes_ = 0;
  bool plain_copy_ = false;   // copy_file_range cannot cross these filesystems
  bool no_sendfile_ = false;  // nor can sendfile
  std::vector<char> buffer_;
};

}  // namespace

UpperTreeStats copy_upper_tree(int upper_fd, const std::filesystem::path& dest, const UpperTreeLimits& limits,
                               std::vector<std::string>& notes) {
  UpperCopier copier(limits, notes);
  return copier.run(upper_fd, dest);
}

}  // namespace dsec::image
