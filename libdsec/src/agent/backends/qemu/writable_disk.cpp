#include "agent/backends/qemu/writable_disk.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "image/process.hpp"

namespace dsec::agent::qemu {
namespace fs = std::filesystem;

void copy_sparse(const fs::path& from, const fs::path& to) {
  UniqueFd in(::open(from.c_str(), O_RDONLY | O_CLOEXEC));
  if (!in) throw_errno_fmt(errno, "open {}", from.string());
  UniqueFd out(::open(to.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (!out) throw_errno_fmt(errno, "create {}", to.string());
  off_t size = ::lseek(in.get(), 0, SEEK_END);
  if (size < 0 || ::ftruncate(out.get(), size) != 0) throw_errno_fmt(errno, "size {}", to.string());
  off_t pos = 0;
  while (pos < size) {
    off_t data = ::lseek(in.get(), pos, SEEK_DATA);
    if (data < 0) break;  // ENXIO: only a hole is left
    off_t hole = ::lseek(in.get(), data, SEEK_HOLE);
    if (hole < 0) hole = size;
    off_t src = data, dst = data;
    while (src < hole) {
      ssize_t n = ::copy_file_range(in.get(), &src, out.get(), &dst, static_cast<std::size_t>(hole - src), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw_errno_fmt(n < 0 ? errno : EIO, "copy {} to {}", from.string(), to.string());
    }
    pos = hole;
  }
}

fs::path WritableDisks::template_for(std::uint64_t bytes) {
  std::lock_guard lock(mu_);
  if (auto it = templates_.find(bytes); it != templates_.end()) return it->second;
  fs::create_directories(cache_dir_);
  fs::path path = cache_dir_ / fmt::format("ext4-{}.img", bytes);
  fs::path tmp = path.string() + ".tmp";
  ::unlink(tmp.c_str());
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) throw_errno_fmt(errno, "create {}", tmp.string());
    if (::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) throw_errno_fmt(errno, "size {}", tmp.string());
  }
  // No reserved blocks (the disk is the sandbox's alone), inode tables and journal initialised lazily by the guest.
  image::ProcessResult r = image::run_process({"mkfs.ext4", "-q", "-F", "-m", "0", "-L", "dsec-rw", "-E",
                                               "lazy_itable_init=1,lazy_journal_init=1,nodiscard", tmp.string()});
  if (!r.ok()) {
    ::unlink(tmp.c_str());
    std::string tail = r.tail(3);
    throw Error(tail.find("No space") != std::string::npos ? Code::kResourceExhausted : Code::kInternal,
                fmt::format("mkfs.ext4 for a {} byte disk: {}: {}", bytes, r.status_text(), tail));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw_errno_fmt(errno, "rename {}", tmp.string());
  templates_.emplace(bytes, path);
  return path;
}

void WritableDisks::make(const fs::path& path, std::uint64_t bytes) {
  constexpr std::uint64_t kMiB = 1ull << 20;
  bytes = std::max<std::uint64_t>(bytes, 16 * kMiB);
  bytes = (bytes + kMiB - 1) / kMiB * kMiB;
  copy_sparse(template_for(bytes), path);
}

}  // namespace dsec::agent::qemu
