// Reading an EROFS layer's metadata without the kernel, for the extract fallback.
//
// Where the kernel cannot mount EROFS, a node extracts each layer with `fsck.erofs --extract` (erofs-utils 1.5).
// That tool writes the files, their modes, owners and times, but drops every extended attribute, among them
// trusted.overlay.opaque, which makes a directory of an upper layer hide what the layers below have in it (a
// snapshot's replaced directory, a diff layer's directory that replaced a file), and it writes each name of a hard
// linked file as a copy of its own, and it changes owners after modes, which clears set-user-ID and set-group-ID
// bits. restore_erofs_metadata reads the layer's inodes, directories and xattrs (the on-disk format of
// linux/fs/erofs/erofs_fs.h: superblock, compact and extended inodes, flat directories, inline and shared xattrs)
// and puts all three back on the extracted tree.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace dsec::image {

struct ErofsEntry {
  std::string path;        // relative to the root, '/'-separated; empty for the root itself
  std::uint64_t nid = 0;   // the inode's number in the image: names of one hard-linked file share it
  std::uint32_t mode = 0;  // st_mode
  std::uint32_t nlink = 0;
  std::vector<std::pair<std::string, std::string>> xattrs;  // full names ("trusted.overlay.opaque") and values
};

// Every entry of the EROFS image in `image` (the metadata part of a layer is enough: the first `meta_bytes` bytes,
// or the whole file when 0), parents before children. DATA_LOSS for an image that is not EROFS or is inconsistent
// (a name out of its block, a directory loop); UNIMPLEMENTED for features erofs-utils 1.5 does not write (long
// xattr name prefixes).
std::vector<ErofsEntry> read_erofs_entries(const std::filesystem::path& image, std::uint64_t meta_bytes = 0);

struct ErofsRestoreStats {
  std::uint64_t xattrs = 0;      // extended attributes set
  std::uint64_t hard_links = 0;  // copies replaced by links
  std::uint64_t modes = 0;       // set-user-ID / set-group-ID bits put back
};

// Sets, on the tree `tree` that fsck.erofs extracted from `image`, the xattrs the image holds and the set-ID bits of
// its modes, and turns the copies of hard-linked files back into links. Paths are resolved below `tree` without
// following symlinks.
ErofsRestoreStats restore_erofs_metadata(const std::filesystem::path& image, std::uint64_t meta_bytes,
                                         const std::filesystem::path& tree);

}  // namespace dsec::image
