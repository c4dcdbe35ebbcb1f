#include "agent/backends/qemu/guest/upper_capture.hpp"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <fmt/format.h>

#include "common/syscall.hpp"

namespace dsec::agent::guest {
namespace fs = std::filesystem;

namespace {

timespec to_timespec(std::int64_t ns) {
  return timespec{static_cast<time_t>(ns / 1000000000ll), static_cast<long>(ns % 1000000000ll)};
}

[[noreturn]] void bad(const std::string& path, std::string_view why) {
  throw Error(Code::kUnavailable, fmt::format("snapshot: the guest sent an entry '{}' that {}", path, why));
}

[[noreturn]] void write_failed(int err, const std::string& what) {
  if (err == ENOSPC || err == EDQUOT)
    throw Error(Code::kResourceExhausted, fmt::format("{}: the disk is full ({})", what, std::strerror(err)), false);
  throw_errno(err, what);
}

}  // namespace

UpperTreeWriter::UpperTreeWriter(const fs::path& dest, const image::UpperTreeLimits& limits)
    : dest_(dest), limits_(limits) {
  if (::mkdir(dest.c_str(), 0755) != 0) throw_errno_fmt(errno, "mkdir {}", dest.string());
  root_.reset(::open(dest.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!root_) throw_errno_fmt(errno, "open {}", dest.string());
}

UniqueFd UpperTreeWriter::parent_of(const std::string& rel, std::string& leaf) {
  if (rel.empty() || rel.front() == '/' || rel.size() > limits_.max_path_bytes)
    bad(rel, "is not a relative path within the limit");
  std::size_t pos = 0;
  while (pos <= rel.size()) {
    auto next = rel.find('/', pos);
    if (next == std::string::npos) next = rel.size();
    std::string_view part(rel.data() + pos, next - pos);
    if (part.empty() || part == "." || part == "..") bad(rel, "has an empty, '.' or '..' component");
    pos = next + 1;
  }
  auto slash = rel.rfind('/');
  leaf = slash == std::string::npos ? rel : rel.substr(slash + 1);
  std::string parent = slash == std::string::npos ? "." : rel.substr(0, slash);
  open_how how{};
  how.flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC;
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;
  int fd = static_cast<int>(::syscall(SYS_openat2, root_.get(), parent.c_str(), &how, sizeof how));
  if (fd < 0) bad(rel, "has no directory before it in the stream");
  return UniqueFd(fd);
}

void UpperTreeWriter::end_file() {
  if (!file_) return;
  if (file_left_ != 0) bad(file_path_, "ended before its size");
  ::fchown(file_.get(), file_entry_.uid, file_entry_.gid);
  ::fchmod(file_.get(), file_entry_.mode & 07777);
  timespec times[2] = {to_timespec(file_entry_.atime_ns), to_timespec(file_entry_.mtime_ns)};
  ::futimens(file_.get(), times);
  file_.reset();
}

void UpperTreeWriter::entry(const files::TreeEntry& e) {
  end_file();
  std::string leaf;
  UniqueFd parent = parent_of(e.path, leaf);
  ++stats_.entries;
  const mode_t perm = e.mode & 07777;
  timespec times[2] = {to_timespec(e.atime_ns), to_timespec(e.mtime_ns)};
  switch (e.kind) {
    case files::EntryKind::kDirectory: {
      if (::mkdirat(parent.get(), leaf.c_str(), 0700) != 0) write_failed(errno, "mkdir " + e.path);
      UniqueFd dir(::openat(parent.get(), leaf.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (!dir) throw_errno_fmt(errno, "open {}", e.path);
      ::fchown(dir.get(), e.uid, e.gid);
      ::fchmod(dir.get(), perm);
      if (e.opaque) {
        if (::fsetxattr(dir.get(), "trusted.overlay.opaque", "y", 1, 0) != 0) write_failed(errno, "mark " + e.path);
        ++stats_.opaque_directories;
      }
      ++stats_.directories;
      dirs_.push_back({e.path, e.atime_ns, e.mtime_ns});
      return;
    }
    case files::EntryKind::kRegular: {
      if (stats_.file_bytes + e.size > limits_.max_file_bytes)
        throw Error(Code::kResourceExhausted,
                    fmt::format("snapshot: the files add up to more than {} bytes", limits_.max_file_bytes), false);
      file_.reset(::openat(parent.get(), leaf.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
      if (!file_) write_failed(errno, "create " + e.path);
      file_path_ = e.path;
      file_left_ = e.size;
      file_entry_ = e;
      stats_.file_bytes += e.size;
      ++stats_.files;
      return;
    }
    case files::EntryKind::kHardlink: {
      std::string source_leaf;
      UniqueFd source_parent = parent_of(e.link, source_leaf);
      if (::linkat(source_parent.get(), source_leaf.c_str(), parent.get(), leaf.c_str(), 0) != 0)
        write_failed(errno, "link " + e.path);
      ++stats_.hard_links;
      return;
    }
    case files::EntryKind::kSymlink:
      if (::symlinkat(e.link.c_str(), parent.get(), leaf.c_str()) != 0) write_failed(errno, "symlink " + e.path);
      ::fchownat(parent.get(), leaf.c_str(), e.uid, e.gid, AT_SYMLINK_NOFOLLOW);
      ::utimensat(parent.get(), leaf.c_str(), times, AT_SYMLINK_NOFOLLOW);
      ++stats_.symlinks;
      return;
    case files::EntryKind::kFifo:
      if (::mknodat(parent.get(), leaf.c_str(), S_IFIFO | perm, 0) != 0) write_failed(errno, "mkfifo " + e.path);
      ::fchownat(parent.get(), leaf.c_str(), e.uid, e.gid, AT_SYMLINK_NOFOLLOW);
      ::utimensat(parent.get(), leaf.c_str(), times, AT_SYMLINK_NOFOLLOW);
      ++stats_.fifos;
      return;
    case files::EntryKind::kWhiteout:
      if (::mknodat(parent.get(), leaf.c_str(), S_IFCHR, makedev(0, 0)) != 0) write_failed(errno, "whiteout " + e.path);
      ++stats_.whiteouts;
      return;
  }
  bad(e.path, "is of an unknown kind");
}

void UpperTreeWriter::data(std::string_view bytes) {
  if (!file_) bad(file_path_, "has data outside a regular file");
  if (bytes.size() > file_left_) bad(file_path_, "is longer than its size");
  file_left_ -= bytes.size();
  stats_.data_bytes += bytes.size();
  while (!bytes.empty()) {
    ssize_t n = ::write(file_.get(), bytes.data(), bytes.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) write_failed(errno, "write " + file_path_);
    bytes.remove_prefix(static_cast<std::size_t>(n));
  }
}

image::UpperTreeStats UpperTreeWriter::finish() {
  end_file();
  // Children changed their directories' times as they were written: the directories' own come last, deepest first.
  for (auto it = dirs_.rbegin(); it != dirs_.rend(); ++it) {
    std::string leaf;
    UniqueFd parent = parent_of(it->path, leaf);
    timespec times[2] = {to_timespec(it->atime_ns), to_timespec(it->mtime_ns)};
    ::utimensat(parent.get(), leaf.c_str(), times, AT_SYMLINK_NOFOLLOW);
  }
  return stats_;
}

}  // namespace dsec::agent::guest
