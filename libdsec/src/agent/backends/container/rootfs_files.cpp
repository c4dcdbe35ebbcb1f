#include "agent/backends/container/rootfs_files.hpp"

#include "agent/files/tar_stream.hpp"

namespace dsec::agent::container {

void RootfsFiles::put_archive(std::string_view dir, std::string_view tar_bytes) {
  files::SandboxTree::Extraction extraction(tree_, dir);
  files::extract_tar(tar_bytes, extraction);
}

std::string RootfsFiles::get_archive(std::string_view dir, std::size_t max_bytes) {
  files::TarWriter tar(max_bytes);
  // Outside the block (a file the host made without the sandbox's ids): the overflow id, as the sandbox sees it.
  auto inside = [&](std::uint32_t id) -> std::uint32_t {
    if (!userns_first_) return id;
    return id >= *userns_first_ && id - *userns_first_ < 65536 ? id - *userns_first_ : 65534;
  };
  tree_.walk(
      dir, max_bytes,
      [&](const files::TreeEntry& e) {
        files::TreeEntry mapped = e;
        mapped.uid = inside(e.uid);
        mapped.gid = inside(e.gid);
        tar.entry(mapped);
      },
      [&](std::string_view bytes) { tar.data(bytes); });
  return tar.finish();
}

}  // namespace dsec::agent::container
