#include "agent/api/audit_log.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/log.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::auth {

namespace fs = std::filesystem;

namespace {

UniqueFd open_for_append(const fs::path& path) {
  UniqueFd fd(::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd) throw Error(Code::kFailedPrecondition, fmt::format("audit log {}: {}", path.string(), std::strerror(errno)));
  return fd;
}

}  // namespace

AuditLog::AuditLog(fs::path path, std::uint64_t max_bytes, unsigned keep)
    : path_(std::move(path)), max_bytes_(max_bytes), keep_(keep) {
  std::error_code ec;
  if (path_.has_parent_path()) fs::create_directories(path_.parent_path(), ec);
  fd_ = open_for_append(path_);
  struct stat st {};
  if (::fstat(fd_.get(), &st) == 0) size_ = static_cast<std::uint64_t>(st.st_size);
}

void AuditLog::record(const AuditEntry& e) {
  const auto now = std::chrono::system_clock::now();
  const double t = std::chrono::duration<double>(now.time_since_epoch()).count();
  nlohmann::json line{{"time", t},        {"who", e.who},       {"peer", e.peer},     {"method", e.method},
                      {"route", e.route}, {"target", e.target}, {"status", e.status}, {"code", e.code}};
  // Replace what is not UTF-8 (a hostile id): a line that cannot be encoded would be lost.
  std::string text = line.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard lock(mu_);
  if (size_ + text.size() > max_bytes_ && size_ > 0) rotate();
  if (!fd_) {
    ++failures_;
    return;
  }
  ssize_t n = ::write(fd_.get(), text.data(), text.size());
  if (n != static_cast<ssize_t>(text.size())) {
    ++failures_;
    return;
  }
  size_ += text.size();
}

void AuditLog::rotate() {
  std::error_code ec;
  auto numbered = [&](unsigned i) { return fs::path(path_.string() + "." + std::to_string(i)); };
  fs::remove(numbered(keep_), ec);
  for (unsigned i = keep_; i > 1; --i) fs::rename(numbered(i - 1), numbered(i), ec);
  fs::rename(path_, numbered(1), ec);
  try {
    fd_ = open_for_append(path_);
    size_ = 0;
  } catch (const Error& err) {
    fd_.reset();
    log_warn("{}", err.what());
  }
}

std::uint64_t AuditLog::write_failures() const {
  std::lock_guard lock(mu_);
  return failures_;
}

}  // namespace dsec::agent::auth
