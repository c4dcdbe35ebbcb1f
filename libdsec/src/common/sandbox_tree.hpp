// A sandbox's file tree as the files API sees it, on a descriptor of the sandbox's root directory. Every path is
// resolved with openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV): ".." and symlinks that the
// sandbox planted resolve inside its root, never outside, and paths do not cross into other mounts (the sandbox's
// /proc, /dev, /sys). Only regular files are read or written, opened without blocking first, so a FIFO planted
// where a file is expected cannot hold the caller.
//
// Used by the container tier on the host (the root is /proc/<init>/root) and by dsec-init inside a virtual machine
// (the root is the guest's own): the same rules on both tiers. No libarchive here (dsec-init is static and small);
// tar streams are made and read by archive_files.hpp on the agent's side, entry by entry, through TreeSink and
// TreeSource.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "common/unique_fd.hpp"

namespace dsec::agent::files {

enum class EntryKind : std::uint8_t {
  kDirectory = 1,
  kRegular = 2,
  kSymlink = 3,
  kHardlink = 4,
  // Only in a VM's writable layer as a snapshot takes it (guest::capture_upper): never in the files API.
  kFifo = 5,
  kWhiteout = 6,  // an overlayfs whiteout: a character device 0/0 hiding a lower layer's entry
};

// One entry of a tree, with its path relative to the tree's directory (no leading '/', may contain "..", which is
// applied lexically and cannot climb above that directory).
struct TreeEntry {
  EntryKind kind{};
  std::string path;
  std::uint32_t mode = 0;  // permission bits (setuid/setgid are dropped on the way in)
  std::string link;        // symlink target; a hard link's source, relative to the tree's directory
  std::uint64_t size = 0;  // a regular file's size (its bytes follow the entry)
  // What a walk saw (a tar download carries them); an extraction leaves ownership to the writer and times to now.
  std::uint32_t uid = 0, gid = 0;
  std::int64_t mtime = 0;
  // Snapshots of a VM's writable layer only: nanosecond times, and trusted.overlay.opaque="y" on a directory.
  std::int64_t atime_ns = 0, mtime_ns = 0;
  bool opaque = false;
};

// What receives a tree entry by entry (extraction into a sandbox).
class TreeSink {
 public:
  virtual ~TreeSink() = default;
  // For a regular file, its bytes follow through write_data() until the next entry or finish().
  virtual void entry(const TreeEntry& e) = 0;
  virtual void write_data(std::string_view bytes) = 0;
  virtual void finish() {}
};

// What walks a tree (a download out of a sandbox): calls `on_entry` for each entry (parents before children) and,
// for regular files, `on_data` with the file's bytes (perhaps in several pieces) right after it.
using EntryVisitor = std::function<void(const TreeEntry&)>;
using DataVisitor = std::function<void(std::string_view)>;

class SandboxTree {
 public:
  // `root` is a descriptor (O_PATH or O_DIRECTORY) of the sandbox's root directory.
  explicit SandboxTree(UniqueFd root) : root_(std::move(root)) {}

  void write_file(std::string_view path, std::string_view data, unsigned mode);
  // An open regular file for writing: created when missing, truncated, its mode set. What the caller writes to the
  // descriptor is the file's content.
  UniqueFd open_for_writing(std::string_view path, unsigned mode);
  std::string read_file(std::string_view path, std::size_t max_bytes);
  // An open regular file for reading (NOT_FOUND, or INVALID_ARGUMENT for a directory or a non-regular file).
  UniqueFd open_for_reading(std::string_view path);
  bool is_directory(std::string_view path);
  // The st_mode of the path (not following a final symlink); NOT_FOUND when it does not exist.
  std::uint32_t mode_of(std::string_view path);

  // Entries are applied below `dir` (created when missing): directories made (mode set), regular files replace
  // whatever non-directory entry had the name (a symlink planted there is not followed), symlinks made as given
  // (they may point anywhere: they resolve inside the root when followed by the files API), hard links made to an
  // entry already in the tree.
  class Extraction final : public TreeSink {
   public:
    Extraction(SandboxTree& tree, std::string_view dir);
    void entry(const TreeEntry& e) override;
    void write_data(std::string_view bytes) override;
    void finish() override { file_.reset(); }

   private:
    SandboxTree& tree_;
    std::string base_;
    UniqueFd file_;  // the regular file being written
    std::string file_path_;
  };

  // Walks `dir` without following symlinks or descending into other mounts. FIFOs, sockets and devices are left
  // out. `max_bytes` caps the file bytes visited (RESOURCE_EXHAUSTED past it).
  void walk(std::string_view dir, std::size_t max_bytes, const EntryVisitor& on_entry, const DataVisitor& on_data);

  int root_fd() const noexcept { return root_.get(); }

 private:
  UniqueFd root_;
};

// Splits an absolute path into normal components ("." dropped, ".." applied lexically; it cannot rise above "/").
// Throws INVALID_ARGUMENT for a relative path or one with NUL.
std::string normalize_sandbox_path(std::string_view path);

}  // namespace dsec::agent::files
