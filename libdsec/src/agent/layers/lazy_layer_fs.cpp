#define FUSE_USE_VERSION 312
#include "agent/layers/lazy_layer_fs.hpp"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "agent/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::layers {
namespace fs = std::filesystem;

namespace {

constexpr double kTimeout = 86400;  // layers never change: the kernel may keep names and attributes for a day
constexpr std::size_t kMaxRead = 1u << 20;

bool is_hex64(std::string_view s) {
  return s.size() == 64 &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// The "minor" of a mount's device in /proc/self/mountinfo: FUSE names its connection by it in fusectl.
unsigned connection_of(const fs::path& mount_point) {
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  unsigned found = 0;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string id, parent, device, root, point;
    if (!(fields >> id >> parent >> device >> root >> point)) continue;
    if (point != mount_point.string()) continue;
    auto colon = device.find(':');
    if (colon != std::string::npos) found = static_cast<unsigned>(std::stoul(device.substr(colon + 1)));
  }
  return found;
}

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct stat file_attr(fuse_ino_t ino, std::uint64_t size) {
  struct stat st {};
  st.st_ino = ino;
  st.st_mode = S_IFREG | 0400;
  st.st_nlink = 1;
  st.st_size = static_cast<off_t>(size);
  st.st_blksize = 4096;
  st.st_blocks = static_cast<blkcnt_t>((size + 511) / 512);
  return st;
}

struct stat root_attr() {
  struct stat st {};
  st.st_ino = FUSE_ROOT_ID;
  st.st_mode = S_IFDIR | 0500;
  st.st_nlink = 2;
  return st;
}

}  // namespace

struct LazyLayerFs::Handlers {
  static LazyLayerFs& self(fuse_req_t req) { return *static_cast<LazyLayerFs*>(fuse_req_userdata(req)); }

  static void init(void*, fuse_conn_info* conn) {
    // Reads of up to 1 MiB (a chunk) in one request, and as much readahead as the kernel allows.
    conn->max_readahead = std::min<unsigned>(conn->max_readahead, kMaxRead);
    conn->want &= ~FUSE_CAP_AUTO_INVAL_DATA;
  }

  // The files of a layer: for a layer in two parts, "<hex>" (its metadata part) and "<hex>.data" (its data device);
  // for a plain EROFS image, "<hex>" (all of it).
  static std::vector<Inode> files_of(const CacheEntry& entry) {
    const std::uint64_t meta = entry.index().meta_size;
    if (meta == 0 || meta >= entry.size()) return {Inode{entry.hex(), entry.hex(), 0, entry.size()}};
    return {Inode{entry.hex(), entry.hex(), 0, meta}, Inode{entry.hex() + ".data", entry.hex(), meta, entry.size() - meta}};
  }

  static void lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
    LazyLayerFs& fs = self(req);
    std::string_view n = name;
    std::string_view hex = n.substr(0, 64);
    std::shared_ptr<CacheEntry> entry;
    if (parent == FUSE_ROOT_ID && is_hex64(hex) && (n.size() == 64 || n.substr(64) == ".data")) entry = fs.cache_.find(hex);
    std::optional<Inode> file;
    if (entry)
      for (auto& f : files_of(*entry))
        if (f.name == n) file = f;
    if (!file) {
      fuse_reply_err(req, ENOENT);
      return;
    }
    fuse_entry_param e{};
    e.ino = fs.inode_of(*file);
    e.generation = 1;
    e.attr = file_attr(e.ino, file->size);
    e.attr_timeout = kTimeout;
    e.entry_timeout = kTimeout;
    fuse_reply_entry(req, &e);
  }

  static void forget(fuse_req_t req, fuse_ino_t, uint64_t) { fuse_reply_none(req); }
  static void forget_multi(fuse_req_t req, size_t, fuse_forget_data*) { fuse_reply_none(req); }

  static void getattr(fuse_req_t req, fuse_ino_t ino, fuse_file_info*) {
    if (ino == FUSE_ROOT_ID) {
      struct stat st = root_attr();
      fuse_reply_attr(req, &st, kTimeout);
      return;
    }
    Inode node;
    if (!self(req).inode(ino, node)) {
      fuse_reply_err(req, ENOENT);
      return;
    }
    struct stat st = file_attr(ino, node.size);
    fuse_reply_attr(req, &st, kTimeout);
  }

  struct OpenFile {
    std::shared_ptr<CacheEntry> entry;
    Inode node;
  };

  static void open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
    LazyLayerFs& fs = self(req);
    if ((fi->flags & O_ACCMODE) != O_RDONLY) {
      fuse_reply_err(req, EROFS);
      return;
    }
    Inode node;
    std::shared_ptr<CacheEntry> entry;
    if (fs.inode(ino, node)) entry = fs.cache_.find(node.hex);
    if (!entry) {
      fuse_reply_err(req, ENOENT);
      return;
    }
    fi->fh = reinterpret_cast<std::uint64_t>(new OpenFile{std::move(entry), node});
    fi->keep_cache = 1;  // the bytes of a layer never change
    fi->noflush = 1;
    if (fuse_reply_open(req, fi) != 0) delete reinterpret_cast<OpenFile*>(fi->fh);
  }

  static void read(fuse_req_t req, fuse_ino_t, size_t size, off_t off, fuse_file_info* fi) {
    LazyLayerFs& fs = self(req);
    auto& file = *reinterpret_cast<OpenFile*>(fi->fh);
    thread_local std::vector<char> buffer;
    try {
      if (off < 0) throw Error(Code::kInvalidArgument, "negative offset");
      const std::uint64_t start = static_cast<std::uint64_t>(off);
      std::size_t n = 0;
      if (start < file.node.size) {
        const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(size, file.node.size - start));
        buffer.resize(std::max(buffer.size(), want));
        n = fs.cache_.read(*file.entry, file.node.base + start, want, buffer.data());
      }
      fuse_reply_buf(req, buffer.data(), n);
    } catch (const std::exception& e) {
      fs.metrics_.read_errors.fetch_add(1, std::memory_order_relaxed);
      fs.log_read_error(fmt::format("read of {} at {} (+{}) failed, answered EIO: {}", file.node.name, off, size,
                                    e.what()));
      fuse_reply_err(req, EIO);
    }
  }

  static void release(fuse_req_t req, fuse_ino_t, fuse_file_info* fi) {
    delete reinterpret_cast<OpenFile*>(fi->fh);
    fuse_reply_err(req, 0);
  }

  static void opendir(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
    if (ino != FUSE_ROOT_ID) {
      fuse_reply_err(req, ENOTDIR);
      return;
    }
    fuse_reply_open(req, fi);
  }

  static void readdir(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
    LazyLayerFs& fs = self(req);
    struct Item {
      std::string name;
      struct stat st;
    };
    std::vector<Item> items{{".", root_attr()}, {"..", root_attr()}};
    for (const auto& entry : fs.cache_.entries())
      for (const auto& file : files_of(*entry)) items.push_back({file.name, file_attr(fs.inode_of(file), file.size)});
    std::vector<char> buf(size);
    std::size_t used = 0;
    for (std::size_t i = static_cast<std::size_t>(std::max<off_t>(off, 0)); i < items.size(); ++i) {
      std::size_t want = fuse_add_direntry(req, buf.data() + used, size - used, items[i].name.c_str(), &items[i].st,
                                           static_cast<off_t>(i + 1));
      if (want > size - used) break;
      used += want;
    }
    fuse_reply_buf(req, buf.data(), used);
  }

  static void releasedir(fuse_req_t req, fuse_ino_t, fuse_file_info*) { fuse_reply_err(req, 0); }
};

LazyLayerFs::LazyLayerFs(BlobCache& cache, fs::path mount_point, LayerMetrics& metrics)
    : cache_(cache), mount_point_(std::move(mount_point)), metrics_(metrics) {
  std::error_code ec;
  fs::create_directories(mount_point_, ec);
  if (ec)
    throw Error(Code::kFailedPrecondition,
                fmt::format("layer file system: mkdir {}: {}", mount_point_.string(), ec.message()));
  ::chmod(mount_point_.c_str(), 0700);

  fuse_lowlevel_ops ops{};
  ops.init = Handlers::init;
  ops.lookup = Handlers::lookup;
  ops.forget = Handlers::forget;
  ops.forget_multi = Handlers::forget_multi;
  ops.getattr = Handlers::getattr;
  ops.open = Handlers::open;
  ops.read = Handlers::read;
  ops.release = Handlers::release;
  ops.opendir = Handlers::opendir;
  ops.readdir = Handlers::readdir;
  ops.releasedir = Handlers::releasedir;

  fuse_args args = FUSE_ARGS_INIT(0, nullptr);
  for (const char* arg : {"dsecd", "-o", "ro,allow_other,default_permissions,fsname=dsec-layers,subtype=dsec-layers"})
    fuse_opt_add_arg(&args, arg);
  session_ = fuse_session_new(&args, &ops, sizeof ops, this);
  fuse_opt_free_args(&args);
  if (session_ == nullptr)
    throw Error(Code::kFailedPrecondition, "layer file system: libfuse could not set up a FUSE session");
  if (fuse_session_mount(session_, mount_point_.c_str()) != 0) {
    fuse_session_destroy(session_);
    session_ = nullptr;
    throw Error(Code::kFailedPrecondition,
                fmt::format("layer file system: cannot mount FUSE at {} (libfuse says why above)",
                            mount_point_.string()));
  }
  // Its connection number, for an abort at shutdown (from mountinfo: a stat() would wait for the loop's INIT).
  connection_ = connection_of(mount_point_);

  // The loop's threads (and the workers libfuse starts from them) take no signals: the agent's main thread does.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  loop_ = std::thread([this] {
    fuse_loop_config* config = fuse_loop_cfg_create();
    fuse_loop_cfg_set_clone_fd(config, 0);
    fuse_loop_cfg_set_max_threads(config, 32);
    fuse_loop_cfg_set_idle_threads(config, 4);
    int rc = fuse_session_loop_mt(session_, config);
    fuse_loop_cfg_destroy(config);
    if (rc != 0 && rc != -ENODEV) log_warn("layer file system: FUSE loop ended with {}", rc);
    std::lock_guard lock(loop_mutex_);
    loop_ended_ = true;
    loop_done_.notify_all();
  });
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
}

LazyLayerFs::~LazyLayerFs() { stop(); }

void LazyLayerFs::stop() {
  if (session_ == nullptr) return;
  fuse_session_exit(session_);
  fuse_session_unmount(session_);
  auto ended_within = [&](std::chrono::milliseconds limit) {
    std::unique_lock lock(loop_mutex_);
    return loop_done_.wait_for(lock, limit, [&] { return loop_ended_; });
  };
  if (!ended_within(std::chrono::milliseconds(2000))) {
    // Something still holds the file system open (a layer mount detached while busy): abort the connection
    // through fusectl, so the loop ends and whatever reads through it gets errors instead of waiting.
    log_warn("layer file system at {} still in use after unmounting; aborting its FUSE connection",
             mount_point_.string());
    std::string abort_file = fmt::format("/sys/fs/fuse/connections/{}/abort", connection_);
    bool mounted_ctl = false;
    if (::access(abort_file.c_str(), F_OK) != 0 &&
        ::mount("fusectl", "/sys/fs/fuse/connections", "fusectl", 0, nullptr) == 0)
      mounted_ctl = true;
    int fd = ::open(abort_file.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd >= 0) {
      (void)!::write(fd, "1", 1);
      ::close(fd);
    } else {
      log_warn("cannot abort the FUSE connection via {}: {}", abort_file, std::strerror(errno));
    }
    if (mounted_ctl) ::umount2("/sys/fs/fuse/connections", MNT_DETACH);
    if (!ended_within(std::chrono::milliseconds(5000))) {
      log_error("layer file system at {}: its FUSE loop did not end; leaving it", mount_point_.string());
      loop_.detach();
      session_ = nullptr;
      return;
    }
  }
  loop_.join();
  fuse_session_destroy(session_);
  session_ = nullptr;
  std::error_code ec;
  fs::remove(mount_point_, ec);
}

std::uint64_t LazyLayerFs::inode_of(const Inode& file) {
  std::lock_guard lock(inodes_mutex_);
  if (auto it = inode_by_name_.find(file.name); it != inode_by_name_.end()) return it->second;
  inodes_.push_back(file);
  std::uint64_t n = inodes_.size() + 1;
  inode_by_name_.emplace(file.name, n);
  return n;
}

bool LazyLayerFs::inode(std::uint64_t ino, Inode& out) const {
  std::lock_guard lock(inodes_mutex_);
  if (ino < 2 || ino - 2 >= inodes_.size()) return false;
  out = inodes_[ino - 2];
  return true;
}

void LazyLayerFs::log_read_error(const std::string& what) {
  // A program that loops over a damaged file must not flood the log: at most 20 lines per 10 seconds.
  std::lock_guard lock(log_mutex_);
  double now = now_seconds();
  if (now - log_window_start_ > 10) {
    if (logged_in_window_ > 20) log_error("layer file system: {} more read errors not shown", logged_in_window_ - 20);
    log_window_start_ = now;
    logged_in_window_ = 0;
  }
  if (++logged_in_window_ <= 20) log_error("layer file system: {}", what);
}

}  // namespace dsec::agent::layers
