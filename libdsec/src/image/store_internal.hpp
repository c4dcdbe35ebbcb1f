// Pieces of the image store shared by its builders: the build-in-progress directory and manifests.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "common/unique_fd.hpp"
#include "image/store.hpp"

namespace dsec::image {

// A build in progress: a private ".tmp-*" directory in the store, locked while this object lives, removed (with
// anything mounted in it) unless commit() moved it into place.
class PendingImage {
 public:
  PendingImage(const ImageStore& store, std::string normalized_name);
  ~PendingImage();
  PendingImage(const PendingImage&) = delete;
  PendingImage& operator=(const PendingImage&) = delete;

  const std::filesystem::path& dir() const noexcept { return dir_; }
  // Where the builder puts the root filesystem (it does not exist yet; builders create it).
  std::filesystem::path rootfs() const { return dir_ / "rootfs"; }
  void log(std::string_view line) const { store_.log(line); }

  // Measures the tree, writes the manifest and renames the directory into place, atomically replacing an image of
  // the same name. The replaced image is removed afterwards.
  ImageRecord commit(std::string source, std::vector<std::string> notes);

 private:
  const ImageStore& store_;
  std::string name_;
  std::filesystem::path dir_;
  UniqueFd lock_;
  bool committed_ = false;
};

// Reads <dir>/manifest.json; nullopt when it is missing or unreadable.
std::optional<ImageRecord> read_manifest(const std::filesystem::path& dir);
void write_manifest(const std::filesystem::path& dir, const ImageRecord& record);

// A fresh random name in `dir` with this prefix ("<dir>/.rm-3f9a0c1d2e4b").
std::filesystem::path random_path(const std::filesystem::path& dir, std::string_view prefix);

}  // namespace dsec::image
