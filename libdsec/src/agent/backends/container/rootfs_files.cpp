#include "agent/backends/container/rootfs_files.hpp"

#include <archive.h>
#include <archive_entry.h>
#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <memory>
#include <vector>

#include "common/syscall.hpp"

namespace dsec::agent::container {
namespace {

constexpr std::uint64_t kResolve = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV;

int openat2_in_root(int root, const std::string& path, std::uint64_t flags, mode_t mode = 0) {
  open_how how{};
  how.flags = flags | O_CLOEXEC;
  how.mode = (flags & O_CREAT) ? mode : 0;
  how.resolve = kResolve;
  // openat2 resolves relative to root; a leading "/" also means root under RESOLVE_IN_ROOT.
  const char* p = path.empty() ? "." : path.c_str();
  long fd;
  do {
    fd = syscall(SYS_openat2, root, p, &how, sizeof how);
  } while (fd < 0 && (errno == EINTR || errno == EAGAIN));
  return static_cast<int>(fd);
}

[[noreturn]] void path_error(int err, std::string_view op, std::string_view path) {
  if (err == EXDEV) throw Error(Code::kInvalidArgument, fmt::format("{} {}: the path crosses a mount (/proc, /dev, /sys "
                                                                   "are not reachable through the files API)", op, path));
  if (err == ENXIO) throw Error(Code::kInvalidArgument, fmt::format("{} {}: not a regular file", op, path));
  throw_errno_fmt(err, "{} {}", op, path);
}

std::pair<std::string, std::string> split_parent(const std::string& normalized) {
  auto slash = normalized.rfind('/');
  std::string parent = slash == 0 ? "/" : normalized.substr(0, slash);
  return {parent, normalized.substr(slash + 1)};
}

// mkdir -p inside the root; returns an fd of the final directory.
UniqueFd make_dirs(int root, const std::string& normalized) {
  UniqueFd dir(openat2_in_root(root, "/", O_PATH | O_DIRECTORY));
  if (!dir) path_error(errno, "open", "/");
  if (normalized == "/") return dir;
  std::size_t pos = 1;
  std::string prefix;
  while (pos <= normalized.size()) {
    auto next = normalized.find('/', pos);
    if (next == std::string::npos) next = normalized.size();
    std::string name = normalized.substr(pos, next - pos);
    prefix += "/" + name;
    UniqueFd child(openat2_in_root(root, prefix, O_PATH | O_DIRECTORY));
    if (!child) {
      if (errno != ENOENT) path_error(errno, "open directory", prefix);
      if (::mkdirat(dir.get(), name.c_str(), 0755) != 0 && errno != EEXIST) path_error(errno, "mkdir", prefix);
      child.reset(openat2_in_root(root, prefix, O_PATH | O_DIRECTORY));
      if (!child) path_error(errno, "open directory", prefix);
    }
    dir = std::move(child);
    pos = next + 1;
  }
  return dir;
}

// Opens a regular file for writing (created if missing, truncated), never blocking on a FIFO.
UniqueFd create_regular(int root, const std::string& normalized, unsigned mode) {
  auto [parent, name] = split_parent(normalized);
  make_dirs(root, parent);
  UniqueFd fd(openat2_in_root(root, normalized, O_WRONLY | O_CREAT | O_NONBLOCK, mode & 0777));
  if (!fd) path_error(errno, "open for writing", normalized);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) path_error(errno, "stat", normalized);
  if (!S_ISREG(st.st_mode)) path_error(ENXIO, "write", normalized);
  if (::ftruncate(fd.get(), 0) != 0) path_error(errno, "truncate", normalized);
  if (::fchmod(fd.get(), mode & 01777) != 0) path_error(errno, "chmod", normalized);
  int fl = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

void write_all(int fd, std::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) path_error(errno, "write", path);
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

std::string read_fd(int fd, std::size_t max_bytes, const std::string& path) {
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) path_error(errno, "read", path);
    if (n == 0) return out;
    if (out.size() + static_cast<std::size_t>(n) > max_bytes)
      throw Error(Code::kResourceExhausted, fmt::format("read {}: larger than the {} byte limit", path, max_bytes));
    out.append(buf, static_cast<std::size_t>(n));
  }
}

struct ArchiveWriteDeleter {
  void operator()(archive* a) const { archive_write_free(a); }
};
struct ArchiveReadDeleter {
  void operator()(archive* a) const { archive_read_free(a); }
};
struct EntryDeleter {
  void operator()(archive_entry* e) const { archive_entry_free(e); }
};

struct TarSink {
  std::string data;
  std::size_t max_bytes;
};

la_ssize_t tar_sink_write(archive* a, void* client, const void* buf, size_t len) {
  auto* sink = static_cast<TarSink*>(client);
  if (sink->data.size() + len > sink->max_bytes) {
    archive_set_error(a, EFBIG, "archive larger than the limit");
    return -1;
  }
  sink->data.append(static_cast<const char*>(buf), len);
  return static_cast<la_ssize_t>(len);
}

void archive_check(archive* a, int rc, std::string_view what) {
  if (rc < ARCHIVE_WARN) {
    int err = archive_errno(a);
    const char* msg = archive_error_string(a);
    if (err == EFBIG) throw Error(Code::kResourceExhausted, fmt::format("{}: {}", what, msg ? msg : "too large"));
    throw Error(Code::kInvalidArgument, fmt::format("{}: {}", what, msg ? msg : "archive error"));
  }
}

void add_tree(archive* a, int dirfd, const std::string& rel, dev_t root_dev, TarSink& sink) {
  UniqueFd iter_fd(::dup(dirfd));
  if (!iter_fd) throw_errno(errno, "dup");
  std::unique_ptr<DIR, int (*)(DIR*)> dir(::fdopendir(iter_fd.release()), ::closedir);
  if (!dir) throw_errno_fmt(errno, "opendir {}", rel);
  while (dirent* d = ::readdir(dir.get())) {
    std::string name = d->d_name;
    if (name == "." || name == "..") continue;
    struct stat st {};
    if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // vanished meanwhile
    std::string path = rel.empty() ? name : rel + "/" + name;
    std::unique_ptr<archive_entry, EntryDeleter> e(archive_entry_new());
    archive_entry_set_pathname(e.get(), path.c_str());
    archive_entry_set_perm(e.get(), st.st_mode & 07777);
    archive_entry_set_uid(e.get(), st.st_uid);
    archive_entry_set_gid(e.get(), st.st_gid);
    archive_entry_set_mtime(e.get(), st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
    if (S_ISDIR(st.st_mode)) {
      if (st.st_dev != root_dev) continue;  // another mount: not part of the sandbox's files
      archive_entry_set_filetype(e.get(), AE_IFDIR);
      archive_check(a, archive_write_header(a, e.get()), "tar header");
      UniqueFd sub(::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (sub) add_tree(a, sub.get(), path, root_dev, sink);
    } else if (S_ISREG(st.st_mode)) {
      UniqueFd f(::openat(dirfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
      if (!f) continue;
      std::string content = read_fd(f.get(), sink.max_bytes, path);
      archive_entry_set_filetype(e.get(), AE_IFREG);
      archive_entry_set_size(e.get(), static_cast<la_int64_t>(content.size()));
      archive_check(a, archive_write_header(a, e.get()), "tar header");
      if (archive_write_data(a, content.data(), content.size()) < 0) archive_check(a, ARCHIVE_FATAL, "tar data");
    } else if (S_ISLNK(st.st_mode)) {
      char target[4096];
      ssize_t n = ::readlinkat(dirfd, name.c_str(), target, sizeof target - 1);
      if (n < 0) continue;
      target[n] = '\0';
      archive_entry_set_filetype(e.get(), AE_IFLNK);
      archive_entry_set_symlink(e.get(), target);
      archive_check(a, archive_write_header(a, e.get()), "tar header");
    }
    // FIFOs, sockets and devices are not files to copy out.
  }
}

}  // namespace

std::string normalize_sandbox_path(std::string_view path) {
  if (path.empty() || path.front() != '/')
    throw Error(Code::kInvalidArgument, fmt::format("path '{}' must be absolute", path));
  if (path.find('\0') != std::string_view::npos) throw Error(Code::kInvalidArgument, "path contains NUL");
  std::vector<std::string_view> parts;
  std::size_t pos = 0;
  while (pos < path.size()) {
    auto next = path.find('/', pos);
    if (next == std::string_view::npos) next = path.size();
    auto part = path.substr(pos, next - pos);
    if (part == "..") {
      if (!parts.empty()) parts.pop_back();
    } else if (!part.empty() && part != ".") {
      if (part.size() > 255) throw Error(Code::kInvalidArgument, "path component longer than 255 bytes");
      parts.push_back(part);
    }
    pos = next + 1;
  }
  std::string out;
  for (auto p : parts) {
    out += '/';
    out += p;
  }
  if (out.size() > 4000) throw Error(Code::kInvalidArgument, "path too long");
  return out.empty() ? "/" : out;
}

void RootfsFiles::write_file(std::string_view path, std::string_view data, unsigned mode) {
  std::string p = normalize_sandbox_path(path);
  if (p == "/") throw Error(Code::kInvalidArgument, "cannot write to /");
  UniqueFd fd = create_regular(root_.get(), p, mode);
  write_all(fd.get(), data, p);
}

std::string RootfsFiles::read_file(std::string_view path, std::size_t max_bytes) {
  std::string p = normalize_sandbox_path(path);
  UniqueFd fd(openat2_in_root(root_.get(), p, O_RDONLY | O_NONBLOCK));
  if (!fd) {
    if (errno == ENOENT) throw Error(Code::kNotFound, fmt::format("no such file in the sandbox: {}", p));
    path_error(errno, "open", p);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) path_error(errno, "stat", p);
  if (S_ISDIR(st.st_mode))
    throw Error(Code::kInvalidArgument, fmt::format("{} is a directory (download it as a tar stream)", p));
  if (!S_ISREG(st.st_mode)) path_error(ENXIO, "read", p);
  int fl = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, fl & ~O_NONBLOCK);
  return read_fd(fd.get(), max_bytes, p);
}

bool RootfsFiles::is_directory(std::string_view path) {
  std::string p = normalize_sandbox_path(path);
  UniqueFd fd(openat2_in_root(root_.get(), p, O_PATH));
  if (!fd) {
    if (errno == ENOENT) throw Error(Code::kNotFound, fmt::format("no such file in the sandbox: {}", p));
    path_error(errno, "open", p);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) path_error(errno, "stat", p);
  return S_ISDIR(st.st_mode);
}

std::string RootfsFiles::get_archive(std::string_view dir, std::size_t max_bytes) {
  std::string p = normalize_sandbox_path(dir);
  UniqueFd fd(openat2_in_root(root_.get(), p, O_RDONLY | O_DIRECTORY));
  if (!fd) {
    if (errno == ENOENT) throw Error(Code::kNotFound, fmt::format("no such directory in the sandbox: {}", p));
    path_error(errno, "open directory", p);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) path_error(errno, "stat", p);
  std::unique_ptr<archive, ArchiveWriteDeleter> a(archive_write_new());
  archive_write_set_format_pax_restricted(a.get());
  archive_write_set_bytes_in_last_block(a.get(), 1);
  TarSink sink{{}, max_bytes};
  archive_check(a.get(), archive_write_open2(a.get(), &sink, nullptr, tar_sink_write, nullptr, nullptr), "tar open");
  add_tree(a.get(), fd.get(), "", st.st_dev, sink);
  archive_check(a.get(), archive_write_close(a.get()), "tar close");
  return std::move(sink.data);
}

void RootfsFiles::put_archive(std::string_view dir, std::string_view tar_bytes) {
  std::string base = normalize_sandbox_path(dir);
  make_dirs(root_.get(), base);
  std::unique_ptr<archive, ArchiveReadDeleter> a(archive_read_new());
  archive_read_support_format_tar(a.get());
  archive_read_support_format_gnutar(a.get());
  archive_read_support_filter_all(a.get());
  archive_check(a.get(), archive_read_open_memory(a.get(), tar_bytes.data(), tar_bytes.size()), "read tar stream");
  archive_entry* e = nullptr;
  for (;;) {
    int rc = archive_read_next_header(a.get(), &e);
    if (rc == ARCHIVE_EOF) break;
    archive_check(a.get(), rc, "read tar stream");
    const char* name = archive_entry_pathname(e);
    if (!name || !*name) continue;
    // Entry names are relative to `dir`; ".." cannot climb above it.
    std::string rel = normalize_sandbox_path(std::string("/") + name);
    if (rel == "/") continue;
    std::string full = base == "/" ? rel : base + rel;
    auto type = archive_entry_filetype(e);
    unsigned perm = archive_entry_perm(e) & 01777;
    auto [parent, leaf] = split_parent(full);
    if (const char* target = archive_entry_hardlink(e)) {
      std::string src = normalize_sandbox_path(std::string("/") + target);
      src = base == "/" ? src : base + src;
      UniqueFd src_fd(openat2_in_root(root_.get(), src, O_PATH | O_NOFOLLOW));
      if (!src_fd) path_error(errno, "hard link source", src);
      UniqueFd pfd = make_dirs(root_.get(), parent);
      ::unlinkat(pfd.get(), leaf.c_str(), 0);
      if (::linkat(src_fd.get(), "", pfd.get(), leaf.c_str(), AT_EMPTY_PATH) != 0) path_error(errno, "link", full);
      continue;
    }
    if (type == AE_IFDIR) {
      UniqueFd d = make_dirs(root_.get(), full);
      UniqueFd rd(openat2_in_root(root_.get(), full, O_RDONLY | O_DIRECTORY));
      if (rd) ::fchmod(rd.get(), perm);
    } else if (type == AE_IFREG) {
      // Like tar: an existing non-directory entry is replaced, so a symlink planted at that name is not followed.
      {
        UniqueFd pfd = make_dirs(root_.get(), parent);
        ::unlinkat(pfd.get(), leaf.c_str(), 0);
      }
      UniqueFd fd = create_regular(root_.get(), full, perm);
      const void* buf;
      size_t size;
      la_int64_t offset;
      for (;;) {
        int r = archive_read_data_block(a.get(), &buf, &size, &offset);
        if (r == ARCHIVE_EOF) break;
        archive_check(a.get(), r, "read tar data");
        if (::pwrite(fd.get(), buf, size, offset) != static_cast<ssize_t>(size)) path_error(errno, "write", full);
      }
    } else if (type == AE_IFLNK) {
      UniqueFd pfd = make_dirs(root_.get(), parent);
      ::unlinkat(pfd.get(), leaf.c_str(), 0);
      if (::symlinkat(archive_entry_symlink(e), pfd.get(), leaf.c_str()) != 0) path_error(errno, "symlink", full);
    }
    // Devices, FIFOs and sockets are skipped.
  }
}

}  // namespace dsec::agent::container
