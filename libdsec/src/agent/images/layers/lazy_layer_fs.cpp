#define FUSE_USE_VERSION 312
#include "agent/images/layers/lazy_layer_fs.hpp"

#include <fcntl.h>
#include <fuse_lowlevel.h>
#include <linux/fuse.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::layers {
namespace fs = std::filesystem;

namespace {

constexpr double kTimeout = 86400;  // layers never change: the kernel may keep names and attributes for a day
constexpr std::size_t kMaxRead = 1u << 20;
// FUSE_NOTIFY_RESEND (Linux 6.9): the kernel queues again every request a server took and did not answer.
constexpr std::int32_t kNotifyResend = 7;
// The id of the INIT message handed to libfuse on a resumed connection: odd and in the resend range, so no
// request the kernel issues ever has it, and the kernel refuses the answer.
constexpr std::uint64_t kSyntheticInitUnique = ~std::uint64_t{0};

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

  static void init(void* userdata, fuse_conn_info* conn) {
    // Reads of up to 1 MiB (a chunk) in one request, and as much readahead as the kernel allows.
    conn->max_readahead = std::min<unsigned>(conn->max_readahead, kMaxRead);
    conn->want &= ~FUSE_CAP_AUTO_INVAL_DATA;
    static_cast<LazyLayerFs*>(userdata)->initialized_ = true;
  }

  static void lookup(fuse_req_t req, fuse_ino_t parent, const char* name) {
    LazyLayerFs& fs = self(req);
    std::string_view n = name;
    std::string_view hex = n.substr(0, 64);
    std::shared_ptr<CacheEntry> entry;
    if (parent == FUSE_ROOT_ID && is_hex64(hex) && (n.size() == 64 || n.substr(64) == ".data"))
      entry = fs.cache_.find(hex);
    std::optional<Inode> file;
    if (entry)
      for (auto& f : LazyLayerFs::files_of(*entry))
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

  // File handles carry nothing (0): a handle the kernel got from an earlier agent means as much to this one.
  static void open(fuse_req_t req, fuse_ino_t ino, fuse_file_info* fi) {
    LazyLayerFs& fs = self(req);
    if ((fi->flags & O_ACCMODE) != O_RDONLY) {
      fuse_reply_err(req, EROFS);
      return;
    }
    Inode node;
    if (!fs.inode(ino, node) || !fs.cache_.find(node.hex)) {
      fuse_reply_err(req, ENOENT);
      return;
    }
    fi->fh = 0;
    fi->keep_cache = 1;  // the bytes of a layer never change
    fi->noflush = 1;
    fuse_reply_open(req, fi);
  }

  static void read(fuse_req_t req, fuse_ino_t ino, size_t size, off_t off, fuse_file_info*) {
    LazyLayerFs& fs = self(req);
    thread_local std::vector<char> buffer;
    Inode node;
    try {
      if (!fs.inode(ino, node)) throw Error(Code::kNotFound, fmt::format("no layer file has node id {}", ino));
      std::shared_ptr<CacheEntry> entry = fs.cache_.find(node.hex);
      if (!entry) throw Error(Code::kNotFound, fmt::format("layer sha256:{} is no longer in the cache", node.hex));
      if (off < 0) throw Error(Code::kInvalidArgument, "negative offset");
      const std::uint64_t start = static_cast<std::uint64_t>(off);
      std::size_t n = 0;
      if (start < node.size) {
        const std::size_t want = static_cast<std::size_t>(std::min<std::uint64_t>(size, node.size - start));
        buffer.resize(std::max(buffer.size(), want));
        n = fs.cache_.read(*entry, node.base + start, want, buffer.data());
      }
      fuse_reply_buf(req, buffer.data(), n);
    } catch (const std::exception& e) {
      fs.metrics_.read_errors.fetch_add(1, std::memory_order_relaxed);
      fs.log_read_error(fmt::format("read of {} at {} (+{}) failed, answered EIO: {}",
                                    node.name.empty() ? fmt::format("node {}", ino) : node.name, off, size, e.what()));
      fuse_reply_err(req, EIO);
    }
  }

  static void release(fuse_req_t req, fuse_ino_t, fuse_file_info*) { fuse_reply_err(req, 0); }

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
      for (const auto& file : LazyLayerFs::files_of(*entry))
        items.push_back({file.name, file_attr(fs.inode_of(file), file.size)});
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

namespace {

fuse_session* new_session(LazyLayerFs* fs) {
  fuse_lowlevel_ops ops{};
  ops.init = LazyLayerFs::Handlers::init;
  ops.lookup = LazyLayerFs::Handlers::lookup;
  ops.forget = LazyLayerFs::Handlers::forget;
  ops.forget_multi = LazyLayerFs::Handlers::forget_multi;
  ops.getattr = LazyLayerFs::Handlers::getattr;
  ops.open = LazyLayerFs::Handlers::open;
  ops.read = LazyLayerFs::Handlers::read;
  ops.release = LazyLayerFs::Handlers::release;
  ops.opendir = LazyLayerFs::Handlers::opendir;
  ops.readdir = LazyLayerFs::Handlers::readdir;
  ops.releasedir = LazyLayerFs::Handlers::releasedir;

  fuse_args args = FUSE_ARGS_INIT(0, nullptr);
  for (const char* arg : {"dsecd", "-o", "ro,allow_other,default_permissions,fsname=dsec-layers,subtype=dsec-layers"})
    fuse_opt_add_arg(&args, arg);
  fuse_session* session = fuse_session_new(&args, &ops, sizeof ops, fs);
  fuse_opt_free_args(&args);
  if (session == nullptr)
    throw Error(Code::kFailedPrecondition, "layer file system: libfuse could not set up a FUSE session");
  return session;
}

}  // namespace

std::uint64_t layer_inode(std::string_view hex, bool data_part) {
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < 15 && i < hex.size(); ++i) {
    char c = hex[i];
    v = v << 4 | static_cast<std::uint64_t>(c >= 'a' ? c - 'a' + 10 : c - '0');
  }
  return std::uint64_t{1} << 63 | v << 1 | (data_part ? 1 : 0);
}

std::vector<LazyLayerFs::Inode> LazyLayerFs::files_of(const CacheEntry& entry) {
  const std::uint64_t meta = entry.index().meta_size;
  if (meta == 0 || meta >= entry.size()) return {Inode{entry.hex(), entry.hex(), 0, entry.size(), false}};
  return {Inode{entry.hex(), entry.hex(), 0, meta, false},
          Inode{entry.hex() + ".data", entry.hex(), meta, entry.size() - meta, true}};
}

LazyLayerFs::LazyLayerFs(BlobCache& cache, fs::path mount_point, LayerMetrics& metrics)
    : cache_(cache), mount_point_(std::move(mount_point)), metrics_(metrics) {
  std::error_code ec;
  fs::create_directories(mount_point_, ec);
  if (ec)
    throw Error(Code::kFailedPrecondition,
                fmt::format("layer file system: mkdir {}: {}", mount_point_.string(), ec.message()));
  ::chmod(mount_point_.c_str(), 0700);

  session_ = new_session(this);
  if (fuse_session_mount(session_, mount_point_.c_str()) != 0) {
    fuse_session_destroy(session_);
    session_ = nullptr;
    throw Error(
        Code::kFailedPrecondition,
        fmt::format("layer file system: cannot mount FUSE at {} (libfuse says why above)", mount_point_.string()));
  }
  // Its connection number, for an abort at shutdown (from mountinfo: a stat() would wait for the loop's INIT).
  connection_ = connection_of(mount_point_);
  start_loop();
}

LazyLayerFs::LazyLayerFs(BlobCache& cache, fs::path mount_point, LayerMetrics& metrics, UniqueFd device)
    : cache_(cache), mount_point_(std::move(mount_point)), metrics_(metrics), resumed_(true) {
  session_ = new_session(this);
  // libfuse takes an open /dev/fuse descriptor for a mount point named /dev/fd/N, and owns it from then on.
  std::string dev = fmt::format("/dev/fd/{}", device.get());
  if (fuse_session_mount(session_, dev.c_str()) != 0) {
    fuse_session_destroy(session_);
    session_ = nullptr;
    throw Error(Code::kFailedPrecondition,
                fmt::format("layer file system: libfuse refused the FUSE descriptor of {}", mount_point_.string()));
  }
  const int fd = device.release();
  connection_ = connection_of(mount_point_);

  // The kernel and the earlier server agreed on the connection's parameters in its INIT; libfuse takes no other
  // request before an INIT. One like the kernel's is handed to it here (FUSE_MAX_PAGES among its flags, so that
  // libfuse reads with buffers as large as the kernel's requests may be); its answer goes to no request.
  struct {
    fuse_in_header header;
    fuse_init_in init;
  } message{};
  message.header.len = sizeof message;
  message.header.opcode = FUSE_INIT;
  message.header.unique = kSyntheticInitUnique;
  message.init.major = FUSE_KERNEL_VERSION;
  message.init.minor = FUSE_KERNEL_MINOR_VERSION;
  message.init.max_readahead = kMaxRead;
  message.init.flags = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_MAX_PAGES | FUSE_INIT_EXT;
  fuse_buf buf{};
  buf.size = sizeof message;
  buf.mem = &message;
  fuse_session_process_buf(session_, &buf);
  if (!initialized_) {
    fuse_session_destroy(session_);  // closes the descriptor
    session_ = nullptr;
    throw Error(Code::kFailedPrecondition, "layer file system: libfuse did not take the INIT of a resumed connection");
  }

  start_loop();

  // What the earlier server read and never answered waits in the kernel's processing list: ask for it again.
  fuse_out_header resend{};
  resend.len = sizeof resend;
  resend.error = kNotifyResend;
  resend.unique = 0;
  if (::write(fd, &resend, sizeof resend) == static_cast<ssize_t>(sizeof resend)) {
    resent_ = true;
  } else {
    log_warn(
        "layer file system: the kernel cannot resend the requests the earlier agent took and did not answer "
        "({}; FUSE_NOTIFY_RESEND needs Linux 6.9): reads that were in flight when it died stay blocked until "
        "their readers are killed or the layer file system is stopped",
        std::strerror(errno));
  }
}

void LazyLayerFs::start_loop() {
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

int LazyLayerFs::device_fd() const noexcept { return session_ ? fuse_session_fd(session_) : -1; }

void LazyLayerFs::stop() {
  if (session_ == nullptr) return;
  fuse_session_exit(session_);
  if (resumed_) {
    // libfuse did not mount it, so it does not unmount it either.
    ::umount2(mount_point_.c_str(), MNT_DETACH);
  } else {
    fuse_session_unmount(session_);
  }
  auto ended_within = [&](std::chrono::milliseconds limit) {
    std::unique_lock lock(loop_mutex_);
    return loop_done_.wait_for(lock, limit, [&] { return loop_ended_; });
  };
  if (!ended_within(std::chrono::milliseconds(2000))) {
    // Something still holds the file system open (a layer mount detached while busy): abort the connection
    // through fusectl, so the loop ends and whatever reads through it gets errors instead of waiting.
    log_warn("layer file system at {} still in use after unmounting; aborting its FUSE connection",
             mount_point_.string());
    abort_fuse_connection(connection_);
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

bool abort_fuse_connection(unsigned connection) {
  if (connection == 0) return false;
  std::string abort_file = fmt::format("/sys/fs/fuse/connections/{}/abort", connection);
  bool mounted_ctl = false;
  if (::access(abort_file.c_str(), F_OK) != 0 &&
      ::mount("fusectl", "/sys/fs/fuse/connections", "fusectl", 0, nullptr) == 0)
    mounted_ctl = true;
  int fd = ::open(abort_file.c_str(), O_WRONLY | O_CLOEXEC);
  bool done = false;
  if (fd >= 0) {
    done = ::write(fd, "1", 1) == 1;
    ::close(fd);
  } else {
    log_warn("cannot abort the FUSE connection via {}: {}", abort_file, std::strerror(errno));
  }
  if (mounted_ctl) ::umount2("/sys/fs/fuse/connections", MNT_DETACH);
  return done;
}

std::uint64_t LazyLayerFs::inode_of(const Inode& file) {
  const std::uint64_t ino = layer_inode(file.hex, file.data);
  std::lock_guard lock(inodes_mutex_);
  inodes_.insert_or_assign(ino, file);
  return ino;
}

bool LazyLayerFs::inode(std::uint64_t ino, Inode& out) {
  std::lock_guard lock(inodes_mutex_);
  auto it = inodes_.find(ino);
  if (it == inodes_.end()) {
    // A node id this server never handed out: the kernel had it from an earlier agent. The layers are the cache's.
    for (const auto& entry : cache_.entries())
      for (auto& file : files_of(*entry)) {
        const std::uint64_t n = layer_inode(file.hex, file.data);
        if (n == ino) inodes_.insert_or_assign(n, file);
      }
    it = inodes_.find(ino);
    if (it == inodes_.end()) return false;
  }
  out = it->second;
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
