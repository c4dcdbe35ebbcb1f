// The node's local image store. For now an image is one read-only root directory; layered, content-addressed EROFS
// images streamed from remote stores replace this (issue: layered images), behind the same lookup.
//
// Layout under the store root (default /var/lib/dsec/images):
//   <escaped name>/manifest.json   {"name", "created_at", "size_bytes", "source", "layers": ["rootfs"], "notes": [...]}
//   <escaped name>/rootfs/         the root filesystem, read-only to sandboxes (it is an overlay lower layer)
//   .tmp-*/                        builds in progress (renamed into place when done, removed when they fail)
//   .rm-*/                         images being removed
// The escaped name is the normalised name with '%', '/' and ':' percent-encoded ("swe/django:1" ->
// "swe%2Fdjango%3A1"), so it is one path component and safe in overlayfs mount options.
// Next to the store, <root>/../cache holds tarballs of debootstrap trees, so a rebuild never downloads again.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/unique_fd.hpp"

namespace dsec::image {

struct ImageRecord {
  std::string name;                            // normalised: "busybox" and "busybox:latest" are one image
  std::filesystem::path dir;                   // the image's directory in the store
  std::vector<std::filesystem::path> layers;   // read-only root layers, lowest first
  std::uint64_t size_bytes = 0;                // bytes of file content (hard links counted once) and symlinks
  double created_at = 0;                       // unix seconds
  std::string source;                          // what it was built from
  std::vector<std::string> notes;              // what the build left out or changed, e.g. skipped device nodes
};

// A hold on an image's files for as long as a sandbox uses them (a shared flock on its manifest). While a lease
// lives, removing or replacing the image takes the name away at once but leaves the files (under a ".rm-" name)
// until the last lease ends; the next prune_stale removes them. Movable; released on destruction.
class ImageLease {
 public:
  ImageLease() = default;
  ImageLease(UniqueFd fd, ImageRecord record) : fd_(std::move(fd)), record_(std::move(record)) {}
  explicit operator bool() const noexcept { return static_cast<bool>(fd_); }
  const ImageRecord& record() const noexcept { return record_; }

 private:
  UniqueFd fd_;
  ImageRecord record_;
};

// "busybox" -> "busybox:latest"; names keep letters, digits, '-', '_', '.', '/', and one ':' before the tag.
// Each '/'-separated part of the repository starts with a letter or digit; the tag starts with a letter, digit or
// '_'. Throws dsec::Error(INVALID_ARGUMENT) for anything else.
std::string normalize_name(const std::string& name);

// The store directory name of a normalised name (see the layout above), and back.
std::string escape_name(std::string_view normalized_name);
std::string unescape_name(std::string_view escaped);

class ImageStore {
 public:
  // Receives builder output (debootstrap's progress, notes) line by line. Called on the building thread.
  using LogSink = std::function<void(std::string_view line)>;

  explicit ImageStore(std::filesystem::path root);

  const std::filesystem::path& root() const noexcept { return root_; }
  // <root>/../cache: debootstrap tarballs.
  std::filesystem::path cache_dir() const;
  void set_log(LogSink sink) { log_ = std::move(sink); }

  // Images sorted by name. Directories without a readable manifest (foreign or damaged) are left out.
  std::vector<ImageRecord> list() const;
  std::optional<ImageRecord> find(const std::string& name) const;
  // Like find, but a missing image is dsec::Error(NOT_FOUND) naming it and what the store has.
  ImageRecord resolve(const std::string& name) const;
  // resolve, plus a lease that keeps the image's files in place while it lives (see ImageLease).
  ImageLease lease(const std::string& name) const;
  // Removes an image; NOT_FOUND if it does not exist. The name is gone when this returns; the files too, unless a
  // lease holds them (then the last lease's end and the next prune_stale remove them).
  void remove(const std::string& name);

  // Builders. Each one builds into a temporary directory in the store and renames it into place, so a failed or
  // interrupted build never leaves a half image under the name. An existing image of that name is replaced.
  //
  // A copy of a directory tree: modes, ownership, times, xattrs, symlinks and hard links are kept. Device nodes and
  // sockets are skipped (a sandbox gets its own /dev), each skip listed in the record's notes. Mounts below
  // source_dir are not crossed.
  ImageRecord build_from_directory(const std::string& name, const std::filesystem::path& source_dir);
  // A tiny image from the host's busybox-static: /bin/busybox and a symlink per applet in /bin (/bin/sh among them),
  // /sbin, /usr/bin and /usr/sbin linked to /bin, /etc/passwd and /etc/group with root, /tmp (1777), /root, and
  // /proc /dev /sys /run /etc/hostname /etc/resolv.conf /etc/hosts as mount points. FAILED_PRECONDITION when the
  // binary is missing or dynamically linked.
  ImageRecord build_busybox(const std::string& name, const std::filesystem::path& busybox = "/bin/busybox");
  // debootstrap --variant=minbase SUITE with extra packages (e.g. python3) from the Debian mirror (empty: the one
  // this machine's apt sources use). The debootstrap tree, with apt's package cache and lists, logs, documentation,
  // manual pages, translations and the host's /etc/hostname, /etc/resolv.conf and /etc/hosts taken out, is cached as
  // a tarball under <root>/../cache so a rebuild does not download again.
  ImageRecord build_debootstrap(const std::string& name, const std::string& suite,
                                const std::vector<std::string>& include_packages, const std::string& mirror = {});

  // Removes what interrupted builds and removals left behind: temporary directories no live build holds, and
  // removed or replaced images no lease holds any more.
  void prune_stale() const;

 private:
  std::filesystem::path dir_for(const std::string& normalized_name) const;
  // Deletes a directory that was renamed to a ".rm-" name, unless a lease still holds it.
  void discard(const std::filesystem::path& doomed) const;
  void log(std::string_view line) const {
    if (log_) log_(line);
  }

  std::filesystem::path root_;
  LogSink log_;

  friend class PendingImage;
};

}  // namespace dsec::image
