// Whole-tree operations on root filesystems: copy, pack to and unpack from a tarball (libarchive), measure, remove.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dsec::image {

// Copies the tree at `source` to `dest` (which must not exist): modes, numeric ownership, times, xattrs, ACLs,
// symlinks (as links) and hard links (as links) are kept. Device nodes and sockets are skipped and each skip is
// appended to `notes`; mounts below `source` are not crossed.
void copy_tree(const std::filesystem::path& source, const std::filesystem::path& dest, std::vector<std::string>& notes);

// Writes the tree at `source` as a zstd-compressed pax tarball to `tarball` (through a temporary file renamed into
// place, so a tarball that exists is whole). Entries are relative ("./usr/bin/..."), ownership numeric.
void pack_tree(const std::filesystem::path& source, const std::filesystem::path& tarball);

// Extracts a tarball written by pack_tree (or any tar, compressed or not) into `dest` (which must not exist),
// refusing entries that would land outside it. What could not be restored exactly (an xattr, a time) is appended to
// `notes`.
void unpack_tree(const std::filesystem::path& tarball, const std::filesystem::path& dest,
                 std::vector<std::string>& notes);

// Bytes of file content (hard links counted once) plus symlink targets, without crossing mounts.
std::uint64_t tree_size(const std::filesystem::path& root);

// Detaches every mount at or below `path` (deepest first). Builders that run tools which mount (debootstrap mounts
// /proc and /sys in its target) call this before touching the tree.
void unmount_below(const std::filesystem::path& path);

// Removes `path` and everything below it, never following symlinks and never crossing into another filesystem
// (mounts below are detached first). A path that does not exist is not an error.
void remove_tree(const std::filesystem::path& path);

}  // namespace dsec::image
