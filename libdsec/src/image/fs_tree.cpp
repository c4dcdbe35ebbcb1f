#include "image/fs_tree.hpp"

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <ftw.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <memory>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "image/archive_internal.hpp"

namespace dsec::image {
namespace fs = std::filesystem;
namespace {

std::string describe_type(mode_t type) {
  switch (type) {
    case AE_IFCHR:
      return "character device";
    case AE_IFBLK:
      return "block device";
    case AE_IFSOCK:
      return "socket";
    default:
      return "special file";
  }
}

// Mount points from /proc/self/mountinfo (field 5), with the kernel's octal escapes undone.
std::vector<std::string> mount_points() {
  std::ifstream in("/proc/self/mountinfo");
  if (!in) throw_errno(errno, "open /proc/self/mountinfo");
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) {
    std::size_t pos = 0;
    for (int field = 0; field < 4 && pos != std::string::npos; ++field) {
      pos = line.find(' ', pos);
      if (pos != std::string::npos) ++pos;
    }
    if (pos == std::string::npos) continue;
    std::size_t end = line.find(' ', pos);
    std::string raw = line.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    std::string mp;
    for (std::size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\\' && i + 3 < raw.size()) {
        int v = 0;
        bool ok = true;
        for (int k = 1; k <= 3; ++k) {
          char c = raw[i + k];
          if (c < '0' || c > '7') ok = false;
          v = v * 8 + (c - '0');
        }
        if (ok) {
          mp.push_back(static_cast<char>(v));
          i += 3;
          continue;
        }
      }
      mp.push_back(raw[i]);
    }
    out.push_back(std::move(mp));
  }
  return out;
}

// nftw has no user-data argument; the walks below keep their state per thread.
struct RemoveState {
  int first_errno = 0;
  std::string first_path;
};
thread_local RemoveState* t_remove = nullptr;

int remove_one(const char* path, const struct stat* st, int type, struct FTW*) {
  int r = (type == FTW_DP || type == FTW_D || type == FTW_DNR) ? ::rmdir(path) : ::unlink(path);
  if (r != 0 && errno != ENOENT && t_remove->first_errno == 0) {
    t_remove->first_errno = errno;
    t_remove->first_path = path;
  }
  return 0;
}

struct SizeState {
  std::uint64_t bytes = 0;
  std::set<std::pair<dev_t, ino_t>> seen;
};
thread_local SizeState* t_size = nullptr;

int size_one(const char*, const struct stat* st, int type, struct FTW*) {
  if (type == FTW_F && S_ISREG(st->st_mode)) {
    if (st->st_nlink > 1 && !t_size->seen.emplace(st->st_dev, st->st_ino).second) return 0;
    t_size->bytes += static_cast<std::uint64_t>(st->st_size);
  } else if (type == FTW_SL || type == FTW_SLN) {
    t_size->bytes += static_cast<std::uint64_t>(st->st_size);
  }
  return 0;
}

}  // namespace

void copy_tree(const fs::path& source, const fs::path& dest, std::vector<std::string>& notes) {
  std::error_code ec;
  fs::path src = fs::canonical(source, ec);
  if (ec) throw Error(code_for_errno(ec.value()), fmt::format("{}: {}", source.string(), ec.message()));
  if (!fs::is_directory(src))
    throw Error(Code::kInvalidArgument, fmt::format("{} is not a directory", source.string()));
  if (fs::exists(fs::symlink_status(dest)))
    throw Error(Code::kAlreadyExists, fmt::format("copy destination {} exists", dest.string()));
  fs::path dst = fs::weakly_canonical(dest);
  if (dst == src || (dst.string() + "/").starts_with(src.string() + "/") ||
      (src.string() + "/").starts_with(dst.string() + "/"))
    throw Error(Code::kInvalidArgument,
                fmt::format("cannot copy {} into {}: one contains the other", src.string(), dst.string()));

  ReadArchive rd = open_disk_reader(src, 0);
  WriteArchive wd = open_disk_writer();
  LinkResolver links(archive_entry_linkresolver_new());
  if (!links) throw Error(Code::kResourceExhausted, "archive_entry_linkresolver_new failed");
  archive_entry_linkresolver_set_strategy(links.get(), ARCHIVE_FORMAT_TAR_PAX_RESTRICTED);

  Warnings warnings(notes);
  std::size_t skipped = 0;
  for (;;) {
    Entry owned(archive_entry_new());
    int r = archive_read_next_header2(rd.get(), owned.get());
    if (r == ARCHIVE_EOF) break;
    if (r == ARCHIVE_WARN) warnings.add(rd.get(), archive_entry_pathname(owned.get()) ?: src.c_str());
    if (r < ARCHIVE_WARN) throw_archive(rd.get(), fmt::format("read {}", src.string()));
    // Walk into directories (read_disk only descends when asked; mounts are not crossed).
    archive_read_disk_descend(rd.get());

    fs::path rel = fs::path(archive_entry_pathname(owned.get())).lexically_relative(src);
    if (rel == ".") rel.clear();
    mode_t type = archive_entry_filetype(owned.get());
    if (type == AE_IFCHR || type == AE_IFBLK || type == AE_IFSOCK) {
      if (skipped++ < kMaxWarnings)
        notes.push_back(fmt::format("skipped {} /{} (a sandbox gets its own /dev)", describe_type(type), rel.string()));
      continue;
    }
    archive_entry_set_pathname(owned.get(), join(dst, rel).c_str());

    archive_entry* e = owned.get();
    archive_entry* spare = nullptr;
    archive_entry_linkify(links.get(), &e, &spare);
    // With the tar strategy the first name of a hard-linked file comes back whole and later ones as links to it.
    bool is_link = archive_entry_hardlink(e) != nullptr;
    write_entry_to_disk(rd.get(), wd.get(), e, !is_link, warnings);
  }
  if (skipped > kMaxWarnings) notes.push_back(fmt::format("... {} special files skipped in all", skipped));
  // Directory modes and times are applied at close, after their contents are written.
  if (archive_write_close(wd.get()) != ARCHIVE_OK) throw_archive(wd.get(), fmt::format("finish {}", dst.string()));
}

void pack_tree(const fs::path& source, const fs::path& tarball) {
  std::error_code ec;
  fs::path src = fs::canonical(source, ec);
  if (ec) throw Error(code_for_errno(ec.value()), fmt::format("{}: {}", source.string(), ec.message()));
  fs::create_directories(tarball.parent_path());
  std::string tmp_name = tarball.string() + ".tmp-XXXXXX";
  UniqueFd out(::mkostemp(tmp_name.data(), O_CLOEXEC));
  if (!out) throw_errno_fmt(errno, "create {}", tmp_name);
  fs::path tmp = tmp_name;
  if (::fchmod(out.get(), 0644) != 0) throw_errno_fmt(errno, "chmod {}", tmp_name);

  try {
    ReadArchive rd = open_disk_reader(src, ARCHIVE_READDISK_NO_SPARSE);
    WriteArchive aw(archive_write_new());
    if (!aw) throw Error(Code::kResourceExhausted, "archive_write_new failed");
    if (archive_write_add_filter_zstd(aw.get()) != ARCHIVE_OK) throw_archive(aw.get(), "zstd filter");
    if (archive_write_set_format_pax_restricted(aw.get()) != ARCHIVE_OK) throw_archive(aw.get(), "pax format");
    if (archive_write_open_fd(aw.get(), out.get()) != ARCHIVE_OK)
      throw_archive(aw.get(), fmt::format("create {}", tmp.string()));
    LinkResolver links(archive_entry_linkresolver_new());
    archive_entry_linkresolver_set_strategy(links.get(), archive_format(aw.get()));

    std::vector<char> zeros(std::size_t{64} << 10, 0);
    for (;;) {
      Entry owned(archive_entry_new());
      int r = archive_read_next_header2(rd.get(), owned.get());
      if (r == ARCHIVE_EOF) break;
      if (r < ARCHIVE_WARN) throw_archive(rd.get(), fmt::format("read {}", src.string()));
      archive_read_disk_descend(rd.get());
      if (archive_entry_filetype(owned.get()) == AE_IFSOCK) continue;  // tar cannot hold sockets
      fs::path rel = fs::path(archive_entry_pathname(owned.get())).lexically_relative(src);
      std::string name = (rel == "." || rel.empty()) ? std::string(".") : "./" + rel.string();
      archive_entry_set_pathname(owned.get(), name.c_str());
      // Numeric ownership only: the tree belongs to an image, not to this host's user database.
      archive_entry_set_uname(owned.get(), nullptr);
      archive_entry_set_gname(owned.get(), nullptr);

      archive_entry* e = owned.get();
      archive_entry* spare = nullptr;
      archive_entry_linkify(links.get(), &e, &spare);
      if (archive_write_header(aw.get(), e) < ARCHIVE_WARN) throw_archive(aw.get(), fmt::format("pack {}", name));
      if (archive_entry_hardlink(e) == nullptr && archive_entry_size(e) > 0) {
        const void* buf = nullptr;
        size_t size = 0;
        la_int64_t offset = 0;
        la_int64_t written = 0;
        for (;;) {
          int rr = archive_read_data_block(rd.get(), &buf, &size, &offset);
          if (rr == ARCHIVE_EOF) break;
          if (rr < ARCHIVE_WARN) throw_archive(rd.get(), fmt::format("read {}", name));
          while (written < offset) {  // a hole: tar stores it as zeros
            auto n = static_cast<size_t>(std::min<la_int64_t>(offset - written, zeros.size()));
            if (archive_write_data(aw.get(), zeros.data(), n) < 0)
              throw_archive(aw.get(), fmt::format("pack {}", name));
            written += static_cast<la_int64_t>(n);
          }
          if (size > 0 && archive_write_data(aw.get(), buf, size) < 0)
            throw_archive(aw.get(), fmt::format("pack {}", name));
          written += static_cast<la_int64_t>(size);
        }
      }
    }
    if (archive_write_close(aw.get()) != ARCHIVE_OK) throw_archive(aw.get(), fmt::format("write {}", tmp.string()));
    if (::fsync(out.get()) != 0) throw_errno_fmt(errno, "sync {}", tmp.string());
    if (::rename(tmp.c_str(), tarball.c_str()) != 0)
      throw_errno_fmt(errno, "rename {} to {}", tmp.string(), tarball.string());
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

void unpack_tree(const fs::path& tarball, const fs::path& dest, std::vector<std::string>& notes) {
  if (fs::exists(fs::symlink_status(dest)))
    throw Error(Code::kAlreadyExists, fmt::format("unpack destination {} exists", dest.string()));
  fs::path dst = fs::weakly_canonical(dest);
  ReadArchive ar(archive_read_new());
  if (!ar) throw Error(Code::kResourceExhausted, "archive_read_new failed");
  archive_read_support_filter_all(ar.get());
  archive_read_support_format_tar(ar.get());
  if (archive_read_open_filename(ar.get(), tarball.c_str(), 1 << 20) != ARCHIVE_OK)
    throw_archive(ar.get(), fmt::format("open {}", tarball.string()));
  WriteArchive wd = open_disk_writer();
  Warnings warnings(notes);

  // The tree's root comes first in pack_tree's tarballs; other tars may not have it.
  fs::create_directory(dst);
  for (;;) {
    archive_entry* e = nullptr;
    int r = archive_read_next_header(ar.get(), &e);
    if (r == ARCHIVE_EOF) break;
    if (r == ARCHIVE_WARN) warnings.add(ar.get(), tarball.string());
    if (r < ARCHIVE_WARN) throw_archive(ar.get(), fmt::format("read {}", tarball.string()));
    fs::path rel = safe_relative(archive_entry_pathname(e));
    archive_entry_set_pathname(e, join(dst, rel).c_str());
    if (const char* hl = archive_entry_hardlink(e)) {
      fs::path target = safe_relative(hl);
      if (target.empty()) throw Error(Code::kInvalidArgument, "tar hard link to the tree's root");
      archive_entry_set_hardlink(e, join(dst, target).c_str());
    }
    write_entry_to_disk(ar.get(), wd.get(), e, archive_entry_hardlink(e) == nullptr, warnings);
  }
  if (archive_write_close(wd.get()) != ARCHIVE_OK) throw_archive(wd.get(), fmt::format("finish {}", dst.string()));
}

std::uint64_t tree_size(const fs::path& root) {
  SizeState state;
  t_size = &state;
  int r = ::nftw(root.c_str(), size_one, 64, FTW_PHYS | FTW_MOUNT);
  t_size = nullptr;
  if (r != 0) throw_errno_fmt(errno, "measure {}", root.string());
  return state.bytes;
}

void unmount_below(const fs::path& path) {
  std::string base = fs::weakly_canonical(path).string();
  while (base.size() > 1 && base.back() == '/') base.pop_back();
  std::vector<std::string> targets;
  for (auto& mp : mount_points())
    if (mp == base || mp.starts_with(base + "/")) targets.push_back(std::move(mp));
  // Deepest first; a path mounted twice is detached as often as it appears.
  std::sort(targets.begin(), targets.end(), [](const auto& a, const auto& b) { return a.size() > b.size(); });
  for (const auto& t : targets)
    if (::umount2(t.c_str(), MNT_DETACH) != 0 && errno != EINVAL && errno != ENOENT)
      throw_errno_fmt(errno, "unmount {}", t);
}

void remove_tree(const fs::path& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return;
    throw_errno_fmt(errno, "stat {}", path.string());
  }
  if (!S_ISDIR(st.st_mode)) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) throw_errno_fmt(errno, "remove {}", path.string());
    return;
  }
  unmount_below(path);
  RemoveState state;
  t_remove = &state;
  int r = ::nftw(path.c_str(), remove_one, 64, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
  int walk_errno = errno;
  t_remove = nullptr;
  if (r != 0 && walk_errno != ENOENT) throw_errno_fmt(walk_errno, "remove {}", path.string());
  if (state.first_errno != 0) throw_errno_fmt(state.first_errno, "remove {}", state.first_path);
}

}  // namespace dsec::image
