// The directory store: blobs and refs as files, written under .tmp/ and renamed into place (see blob_store.hpp).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/digest.hpp"
#include "image/store/manifest.hpp"

namespace dsec::image {
namespace fs = std::filesystem;
namespace {

[[noreturn]] void throw_store_errno(int err, std::string_view what) {
  if (err == ENOSPC || err == EDQUOT)
    throw Error(Code::kResourceExhausted, fmt::format("{}: the store's disk is full ({})", what, std::strerror(err)));
  throw_errno_fmt(err, "{}", what);
}

std::string random_suffix() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{:016x}", rng());
}

void write_all(int fd, std::string_view bytes, const fs::path& path) {
  while (!bytes.empty()) {
    ssize_t n = ::write(fd, bytes.data(), bytes.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_store_errno(errno, fmt::format("write {}", path.string()));
    }
    bytes.remove_prefix(static_cast<std::size_t>(n));
  }
}

class DirectoryStore final : public BlobStore {
 public:
  explicit DirectoryStore(fs::path root) : root_(std::move(root)), url_(root_.string()) {}

  const std::string& url() const override { return url_; }

  bool has_blob(const std::string& digest) override {
    struct stat st {};
    // lstat: read_blob does not follow a symlink in place of a blob, so neither does has_blob.
    return ::lstat(blob_path(digest).c_str(), &st) == 0 && S_ISREG(st.st_mode);
  }

  bool touch_blob(const std::string& digest) override {
    if (!has_blob(digest)) return false;
    renew(digest);
    return true;
  }

  std::string read_blob(const std::string& digest, std::uint64_t max_size) override {
    fs::path path = blob_path(digest);
    UniqueFd fd = open_blob(path, digest);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) throw_errno_fmt(errno, "stat {}", path.string());
    if (static_cast<std::uint64_t>(st.st_size) > max_size)
      throw Error(Code::kResourceExhausted, fmt::format("blob {} in store {} is {} bytes, more than the {} allowed",
                                                        digest, url_, st.st_size, max_size));
    std::string bytes = read_at(fd.get(), path, 0, static_cast<std::uint64_t>(st.st_size));
    std::string actual = sha256_digest(bytes);
    if (actual != digest)
      throw Error(Code::kDataLoss,
                  fmt::format("blob {} in store {} is damaged: its bytes hash to {}", digest, url_, actual));
    return bytes;
  }

  std::string read_range(const std::string& digest, std::uint64_t offset, std::uint64_t length) override {
    fs::path path = blob_path(digest);
    UniqueFd fd = open_blob(path, digest);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) throw_errno_fmt(errno, "stat {}", path.string());
    const auto size = static_cast<std::uint64_t>(st.st_size);
    if (offset > size || length > size - offset)
      throw Error(Code::kOutOfRange, fmt::format("blob {} in store {} has {} bytes; bytes {}..{} asked for", digest,
                                                 url_, size, offset, offset + length));
    return read_at(fd.get(), path, offset, length);
  }

  void put_blob_file(const std::string& digest, const fs::path& file) override {
    digest_hex(digest, "blob");
    if (has_blob(digest)) return renew(digest);
    std::string actual = sha256_file(file);
    if (actual != digest)
      throw Error(Code::kDataLoss, fmt::format("{} hashes to {}, not {}", file.string(), actual, digest));
    fs::path tmp = tmp_path();
    // Same filesystem: a hard link is free. Otherwise copy.
    std::error_code ec;
    fs::create_hard_link(file, tmp, ec);
    if (ec) {
      try {
        copy_file(file, tmp, fmt::format("copy {} into store {}", file.string(), url_));
      } catch (...) {
        ::unlink(tmp.c_str());
        throw;
      }
    }
    publish(tmp, blob_path(digest));
  }

  void put_blob(const std::string& digest, std::string_view bytes) override {
    digest_hex(digest, "blob");
    if (has_blob(digest)) return renew(digest);
    std::string actual = sha256_digest(bytes);
    if (actual != digest) throw Error(Code::kDataLoss, fmt::format("bytes hash to {}, not {}", actual, digest));
    fs::path tmp = tmp_path();
    write_file(tmp, bytes);
    publish(tmp, blob_path(digest));
  }

  void remove_blob(const std::string& digest) override {
    fs::path path = blob_path(digest);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) throw_errno_fmt(errno, "remove {}", path.string());
  }

  std::vector<BlobInfo> list_blobs() override {
    std::vector<BlobInfo> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root_ / "blobs" / "sha256", ec)) {
      std::string name = entry.path().filename().string();
      std::string digest = "sha256:" + name;
      if (!is_digest(digest)) continue;
      struct stat st {};
      if (::lstat(entry.path().c_str(), &st) != 0 || !S_ISREG(st.st_mode)) continue;
      out.push_back({digest, static_cast<std::uint64_t>(st.st_size),
                     static_cast<double>(st.st_mtim.tv_sec) + st.st_mtim.tv_nsec / 1e9});
    }
    if (ec && ec != std::errc::no_such_file_or_directory)
      throw Error(Code::kUnavailable, fmt::format("list blobs of store {}: {}", url_, ec.message()));
    std::sort(out.begin(), out.end(), [](const BlobInfo& a, const BlobInfo& b) { return a.digest < b.digest; });
    return out;
  }

  std::optional<std::string> read_ref(const std::string& tagged) override {
    fs::path path = ref_path(tagged);
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd) {
      if (errno == ENOENT) return std::nullopt;
      throw_errno_fmt(errno, "open {}", path.string());
    }
    std::string text = read_at(fd.get(), path, 0, 0, /*to_end=*/true);
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
    if (!is_digest(text))
      throw Error(Code::kDataLoss,
                  fmt::format("ref {} in store {} is damaged (it does not hold a digest)", tagged, url_));
    return text;
  }

  void write_ref(const std::string& tagged, const std::string& manifest_digest) override {
    digest_hex(manifest_digest, "manifest");
    fs::path path = ref_path(tagged);  // a bad name fails before anything is written
    fs::path tmp = tmp_path();
    write_file(tmp, manifest_digest + "\n");
    fs::create_directories(path.parent_path());
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      throw_store_errno(err, fmt::format("rename into {}", path.string()));
    }
  }

  bool create_ref(const std::string& tagged, const std::string& manifest_digest) override {
    digest_hex(manifest_digest, "manifest");
    fs::path path = ref_path(tagged);
    fs::path tmp = tmp_path();
    write_file(tmp, manifest_digest + "\n");
    std::error_code ec;
    fs::create_directories(path.parent_path(), ec);
    // link() never replaces: of two writers of one new tag, exactly one succeeds.
    int rc = ::link(tmp.c_str(), path.c_str());
    int err = errno;
    ::unlink(tmp.c_str());
    if (rc == 0) return true;
    if (err == EEXIST) return false;
    throw_store_errno(err, fmt::format("link into {}", path.string()));
  }

  bool remove_ref(const std::string& tagged) override {
    fs::path path = ref_path(tagged);
    if (::unlink(path.c_str()) == 0) return true;
    if (errno == ENOENT) return false;
    throw_errno_fmt(errno, "remove {}", path.string());
  }

  std::vector<std::string> list_refs() override {
    std::vector<std::string> out;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(root_ / "refs", ec)) {
      std::string tagged = unescape_reference(entry.path().filename().string());
      try {
        ImageReference ref = parse_reference(tagged);
        if (ref.tagged() == tagged && !entry.path().filename().string().starts_with(".")) out.push_back(tagged);
      } catch (const Error&) {
        // not a ref this store wrote
      }
    }
    if (ec && ec != std::errc::no_such_file_or_directory)
      throw Error(Code::kUnavailable, fmt::format("list refs of store {}: {}", url_, ec.message()));
    std::sort(out.begin(), out.end());
    return out;
  }

  std::shared_ptr<void> claim(const std::string& name) override {
    fs::path dir = root_ / ".locks";
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw Error(Code::kUnavailable, fmt::format("store {}: mkdir {}: {}", url_, dir.string(), ec.message()));
    fs::path path = dir / escape_reference(name);
    auto fd = std::make_shared<UniqueFd>(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (!*fd) throw_errno_fmt(errno, "store {}: open {}", url_, path.string());
    if (retry_eintr([&] { return ::flock(fd->get(), LOCK_EX); }) != 0)
      throw_errno_fmt(errno, "store {}: flock {}", url_, path.string());
    // The lock file stays (removing it would race with a waiter that has it open); closing the fd releases it.
    return fd;
  }

 private:
  fs::path blob_path(const std::string& digest) const {
    return root_ / "blobs" / "sha256" / digest_hex(digest, "blob");
  }
  fs::path ref_path(const std::string& tagged) const {
    ImageReference ref = parse_reference(tagged);
    return root_ / "refs" / escape_reference(ref.tagged());
  }

  // A blob stored again counts as freshly written: garbage collection's grace protects it until the image that
  // stored it is tagged.
  void renew(const std::string& digest) {
    ::utimensat(AT_FDCWD, blob_path(digest).c_str(), nullptr, AT_SYMLINK_NOFOLLOW);
  }

  UniqueFd open_blob(const fs::path& path, const std::string& digest) const {
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd) {
      if (errno == ENOENT) throw Error(Code::kNotFound, fmt::format("blob {} is not in store {}", digest, url_));
      throw_errno_fmt(errno, "open {}", path.string());
    }
    return fd;
  }

  static std::string read_at(int fd, const fs::path& path, std::uint64_t offset, std::uint64_t length,
                             bool to_end = false) {
    std::string out;
    if (to_end) {
      char buf[4096];
      for (;;) {
        ssize_t n = ::read(fd, buf, sizeof buf);
        if (n < 0) {
          if (errno == EINTR) continue;
          throw_errno_fmt(errno, "read {}", path.string());
        }
        if (n == 0) break;
        out.append(buf, static_cast<std::size_t>(n));
        if (out.size() > 4096) throw Error(Code::kDataLoss, fmt::format("{} is too long for a ref", path.string()));
      }
      return out;
    }
    out.resize(length);
    std::size_t done = 0;
    while (done < length) {
      ssize_t n = ::pread(fd, out.data() + done, length - done, static_cast<off_t>(offset + done));
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EIO) throw Error(Code::kDataLoss, fmt::format("read {}: I/O error", path.string()));
        throw_errno_fmt(errno, "read {}", path.string());
      }
      if (n == 0) throw Error(Code::kOutOfRange, fmt::format("{} ended early", path.string()));
      done += static_cast<std::size_t>(n);
    }
    return out;
  }

  fs::path tmp_path() {
    fs::path dir = root_ / ".tmp";
    std::error_code ec;
    fs::create_directories(dir, ec);
    fs::create_directories(root_ / "blobs" / "sha256", ec);
    if (ec) throw_store_errno(ec.value(), fmt::format("create store directories in {}", url_));
    return dir / random_suffix();
  }

  // Copies `from` to the new file `to` and syncs it. (std::filesystem::copy_file reports a full disk as an I/O
  // error once it falls back to streams; this says ENOSPC, which becomes RESOURCE_EXHAUSTED.)
  static void copy_file(const fs::path& from, const fs::path& to, const std::string& what) {
    UniqueFd in(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
    if (!in) throw_errno_fmt(errno, "open {}", from.string());
    UniqueFd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (!out) throw_store_errno(errno, fmt::format("create {}", to.string()));
    bool plain = false;
    for (;;) {
      ssize_t n = ::copy_file_range(in.get(), nullptr, out.get(), nullptr, 1u << 30, 0);
      if (n > 0) continue;
      if (n == 0) break;
      if (errno == EINTR) continue;
      if (errno == EXDEV || errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP) {
        plain = true;
        break;
      }
      throw_store_errno(errno, what);
    }
    if (plain) {
      std::vector<char> buf(1u << 20);
      for (;;) {
        ssize_t n = ::read(in.get(), buf.data(), buf.size());
        if (n < 0) {
          if (errno == EINTR) continue;
          throw_errno_fmt(errno, "read {}", from.string());
        }
        if (n == 0) break;
        write_all(out.get(), std::string_view(buf.data(), static_cast<std::size_t>(n)), to);
      }
    }
    if (::fsync(out.get()) != 0) throw_store_errno(errno, fmt::format("sync {}", to.string()));
  }

  static void write_file(const fs::path& path, std::string_view bytes) {
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
    if (!fd) throw_store_errno(errno, fmt::format("create {}", path.string()));
    try {
      write_all(fd.get(), bytes, path);
      if (::fsync(fd.get()) != 0) throw_store_errno(errno, fmt::format("sync {}", path.string()));
    } catch (...) {
      ::unlink(path.c_str());
      throw;
    }
  }

  static void publish(const fs::path& tmp, const fs::path& path) {
    ::chmod(tmp.c_str(), 0644);
    // Stored now, whatever the age of a file linked in: gc's grace counts from here.
    ::utimensat(AT_FDCWD, tmp.c_str(), nullptr, 0);
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
      int err = errno;
      ::unlink(tmp.c_str());
      throw_store_errno(err, fmt::format("rename into {}", path.string()));
    }
  }

  fs::path root_;
  std::string url_;
};

}  // namespace

std::unique_ptr<BlobStore> open_directory_store(const fs::path& root) { return std::make_unique<DirectoryStore>(root); }

std::unique_ptr<BlobStore> open_store(std::string_view url, const StoreOptions& options) {
  if (url.empty()) throw Error(Code::kInvalidArgument, "empty store URL");
  if (url.starts_with("http://") || url.starts_with("https://")) return open_http_store(url, options);
  if (url.starts_with("file://")) {
    std::string_view path = url.substr(7);
    if (!path.starts_with("/"))
      throw Error(Code::kInvalidArgument, fmt::format("store URL '{}': file:// needs an absolute path", url));
    return open_directory_store(fs::path(path));
  }
  if (std::size_t scheme = url.find("://"); scheme != std::string_view::npos)
    throw Error(Code::kInvalidArgument,
                fmt::format("store URL '{}': unknown scheme (a directory, file://, http:// or https://)", url));
  return open_directory_store(fs::absolute(fs::path(url)));
}

}  // namespace dsec::image
