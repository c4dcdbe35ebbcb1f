// What a layer above a parent image must hold so that the image shows a given root filesystem.
//
// An image built from a whole root filesystem (a debootstrap tree with a toolchain in it, a busybox system, a full
// export of a container) on top of a parent would repeat every file the parent already has. make_diff_tree keeps
// only the difference: given the parent's merged view `base` and the wanted tree `full`, it writes into `out` a tree
// such that overlayfs with `out` above `base` shows exactly `full`:
//   * every entry of `full` that is new, or differs from `base` in type, mode, owner, size, modification time,
//     symlink target, device number or extended attributes (a regular file equal in all of these is taken as
//     unchanged: its content is not read);
//   * the directories on the way to them, with `full`'s metadata (a directory whose own metadata changed is written
//     even when nothing below it did);
//   * an overlayfs whiteout (a character device 0/0) for each entry of `base` that `full` lacks; one for a whole
//     missing directory;
//   * an opaque directory (xattr trusted.overlay.opaque="y") holding the whole subtree where `full` has a directory
//     and `base` a non-directory.
// Regular files are hard-linked from `full` when `out` is on the same filesystem and `full` is scratch (a tree the
// build made and never writes again; DiffOptions::link_files), else copied (reflinked where the filesystem can;
// copy_file_range otherwise), so a user's own directory is only read. Hard links within `full` stay hard links in
// `out`. Mount points below `full` are not crossed. overlayfs's own xattrs
// (trusted.overlay.*) in `full` are neither compared nor copied.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dsec::image {

struct DiffStats {
  std::uint64_t written = 0;    // entries of `full` written to `out` (new or changed, and the contents of new
                                // directories); directories only on the way are not counted
  std::uint64_t unchanged = 0;  // non-directories of `full` found equal in `base`
  std::uint64_t whiteouts = 0;
  std::uint64_t opaque_dirs = 0;
  std::uint64_t bytes = 0;   // regular file content in `out` (hard links counted once)
  std::uint64_t linked = 0;  // regular files hard-linked from `full` rather than copied
};

struct DiffOptions {
  // Hard-link the regular files `out` needs from `full` where one filesystem holds both. Only for a scratch
  // `full`: a link shares the inode, and adds to its link count and change time.
  bool link_files = true;
};

// Writes the difference (above) into `out`, which must not exist (ALREADY_EXISTS) and is created. `base` and
// `full` must be directories (INVALID_ARGUMENT otherwise). A summary and what was left out (mount points) are
// appended to `notes`. Needs the privileges to create whiteouts and set trusted xattrs (root) when there are any
// to write; PERMISSION_DENIED otherwise.
DiffStats make_diff_tree(const std::filesystem::path& base, const std::filesystem::path& full,
                         const std::filesystem::path& out, std::vector<std::string>& notes,
                         const DiffOptions& options = {});

}  // namespace dsec::image
