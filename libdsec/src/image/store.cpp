#include "image/store.hpp"

#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <random>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/syscall.hpp"
#include "dsec/error.hpp"
#include "image/fs_tree.hpp"
#include "image/store_internal.hpp"

namespace dsec::image {
namespace fs = std::filesystem;
namespace {

constexpr std::size_t kMaxTagLength = 128;
constexpr std::size_t kMaxDirNameLength = 255;
constexpr std::string_view kTmpPrefix = ".tmp-";
constexpr std::string_view kRemovingPrefix = ".rm-";
constexpr std::string_view kLockFile = ".lock";
constexpr std::string_view kManifestFile = "manifest.json";

bool is_alnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }
bool is_name_char(char c) { return is_alnum(c) || c == '-' || c == '_' || c == '.'; }

[[noreturn]] void bad_name(const std::string& name, std::string_view why) {
  throw Error(Code::kInvalidArgument, fmt::format("invalid image name '{}': {}", name, why));
}

std::string describe_char(char c) {
  if (c == ' ') return "a space";
  if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f)
    return fmt::format("byte 0x{:02x}", static_cast<unsigned char>(c));
  return fmt::format("'{}'", c);
}

double now_unix() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

// Renames `from` to `to`, replacing a directory at `to` atomically. Returns true when something was replaced, and
// then `from` holds the old directory.
bool rename_into_place(const fs::path& from, const fs::path& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return false;
  int err = errno;
  if (err == EEXIST) {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) return true;
    err = errno;
    if (err != EINVAL && err != ENOSYS) throw_errno_fmt(err, "replace {} with {}", to.string(), from.string());
    // A filesystem without RENAME_EXCHANGE: move the old image aside first (a moment without the image).
    fs::path aside = random_path(to.parent_path(), kRemovingPrefix);
    if (::rename(to.c_str(), aside.c_str()) != 0) throw_errno_fmt(errno, "move {} aside", to.string());
    if (::rename(from.c_str(), to.c_str()) != 0) throw_errno_fmt(errno, "rename {} to {}", from.string(), to.string());
    if (::rename(aside.c_str(), from.c_str()) != 0) throw_errno_fmt(errno, "rename {}", aside.string());
    return true;
  }
  if (err != EINVAL && err != ENOSYS) throw_errno_fmt(err, "rename {} to {}", from.string(), to.string());
  // No RENAME_NOREPLACE on this filesystem.
  if (fs::exists(fs::symlink_status(to))) {
    fs::path aside = random_path(to.parent_path(), kRemovingPrefix);
    if (::rename(to.c_str(), aside.c_str()) != 0) throw_errno_fmt(errno, "move {} aside", to.string());
    if (::rename(from.c_str(), to.c_str()) != 0) throw_errno_fmt(errno, "rename {} to {}", from.string(), to.string());
    if (::rename(aside.c_str(), from.c_str()) != 0) throw_errno_fmt(errno, "rename {}", aside.string());
    return true;
  }
  if (::rename(from.c_str(), to.c_str()) != 0) throw_errno_fmt(errno, "rename {} to {}", from.string(), to.string());
  return false;
}

}  // namespace

std::string normalize_name(const std::string& name) {
  if (name.empty()) bad_name(name, "it is empty");
  std::size_t colon = name.find(':');
  if (colon != std::string::npos && name.find(':', colon + 1) != std::string::npos)
    bad_name(name, "more than one ':'");
  std::string repo = name.substr(0, colon);
  std::string tag = colon == std::string::npos ? "latest" : name.substr(colon + 1);

  if (repo.empty()) bad_name(name, "no name before the tag");
  std::size_t part_start = 0;
  for (std::size_t i = 0; i <= repo.size(); ++i) {
    if (i == repo.size() || repo[i] == '/') {
      if (i == part_start) bad_name(name, "an empty part between '/'");
      if (!is_alnum(repo[part_start]))
        bad_name(name, fmt::format("'{}' must start with a letter or digit", repo.substr(part_start, i - part_start)));
      part_start = i + 1;
      continue;
    }
    if (!is_name_char(repo[i])) bad_name(name, fmt::format("{} is not allowed", describe_char(repo[i])));
  }

  if (tag.empty()) bad_name(name, "an empty tag after ':'");
  if (tag.size() > kMaxTagLength) bad_name(name, fmt::format("the tag is longer than {} characters", kMaxTagLength));
  if (!is_alnum(tag[0]) && tag[0] != '_') bad_name(name, "the tag must start with a letter, digit or '_'");
  for (char c : tag)
    if (!is_name_char(c)) bad_name(name, fmt::format("{} is not allowed in the tag", describe_char(c)));

  std::string normalized = repo + ":" + tag;
  if (escape_name(normalized).size() > kMaxDirNameLength) bad_name(name, "it is too long");
  return normalized;
}

std::string escape_name(std::string_view normalized_name) {
  std::string out;
  out.reserve(normalized_name.size() + 8);
  for (char c : normalized_name) {
    switch (c) {
      case '%': out += "%25"; break;
      case '/': out += "%2F"; break;
      case ':': out += "%3A"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

std::string unescape_name(std::string_view escaped) {
  std::string out;
  for (std::size_t i = 0; i < escaped.size(); ++i) {
    if (escaped[i] == '%' && i + 2 < escaped.size()) {
      std::string_view code = escaped.substr(i + 1, 2);
      if (code == "25") out.push_back('%');
      else if (code == "2F" || code == "2f") out.push_back('/');
      else if (code == "3A" || code == "3a") out.push_back(':');
      else {
        out.push_back('%');
        continue;
      }
      i += 2;
      continue;
    }
    out.push_back(escaped[i]);
  }
  return out;
}

fs::path random_path(const fs::path& dir, std::string_view prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  for (;;) {
    fs::path p = dir / fmt::format("{}{:012x}", prefix, rng() & 0xffffffffffffull);
    if (!fs::exists(fs::symlink_status(p))) return p;
  }
}

std::optional<ImageRecord> read_manifest(const fs::path& dir) {
  std::ifstream in(dir / kManifestFile);
  if (!in) return std::nullopt;
  try {
    nlohmann::json j = nlohmann::json::parse(in);
    ImageRecord r;
    r.name = j.at("name").get<std::string>();
    r.dir = dir;
    for (const auto& layer : j.value("layers", std::vector<std::string>{"rootfs"})) {
      fs::path rel(layer);
      if (rel.is_absolute() || rel.empty() || layer.find("..") != std::string::npos) return std::nullopt;
      r.layers.push_back(dir / rel);
    }
    r.size_bytes = j.value("size_bytes", std::uint64_t{0});
    r.created_at = j.value("created_at", 0.0);
    r.source = j.value("source", std::string());
    r.notes = j.value("notes", std::vector<std::string>{});
    return r;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

void write_manifest(const fs::path& dir, const ImageRecord& record) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : record.layers) layers.push_back(l.lexically_relative(dir).string());
  nlohmann::json j = {
      {"name", record.name},          {"created_at", record.created_at}, {"size_bytes", record.size_bytes},
      {"source", record.source},      {"layers", layers},                {"notes", record.notes},
  };
  fs::path path = dir / kManifestFile;
  std::string text = j.dump(2) + "\n";
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644));
  if (!fd) throw_errno_fmt(errno, "create {}", path.string());
  for (std::size_t done = 0; done < text.size();) {
    ssize_t n = retry_eintr([&] { return ::write(fd.get(), text.data() + done, text.size() - done); });
    if (n < 0) throw_errno_fmt(errno, "write {}", path.string());
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd.get()) != 0) throw_errno_fmt(errno, "sync {}", path.string());
}

// ---------------------------------------------------------------------------------------------------------------

PendingImage::PendingImage(const ImageStore& store, std::string normalized_name)
    : store_(store), name_(std::move(normalized_name)) {
  std::error_code ec;
  fs::create_directories(store_.root(), ec);
  if (ec) throw Error(code_for_errno(ec.value()), fmt::format("create {}: {}", store_.root().string(), ec.message()));
  std::string label = escape_name(name_).substr(0, 48);
  std::string templ = (store_.root() / fmt::format("{}{}-XXXXXX", kTmpPrefix, label)).string();
  if (::mkdtemp(templ.data()) == nullptr) throw_errno_fmt(errno, "create a build directory in {}", store_.root().string());
  dir_ = templ;
  // mkdtemp makes it private; an image directory is as readable as any system directory.
  ::chmod(dir_.c_str(), 0755);
  lock_.reset(::open((dir_ / kLockFile).c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600));
  if (!lock_ || ::flock(lock_.get(), LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    ::rmdir(dir_.c_str());
    throw_errno_fmt(err, "lock {}", dir_.string());
  }
}

PendingImage::~PendingImage() {
  if (committed_) return;
  try {
    remove_tree(dir_);
  } catch (const std::exception& e) {
    store_.log(fmt::format("warning: could not remove the failed build {}: {}", dir_.string(), e.what()));
  }
}

ImageRecord PendingImage::commit(std::string source, std::vector<std::string> notes) {
  if (!fs::is_directory(fs::symlink_status(rootfs())))
    throw Error(Code::kInternal, fmt::format("build of {} produced no root filesystem", name_));
  unmount_below(dir_);
  ImageRecord record;
  record.name = name_;
  record.dir = dir_;
  record.layers = {rootfs()};
  record.size_bytes = tree_size(rootfs());
  record.created_at = now_unix();
  record.source = std::move(source);
  record.notes = std::move(notes);
  write_manifest(dir_, record);

  fs::path final_dir = store_.dir_for(name_);
  bool replaced = rename_into_place(dir_, final_dir);
  committed_ = true;
  ::unlink((final_dir / kLockFile).c_str());
  if (replaced) {
    // dir_ now holds the image that was replaced. It has no lock file, so prune_stale leaves it alone until it is
    // renamed to a removal name here.
    fs::path old = random_path(store_.root(), kRemovingPrefix);
    if (::rename(dir_.c_str(), old.c_str()) == 0) store_.discard(old);
  }
  lock_.reset();
  record.dir = final_dir;
  record.layers = {final_dir / "rootfs"};
  return record;
}

// ---------------------------------------------------------------------------------------------------------------

ImageStore::ImageStore(fs::path root) {
  if (root.empty()) throw Error(Code::kInvalidArgument, "image store root is empty");
  root_ = fs::absolute(root).lexically_normal();
  std::string s = root_.string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  root_ = s;
}

fs::path ImageStore::cache_dir() const { return root_.parent_path() / "cache"; }

fs::path ImageStore::dir_for(const std::string& normalized_name) const { return root_ / escape_name(normalized_name); }

std::vector<ImageRecord> ImageStore::list() const {
  std::vector<ImageRecord> out;
  std::error_code ec;
  fs::directory_iterator it(root_, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory) return out;
    throw Error(code_for_errno(ec.value()), fmt::format("list {}: {}", root_.string(), ec.message()));
  }
  for (const auto& entry : it) {
    std::string dirname = entry.path().filename().string();
    if (dirname.empty() || dirname[0] == '.') continue;
    if (!entry.is_directory(ec)) continue;
    auto record = read_manifest(entry.path());
    if (!record || escape_name(record->name) != dirname) continue;
    out.push_back(std::move(*record));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.name < b.name; });
  return out;
}

std::optional<ImageRecord> ImageStore::find(const std::string& name) const {
  std::string normalized = normalize_name(name);
  auto record = read_manifest(dir_for(normalized));
  if (!record || record->name != normalized) return std::nullopt;
  return record;
}

ImageRecord ImageStore::resolve(const std::string& name) const {
  if (auto record = find(name)) return std::move(*record);
  std::string normalized = normalize_name(name);
  auto images = list();
  if (images.empty())
    throw Error(Code::kNotFound,
                fmt::format("image '{}' not found: the store {} has no images (build one with `dsec image build "
                            "busybox --from busybox-static`)",
                            normalized, root_.string()));
  std::string names;
  for (const auto& r : images) names += (names.empty() ? "" : ", ") + r.name;
  throw Error(Code::kNotFound,
              fmt::format("image '{}' not found in {}; it has: {}", normalized, root_.string(), names));
}

void ImageStore::remove(const std::string& name) {
  std::string normalized = normalize_name(name);
  fs::path dir = dir_for(normalized);
  if (!read_manifest(dir)) {
    resolve(name);  // throws NOT_FOUND with what the store has
    throw Error(Code::kNotFound, fmt::format("image '{}' not found in {}", normalized, root_.string()));
  }
  // Renamed away first, so the name is gone at once even if removing the tree takes a while or fails half way.
  fs::path doomed = random_path(root_, kRemovingPrefix);
  if (::rename(dir.c_str(), doomed.c_str()) != 0) {
    if (errno == ENOENT) throw Error(Code::kNotFound, fmt::format("image '{}' not found in {}", normalized, root_.string()));
    throw_errno_fmt(errno, "remove image {} ({})", normalized, dir.string());
  }
  discard(doomed);
}

ImageLease ImageStore::lease(const std::string& name) const {
  // The lock is taken on the manifest that was at the name when it was opened; if the image was replaced or removed
  // in between (the remover saw no lease and may be deleting it), try again with what is at the name now.
  for (int attempt = 0;; ++attempt) {
    ImageRecord record = resolve(name);
    fs::path manifest = record.dir / kManifestFile;
    UniqueFd fd(::open(manifest.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd) {
      if (errno == ENOENT && attempt < 5) continue;
      throw_errno_fmt(errno, "open {}", manifest.string());
    }
    if (retry_eintr([&] { return ::flock(fd.get(), LOCK_SH); }) != 0) throw_errno_fmt(errno, "lock {}", manifest.string());
    struct stat held {}, current {};
    if (::fstat(fd.get(), &held) != 0) throw_errno_fmt(errno, "stat {}", manifest.string());
    if (::stat(manifest.c_str(), &current) == 0 && current.st_ino == held.st_ino && current.st_dev == held.st_dev)
      return ImageLease(std::move(fd), std::move(record));
    if (attempt >= 5)
      throw Error(Code::kAborted, fmt::format("image '{}' kept changing while it was being leased", record.name));
  }
}

void ImageStore::discard(const fs::path& doomed) const {
  try {
    UniqueFd fd(::open((doomed / kManifestFile).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (fd && ::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) throw_errno_fmt(errno, "lock {}", (doomed / kManifestFile).string());
      log(fmt::format("{} is still in use by sandboxes; its files go when the last one ends", doomed.string()));
      return;
    }
    // Deleted while the exclusive lock is held, so no lease can start on it half way.
    remove_tree(doomed);
  } catch (const std::exception& e) {
    log(fmt::format("warning: could not remove {}: {}", doomed.string(), e.what()));
  }
}

void ImageStore::prune_stale() const {
  std::error_code ec;
  fs::directory_iterator it(root_, ec);
  if (ec) return;
  for (const auto& entry : it) {
    std::string dirname = entry.path().filename().string();
    try {
      if (dirname.starts_with(kRemovingPrefix)) {
        discard(entry.path());
      } else if (dirname.starts_with(kTmpPrefix)) {
        UniqueFd fd(::open((entry.path() / kLockFile).c_str(), O_RDWR | O_CLOEXEC));
        if (!fd) continue;  // not a build directory, or one being committed right now
        if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) continue;  // a live build holds it
        log(fmt::format("removing {} left by an interrupted build", entry.path().string()));
        remove_tree(entry.path());
      }
    } catch (const std::exception& e) {
      log(fmt::format("warning: could not remove {}: {}", entry.path().string(), e.what()));
    }
  }
}

}  // namespace dsec::image
