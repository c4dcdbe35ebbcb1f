#include "image/tree_diff.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

namespace dsec::image {
namespace fs = std::filesystem;
namespace {

constexpr std::string_view kOverlayXattrPrefix = "trusted.overlay.";
constexpr std::size_t kMaxSkipNotes = 20;

using Xattrs = std::map<std::string, std::string>;

struct stat lstat_or_throw(const fs::path& p) {
  struct stat st {};
  if (::lstat(p.c_str(), &st) != 0) throw_errno_fmt(errno, "stat {}", p.string());
  return st;
}

// The names in a directory, sorted, without "." and "..".
std::vector<std::string> list_dir(const fs::path& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (!d) throw_errno_fmt(errno, "open directory {}", dir.string());
  errno = 0;
  while (dirent* e = ::readdir(d)) {
    std::string_view n = e->d_name;
    if (n != "." && n != "..") names.emplace_back(n);
    errno = 0;
  }
  int err = errno;
  ::closedir(d);
  if (err != 0) throw_errno_fmt(err, "read directory {}", dir.string());
  std::sort(names.begin(), names.end());
  return names;
}

// Extended attributes of `p` (not following a symlink), without overlayfs's own.
Xattrs read_xattrs(const fs::path& p) {
  Xattrs out;
  std::string names;
  for (;;) {
    ssize_t n = ::llistxattr(p.c_str(), nullptr, 0);
    if (n < 0) {
      if (errno == ENOTSUP || errno == ENODATA) return out;
      throw_errno_fmt(errno, "list xattrs of {}", p.string());
    }
    if (n == 0) return out;
    names.resize(static_cast<std::size_t>(n));
    n = ::llistxattr(p.c_str(), names.data(), names.size());
    if (n >= 0) {
      names.resize(static_cast<std::size_t>(n));
      break;
    }
    if (errno != ERANGE) throw_errno_fmt(errno, "list xattrs of {}", p.string());
  }
  for (std::size_t at = 0; at < names.size();) {
    std::string name = names.c_str() + at;
    at += name.size() + 1;
    if (name.empty() || name.starts_with(kOverlayXattrPrefix)) continue;
    std::string value;
    for (;;) {
      ssize_t n = ::lgetxattr(p.c_str(), name.c_str(), nullptr, 0);
      if (n < 0) {
        if (errno == ENODATA) break;  // removed meanwhile
        throw_errno_fmt(errno, "read xattr {} of {}", name, p.string());
      }
      value.resize(static_cast<std::size_t>(n));
      n = ::lgetxattr(p.c_str(), name.c_str(), value.data(), value.size());
      if (n >= 0) {
        value.resize(static_cast<std::size_t>(n));
        out.emplace(std::move(name), std::move(value));
        break;
      }
      if (errno != ERANGE) throw_errno_fmt(errno, "read xattr {} of {}", name, p.string());
    }
  }
  return out;
}

void write_xattrs(const fs::path& p, const Xattrs& xattrs) {
  for (const auto& [name, value] : xattrs)
    if (::lsetxattr(p.c_str(), name.c_str(), value.data(), value.size(), 0) != 0)
      throw_errno_fmt(errno, "set xattr {} on {}", name, p.string());
}

std::string read_link(const fs::path& p, std::size_t size_hint) {
  std::string target(std::max<std::size_t>(size_hint, 64) + 1, '\0');
  for (;;) {
    ssize_t n = ::readlink(p.c_str(), target.data(), target.size());
    if (n < 0) throw_errno_fmt(errno, "read symlink {}", p.string());
    if (static_cast<std::size_t>(n) < target.size()) {
      target.resize(static_cast<std::size_t>(n));
      return target;
    }
    target.resize(target.size() * 2);
  }
}

bool same_time(const struct stat& a, const struct stat& b) {
  return a.st_mtim.tv_sec == b.st_mtim.tv_sec && a.st_mtim.tv_nsec == b.st_mtim.tv_nsec;
}

// Owner, mode, times and xattrs of `from` onto `to` (not following symlinks). Owner first: chown clears set-id bits.
void copy_metadata(const fs::path& from, const struct stat& st, const fs::path& to) {
  if (::lchown(to.c_str(), st.st_uid, st.st_gid) != 0) throw_errno_fmt(errno, "chown {}", to.string());
  if (!S_ISLNK(st.st_mode) && ::chmod(to.c_str(), st.st_mode & 07777) != 0)
    throw_errno_fmt(errno, "chmod {}", to.string());
  write_xattrs(to, read_xattrs(from));
  const struct timespec times[2] = {st.st_atim, st.st_mtim};
  if (::utimensat(AT_FDCWD, to.c_str(), times, AT_SYMLINK_NOFOLLOW) != 0)
    throw_errno_fmt(errno, "set times of {}", to.string());
}

// Copies a regular file's bytes: a reflink where the filesystem shares extents, else copy_file_range, else
// read/write.
void copy_file_data(const fs::path& from, int in, const fs::path& to, int out) {
  if (::ioctl(out, FICLONE, in) == 0) return;
  bool plain = false;
  for (;;) {
    ssize_t n = ::copy_file_range(in, nullptr, out, nullptr, 1u << 30, 0);
    if (n > 0) continue;
    if (n == 0) return;
    if (errno == EINTR) continue;
    if (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) {
      plain = true;
      break;
    }
    if (errno == ENOSPC) throw Error(Code::kResourceExhausted, fmt::format("write {}: the disk is full", to.string()));
    throw_errno_fmt(errno, "copy {} to {}", from.string(), to.string());
  }
  if (!plain) return;
  std::vector<char> buf(1u << 20);
  for (;;) {
    ssize_t n = retry_eintr([&] { return ::read(in, buf.data(), buf.size()); });
    if (n < 0) throw_errno_fmt(errno, "read {}", from.string());
    if (n == 0) return;
    for (ssize_t done = 0; done < n;) {
      ssize_t w = retry_eintr([&] { return ::write(out, buf.data() + done, static_cast<std::size_t>(n - done)); });
      if (w < 0) {
        if (errno == ENOSPC)
          throw Error(Code::kResourceExhausted, fmt::format("write {}: the disk is full", to.string()));
        throw_errno_fmt(errno, "write {}", to.string());
      }
      done += w;
    }
  }
}

class Differ {
 public:
  Differ(fs::path base, fs::path full, fs::path out, std::vector<std::string>& notes, const DiffOptions& options)
      : base_(std::move(base)), full_(std::move(full)), out_(std::move(out)), notes_(notes) {
    full_dev_ = lstat_or_throw(full_).st_dev;
    out_dev_ = lstat_or_throw(out_).st_dev;
    may_link_ = options.link_files && full_dev_ == out_dev_;
  }

  DiffStats run() {
    created_.insert(fs::path());
    dirs_.push_back(fs::path());
    walk(fs::path(), true);
    // Directory metadata last, deepest first: writing into a directory changes its times.
    for (auto it = dirs_.rbegin(); it != dirs_.rend(); ++it) {
      fs::path f = join(full_, *it);
      copy_metadata(f, lstat_or_throw(f), join(out_, *it));
    }
    if (skipped_mounts_ > kMaxSkipNotes)
      notes_.push_back(fmt::format("... {} mount points left out in all", skipped_mounts_));
    return stats_;
  }

 private:
  static fs::path join(const fs::path& root, const fs::path& rel) { return rel.empty() ? root : root / rel; }

  // Makes out/rel (and the directories above it) if this run has not yet.
  void ensure_dir(const fs::path& rel) {
    if (created_.count(rel)) return;
    ensure_dir(rel.parent_path());
    fs::path p = join(out_, rel);
    if (::mkdir(p.c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}", p.string());
    created_.insert(rel);
    dirs_.push_back(rel);
  }

  bool is_mount_point(const fs::path& rel, const struct stat& st) {
    if (!S_ISDIR(st.st_mode) || st.st_dev == full_dev_) return false;
    if (skipped_mounts_++ < kMaxSkipNotes)
      notes_.push_back(fmt::format("left out /{}: another filesystem is mounted there", rel.string()));
    return true;
  }

  // Compares the directory full/rel with base/rel (when `in_base`) and writes what differs.
  void walk(const fs::path& rel, bool in_base) {
    const fs::path full_dir = join(full_, rel);
    const fs::path base_dir = join(base_, rel);
    std::vector<std::string> names = list_dir(full_dir);
    std::vector<std::string> base_names;
    if (in_base) base_names = list_dir(base_dir);

    for (const std::string& name : names) {
      const fs::path child = rel / name;
      const fs::path f = full_dir / name;
      const struct stat fst = lstat_or_throw(f);
      if (is_mount_point(child, fst)) continue;
      struct stat bst {};
      bool in_b = in_base && std::binary_search(base_names.begin(), base_names.end(), name);
      if (in_b && ::lstat((base_dir / name).c_str(), &bst) != 0) {
        if (errno != ENOENT) throw_errno_fmt(errno, "stat {}", (base_dir / name).string());
        in_b = false;
      }
      if (S_ISDIR(fst.st_mode)) {
        if (in_b && S_ISDIR(bst.st_mode)) {
          if (!same_dir_metadata(base_dir / name, bst, f, fst)) {
            ensure_dir(child);
            ++stats_.written;
          }
          walk(child, true);
        } else {
          ensure_dir(child);
          if (in_b) {
            mark_opaque(child);
          }
          ++stats_.written;
          copy_subtree(child);
        }
      } else if (in_b && !S_ISDIR(bst.st_mode) && same_entry(base_dir / name, bst, f, fst)) {
        ++stats_.unchanged;
      } else {
        ensure_dir(rel);
        copy_entry(child, fst);
      }
    }
    for (const std::string& name : base_names) {
      if (std::binary_search(names.begin(), names.end(), name)) continue;
      ensure_dir(rel);
      make_whiteout(rel / name);
    }
  }

  void copy_subtree(const fs::path& rel) {
    for (const std::string& name : list_dir(join(full_, rel))) {
      const fs::path child = rel / name;
      const struct stat st = lstat_or_throw(join(full_, child));
      if (is_mount_point(child, st)) continue;
      if (S_ISDIR(st.st_mode)) {
        ensure_dir(child);
        ++stats_.written;
        copy_subtree(child);
      } else {
        copy_entry(child, st);
      }
    }
  }

  void copy_entry(const fs::path& rel, const struct stat& st) {
    const fs::path from = join(full_, rel);
    const fs::path to = join(out_, rel);
    ++stats_.written;
    if (S_ISREG(st.st_mode)) {
      copy_regular(rel, from, to, st);
    } else if (S_ISLNK(st.st_mode)) {
      std::string target = read_link(from, static_cast<std::size_t>(st.st_size));
      if (::symlink(target.c_str(), to.c_str()) != 0) throw_errno_fmt(errno, "symlink {}", to.string());
      copy_metadata(from, st, to);
    } else {
      // Devices, FIFOs and sockets as nodes (the layer's builder decides what it keeps of them).
      if (::mknod(to.c_str(), st.st_mode, st.st_rdev) != 0) {
        if (errno == EPERM)
          throw Error(Code::kPermissionDenied, fmt::format("make {}: creating device nodes needs root", to.string()));
        throw_errno_fmt(errno, "make {}", to.string());
      }
      copy_metadata(from, st, to);
    }
  }

  void copy_regular(const fs::path& rel, const fs::path& from, const fs::path& to, const struct stat& st) {
    const std::pair<dev_t, ino_t> key{st.st_dev, st.st_ino};
    if (st.st_nlink > 1) {
      if (auto it = links_.find(key); it != links_.end()) {
        if (::link(join(out_, it->second).c_str(), to.c_str()) != 0)
          throw_errno_fmt(errno, "link {} to {}", to.string(), it->second.string());
        return;
      }
    }
    stats_.bytes += static_cast<std::uint64_t>(st.st_size);
    if (may_link_) {
      if (::link(from.c_str(), to.c_str()) == 0) {
        ++stats_.linked;
        if (st.st_nlink > 1) links_.emplace(key, rel);
        return;
      }
      if (errno == EXDEV) may_link_ = false;
      else if (errno != EPERM && errno != EMLINK) throw_errno_fmt(errno, "link {} to {}", to.string(), from.string());
    }
    UniqueFd in(::open(from.c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC));
    if (!in) throw_errno_fmt(errno, "open {}", from.string());
    UniqueFd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!out) throw_errno_fmt(errno, "create {}", to.string());
    copy_file_data(from, in.get(), to, out.get());
    out.reset();
    copy_metadata(from, st, to);
    if (st.st_nlink > 1) links_.emplace(key, rel);
  }

  void make_whiteout(const fs::path& rel) {
    fs::path p = join(out_, rel);
    if (::mknod(p.c_str(), S_IFCHR | 0000, makedev(0, 0)) != 0) {
      if (errno == EPERM)
        throw Error(Code::kPermissionDenied,
                    fmt::format("make whiteout {}: overlayfs whiteouts need root", p.string()));
      throw_errno_fmt(errno, "make whiteout {}", p.string());
    }
    ++stats_.whiteouts;
  }

  void mark_opaque(const fs::path& rel) {
    fs::path p = join(out_, rel);
    if (::lsetxattr(p.c_str(), "trusted.overlay.opaque", "y", 1, 0) != 0) {
      if (errno == EPERM)
        throw Error(Code::kPermissionDenied, fmt::format("mark {} opaque: trusted xattrs need root", p.string()));
      throw_errno_fmt(errno, "mark {} opaque", p.string());
    }
    ++stats_.opaque_dirs;
  }

  static bool same_dir_metadata(const fs::path& b, const struct stat& bs, const fs::path& f, const struct stat& fs) {
    return bs.st_mode == fs.st_mode && bs.st_uid == fs.st_uid && bs.st_gid == fs.st_gid && same_time(bs, fs) &&
           read_xattrs(b) == read_xattrs(f);
  }

  static bool same_entry(const fs::path& b, const struct stat& bs, const fs::path& f, const struct stat& fs) {
    if (bs.st_mode != fs.st_mode || bs.st_uid != fs.st_uid || bs.st_gid != fs.st_gid || bs.st_size != fs.st_size ||
        !same_time(bs, fs))
      return false;
    if ((S_ISCHR(fs.st_mode) || S_ISBLK(fs.st_mode)) && bs.st_rdev != fs.st_rdev) return false;
    if (S_ISLNK(fs.st_mode) &&
        read_link(b, static_cast<std::size_t>(bs.st_size)) != read_link(f, static_cast<std::size_t>(fs.st_size)))
      return false;
    return read_xattrs(b) == read_xattrs(f);
  }

  fs::path base_, full_, out_;
  std::vector<std::string>& notes_;
  dev_t full_dev_ = 0, out_dev_ = 0;
  bool may_link_ = false;
  std::set<fs::path> created_;
  std::vector<fs::path> dirs_;                         // created in out, in creation order (parents first)
  std::map<std::pair<dev_t, ino_t>, fs::path> links_;  // full's multiply-linked files -> their first path in out
  std::size_t skipped_mounts_ = 0;
  DiffStats stats_;
};

std::string mib(std::uint64_t bytes) { return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20)); }

}  // namespace

DiffStats make_diff_tree(const fs::path& base, const fs::path& full, const fs::path& out,
                         std::vector<std::string>& notes, const DiffOptions& options) {
  for (const auto* p : {&base, &full}) {
    struct stat st {};
    if (::stat(p->c_str(), &st) != 0) {
      if (errno == ENOENT) throw Error(Code::kNotFound, fmt::format("{} does not exist", p->string()));
      throw_errno_fmt(errno, "stat {}", p->string());
    }
    if (!S_ISDIR(st.st_mode)) throw Error(Code::kInvalidArgument, fmt::format("{} is not a directory", p->string()));
  }
  struct stat st {};
  if (::lstat(out.c_str(), &st) == 0)
    throw Error(Code::kAlreadyExists, fmt::format("diff destination {} exists", out.string()));
  if (::mkdir(out.c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}", out.string());
  try {
    Differ differ(fs::canonical(base), fs::canonical(full), fs::canonical(out), notes, options);
    DiffStats stats = differ.run();
    notes.push_back(
        fmt::format("layer holds the difference from its parent: {} entries new or changed ({} of file "
                    "data), {} unchanged, {} removed, {} directories replaced",
                    stats.written, mib(stats.bytes), stats.unchanged, stats.whiteouts, stats.opaque_dirs));
    return stats;
  } catch (...) {
    std::error_code ec;
    fs::remove_all(out, ec);
    throw;
  }
}

}  // namespace dsec::image
