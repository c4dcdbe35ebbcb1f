#include "agent/images/layers/layer_mounts.hpp"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "image/erofs_meta.hpp"
#include "image/fs_tree.hpp"
#include "image/process.hpp"
#include "image/store/digest.hpp"

namespace dsec::agent::layers {
namespace fs = std::filesystem;

namespace {

bool kernel_has_erofs() {
  std::ifstream in("/proc/filesystems");
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string word, last;
    while (words >> word) last = word;
    if (last == "erofs") return true;
  }
  return false;
}

// Why this node cannot mount layers lazily, or empty when it can try.
std::string lazy_unavailable_reason() {
  if (!kernel_has_erofs()) return "kernel lacks EROFS";
  if (::access("/dev/fuse", F_OK) != 0) return "no /dev/fuse";
  if (::geteuid() != 0) return "not root: mounting layers needs root";
  return {};
}

// Copies `length` bytes of `from` starting at `offset` into a new file `to`.
void copy_range(const fs::path& from, std::uint64_t offset, std::uint64_t length, const fs::path& to) {
  UniqueFd in(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) throw_errno_fmt(errno, "open {}", from.string());
  UniqueFd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  if (!out) throw_errno_fmt(errno, "create {}", to.string());
  loff_t in_off = static_cast<loff_t>(offset);
  while (length > 0) {
    ssize_t n = ::copy_file_range(in.get(), &in_off, out.get(), nullptr, length, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno_fmt(errno, "copy {} to {}", from.string(), to.string());
    }
    if (n == 0) throw Error(Code::kDataLoss, fmt::format("{} ended early", from.string()));
    length -= static_cast<std::uint64_t>(n);
  }
}

bool is_hex64(std::string_view s) {
  return s.size() == 64 &&
         std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

// mountinfo escapes space, tab, newline and backslash as \ooo.
std::string unescape_mountinfo(std::string_view s) {
  std::string out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1]))) {
      out.push_back(static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0')));
      i += 3;
    } else {
      out.push_back(s[i]);
    }
  }
  return out;
}

struct MountEntry {
  fs::path point;
  std::string fstype, source;
  unsigned minor = 0;
};

// The mounts at or below `dir`, in mount order (a mount stacked on another comes after it).
std::vector<MountEntry> mounts_below(const fs::path& dir) {
  std::vector<MountEntry> out;
  std::ifstream in("/proc/self/mountinfo");
  std::string line;
  const std::string base = dir.string();
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string id, parent, device, root, point;
    if (!(fields >> id >> parent >> device >> root >> point)) continue;
    point = unescape_mountinfo(point);
    if (point != base && !point.starts_with(base + "/")) continue;
    std::string word;
    while (fields >> word && word != "-") {
    }
    MountEntry m;
    m.point = point;
    fields >> m.fstype >> m.source;
    m.source = unescape_mountinfo(m.source);
    if (auto colon = device.find(':'); colon != std::string::npos) {
      try {
        m.minor = static_cast<unsigned>(std::stoul(device.substr(colon + 1)));
      } catch (const std::exception&) {
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace

LayerMode parse_layer_mode(std::string_view text) {
  if (text == "auto") return LayerMode::kAuto;
  if (text == "lazy") return LayerMode::kLazy;
  if (text == "extract") return LayerMode::kExtract;
  throw Error(Code::kInvalidArgument, fmt::format("layer mode '{}': use auto, lazy or extract", text));
}

std::string_view to_string(LayerMode mode) {
  switch (mode) {
    case LayerMode::kAuto:
      return "auto";
    case LayerMode::kLazy:
      return "lazy";
    case LayerMode::kExtract:
      return "extract";
  }
  return "auto";
}

struct LayerMounts::Slot {
  enum class State { kPreparing, kReady, kFailed };
  std::string hex, digest;
  State state = State::kPreparing;
  std::optional<Error> error;
  fs::path dir;
  bool mounted = false;  // an EROFS mount at dir; else dir is an extracted tree in the cache
  LayerUse use;
  std::atomic<std::uint32_t> users{0};
  bool adopted = false;      // taken over from an earlier agent at start
  bool warned_busy = false;  // prune() said once that it could not unmount it
};

LayerMounts::LayerMounts(LayerMountsOptions options, BlobCache& cache, LayerMetrics& metrics)
    : options_(std::move(options)), cache_(cache), metrics_(metrics) {
  if (options_.mount_dir.empty()) throw Error(Code::kInvalidArgument, "layer mounts: no mount directory given");
  if (options_.keeper_binary.empty()) options_.keeper_binary = default_keeper_binary();
  if (!options_.stores.empty()) cache_.set_default_stores(options_.stores);

  std::string reason = options_.mode == LayerMode::kExtract ? std::string() : lazy_unavailable_reason();
  // What an earlier agent left: its layer file system and the layer mounts over it, taken over while its keeper
  // still holds the connection.
  if (options_.mode != LayerMode::kExtract && reason.empty()) {
    try {
      if (resume_lazy()) return;
    } catch (const std::exception& e) {
      log_warn("layer mounts of the earlier agent cannot be taken over: {}; detaching them", e.what());
      slots_.clear();
      resumed_ = false;
    }
  }
  // Otherwise detached, so that the sandboxes it left can still finish with them.
  remove_leftovers();
  std::error_code ec;
  fs::create_directories(options_.mount_dir, ec);
  if (ec)
    throw Error(code_for_errno(ec.value()),
                fmt::format("layer mounts: mkdir {}: {}", options_.mount_dir.string(), ec.message()));
  ::chmod(options_.mount_dir.c_str(), 0700);

  if (options_.mode == LayerMode::kExtract) {
    description_ = "extract (chosen by --layer-mode extract)";
    adopt_extracted();
    return;
  }
  if (reason.empty()) {
    try {
      fs_ = std::make_unique<LazyLayerFs>(cache_, options_.mount_dir / "blobs", metrics_);
    } catch (const Error& e) {
      reason = e.what();
    }
  }
  if (!reason.empty()) {
    if (options_.mode == LayerMode::kLazy)
      throw Error(Code::kFailedPrecondition, fmt::format("--layer-mode lazy: this node cannot: {}", reason));
    description_ = fmt::format("extract ({})", reason);
    log_warn("image layers will be extracted whole, not streamed: {}", reason);
    adopt_extracted();
    return;
  }
  lazy_ = true;
  description_ = "erofs-lazy";
  start_keeper();
}

namespace {

// Detaches each of `points`, those below others first.
void detach_deepest_first(std::vector<fs::path> points) {
  std::sort(points.begin(), points.end(),
            [](const fs::path& a, const fs::path& b) { return a.string().size() > b.string().size(); });
  for (const auto& point : points) ::umount2(point.c_str(), MNT_DETACH);
}

// Removes what is in `mount_dir` besides the FUSE mount, the keeper's record and the layers in `kept`.
void remove_unmounted(const fs::path& mount_dir, const std::set<std::string>& kept) {
  std::error_code ec;
  for (const auto& item : fs::directory_iterator(mount_dir, ec)) {
    const std::string name = item.path().filename().string();
    if (name == "blobs" || name == "keeper" || kept.count(name)) continue;
    if (item.is_directory(ec)) ::rmdir(item.path().c_str());
    else ::unlink(item.path().c_str());
  }
}

}  // namespace

void LayerMounts::adopt_layer_mount(const std::string& hex, const fs::path& point) {
  auto slot = std::make_shared<Slot>();
  slot->hex = hex;
  slot->digest = "sha256:" + hex;
  slot->state = Slot::State::kReady;
  slot->dir = point;
  slot->mounted = true;
  slot->adopted = true;
  slot->use = cache_.hold(hex);
  slots_.insert_or_assign(hex, std::move(slot));
}

bool LayerMounts::resume_lazy() {
  std::string why;
  std::unique_ptr<LayerKeeper> keeper = LayerKeeper::find(keeper_record(), why);
  if (!keeper) {
    if (!why.empty()) log_warn("layer mounts of the earlier agent are detached, not taken over: {}", why);
    return false;
  }
  const fs::path blobs = options_.mount_dir / "blobs";
  std::vector<MountEntry> left = mounts_below(options_.mount_dir);
  const MountEntry* fuse = nullptr;
  for (const auto& m : left)
    if (m.point == blobs) fuse = &m;  // the last one: a mount stacked on another hides it
  if (fuse == nullptr || fuse->fstype != "fuse.dsec-layers" || fuse->minor != keeper->record().connection) {
    log_warn(
        "layer mounts of the earlier agent are detached, not taken over: its keeper (pid {}) holds FUSE "
        "connection {}, but {} is {}",
        keeper->pid(), keeper->record().connection, blobs.string(),
        fuse == nullptr ? std::string("not mounted") : fmt::format("{} of connection {}", fuse->fstype, fuse->minor));
    keeper->stop();  // its connection ends with the last descriptor of it
    return false;
  }
  std::unique_ptr<LazyLayerFs> fs;
  try {
    fs = std::make_unique<LazyLayerFs>(cache_, blobs, metrics_, keeper->take_connection());
  } catch (...) {
    keeper->stop();
    throw;
  }

  // The layer mounts over it: each an EROFS mount of its own layer's file, one level below mount_dir, of a layer
  // the cache still has. Anything else there is detached.
  std::map<fs::path, int> count;
  for (const auto& m : left) ++count[m.point];
  std::vector<fs::path> detach;
  std::set<std::string> kept;
  for (const auto& m : left) {
    if (m.point == blobs) continue;
    const std::string name = m.point.filename().string();
    const bool usable = m.point.parent_path() == options_.mount_dir && count[m.point] == 1 && is_hex64(name) &&
                        m.fstype == "erofs" && m.source == (blobs / name).string() && cache_.find(name) != nullptr;
    struct statfs sfs {};
    if (!usable || ::statfs(m.point.c_str(), &sfs) != 0 || sfs.f_type != EROFS_SUPER_MAGIC_V1) {
      log_warn(
          "layer mounts: detaching {} ({} from {}) that the earlier agent left: not a layer mount this agent "
          "can serve",
          m.point.string(), m.fstype, m.source);
      detach.push_back(m.point);
      continue;
    }
    adopt_layer_mount(name, m.point);
    kept.insert(name);
  }
  detach_deepest_first(detach);
  // Directories of layers that are not mounted any more, a half-written record: gone.
  remove_unmounted(options_.mount_dir, kept);

  fs_ = std::move(fs);
  keeper_ = std::move(keeper);
  resumed_ = true;
  lazy_ = true;
  description_ = "erofs-lazy";
  log_info(
      "layer file system taken over from the earlier agent (keeper pid {}, FUSE connection {}): {} layer "
      "mounts kept{}",
      keeper_->pid(), fs_->connection(), kept.size(), fs_->resent() ? ", unanswered reads resent" : "");
  return true;
}

void LayerMounts::remove_leftovers() {
  // A keeper that is still the process recorded ends now: the connection it held ends with it, and reads still
  // waiting on it get errors instead of waiting for good.
  std::string why;
  if (auto keeper = LayerKeeper::find(keeper_record(), why)) {
    log_info("ending the layer keeper (pid {}) of the earlier agent", keeper->pid());
    keeper->stop();
  }
  image::remove_tree(options_.mount_dir);
}

void LayerMounts::adopt_extracted() {
  // Extracted layers are directories in the cache, used in place by the sandboxes' overlays: held until the first
  // prune, so the cache does not evict one a sandbox taken over from the earlier agent still stands on.
  for (const auto& entry : cache_.entries()) {
    std::error_code ec;
    if (!fs::is_directory(entry->tree_dir(), ec)) continue;
    auto slot = std::make_shared<Slot>();
    slot->hex = entry->hex();
    slot->digest = entry->digest();
    slot->state = Slot::State::kReady;
    slot->dir = entry->tree_dir();
    slot->mounted = false;
    slot->adopted = true;
    try {
      slot->use = cache_.hold(entry->hex());
    } catch (const Error&) {
      continue;  // evicted meanwhile
    }
    slots_.insert_or_assign(entry->hex(), std::move(slot));
  }
}

void LayerMounts::start_keeper() {
  try {
    keeper_ = LayerKeeper::start(options_.keeper_binary, fs_->device_fd(), fs_->connection(), keeper_record());
  } catch (const std::exception& e) {
    keeper_unavailable_ = true;
    log_warn("layer mounts will not survive a restart of the agent (no layer keeper): {}", e.what());
  }
}

void LayerMounts::check_keeper() {
  // Caller holds mutex_.
  if (shut_down_ || !lazy_ || !fs_ || keeper_unavailable_) return;
  if (keeper_) {
    if (!keeper_->exited()) return;
    log_warn("the layer keeper (pid {}) ended while the layer file system is mounted; starting another",
             keeper_->pid());
    keeper_->stop();
    keeper_.reset();
  }
  start_keeper();
}

LayerMounts::~LayerMounts() {
  try {
    shutdown();
  } catch (const std::exception& e) {
    log_warn("layer mounts shutdown: {}", e.what());
  }
}

std::string LayerMounts::mode_description() const {
  std::lock_guard lock(mutex_);
  return description_;
}

std::map<std::string, std::uint32_t> LayerMounts::users() const {
  std::lock_guard lock(mutex_);
  std::map<std::string, std::uint32_t> out;
  for (const auto& [hex, slot] : slots_) out[slot->digest] = slot->users.load();
  return out;
}

std::vector<std::string> LayerMounts::adopted() const {
  std::lock_guard lock(mutex_);
  std::vector<std::string> out;
  for (const auto& [hex, slot] : slots_)
    if (slot->adopted) out.push_back(slot->digest);
  return out;
}

pid_t LayerMounts::keeper_pid() const {
  std::lock_guard lock(mutex_);
  return keeper_ ? keeper_->pid() : 0;
}

MountedLayer LayerMounts::acquire(const image::LayerDescriptor& layer, const Stores& stores) {
  const std::string hex = image::digest_hex(layer.digest, "layer digest");
  std::shared_ptr<Slot> slot;
  bool mine = false;
  {
    std::unique_lock lock(mutex_);
    if (shut_down_) throw Error(Code::kUnavailable, "the agent is shutting down");
    if (auto it = slots_.find(hex); it != slots_.end()) {
      slot = it->second;
      ++slot->users;
      changed_.wait(lock, [&] { return slot->state != Slot::State::kPreparing; });
      if (slot->state == Slot::State::kFailed) {
        --slot->users;
        throw *slot->error;
      }
    } else {
      slot = std::make_shared<Slot>();
      slot->hex = hex;
      slot->digest = layer.digest;
      slot->users = 1;
      slots_.emplace(hex, slot);
      mine = true;
    }
  }
  if (mine) {
    std::optional<Error> failure;
    try {
      prepare(*slot, layer, stores);
    } catch (const Error& e) {
      failure = e;
    } catch (const std::exception& e) {
      failure = Error(Code::kInternal, fmt::format("layer {}: {}", layer.digest, e.what()));
    }
    std::lock_guard lock(mutex_);
    if (failure) {
      slot->state = Slot::State::kFailed;
      slot->error = failure;
      --slot->users;
      slot->use.reset();
      if (auto it = slots_.find(hex); it != slots_.end() && it->second == slot) slots_.erase(it);
      changed_.notify_all();
      throw *failure;
    }
    slot->state = Slot::State::kReady;
    changed_.notify_all();
  }
  // The hold only counts down: prune() unmounts a layer whose count is 0, under the lock acquire() counts up in.
  std::shared_ptr<const void> hold(slot.get(), [slot](const void*) { --slot->users; });
  LayerImage image;
  if (slot->mounted && fs_) {
    image.file = fs_->file_of(hex);
    if (slot->use.entry().index().meta_size > 0) image.data_file = fs_->data_file_of(hex);
  }
  return MountedLayer{slot->dir, std::move(hold), std::move(image)};
}

void LayerMounts::prepare(Slot& slot, const image::LayerDescriptor& layer, const Stores& stores) {
  slot.use = cache_.acquire(layer, stores, lazy_);
  if (lazy_ && mount_lazy(slot)) return;
  extract(slot);
}

bool LayerMounts::mount_lazy(Slot& slot) {
  fs::path dir = options_.mount_dir / slot.hex;
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) throw_errno_fmt(errno, "mkdir {}", dir.string());
  fs::path source = fs_->file_of(slot.hex);
  // A layer in two parts (chunk_index.hpp) names its data device: the layer file system's "<hex>.data".
  std::string options;
  if (slot.use.entry().index().meta_size > 0) options = "device=" + fs_->data_file_of(slot.hex).string();
  if (::mount(source.c_str(), dir.c_str(), "erofs", MS_RDONLY | MS_NODEV | MS_NOSUID,
              options.empty() ? nullptr : options.c_str()) != 0) {
    int err = errno;
    ::rmdir(dir.c_str());
    if ((err == ENOTBLK || err == ENODEV) && options_.mode == LayerMode::kAuto) {
      fall_back_to_extract(err == ENOTBLK ? "kernel lacks EROFS file-backed mounts" : "kernel lacks EROFS");
      return false;
    }
    if (err == EINVAL)
      throw Error(Code::kInvalidArgument,
                  fmt::format("layer {} is not a valid EROFS image (mount: {})", slot.digest, std::strerror(err)));
    if (err == EIO)
      throw Error(Code::kUnavailable,
                  fmt::format("mount layer {}: a part of it could not be fetched or did not match its digest "
                              "(the agent's log says which)",
                              slot.digest));
    throw_errno_fmt(err, "mount layer {} (EROFS from {}) on {}", slot.digest, source.string(), dir.string());
  }
  slot.dir = dir;
  slot.mounted = true;
  return true;
}

void LayerMounts::extract(Slot& slot) {
  CacheEntry& entry = slot.use.entry();
  fs::path tree = entry.tree_dir();
  std::error_code ec;
  if (!fs::is_directory(tree, ec)) {
    cache_.ensure_all(entry);
    fs::path building = entry.dir() / "tree.tmp";
    image::remove_tree(building);
    std::vector<std::string> argv{"fsck.erofs", "--extract=" + building.string(),
                                  ::geteuid() == 0 ? "--preserve" : "--preserve-perms"};
    // A layer in two parts: fsck.erofs reads the data device from a file of its own.
    fs::path device = entry.dir() / "data.tmp";
    struct RemoveDevice {
      fs::path path;
      ~RemoveDevice() { ::unlink(path.c_str()); }
    } remove_device{device};
    if (entry.index().meta_size > 0) {
      copy_range(entry.layer_file(), entry.index().meta_size, entry.size() - entry.index().meta_size, device);
      argv.push_back("--device=" + device.string());
    }
    argv.push_back(entry.layer_file().string());
    image::ProcessResult result = image::run_process(argv);
    if (!result.ok()) {
      image::remove_tree(building);
      std::string tail = result.tail(5);
      Code code = tail.find("No space left") != std::string::npos ? Code::kResourceExhausted : Code::kInternal;
      throw Error(code,
                  fmt::format("extracting layer {} with fsck.erofs: {}: {}", slot.digest, result.status_text(), tail));
    }
    // fsck.erofs (erofs-utils 1.5) writes neither xattrs (an opaque directory would no longer hide the layers
    // below) nor hard links: both come back from the layer's own metadata.
    try {
      image::restore_erofs_metadata(entry.layer_file(), entry.index().meta_size, building);
    } catch (...) {
      image::remove_tree(building);
      throw;
    }
    if (::rename(building.c_str(), tree.c_str()) != 0)
      throw_errno_fmt(errno, "rename {} to {}", building.string(), tree.string());
    // The files are what the sandboxes use from now on: the chunks need not stay as well.
    cache_.drop_chunks(entry, image::tree_size(tree));
  }
  slot.dir = tree;
  slot.mounted = false;
}

void LayerMounts::fall_back_to_extract(const std::string& reason) {
  std::lock_guard lock(mutex_);
  if (!lazy_) return;
  lazy_ = false;
  description_ = fmt::format("extract ({})", reason);
  log_warn("image layers will be extracted whole, not streamed: {}", reason);
}

void LayerMounts::release_slot(Slot& slot, bool force) {
  if (slot.mounted) {
    if (::umount2(slot.dir.c_str(), 0) != 0) {
      int err = errno;
      if (!force) throw_errno_fmt(err, "unmount layer {} from {}", slot.digest, slot.dir.string());
      log_warn("unmount layer {} from {}: {}; detaching it", slot.digest, slot.dir.string(), std::strerror(err));
      ::umount2(slot.dir.c_str(), MNT_DETACH);
    }
    ::rmdir(slot.dir.c_str());
    slot.mounted = false;
  }
  slot.use.reset();
}

std::size_t LayerMounts::prune() {
  std::size_t count = 0;
  {
    std::lock_guard lock(mutex_);
    for (auto it = slots_.begin(); it != slots_.end();) {
      Slot& slot = *it->second;
      if (slot.state != Slot::State::kReady || slot.users.load() != 0) {
        ++it;
        continue;
      }
      try {
        release_slot(slot, false);
      } catch (const std::exception& e) {
        if (!slot.warned_busy) log_warn("{} (tried again at every prune)", e.what());
        slot.warned_busy = true;
        ++it;
        continue;
      }
      it = slots_.erase(it);
      ++count;
    }
    check_keeper();
  }
  cache_.enforce_limit();
  return count;
}

void LayerMounts::shutdown() {
  std::unique_ptr<LayerKeeper> keeper;
  {
    std::lock_guard lock(mutex_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [hex, slot] : slots_) {
      if (slot->state != Slot::State::kReady) continue;
      if (slot->users.load() != 0) log_warn("layer {} still held by {} at shutdown", slot->digest, slot->users.load());
      release_slot(*slot, true);
    }
    slots_.clear();
    keeper = std::move(keeper_);
  }
  // The keeper first: once the file system is unmounted nothing may hold its connection any more.
  if (keeper) keeper->stop();
  if (fs_) {
    fs_->stop();
    fs_.reset();
  }
  ::rmdir(options_.mount_dir.c_str());
}

}  // namespace dsec::agent::layers
