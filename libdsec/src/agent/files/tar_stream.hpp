// Tar streams of the files API, entry by entry (libarchive): a tar upload becomes TreeEntry calls on a TreeSink
// (a sandbox's tree on the host, or the guest of a VM at the other end of its channel), and entries walked out of a
// sandbox become a pax tar. The rules of what an entry may do live with the tree (sandbox_tree.hpp), not here.
#pragma once

#include <archive.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "common/sandbox_tree.hpp"

namespace dsec::agent::files {

// Reads a tar stream (plain, or compressed in any way libarchive reads; tar, pax and GNU formats) and hands every
// regular file, directory, symlink and hard link to `sink`, then calls sink.finish(). Devices, FIFOs and sockets are
// skipped. INVALID_ARGUMENT for a stream that is not a tar.
void extract_tar(std::string_view tar_bytes, TreeSink& sink);

// Builds a pax tar of entries as they come: entry(), then a regular file's bytes (exactly its size) through
// data(), then the next entry; finish() returns the stream. RESOURCE_EXHAUSTED once the stream passes max_bytes.
class TarWriter {
 public:
  explicit TarWriter(std::size_t max_bytes);
  ~TarWriter();
  TarWriter(const TarWriter&) = delete;
  TarWriter& operator=(const TarWriter&) = delete;

  void entry(const TreeEntry& e);
  void data(std::string_view bytes);
  std::string finish();

 private:
  struct Sink {
    std::string data;
    std::size_t max_bytes;
  };
  static la_ssize_t write_out(archive* a, void* client, const void* buf, size_t len);
  Sink sink_;
  archive* archive_ = nullptr;
};

}  // namespace dsec::agent::files
