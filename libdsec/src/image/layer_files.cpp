#include "image/layer_files.hpp"

#include <fcntl.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "image/fs_tree.hpp"
#include "image/store/chunk_index.hpp"

namespace dsec::image {
namespace fs = std::filesystem;
namespace {

// Stored bytes fetched with one read: consecutive chunks are read together up to this much.
constexpr std::uint64_t kReadBatch = 16ull << 20;
constexpr unsigned long kMountFlags = MS_RDONLY | MS_NODEV | MS_NOSUID;

bool all_zero(const std::string& bytes) {
  return bytes.empty() || (bytes.front() == 0 && std::memcmp(bytes.data(), bytes.data() + 1, bytes.size() - 1) == 0);
}

void write_at(int fd, const fs::path& file, const char* data, std::size_t size, std::uint64_t offset) {
  while (size > 0) {
    ssize_t n = retry_eintr([&] { return ::pwrite(fd, data, size, static_cast<off_t>(offset)); });
    if (n < 0) {
      if (errno == ENOSPC)
        throw Error(Code::kResourceExhausted, fmt::format("write {}: the disk is full", file.string()));
      throw_errno_fmt(errno, "write {}", file.string());
    }
    data += n;
    size -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
}

UniqueFd create_file(const fs::path& p) {
  UniqueFd fd(::open(p.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!fd) throw_errno_fmt(errno, "create {}", p.string());
  return fd;
}

void set_size(int fd, const fs::path& p, std::uint64_t size) {
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    if (errno == ENOSPC || errno == EFBIG)
      throw Error(Code::kResourceExhausted, fmt::format("{}: no room for {} bytes", p.string(), size));
    throw_errno_fmt(errno, "resize {}", p.string());
  }
}

// overlayfs and EROFS options are comma-separated, lowerdir colon-separated: paths holding either cannot be named.
void check_option_path(const fs::path& p) {
  if (p.string().find_first_of(",:\\") != std::string::npos)
    throw Error(Code::kInvalidArgument,
                fmt::format("cannot mount image layers under {}: the path holds ',', ':' or '\\'", p.string()));
}

void unmount(const fs::path& p) {
  if (::umount2(p.c_str(), 0) == 0 || errno == EINVAL || errno == ENOENT) return;
  if (errno == EBUSY && ::umount2(p.c_str(), MNT_DETACH) == 0) return;
  throw_errno_fmt(errno, "unmount {}", p.string());
}

[[noreturn]] void throw_mount_error(int err, const std::string& what, const fs::path& at) {
  switch (err) {
    case EPERM:
      throw Error(Code::kPermissionDenied,
                  fmt::format("mount {} on {}: mounting image layers needs root", what, at.string()));
    case ENODEV:
      throw Error(Code::kFailedPrecondition, fmt::format("mount {}: the kernel lacks the filesystem", what));
    case ENOTBLK:
      throw Error(Code::kFailedPrecondition,
                  fmt::format("mount {}: the kernel cannot mount EROFS from a file (Linux 6.12 or later can)", what));
    default:
      throw_errno_fmt(err, "mount {} on {}", what, at.string());
  }
}

}  // namespace

LayerFiles write_layer_files(BlobStore& store, const LayerDescriptor& layer, const fs::path& dir,
                             const ProgressFn& progress) {
  ChunkIndex index = chunk_index_from_json(store.read_blob(layer.index));
  if (index.layer != layer.digest || index.data != layer.data || index.size != layer.size)
    throw Error(Code::kInvalidArgument, fmt::format("chunk index {} does not describe layer {} (it names {})",
                                                    layer.index, layer.digest, index.layer));
  if (index.meta_size > index.size)
    throw Error(Code::kInvalidArgument,
                fmt::format("chunk index {}: metadata part larger than the layer", layer.index));
  if (::mkdir(dir.c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}", dir.string());

  LayerFiles files;
  files.meta = dir / "meta";
  const bool split = index.meta_size > 0;
  if (split) files.data = dir / "data";
  UniqueFd meta = create_file(files.meta);
  UniqueFd data;
  if (split) data = create_file(files.data);
  const std::uint64_t meta_size = split ? index.meta_size : index.size;

  std::string stored, chunk;
  std::uint64_t written = 0;
  if (progress) progress(fmt::format("reading layer {}", layer.digest.substr(0, 19)), 0, index.size);
  for (std::size_t first = 0; first < index.chunk_count();) {
    // Consecutive chunks lying one after another in the data blob, read with one request.
    std::size_t last = first;
    std::uint64_t span = index.chunks[first].length;
    while (last + 1 < index.chunk_count() &&
           index.chunks[last + 1].offset == index.chunks[last].offset + index.chunks[last].length &&
           span + index.chunks[last + 1].length <= kReadBatch) {
      ++last;
      span += index.chunks[last].length;
    }
    stored = store.read_range(index.data, index.chunks[first].offset, span);
    std::string_view view = stored;
    for (std::size_t i = first; i <= last; ++i) {
      const std::uint64_t at_in_batch = index.chunks[i].offset - index.chunks[first].offset;
      decode_chunk(index, i, view.substr(at_in_batch, index.chunks[i].length), chunk);
      std::uint64_t offset = static_cast<std::uint64_t>(i) * index.chunk_size;
      // Zero chunks are left as holes (the files get their full size below).
      if (!all_zero(chunk)) {
        std::size_t in_meta = offset < meta_size
                                  ? static_cast<std::size_t>(std::min<std::uint64_t>(chunk.size(), meta_size - offset))
                                  : 0;
        if (in_meta > 0) write_at(meta.get(), files.meta, chunk.data(), in_meta, offset);
        if (in_meta < chunk.size())
          write_at(data.get(), files.data, chunk.data() + in_meta, chunk.size() - in_meta,
                   offset + in_meta - meta_size);
      }
      written += chunk.size();
    }
    if (progress) progress(fmt::format("reading layer {}", layer.digest.substr(0, 19)), written, index.size);
    first = last + 1;
  }
  set_size(meta.get(), files.meta, meta_size);
  if (split) set_size(data.get(), files.data, index.size - meta_size);
  return files;
}

MountedImage::MountedImage(BlobStore& store, const Manifest& manifest, const fs::path& scratch,
                           const ProgressFn& progress)
    : scratch_(fs::absolute(scratch)) {
  if (manifest.layers.empty()) throw Error(Code::kInvalidArgument, "image has no layers to mount");
  check_option_path(scratch_);
  if (::mkdir(scratch_.c_str(), 0700) != 0) throw_errno_fmt(errno, "mkdir {}", scratch_.string());
  try {
    std::vector<fs::path> layer_dirs;
    for (std::size_t i = 0; i < manifest.layers.size(); ++i) {
      const LayerDescriptor& layer = manifest.layers[i];
      fs::path dir = scratch_ / fmt::format("layer{}", i);
      LayerFiles files = write_layer_files(store, layer, dir, progress);
      layer_bytes_ += layer.size;
      fs::path at = dir / "root";
      if (::mkdir(at.c_str(), 0755) != 0) throw_errno_fmt(errno, "mkdir {}", at.string());
      mount_layer(layer, files, at);
      layer_dirs.push_back(at);
    }
    if (layer_dirs.size() == 1) {
      root_ = layer_dirs.front();
      return;
    }
    std::string options = "lowerdir=";
    for (auto it = layer_dirs.rbegin(); it != layer_dirs.rend(); ++it)
      options += (it == layer_dirs.rbegin() ? "" : ":") + it->string();
    if (options.size() >= 4000)
      throw Error(Code::kInvalidArgument, fmt::format("{} layers under {}: too many to stack in one overlay mount",
                                                      layer_dirs.size(), scratch_.string()));
    fs::path merged = scratch_ / "merged";
    if (::mkdir(merged.c_str(), 0755) != 0) throw_errno_fmt(errno, "mkdir {}", merged.string());
    if (::mount("overlay", merged.c_str(), "overlay", kMountFlags, options.c_str()) != 0)
      throw_mount_error(errno, fmt::format("overlay of {} layers", layer_dirs.size()), merged);
    mounts_.push_back(merged);
    root_ = merged;
  } catch (...) {
    try {
      release();
    } catch (...) {
    }
    throw;
  }
}

void MountedImage::mount_layer(const LayerDescriptor& layer, const LayerFiles& files, const fs::path& at) {
  std::string options;
  if (!files.data.empty()) {
    check_option_path(files.data);
    options = "device=" + files.data.string();
  }
  if (::mount(files.meta.c_str(), at.c_str(), "erofs", kMountFlags, options.empty() ? nullptr : options.c_str()) != 0) {
    int err = errno;
    if (err == EINVAL)
      throw Error(Code::kInvalidArgument,
                  fmt::format("layer {} is not an EROFS image this kernel can mount", layer.digest));
    throw_mount_error(err, fmt::format("layer {}", layer.digest), at);
  }
  mounts_.push_back(at);
}

void MountedImage::release() {
  while (!mounts_.empty()) {
    unmount(mounts_.back());
    mounts_.pop_back();
  }
  root_.clear();
  if (!scratch_.empty()) {
    remove_tree(scratch_);
    scratch_.clear();
  }
}

MountedImage::~MountedImage() {
  try {
    release();
  } catch (...) {
  }
}

}  // namespace dsec::image
