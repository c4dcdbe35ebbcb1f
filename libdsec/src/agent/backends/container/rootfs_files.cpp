#include "agent/backends/container/rootfs_files.hpp"

#include "agent/files/tar_stream.hpp"

namespace dsec::agent::container {

void RootfsFiles::put_archive(std::string_view dir, std::string_view tar_bytes) {
  files::SandboxTree::Extraction extraction(tree_, dir);
  files::extract_tar(tar_bytes, extraction);
}

std::string RootfsFiles::get_archive(std::string_view dir, std::size_t max_bytes) {
  files::TarWriter tar(max_bytes);
  tree_.walk(dir, max_bytes, [&](const files::TreeEntry& e) { tar.entry(e); },
             [&](std::string_view bytes) { tar.data(bytes); });
  return tar.finish();
}

}  // namespace dsec::agent::container
