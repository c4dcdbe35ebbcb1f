// Tar streams and OCI image layouts as image layers.
//
// A layer tar may delete files of the layers below it with OCI whiteouts: an entry ".wh.NAME" removes NAME, and
// ".wh..wh..opq" in a directory hides everything the lower layers have in it. dsec's layers stack with overlayfs,
// which spells the same two things as a character device 0/0 named NAME and the xattr trusted.overlay.opaque="y" on
// the directory. Applying a tar to a tree therefore does one of two things with whiteouts:
//   kApply     the tree is the whole image: delete what they name (nothing else lies below);
//   kOverlay   the tree is a layer above a parent image: delete what they name from the tree and leave overlayfs's
//              whiteout / opaque marker, so they also hide the parent's files.
//
// Hostile input is refused or contained: member names with ".." or absolute paths are INVALID_ARGUMENT; links are
// never followed while writing (a symlink "etc -> /" then "etc/passwd" is refused); hard links must point inside
// the tree; device nodes, sockets and FIFOs are skipped and listed in the notes; a member larger than the byte budget
// or the free space left is RESOURCE_EXHAUSTED; a truncated or malformed stream is DATA_LOSS.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dsec::image {

enum class WhiteoutMode { kApply, kOverlay };

struct TarLimits {
  std::uint64_t max_bytes = 64ull << 30;  // file content written, over the whole build
  std::uint64_t max_entries = 10'000'000;
  std::uint64_t used_bytes = 0;  // running totals, carried from layer to layer
  std::uint64_t used_entries = 0;
};

// Applies one layer tar (plain, gzip, zstd, xz or bzip2; detected from its bytes) to the tree at `root` (created if
// missing). `tar` is a file path, or "-" for standard input (spooled to a file in `root`'s parent first, since
// whiteouts are applied before the layer's own entries).
void apply_layer_tar(const std::filesystem::path& tar, const std::filesystem::path& root, WhiteoutMode mode,
                     TarLimits& limits, std::vector<std::string>& notes);

// Applies an OCI image (a directory in the OCI image layout, or a tar of one as `docker save` writes it; also the
// older `docker save` format with only manifest.json) to the tree at `root`: its layers in order, each verified
// against its digest first. With several manifests in the index, the one for this machine's platform is taken.
// Returns a description of what was applied ("oci:<path> sha256:... (3 layers)").
std::string apply_oci_image(const std::filesystem::path& layout, const std::filesystem::path& root, WhiteoutMode mode,
                            TarLimits& limits, std::vector<std::string>& notes);

// True when `path` is a directory in the OCI image layout, or a tar whose top level has oci-layout, index.json or
// manifest.json.
bool looks_like_oci_image(const std::filesystem::path& path);

}  // namespace dsec::image
