#include "agent/node/host_id_claims.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "agent/backends/container/process_identity.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent {

namespace fs = std::filesystem;

HostIdClaims::HostIdClaims(fs::path dir, const fs::path& run_dir) : dir_(std::move(dir)), run_dir_(run_dir.string()) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) throw_errno(ec.value(), fmt::format("create the host id claims directory {}", dir_.string()));
  ::chmod(dir_.c_str(), 0700);
  self_.pid = ::getpid();
  self_.start_time = container::process_start_time(self_.pid).value_or(0);
  self_.run_dir = run_dir_;
  self_text_ = fmt::format("{} {} {}\n", self_.pid, self_.start_time, self_.run_dir);
}

bool HostIdClaims::read_holder(const fs::path& path, Holder& out) const {
  std::ifstream in(path);
  if (!in) return false;
  std::string line;
  std::getline(in, line);
  std::istringstream fields(line);
  if (!(fields >> out.pid >> out.start_time)) return false;
  std::getline(fields >> std::ws, out.run_dir);
  return true;
}

HostIdClaims::Verdict HostIdClaims::judge(const Holder& h) const {
  if (h.pid == self_.pid && h.start_time == self_.start_time && h.run_dir == self_.run_dir) return Verdict::kOurs;
  const bool alive = container::process_start_time(h.pid) == std::optional<std::uint64_t>(h.start_time);
  if (alive) return Verdict::kHeld;
  if (h.run_dir == run_dir_) return Verdict::kOursBeforeRestart;
  std::error_code ec;
  if (!h.run_dir.empty() && fs::exists(h.run_dir, ec)) return Verdict::kHeld;
  return Verdict::kStale;
}

bool HostIdClaims::claim(std::uint32_t first) { return claim(first, false); }
bool HostIdClaims::take_over(std::uint32_t first) { return claim(first, true); }

bool HostIdClaims::claim(std::uint32_t first, bool after_restart) {
  static std::atomic<std::uint64_t> counter{0};
  const fs::path path = dir_ / std::to_string(first);
  const fs::path aside = dir_ / fmt::format(".{}.{}.{}", first, self_.pid, counter.fetch_add(1));
  {
    UniqueFd fd(::open(aside.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
    if (!fd) throw_errno_fmt(errno, "write host id claim {}", aside.string());
    if (::write(fd.get(), self_text_.data(), self_text_.size()) != static_cast<ssize_t>(self_text_.size())) {
      int err = errno;
      ::unlink(aside.c_str());
      throw_errno_fmt(err, "write host id claim {}", aside.string());
    }
  }
  struct RemoveAside {
    const fs::path& p;
    ~RemoveAside() { ::unlink(p.c_str()); }
  } remove_aside{aside};
  if (::link(aside.c_str(), path.c_str()) == 0) return true;
  if (errno != EEXIST) throw_errno_fmt(errno, "claim host ids {}", path.string());

  // Someone holds it: decide, and replace a stale claim, under the directory's lock so that two agents never both
  // take the same one over.
  UniqueFd lock(::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!lock || ::flock(lock.get(), LOCK_EX) != 0) throw_errno_fmt(errno, "lock {}", dir_.string());
  Holder holder;
  if (!read_holder(path, holder)) {
    // Gone meanwhile (released), or not a claim at all: a claim file is always whole, so an unreadable one is
    // debris of another program.
    ::unlink(path.c_str());
  } else {
    switch (judge(holder)) {
      case Verdict::kOurs:
        return true;
      case Verdict::kHeld:
        return false;
      case Verdict::kOursBeforeRestart:
        if (!after_restart) return false;  // a sandbox of ours from before the restart may still run on it
        break;
      case Verdict::kStale:
        break;
    }
  }
  if (::rename(aside.c_str(), path.c_str()) != 0) throw_errno_fmt(errno, "claim host ids {}", path.string());
  return true;
}

void HostIdClaims::release(std::uint32_t first) {
  const fs::path path = dir_ / std::to_string(first);
  Holder holder;
  if (read_holder(path, holder) && judge(holder) == Verdict::kOurs) ::unlink(path.c_str());
}

std::vector<std::uint32_t> HostIdClaims::previous_claims() const {
  std::vector<std::uint32_t> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    std::uint32_t first = 0;
    auto [ptr, err] = std::from_chars(name.data(), name.data() + name.size(), first);
    if (err != std::errc() || ptr != name.data() + name.size()) continue;
    Holder holder;
    if (read_holder(entry.path(), holder) && judge(holder) == Verdict::kOursBeforeRestart) out.push_back(first);
  }
  return out;
}

void HostIdClaims::release_previous(std::uint32_t first) {
  const fs::path path = dir_ / std::to_string(first);
  UniqueFd lock(::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!lock || ::flock(lock.get(), LOCK_EX) != 0) return;
  Holder holder;
  if (read_holder(path, holder) && judge(holder) == Verdict::kOursBeforeRestart) ::unlink(path.c_str());
}

}  // namespace dsec::agent
