#include "common/sandbox_tree.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <memory>
#include <vector>

#include "common/syscall.hpp"

namespace dsec::agent::files {
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
  if (err == EXDEV)
    throw Error(Code::kInvalidArgument, fmt::format("{} {}: the path crosses a mount (/proc, /dev, /sys "
                                                    "are not reachable through the files API)",
                                                    op, path));
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

struct WalkState {
  std::size_t max_bytes;
  std::size_t bytes = 0;
  const EntryVisitor& on_entry;
  const DataVisitor& on_data;
};

void walk_dir(int dirfd, const std::string& rel, dev_t root_dev, WalkState& state) {
  UniqueFd iter_fd(::dup(dirfd));
  if (!iter_fd) throw_errno(errno, "dup");
  std::unique_ptr<DIR, int (*)(DIR*)> dir(::fdopendir(iter_fd.release()), ::closedir);
  if (!dir) throw_errno_fmt(errno, "opendir {}", rel);
  while (dirent* d = ::readdir(dir.get())) {
    std::string name = d->d_name;
    if (name == "." || name == "..") continue;
    struct stat st {};
    if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) continue;  // vanished meanwhile
    std::string path = rel;
    if (!path.empty()) path += '/';
    path += name;
    TreeEntry e;
    e.path = path;
    e.mode = st.st_mode & 07777;
    e.uid = st.st_uid;
    e.gid = st.st_gid;
    e.mtime = st.st_mtim.tv_sec;
    if (S_ISDIR(st.st_mode)) {
      if (st.st_dev != root_dev) continue;  // another mount: not part of the sandbox's files
      e.kind = EntryKind::kDirectory;
      state.on_entry(e);
      UniqueFd sub(::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC));
      if (sub) walk_dir(sub.get(), path, root_dev, state);
    } else if (S_ISREG(st.st_mode)) {
      UniqueFd f(::openat(dirfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
      if (!f) continue;
      // The whole file is read before its entry goes out: the entry must carry its size in a tar header.
      std::string content = read_fd(f.get(), state.max_bytes - state.bytes, path);
      state.bytes += content.size();
      e.kind = EntryKind::kRegular;
      e.size = content.size();
      state.on_entry(e);
      if (!content.empty()) state.on_data(content);
    } else if (S_ISLNK(st.st_mode)) {
      char target[4096];
      ssize_t n = ::readlinkat(dirfd, name.c_str(), target, sizeof target - 1);
      if (n < 0) continue;
      e.kind = EntryKind::kSymlink;
      e.link.assign(target, static_cast<std::size_t>(n));
      state.on_entry(e);
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

UniqueFd SandboxTree::open_for_writing(std::string_view path, unsigned mode) {
  std::string p = normalize_sandbox_path(path);
  if (p == "/") throw Error(Code::kInvalidArgument, "cannot write to /");
  return create_regular(root_.get(), p, mode);
}

void SandboxTree::write_file(std::string_view path, std::string_view data, unsigned mode) {
  std::string p = normalize_sandbox_path(path);
  UniqueFd fd = open_for_writing(p, mode);
  write_all(fd.get(), data, p);
}

UniqueFd SandboxTree::open_for_reading(std::string_view path) {
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
  return fd;
}

std::string SandboxTree::read_file(std::string_view path, std::size_t max_bytes) {
  std::string p = normalize_sandbox_path(path);
  UniqueFd fd = open_for_reading(p);
  return read_fd(fd.get(), max_bytes, p);
}

std::uint32_t SandboxTree::mode_of(std::string_view path) {
  std::string p = normalize_sandbox_path(path);
  UniqueFd fd(openat2_in_root(root_.get(), p, O_PATH | O_NOFOLLOW));
  if (!fd) {
    if (errno == ENOENT) throw Error(Code::kNotFound, fmt::format("no such file in the sandbox: {}", p));
    path_error(errno, "open", p);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) path_error(errno, "stat", p);
  return st.st_mode;
}

bool SandboxTree::is_directory(std::string_view path) {
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

void SandboxTree::walk(std::string_view dir, std::size_t max_bytes, const EntryVisitor& on_entry,
                       const DataVisitor& on_data) {
  std::string p = normalize_sandbox_path(dir);
  UniqueFd fd(openat2_in_root(root_.get(), p, O_RDONLY | O_DIRECTORY));
  if (!fd) {
    if (errno == ENOENT) throw Error(Code::kNotFound, fmt::format("no such directory in the sandbox: {}", p));
    path_error(errno, "open directory", p);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) path_error(errno, "stat", p);
  WalkState state{max_bytes, 0, on_entry, on_data};
  walk_dir(fd.get(), "", st.st_dev, state);
}

SandboxTree::Extraction::Extraction(SandboxTree& tree, std::string_view dir)
    : tree_(tree), base_(normalize_sandbox_path(dir)) {
  make_dirs(tree_.root_fd(), base_);
}

void SandboxTree::Extraction::entry(const TreeEntry& e) {
  file_.reset();
  int root = tree_.root_fd();
  // Entry names are relative to the directory; ".." cannot climb above it.
  std::string rel = normalize_sandbox_path("/" + e.path);
  if (rel == "/") return;
  std::string full = base_ == "/" ? rel : base_ + rel;
  unsigned perm = e.mode & 01777;
  auto [parent, leaf] = split_parent(full);
  switch (e.kind) {
    case EntryKind::kHardlink: {
      std::string src = normalize_sandbox_path("/" + e.link);
      src = base_ == "/" ? src : base_ + src;
      UniqueFd src_fd(openat2_in_root(root, src, O_PATH | O_NOFOLLOW));
      if (!src_fd) path_error(errno, "hard link source", src);
      UniqueFd pfd = make_dirs(root, parent);
      ::unlinkat(pfd.get(), leaf.c_str(), 0);
      if (::linkat(src_fd.get(), "", pfd.get(), leaf.c_str(), AT_EMPTY_PATH) != 0) path_error(errno, "link", full);
      return;
    }
    case EntryKind::kDirectory: {
      UniqueFd d = make_dirs(root, full);
      UniqueFd rd(openat2_in_root(root, full, O_RDONLY | O_DIRECTORY));
      if (rd) ::fchmod(rd.get(), perm);
      return;
    }
    case EntryKind::kRegular: {
      // Like tar: an existing non-directory entry is replaced, so a symlink planted at that name is not followed.
      {
        UniqueFd pfd = make_dirs(root, parent);
        ::unlinkat(pfd.get(), leaf.c_str(), 0);
      }
      file_ = create_regular(root, full, perm);
      file_path_ = full;
      return;
    }
    case EntryKind::kSymlink: {
      UniqueFd pfd = make_dirs(root, parent);
      ::unlinkat(pfd.get(), leaf.c_str(), 0);
      if (::symlinkat(e.link.c_str(), pfd.get(), leaf.c_str()) != 0) path_error(errno, "symlink", full);
      return;
    }
    case EntryKind::kFifo:
    case EntryKind::kWhiteout:
      return;  // the files API extracts no special files
  }
  throw Error(Code::kInvalidArgument, fmt::format("{}: unknown kind of tree entry", full));
}

void SandboxTree::Extraction::write_data(std::string_view bytes) {
  if (!file_) throw Error(Code::kInvalidArgument, "file data outside a regular file's entry");
  write_all(file_.get(), bytes, file_path_);
}

}  // namespace dsec::agent::files
