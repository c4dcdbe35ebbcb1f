// A sandbox's writable layer as the tree of a new image layer (snapshots).
//
// overlayfs keeps what a sandbox changed on top of its image in the overlay's upper directory: new and changed
// files (a file changed by one byte is copied up whole), a whiteout (a character device 0/0) for each entry of the
// image the sandbox deleted, and trusted.overlay.opaque="y" on a directory it replaced (removed, then made again),
// which hides everything the image had in it. That is already the form image layers use for deletions
// (docs/images.md), so a copy of the upper directory, stacked above the same image layers, shows exactly the files
// the sandbox saw. copy_upper_tree makes that copy:
//   * directories, regular files, symlinks, FIFOs and whiteouts, with their mode, numeric owner, access and
//     modification times and extended attributes; file names are bytes, copied as they are;
//   * hard links stay hard links; holes in sparse files stay holes (only the data is read and written);
//   * trusted.overlay.opaque="y" is kept on directories; overlayfs's other private xattrs (trusted.overlay.origin,
//     impure, nlink, upper, ...) are dropped: they describe the upper's relation to one mount's lowers and would
//     mislead an overlay that stacks the layer as a lower;
//   * sockets (useless without their process) and device nodes other than whiteouts (a sandbox cannot make them)
//     are left out, each counted in `skipped` and named in the notes.
// An upper written with metacopy or redirect_dir on (trusted.overlay.metacopy / redirect: the data or the name
// lives in a lower layer) cannot be copied on its own and is FAILED_PRECONDITION; dsec mounts overlays with both off.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dsec::image {

struct UpperTreeLimits {
  // Apparent size of all regular files together (a sparse file counts whole: mkfs.erofs maps every chunk of it).
  std::uint64_t max_file_bytes = 16ull << 30;
  // Longest path below the root: mkfs.erofs walks the tree by path, and paths past PATH_MAX fail there.
  std::size_t max_path_bytes = 4000;
};

struct UpperTreeStats {
  std::uint64_t entries = 0;  // everything written below the root
  std::uint64_t files = 0;    // regular files (inodes, not names)
  std::uint64_t directories = 0;
  std::uint64_t symlinks = 0;
  std::uint64_t fifos = 0;
  std::uint64_t whiteouts = 0;
  std::uint64_t opaque_directories = 0;
  std::uint64_t hard_links = 0;  // further names of a file already copied
  std::uint64_t file_bytes = 0;  // apparent size of the regular files (each inode once)
  std::uint64_t data_bytes = 0;  // bytes read and written (holes are not)
  std::uint64_t skipped = 0;     // sockets and device nodes left out
};

// Copies the upper directory open at `upper_fd` (any open or O_PATH descriptor of the directory) into `dest`,
// which must not exist; its parent must. Never follows a symlink of the source and never leaves its filesystem.
// Throws RESOURCE_EXHAUSTED (not retryable) past `limits` or when dest's disk is full, FAILED_PRECONDITION for an
// upper with metacopy or redirect xattrs, and what the syscalls say otherwise. On failure, what was written stays
// for the caller to remove. Notes say what was left out.
UpperTreeStats copy_upper_tree(int upper_fd, const std::filesystem::path& dest, const UpperTreeLimits& limits,
                               std::vector<std::string>& notes);

}  // namespace dsec::image
