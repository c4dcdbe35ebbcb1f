// libarchive helpers shared by the image code that reads and writes trees and tar streams: owning handles, error
// mapping, warnings collected as build notes, safe member names, and writing an entry to disk.
#pragma once

#include <archive.h>
#include <archive_entry.h>

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "dsec/error.hpp"

namespace dsec::image {
namespace fs = std::filesystem;

// How many libarchive warnings one operation reports before it only counts them.
inline constexpr std::size_t kMaxWarnings = 20;

struct ArchiveReadFree {
  void operator()(archive* a) const noexcept { archive_read_free(a); }
};
struct ArchiveWriteFree {
  void operator()(archive* a) const noexcept { archive_write_free(a); }
};
struct EntryFree {
  void operator()(archive_entry* e) const noexcept { archive_entry_free(e); }
};
struct ResolverFree {
  void operator()(archive_entry_linkresolver* r) const noexcept { archive_entry_linkresolver_free(r); }
};
using ReadArchive = std::unique_ptr<archive, ArchiveReadFree>;
using WriteArchive = std::unique_ptr<archive, ArchiveWriteFree>;
using Entry = std::unique_ptr<archive_entry, EntryFree>;
using LinkResolver = std::unique_ptr<archive_entry_linkresolver, ResolverFree>;

[[noreturn]] inline void throw_archive(archive* a, std::string_view context) {
  const char* msg = archive_error_string(a);
  int err = archive_errno(a);
  std::string text = fmt::format("{}: {}", context, msg ? msg : "libarchive error");
  throw Error(err > 0 ? code_for_errno(err) : Code::kInternal, text);
}

// Reading failed: a stream that is not a tar, or is damaged or truncated, is DATA_LOSS (libarchive says so with
// EILSEQ, its "file format" errno, or with no errno at all); a system error (no permission, a vanished file) keeps
// its own code.
[[noreturn]] inline void throw_archive_read(archive* a, std::string_view context) {
  const char* msg = archive_error_string(a);
  int err = archive_errno(a);
  std::string text = fmt::format("{}: {}", context, msg ? msg : "libarchive error");
  const bool format = err <= 0 || err == EILSEQ || err == EINVAL || err == EIO;
  throw Error(format ? Code::kDataLoss : code_for_errno(err), text);
}

class Warnings {
 public:
  explicit Warnings(std::vector<std::string>& notes) : notes_(notes) {}
  ~Warnings() {
    if (dropped_ > 0) notes_.push_back(fmt::format("... and {} more warnings", dropped_));
  }
  void add(archive* a, std::string_view path) {
    const char* msg = archive_error_string(a);
    if (count_++ < kMaxWarnings) {
      notes_.push_back(fmt::format("{}: {}", path, msg ? msg : "warning"));
    } else {
      ++dropped_;
    }
  }

 private:
  std::vector<std::string>& notes_;
  std::size_t count_ = 0;
  std::size_t dropped_ = 0;
};

// Rejects tar member names that are absolute or climb out with "..". Returns the name without "./" prefixes.
inline fs::path safe_relative(const char* name) {
  if (name == nullptr) throw Error(Code::kDataLoss, "tar entry without a name");
  fs::path p = fs::path(name).lexically_normal();
  if (p.is_absolute()) throw Error(Code::kInvalidArgument, fmt::format("tar entry with an absolute path: {}", name));
  for (const auto& part : p)
    if (part == "..") throw Error(Code::kInvalidArgument, fmt::format("tar entry that leaves the tree: {}", name));
  if (p == "." || p.empty()) return {};
  std::string s = p.string();
  while (!s.empty() && s.back() == '/') s.pop_back();
  return s;
}

inline fs::path join(const fs::path& base, const fs::path& rel) { return rel.empty() ? base : base / rel; }

inline ReadArchive open_disk_reader(const fs::path& source, int extra_behavior) {
  ReadArchive rd(archive_read_disk_new());
  if (!rd) throw Error(Code::kResourceExhausted, "archive_read_disk_new failed");
  if (archive_read_disk_set_symlink_physical(rd.get()) != ARCHIVE_OK) throw_archive(rd.get(), "read_disk");
  if (archive_read_disk_set_behavior(
          rd.get(), ARCHIVE_READDISK_NO_TRAVERSE_MOUNTS | ARCHIVE_READDISK_NO_FFLAGS | extra_behavior) != ARCHIVE_OK)
    throw_archive(rd.get(), "read_disk");
  if (archive_read_disk_open(rd.get(), source.c_str()) != ARCHIVE_OK)
    throw_archive(rd.get(), fmt::format("open {}", source.string()));
  return rd;
}

inline WriteArchive open_disk_writer() {
  WriteArchive wd(archive_write_disk_new());
  if (!wd) throw Error(Code::kResourceExhausted, "archive_write_disk_new failed");
  const int flags = ARCHIVE_EXTRACT_PERM | ARCHIVE_EXTRACT_OWNER | ARCHIVE_EXTRACT_TIME | ARCHIVE_EXTRACT_ACL |
                    ARCHIVE_EXTRACT_XATTR | ARCHIVE_EXTRACT_SECURE_SYMLINKS | ARCHIVE_EXTRACT_SECURE_NODOTDOT |
                    ARCHIVE_EXTRACT_SPARSE;
  if (archive_write_disk_set_options(wd.get(), flags) != ARCHIVE_OK) throw_archive(wd.get(), "write_disk");
  return wd;
}

inline void copy_data_to_disk(archive* from, archive* to, const std::string& path, Warnings& warnings) {
  const void* buf = nullptr;
  size_t size = 0;
  la_int64_t offset = 0;
  for (;;) {
    int r = archive_read_data_block(from, &buf, &size, &offset);
    if (r == ARCHIVE_EOF) return;
    if (r == ARCHIVE_WARN) warnings.add(from, path);
    if (r < ARCHIVE_WARN) throw_archive_read(from, fmt::format("read {}", path));
    // libarchive reports a failed write(2) (ENOSPC, EIO) as a mere warning; for an image it is fatal.
    if (archive_write_data_block(to, buf, size, offset) != ARCHIVE_OK) throw_archive(to, fmt::format("write {}", path));
  }
}

// Writes an entry through write_disk: header, data unless it is a hard link, finish.
inline void write_entry_to_disk(archive* from, archive* wd, archive_entry* e, bool with_data, Warnings& warnings) {
  std::string path = archive_entry_pathname(e);
  int r = archive_write_header(wd, e);
  if (r == ARCHIVE_WARN) warnings.add(wd, path);
  if (r < ARCHIVE_WARN) throw_archive(wd, fmt::format("create {}", path));
  if (with_data && archive_entry_size(e) > 0) copy_data_to_disk(from, wd, path, warnings);
  r = archive_write_finish_entry(wd);
  if (r == ARCHIVE_WARN) warnings.add(wd, path);
  if (r < ARCHIVE_WARN) throw_archive(wd, fmt::format("finish {}", path));
}

}  // namespace dsec::image
