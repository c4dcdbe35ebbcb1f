// Shared helpers for the image unit tests: a private temporary directory per test, small file makers, tar streams
// written with libarchive, and a built layer read back from its store and mounted as EROFS (with an overlay view of
// several layers), the way a node would see it.
#pragma once

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "dsec/error.hpp"
#include "image/fs_tree.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/manifest.hpp"

namespace dsec::image::testing {

// Runs `fn`, expects a dsec::Error with `code` whose message holds every one of `parts`; returns the message.
inline std::string expect_error(const std::function<void()>& fn, Code code, std::vector<std::string> parts = {}) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(e.code_name(), code_name(code)) << e.what();
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << "'" << p << "' not in: " << e.what();
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected dsec::Error " << code_name(code) << ", got another exception: " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected dsec::Error " << code_name(code) << ", nothing was thrown";
  return "";
}

// A fresh directory under $TMPDIR (or /tmp), removed with everything below it (mounts detached first) when the
// test ends.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base && *base ? base : "/tmp") + "/dsec-image-test-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = std::filesystem::canonical(templ);
  }
  ~TempDir() {
    try {
      remove_tree(path_);
    } catch (...) {
    }
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& rel) const { return path_ / rel; }

 private:
  std::filesystem::path path_;
};

inline void write_text(const std::filesystem::path& p, const std::string& text, mode_t mode = 0644) {
  std::filesystem::create_directories(p.parent_path());
  {
    std::ofstream out(p, std::ios::trunc | std::ios::binary);
    out << text;
  }
  ::chmod(p.c_str(), mode);
}

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline struct stat lstat_of(const std::filesystem::path& p) {
  struct stat st {};
  if (::lstat(p.c_str(), &st) != 0) ADD_FAILURE() << "lstat " << p << ": " << std::strerror(errno);
  return st;
}

inline bool running_as_root() { return ::geteuid() == 0; }

// The names in `dir` that start with `prefix` (to find leftover .tmp-* / .rm-* entries).
inline std::vector<std::string> entries_with_prefix(const std::filesystem::path& dir, const std::string& prefix) {
  std::vector<std::string> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    std::string n = e.path().filename().string();
    if (n.starts_with(prefix)) out.push_back(n);
  }
  return out;
}

// Everything below `root` as relative paths ("etc", "etc/passwd", ...), sorted; symlinks are not followed.
inline std::set<std::string> tree_paths(const std::filesystem::path& root) {
  std::set<std::string> out;
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(root, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec))
    out.insert(it->path().lexically_relative(root).string());  // (relative() would resolve symlinks)
  if (ec) ADD_FAILURE() << "walk " << root << ": " << ec.message();
  return out;
}

// Deterministic bytes that do not compress (a seeded generator), and bytes that compress very well.
inline std::string random_bytes(std::size_t n, std::uint64_t seed = 42) {
  std::mt19937_64 rng(seed);
  std::string out(n, '\0');
  for (std::size_t i = 0; i < n; i += 8) {
    std::uint64_t v = rng();
    std::memcpy(out.data() + i, &v, std::min<std::size_t>(8, n - i));
  }
  return out;
}

inline std::string compressible_bytes(std::size_t n) {
  std::string out;
  out.reserve(n);
  for (std::size_t i = 0; out.size() < n; ++i) out += "line " + std::to_string(i % 100) + " of a very regular file\n";
  out.resize(n);
  return out;
}

// The value of an xattr (lgetxattr), or nullopt when the file has none by that name.
inline std::optional<std::string> xattr_of(const std::filesystem::path& p, const char* name) {
  char buf[256];
  ssize_t n = ::lgetxattr(p.c_str(), name, buf, sizeof buf);
  if (n < 0) return std::nullopt;
  return std::string(buf, static_cast<std::size_t>(n));
}

// What a tar member carries besides its name and content.
struct TarAttrs {
  mode_t mode = 0;  // 0: 0644 for files, 0755 for directories
  uid_t uid = 0;
  gid_t gid = 0;
  time_t mtime = 1600000000;
  std::map<std::string, std::string> xattrs;
};

inline TarAttrs tar_attrs(mode_t mode, uid_t uid = 0, gid_t gid = 0, time_t mtime = 1600000000,
                          std::map<std::string, std::string> xattrs = {}) {
  TarAttrs a;
  a.mode = mode;
  a.uid = uid;
  a.gid = gid;
  a.mtime = mtime;
  a.xattrs = std::move(xattrs);
  return a;
}

// A tar stream written entry by entry (pax format, so owners, nanosecond times and xattrs survive).
class TarWriter {
 public:
  enum class Compression { kNone, kGzip };

  explicit TarWriter(const std::filesystem::path& path, Compression compression = Compression::kNone)
      : a_(archive_write_new()) {
    archive_write_set_format_pax(a_);
    if (compression == Compression::kGzip) archive_write_add_filter_gzip(a_);
    if (archive_write_open_filename(a_, path.c_str()) != ARCHIVE_OK)
      throw std::runtime_error("open " + path.string() + ": " + archive_error_string(a_));
  }
  ~TarWriter() {
    close();
    archive_write_free(a_);
  }
  TarWriter(const TarWriter&) = delete;
  TarWriter& operator=(const TarWriter&) = delete;

  void file(const std::string& name, const std::string& content, TarAttrs attrs = TarAttrs()) {
    add(name, AE_IFREG, attrs.mode ? attrs.mode : 0644, attrs, content.size(), nullptr, nullptr);
    if (!content.empty() && archive_write_data(a_, content.data(), content.size()) < 0)
      throw std::runtime_error(std::string("tar data: ") + archive_error_string(a_));
  }
  void dir(const std::string& name, TarAttrs attrs = TarAttrs()) {
    add(name, AE_IFDIR, attrs.mode ? attrs.mode : 0755, attrs, 0, nullptr, nullptr);
  }
  void symlink(const std::string& name, const std::string& target) {
    add(name, AE_IFLNK, 0777, TarAttrs(), 0, target.c_str(), nullptr);
  }
  void hardlink(const std::string& name, const std::string& target) {
    add(name, AE_IFREG, 0644, TarAttrs(), 0, nullptr, target.c_str());
  }
  void char_device(const std::string& name, unsigned major_nr, unsigned minor_nr) {
    Entry e(archive_entry_new());
    archive_entry_set_pathname(e.get(), name.c_str());
    archive_entry_set_filetype(e.get(), AE_IFCHR);
    archive_entry_set_perm(e.get(), 0666);
    archive_entry_set_rdev(e.get(), makedev(major_nr, minor_nr));
    if (archive_write_header(a_, e.get()) != ARCHIVE_OK)
      throw std::runtime_error(std::string("tar header: ") + archive_error_string(a_));
  }
  void close() {
    if (!closed_) archive_write_close(a_);
    closed_ = true;
  }

 private:
  struct EntryFree {
    void operator()(archive_entry* e) const { archive_entry_free(e); }
  };
  using Entry = std::unique_ptr<archive_entry, EntryFree>;

  void add(const std::string& name, mode_t type, mode_t mode, const TarAttrs& attrs, std::int64_t size,
           const char* symlink_target, const char* hardlink_target) {
    Entry e(archive_entry_new());
    archive_entry_set_pathname(e.get(), name.c_str());
    archive_entry_set_filetype(e.get(), type);
    archive_entry_set_perm(e.get(), mode);
    archive_entry_set_uid(e.get(), attrs.uid);
    archive_entry_set_gid(e.get(), attrs.gid);
    archive_entry_set_mtime(e.get(), attrs.mtime, 0);
    if (type == AE_IFREG && !hardlink_target) archive_entry_set_size(e.get(), size);
    if (symlink_target) archive_entry_set_symlink(e.get(), symlink_target);
    if (hardlink_target) archive_entry_set_hardlink(e.get(), hardlink_target);
    for (const auto& [k, v] : attrs.xattrs) archive_entry_xattr_add_entry(e.get(), k.c_str(), v.data(), v.size());
    if (archive_write_header(a_, e.get()) != ARCHIVE_OK)
      throw std::runtime_error(std::string("tar header: ") + archive_error_string(a_));
  }

  archive* a_;
  bool closed_ = false;
};

// Why EROFS layers cannot be mounted here, or "" when they can be tried.
inline std::string mount_skip_reason() {
  if (!running_as_root()) return "mounting EROFS layers and overlays needs root";
  std::ifstream fs("/proc/filesystems");
  std::string all((std::istreambuf_iterator<char>(fs)), std::istreambuf_iterator<char>());
  if (all.find("erofs") == std::string::npos) {
    // The module may load on first mount; only give up when modprobe cannot find it either.
    if (std::system("modprobe erofs >/dev/null 2>&1") != 0 && all.find("erofs") == std::string::npos)
      return "this kernel has no EROFS";
  }
  return "";
}

// A layer read back from its store the way a node reads it: the chunk index, every chunk (decoded and checked), the
// metadata part written to meta.img and the data device to data.img, and the EROFS mounted read-only (file-backed,
// with "device=" naming the data part). Unmounted when it goes away.
class MountedLayer {
 public:
  MountedLayer(BlobStore& store, const LayerDescriptor& layer, const std::filesystem::path& dir) : dir_(dir) {
    std::filesystem::create_directories(dir_ / "mnt");
    index_ = chunk_index_from_json(store.read_blob(layer.index));
    if (index_.layer != layer.digest) throw std::runtime_error("chunk index names another layer");
    if (index_.data != layer.data) throw std::runtime_error("chunk index names another data blob");
    std::ofstream meta(dir_ / "meta.img", std::ios::binary | std::ios::trunc);
    std::ofstream data(dir_ / "data.img", std::ios::binary | std::ios::trunc);
    std::string chunk;
    std::uint64_t at = 0;
    for (std::size_t i = 0; i < index_.chunk_count(); ++i) {
      const ChunkEntry& c = index_.chunks[i];
      decode_chunk(index_, i, store.read_range(layer.data, c.offset, c.length), chunk);
      std::string_view bytes = chunk;
      if (at < index_.meta_size) {
        std::size_t to_meta = static_cast<std::size_t>(std::min<std::uint64_t>(bytes.size(), index_.meta_size - at));
        meta.write(bytes.data(), static_cast<std::streamsize>(to_meta));
        bytes.remove_prefix(to_meta);
      }
      data.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
      at += chunk.size();
    }
    meta.close();
    data.close();
    if (at != layer.size) throw std::runtime_error("the chunks do not add up to the layer's size");
    std::string options = "device=" + (dir_ / "data.img").string();
    if (::mount((dir_ / "meta.img").c_str(), (dir_ / "mnt").c_str(), "erofs", MS_RDONLY, options.c_str()) != 0)
      throw std::runtime_error("mount erofs " + (dir_ / "meta.img").string() + ": " + std::strerror(errno));
    mounted_ = true;
  }
  ~MountedLayer() {
    if (mounted_) ::umount2((dir_ / "mnt").c_str(), MNT_DETACH);
  }
  MountedLayer(const MountedLayer&) = delete;
  MountedLayer& operator=(const MountedLayer&) = delete;

  std::filesystem::path root() const { return dir_ / "mnt"; }
  const ChunkIndex& index() const { return index_; }

 private:
  std::filesystem::path dir_;
  ChunkIndex index_;
  bool mounted_ = false;
};

// A read-only overlay of mounted layers, `lowers` listed top first (as overlayfs's lowerdir wants them), so
// whiteouts and opaque directories of upper layers hide what lower layers have.
class OverlayView {
 public:
  OverlayView(const std::vector<std::filesystem::path>& lowers, const std::filesystem::path& mnt) : mnt_(mnt) {
    std::filesystem::create_directories(mnt_);
    std::string options = "lowerdir=";
    for (std::size_t i = 0; i < lowers.size(); ++i) options += (i ? ":" : "") + lowers[i].string();
    if (::mount("overlay", mnt_.c_str(), "overlay", MS_RDONLY, options.c_str()) != 0)
      throw std::runtime_error("mount overlay " + options + ": " + std::strerror(errno));
    mounted_ = true;
  }
  ~OverlayView() {
    if (mounted_) ::umount2(mnt_.c_str(), MNT_DETACH);
  }
  OverlayView(const OverlayView&) = delete;
  OverlayView& operator=(const OverlayView&) = delete;
  const std::filesystem::path& root() const { return mnt_; }

 private:
  std::filesystem::path mnt_;
  bool mounted_ = false;
};

}  // namespace dsec::image::testing
