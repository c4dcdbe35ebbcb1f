// The agent's side of a VM snapshot: the guest's writable layer arrives as a stream of entries (guest_protocol
// kCaptureUpper) and is written here as the tree of a new image layer, in the form image/upper_tree.hpp describes
// (whiteouts as character devices 0/0, trusted.overlay.opaque="y" on replaced directories, hard links, modes,
// numeric owners, times), so a VM's snapshot becomes a layer exactly as a container's does.
//
// The stream comes from inside the VM: every name is checked (relative, no "..", within the path limit), every
// parent is opened beneath the destination without following symlinks (a symlink the guest sent cannot lead a
// later entry outside the tree), and the limits hold whatever the guest claims.
#pragma once

#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "common/sandbox_tree.hpp"
#include "common/unique_fd.hpp"
#include "image/upper_tree.hpp"

namespace dsec::agent::guest {

class UpperTreeWriter {
 public:
  // Makes `dest` (it must not exist; its parent must).
  UpperTreeWriter(const std::filesystem::path& dest, const image::UpperTreeLimits& limits);

  void entry(const files::TreeEntry& e);
  void data(std::string_view bytes);
  // Ends the last file and sets the directories' times. The stats of what was written.
  image::UpperTreeStats finish();

 private:
  UniqueFd parent_of(const std::string& rel, std::string& leaf);
  void end_file();

  std::filesystem::path dest_;
  image::UpperTreeLimits limits_;
  UniqueFd root_;
  image::UpperTreeStats stats_;
  UniqueFd file_;
  std::string file_path_;
  std::uint64_t file_left_ = 0;
  files::TreeEntry file_entry_;
  struct DirTimes {
    std::string path;
    std::int64_t atime_ns, mtime_ns;
  };
  std::vector<DirTimes> dirs_;
};

}  // namespace dsec::agent::guest
