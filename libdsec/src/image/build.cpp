#include "image/build.hpp"

#include <fcntl.h>
#include <ftw.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <chrono>
#include <random>
#include <set>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "image/fs_tree.hpp"
#include "image/layer_files.hpp"
#include "image/process.hpp"
#include "image/store/digest.hpp"
#include "image/tree_diff.hpp"

namespace dsec::image {
namespace fs = std::filesystem;

fs::path make_scratch_dir(const fs::path& parent, std::string_view prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  std::error_code ec;
  fs::create_directories(parent, ec);
  // (A read-only or full store says so here, not as a missing directory below.)
  if (ec) throw_errno_fmt(ec.value(), "create {}", parent.string());
  for (;;) {
    fs::path p = parent / fmt::format("{}{:012x}", prefix, rng() & 0xffffffffffffull);
    if (::mkdir(p.c_str(), 0700) == 0) return p;
    if (errno != EEXIST) throw_errno_fmt(errno, "create {}", p.string());
  }
}

namespace {

constexpr std::size_t kMaxExcluded = 2000;

double now_unix() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// What mkfs.erofs must leave out of a tree, and what the tree holds.
struct TreeScan {
  std::vector<std::string> excluded;  // relative paths
  std::uint64_t files_size = 0;
  std::uint64_t entries = 0;
};

TreeScan* g_scan = nullptr;
dev_t g_root_dev = 0;
std::size_t g_root_len = 0;
std::set<std::pair<dev_t, ino_t>>* g_seen_links = nullptr;

int scan_one(const char* path, const struct stat* st, int type, struct FTW* ftw) {
  TreeScan& scan = *g_scan;
  ++scan.entries;
  std::string rel = std::string(path).substr(std::min<std::size_t>(g_root_len + 1, std::strlen(path)));
  if (type == FTW_NS || type == FTW_DNR) throw Error(Code::kPermissionDenied, fmt::format("cannot read {}", path));
  if (ftw->level > 0 && st->st_dev != g_root_dev) {
    scan.excluded.push_back(rel);  // another filesystem mounted inside the tree
    return FTW_SKIP_SUBTREE;
  }
  if (S_ISREG(st->st_mode)) {
    if (st->st_nlink == 1 || g_seen_links->insert({st->st_dev, st->st_ino}).second)
      scan.files_size += static_cast<std::uint64_t>(st->st_size);
  } else if (S_ISLNK(st->st_mode)) {
    scan.files_size += static_cast<std::uint64_t>(st->st_size);
  } else if (S_ISCHR(st->st_mode) && major(st->st_rdev) == 0 && minor(st->st_rdev) == 0) {
    // an overlayfs whiteout: kept
  } else if (S_ISCHR(st->st_mode) || S_ISBLK(st->st_mode) || S_ISSOCK(st->st_mode)) {
    scan.excluded.push_back(rel);
  }
  return FTW_CONTINUE;
}

TreeScan scan_tree(const fs::path& root) {
  TreeScan scan;
  std::set<std::pair<dev_t, ino_t>> seen;
  struct stat st {};
  if (::lstat(root.c_str(), &st) != 0) throw_errno_fmt(errno, "stat {}", root.string());
  static std::mutex mutex;  // nftw's callback has no user pointer
  std::lock_guard lock(mutex);
  g_scan = &scan;
  g_root_dev = st.st_dev;
  g_root_len = root.string().size();
  g_seen_links = &seen;
  if (::nftw(root.c_str(), scan_one, 64, FTW_PHYS | FTW_ACTIONRETVAL) != 0 && errno != 0)
    throw_errno_fmt(errno, "walk {}", root.string());
  return scan;
}

std::uint64_t file_size_of(const fs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) throw_errno_fmt(errno, "stat {}", p.string());
  return static_cast<std::uint64_t>(st.st_size);
}

// Appends the file `from` to `to`.
void append_file(const fs::path& to, const fs::path& from) {
  UniqueFd out(::open(to.c_str(), O_WRONLY | O_CLOEXEC));
  if (!out) throw_errno_fmt(errno, "open {}", to.string());
  UniqueFd in(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) throw_errno_fmt(errno, "open {}", from.string());
  loff_t at = static_cast<loff_t>(file_size_of(to));
  for (;;) {
    ssize_t n = ::copy_file_range(in.get(), nullptr, out.get(), &at, 1u << 30, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == ENOSPC)
        throw Error(Code::kResourceExhausted, fmt::format("write {}: the disk is full", to.string()));
      throw_errno_fmt(errno, "append {} to {}", from.string(), to.string());
    }
    if (n == 0) break;
  }
}

void truncate_file(const fs::path& p, std::uint64_t size) {
  if (::truncate(p.c_str(), static_cast<off_t>(size)) != 0) {
    if (errno == ENOSPC) throw Error(Code::kResourceExhausted, fmt::format("{}: the disk is full", p.string()));
    throw_errno_fmt(errno, "resize {}", p.string());
  }
}

}  // namespace

LayerSource LayerSource::parse(const std::string& text) {
  LayerSource s;
  auto after = [&](std::string_view prefix) { return text.substr(prefix.size()); };
  if (text.empty()) throw Error(Code::kInvalidArgument, "empty image source");
  if (text == "busybox-static") {
    s.kind = Kind::kBusybox;
  } else if (text.starts_with("debootstrap:")) {
    s.kind = Kind::kDebootstrap;
    s.path = after("debootstrap:");
    if (s.path.empty()) throw Error(Code::kInvalidArgument, "debootstrap: needs a suite, e.g. debootstrap:bookworm");
  } else if (text.starts_with("tar:")) {
    s.kind = Kind::kTar;
    s.path = after("tar:");
  } else if (text.starts_with("oci:")) {
    s.kind = Kind::kOci;
    s.path = after("oci:");
  } else if (text.starts_with("dir:")) {
    s.kind = Kind::kDirectory;
    s.path = after("dir:");
  } else if (text == "-") {
    s.kind = Kind::kTar;
    s.path = "-";
  } else {
    s.path = text;
    std::error_code ec;
    auto st = fs::status(text, ec);
    if (ec || !fs::exists(st))
      throw Error(Code::kNotFound, fmt::format("image source {} does not exist (a directory, a tar file, oci:PATH, "
                                               "tar:FILE, busybox-static or debootstrap:SUITE)",
                                               text));
    if (fs::is_directory(st)) s.kind = looks_like_oci_image(text) ? Kind::kOci : Kind::kDirectory;
    else s.kind = looks_like_oci_image(text) ? Kind::kOci : Kind::kTar;
  }
  if ((s.kind == Kind::kTar || s.kind == Kind::kOci || s.kind == Kind::kDirectory) && s.path.empty())
    throw Error(Code::kInvalidArgument, fmt::format("image source '{}' names no path", text));
  return s;
}

LayerDescriptor store_tree_as_layer(BlobStore& store, const fs::path& tree, LayerRole role, const fs::path& work,
                                    std::vector<std::string>& notes, const ProgressFn& progress, bool* existed,
                                    std::uint32_t chunk_size) {
  TreeScan scan = scan_tree(tree);
  if (scan.excluded.size() > kMaxExcluded)
    throw Error(Code::kInvalidArgument,
                fmt::format("{} holds {} device nodes, sockets or mounts; too many to leave out", tree.string(),
                            scan.excluded.size()));
  std::vector<std::string> argv{"mkfs.erofs", "--quiet"};
  for (const auto& rel : scan.excluded) argv.push_back("--exclude-path=" + rel);
  if (!scan.excluded.empty())
    notes.push_back(fmt::format("left out {} device nodes, sockets or mounted filesystems (first: /{})",
                                scan.excluded.size(), scan.excluded.front()));
  // Metadata and file data in two parts (see chunk_index.hpp): the metadata image, padded to whole chunks, then the
  // data device. A node prefetches the first part and fetches the second as files are read.
  fs::path layer_file = work / "layer.erofs";
  fs::path blob_file = work / "layer.blob";
  argv.insert(argv.begin() + 2, {"--blobdev=" + blob_file.string(), "--chunksize=4096"});
  argv.push_back(layer_file.string());
  argv.push_back(tree.string());
  if (progress) progress("making the EROFS layer", 0, scan.files_size);
  ProcessResult mkfs = run_process(argv);
  if (!mkfs.ok()) {
    std::string tail = mkfs.tail();
    bool full = tail.find("No space") != std::string::npos;
    throw Error(full ? Code::kResourceExhausted : Code::kInternal,
                fmt::format("mkfs.erofs {}: {}", mkfs.status_text(), tail));
  }
  const std::uint64_t meta_bytes = file_size_of(layer_file);
  const std::uint64_t meta_size = (meta_bytes + chunk_size - 1) / chunk_size * chunk_size;
  truncate_file(layer_file, meta_size);
  // A tree without file data still gets a one-block data device, so every layer mounts the same way.
  if (!fs::exists(blob_file) || file_size_of(blob_file) == 0) {
    UniqueFd fd(::open(blob_file.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644));
    if (!fd) throw_errno_fmt(errno, "create {}", blob_file.string());
    truncate_file(blob_file, 4096);
  }
  append_file(layer_file, blob_file);
  ::unlink(blob_file.c_str());
  std::vector<std::uint32_t> prefetch;
  for (std::uint64_t c = 0; c < meta_size / chunk_size; ++c) prefetch.push_back(static_cast<std::uint32_t>(c));
  fs::path data_file = work / "layer.chunks";
  ChunkedLayer chunked = write_chunked_layer(layer_file, data_file, meta_size, prefetch, chunk_size, 3,
                                             [&](std::uint64_t done, std::uint64_t total) {
                                               if (progress) progress("compressing chunks", done, total);
                                             });
  ::unlink(layer_file.c_str());
  // touch_blob: a layer found in the store is reused, and a garbage collection running now must keep it.
  const bool had = store.touch_blob(chunked.index.data) && store.touch_blob(chunked.index_digest);
  if (existed) *existed = had;
  if (!had) {
    if (progress) progress("storing the layer", 0, chunked.index.data_size);
    store.put_blob_file(chunked.index.data, data_file);
    store.put_blob(chunked.index_digest, chunked.index_json);
    if (progress) progress("storing the layer", chunked.index.data_size, chunked.index.data_size);
  }
  ::unlink(data_file.c_str());
  LayerDescriptor d;
  d.role = role;
  d.digest = chunked.index.layer;
  d.size = chunked.index.size;
  d.index = chunked.index_digest;
  d.data = chunked.index.data;
  d.stored_size = chunked.index.data_size;
  d.files_size = scan.files_size;
  return d;
}

namespace {

// The build's source as a tree under `tree` (a directory source is used where it is): what the manifest says it
// was built from.
std::string make_source_tree(const BuildOptions& options, fs::path& tree, WhiteoutMode whiteouts, BuildResult& result) {
  const LayerSource& src = options.source;
  TarLimits limits;
  limits.max_bytes = options.max_bytes;
  switch (src.kind) {
    case LayerSource::Kind::kDirectory: {
      std::error_code ec;
      auto st = fs::status(src.path, ec);
      if (ec || !fs::exists(st))
        throw Error(Code::kNotFound, fmt::format("source directory {} does not exist", src.path));
      if (!fs::is_directory(st))
        throw Error(Code::kInvalidArgument, fmt::format("source {} is not a directory", src.path));
      tree = fs::canonical(src.path);
      return fmt::format("directory {}", tree.string());
    }
    case LayerSource::Kind::kTar:
      apply_layer_tar(src.path, tree, whiteouts, limits, result.notes);
      return src.path == "-" ? "tar from standard input" : fmt::format("tar {}", fs::absolute(src.path).string());
    case LayerSource::Kind::kOci:
      return apply_oci_image(fs::absolute(src.path), tree, whiteouts, limits, result.notes);
    case LayerSource::Kind::kBusybox:
      return make_busybox_tree(tree, options.busybox, result.notes);
    case LayerSource::Kind::kDebootstrap:
      if (options.cache_dir.empty())
        throw Error(Code::kInvalidArgument, "build_image: no cache directory for debootstrap");
      return make_debootstrap_tree(tree, src.path, options.include_packages, options.mirror, options.cache_dir,
                                   options.log, result.notes);
  }
  return {};
}

// The difference of `tree` from the parent image, as a tree of its own under `work`.
fs::path diff_from_parent(BlobStore& store, const BuildOptions& options, const ResolvedManifest& parent,
                          const fs::path& tree, const fs::path& work, BuildResult& result,
                          const std::function<void(std::string_view)>& log) {
  auto started = std::chrono::steady_clock::now();
  log(fmt::format("comparing with the {} layer{} of {}", parent.manifest.layers.size(),
                  parent.manifest.layers.size() == 1 ? "" : "s", parent.reference.to_string()));
  MountedImage parent_view(store, parent.manifest, work / "parent", options.progress);
  std::vector<std::string> diff_notes;
  fs::path diff_tree = work / "diff";
  DiffOptions diff_options;
  diff_options.link_files = options.source.kind != LayerSource::Kind::kDirectory;  // the user's directory is only read
  make_diff_tree(parent_view.root(), tree, diff_tree, diff_notes, diff_options);
  parent_view.release();
  for (const auto& n : diff_notes) log(n);
  result.notes.insert(result.notes.end(), diff_notes.begin(), diff_notes.end());
  result.seconds_diff = since(started);
  return diff_tree;
}

// The image's manifest (the parent's layers, then the new one) committed under the reference's name and tag.
void commit_build(BlobStore& store, ImageReference ref, const std::optional<ResolvedManifest>& parent,
                  const std::string& source, BuildResult& result) {
  auto started = std::chrono::steady_clock::now();
  Manifest m;
  m.name = ref.name;
  m.tag = ref.tag;
  if (parent) {
    m.layers = parent->manifest.layers;
    m.parent = parent->reference.to_string();
  }
  m.layers.push_back(result.layer);
  m.created_at = now_unix();
  m.source = source;
  m.notes = result.notes;
  ref.digest = commit_manifest(store, m);
  result.image = fetch_manifest(store, ref);
  result.seconds_store = since(started);
}

}  // namespace

BuildResult build_image(BlobStore& store, const BuildOptions& options) {
  ImageReference ref = parse_reference(options.reference);
  if (!ref.digest.empty())
    throw Error(Code::kInvalidArgument, fmt::format("{}: a build names a tag, not a digest", options.reference));
  if (options.work_dir.empty()) throw Error(Code::kInvalidArgument, "build_image: no work directory");
  BuildResult result;
  std::optional<ResolvedManifest> parent;
  if (!options.parent.empty()) parent = fetch_manifest(store, parse_reference(options.parent));
  const LayerRole role = options.role.value_or(parent ? LayerRole::kTask : LayerRole::kBase);
  const LayerSource::Kind kind = options.source.kind;
  const bool whole_root = kind == LayerSource::Kind::kBusybox || kind == LayerSource::Kind::kDebootstrap;
  if (options.diff.value_or(false) && !parent)
    throw Error(Code::kInvalidArgument, "a layer that holds only its difference from a parent needs a parent image");
  const bool diff = parent && options.diff.value_or(whole_root);
  result.diff = diff;
  // A diff's source is a whole image: tar and OCI whiteouts delete from it rather than hide the parent's files.
  const WhiteoutMode whiteouts = parent && !diff ? WhiteoutMode::kOverlay : WhiteoutMode::kApply;
  auto log = [&](std::string_view line) {
    if (options.log) options.log(line);
  };

  fs::path work = make_scratch_dir(options.work_dir, "build-");
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      try {
        remove_tree(p);
      } catch (...) {
      }
    }
  } cleanup{work};

  auto started = std::chrono::steady_clock::now();
  fs::path tree = work / "tree";
  const std::string source = make_source_tree(options, tree, whiteouts, result);
  for (const auto& n : result.notes) log(n);
  result.seconds_tree = since(started);

  if (diff) tree = diff_from_parent(store, options, *parent, tree, work, result, log);

  started = std::chrono::steady_clock::now();
  std::vector<std::string> layer_notes;
  result.layer = store_tree_as_layer(store, tree, role, work, layer_notes, options.progress, &result.layer_existed,
                                     options.chunk_size);
  for (const auto& n : layer_notes) log(n);
  result.notes.insert(result.notes.end(), layer_notes.begin(), layer_notes.end());
  result.seconds_mkfs = since(started);

  commit_build(store, ref, parent, source, result);
  return result;
}

}  // namespace dsec::image
