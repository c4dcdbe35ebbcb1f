#include "agent/files/tar_stream.hpp"

#include <archive_entry.h>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::agent::files {
namespace {

struct ArchiveReadDeleter {
  void operator()(archive* a) const { archive_read_free(a); }
};
struct EntryDeleter {
  void operator()(archive_entry* e) const { archive_entry_free(e); }
};

void archive_check(archive* a, int rc, std::string_view what) {
  if (rc < ARCHIVE_WARN) {
    int err = archive_errno(a);
    const char* msg = archive_error_string(a);
    if (err == EFBIG) throw Error(Code::kResourceExhausted, fmt::format("{}: {}", what, msg ? msg : "too large"));
    throw Error(Code::kInvalidArgument, fmt::format("{}: {}", what, msg ? msg : "archive error"));
  }
}

}  // namespace

void extract_tar(std::string_view tar_bytes, TreeSink& sink) {
  std::unique_ptr<archive, ArchiveReadDeleter> a(archive_read_new());
  archive_read_support_format_tar(a.get());
  archive_read_support_format_gnutar(a.get());
  archive_read_support_filter_all(a.get());
  archive_check(a.get(), archive_read_open_memory(a.get(), tar_bytes.data(), tar_bytes.size()), "read tar stream");
  archive_entry* e = nullptr;
  static const std::string kZeros(65536, '\0');
  for (;;) {
    int rc = archive_read_next_header(a.get(), &e);
    if (rc == ARCHIVE_EOF) break;
    archive_check(a.get(), rc, "read tar stream");
    const char* name = archive_entry_pathname(e);
    if (!name || !*name) continue;
    TreeEntry entry;
    entry.path = name;
    entry.mode = archive_entry_perm(e) & 01777;
    if (const char* target = archive_entry_hardlink(e)) {
      entry.kind = EntryKind::kHardlink;
      entry.link = target;
      sink.entry(entry);
      continue;
    }
    auto type = archive_entry_filetype(e);
    if (type == AE_IFDIR) {
      entry.kind = EntryKind::kDirectory;
      sink.entry(entry);
    } else if (type == AE_IFLNK) {
      const char* target = archive_entry_symlink(e);
      entry.kind = EntryKind::kSymlink;
      entry.link = target ? target : "";
      sink.entry(entry);
    } else if (type == AE_IFREG) {
      entry.kind = EntryKind::kRegular;
      entry.size = static_cast<std::uint64_t>(archive_entry_size(e));
      sink.entry(entry);
      const void* buf;
      size_t size;
      la_int64_t offset;
      std::uint64_t written = 0;
      for (;;) {
        int r = archive_read_data_block(a.get(), &buf, &size, &offset);
        if (r == ARCHIVE_EOF) break;
        archive_check(a.get(), r, "read tar data");
        // A sparse entry's holes arrive as gaps between blocks: they are zeros.
        while (written < static_cast<std::uint64_t>(offset)) {
          std::size_t n = std::min<std::uint64_t>(kZeros.size(), static_cast<std::uint64_t>(offset) - written);
          sink.write_data(std::string_view(kZeros.data(), n));
          written += n;
        }
        if (size > 0) sink.write_data(std::string_view(static_cast<const char*>(buf), size));
        written += size;
      }
      while (written < entry.size) {
        std::size_t n = std::min<std::uint64_t>(kZeros.size(), entry.size - written);
        sink.write_data(std::string_view(kZeros.data(), n));
        written += n;
      }
    }
    // Devices, FIFOs and sockets are skipped.
  }
  sink.finish();
}

TarWriter::TarWriter(std::size_t max_bytes) : sink_{{}, max_bytes}, archive_(archive_write_new()) {
  if (!archive_) throw Error(Code::kResourceExhausted, "archive_write_new failed");
  archive_write_set_format_pax_restricted(archive_);
  archive_write_set_bytes_in_last_block(archive_, 1);
  archive_check(archive_, archive_write_open2(archive_, &sink_, nullptr, &TarWriter::write_out, nullptr, nullptr),
                "tar open");
}

TarWriter::~TarWriter() {
  if (archive_) archive_write_free(archive_);
}

void TarWriter::entry(const TreeEntry& e) {
  std::unique_ptr<archive_entry, EntryDeleter> ae(archive_entry_new());
  archive_entry_set_pathname(ae.get(), e.path.c_str());
  archive_entry_set_perm(ae.get(), e.mode & 07777);
  archive_entry_set_uid(ae.get(), e.uid);
  archive_entry_set_gid(ae.get(), e.gid);
  archive_entry_set_mtime(ae.get(), e.mtime, 0);
  switch (e.kind) {
    case EntryKind::kDirectory:
      archive_entry_set_filetype(ae.get(), AE_IFDIR);
      break;
    case EntryKind::kRegular:
      archive_entry_set_filetype(ae.get(), AE_IFREG);
      archive_entry_set_size(ae.get(), static_cast<la_int64_t>(e.size));
      break;
    case EntryKind::kSymlink:
      archive_entry_set_filetype(ae.get(), AE_IFLNK);
      archive_entry_set_symlink(ae.get(), e.link.c_str());
      break;
    case EntryKind::kHardlink:
      archive_entry_set_filetype(ae.get(), AE_IFREG);
      archive_entry_set_hardlink(ae.get(), e.link.c_str());
      break;
    case EntryKind::kFifo:
    case EntryKind::kWhiteout:
      return;  // not files to download
  }
  archive_check(archive_, archive_write_header(archive_, ae.get()), "tar header");
}

void TarWriter::data(std::string_view bytes) {
  if (archive_write_data(archive_, bytes.data(), bytes.size()) < 0) archive_check(archive_, ARCHIVE_FATAL, "tar data");
}

std::string TarWriter::finish() {
  archive_check(archive_, archive_write_close(archive_), "tar close");
  return std::move(sink_.data);
}

la_ssize_t TarWriter::write_out(archive* a, void* client, const void* buf, size_t len) {
  auto* sink = static_cast<Sink*>(client);
  if (sink->data.size() + len > sink->max_bytes) {
    archive_set_error(a, EFBIG, "archive larger than the %zu byte limit", sink->max_bytes);
    return -1;
  }
  sink->data.append(static_cast<const char*>(buf), len);
  return static_cast<la_ssize_t>(len);
}

}  // namespace dsec::agent::files
