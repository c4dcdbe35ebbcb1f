#include "agent/registry/create_ids.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <unordered_map>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"

namespace dsec::agent {

CreateIds::CreateIds(std::filesystem::path path) : path_(std::move(path)) {}

std::vector<CreateIds::Entry> CreateIds::load() const {
  std::vector<Entry> out;
  if (path_.empty()) return out;
  std::lock_guard lock(mutex_);
  std::ifstream in(path_);
  std::unordered_map<std::string, std::size_t> index;  // request id -> its entry in `out`
  std::vector<bool> dropped;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    protocol::json j = protocol::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) continue;
    try {
      if (j.contains("forget")) {
        auto it = index.find(j.at("forget").get<std::string>());
        if (it != index.end() && out[it->second].sandbox_id == j.at("sandbox").get<std::string>()) {
          dropped[it->second] = true;
          index.erase(it);
        }
        continue;
      }
      Entry e{j.at("request_id").get<std::string>(), j.at("sandbox").get<std::string>(),
              j.at("fingerprint").get<std::string>(), j.at("at").get<double>()};
      if (auto it = index.find(e.request_id); it != index.end()) dropped[it->second] = true;  // reused since
      index[e.request_id] = out.size();
      out.push_back(std::move(e));
      dropped.push_back(false);
    } catch (const std::exception&) {
      // A line of another shape: skipped like a torn one.
    }
  }
  std::vector<Entry> kept;
  kept.reserve(out.size());
  for (std::size_t i = 0; i < out.size(); ++i)
    if (!dropped[i]) kept.push_back(std::move(out[i]));
  return kept;
}

void CreateIds::append(const Entry& e) {
  if (path_.empty()) return;
  protocol::json j{
      {"request_id", e.request_id}, {"sandbox", e.sandbox_id}, {"fingerprint", e.fingerprint}, {"at", e.at}};
  std::lock_guard lock(mutex_);
  write_line(j.dump() + "\n");
}

void CreateIds::forget(const std::string& request_id, const std::string& sandbox_id) {
  if (path_.empty()) return;
  protocol::json j{{"forget", request_id}, {"sandbox", sandbox_id}};
  std::lock_guard lock(mutex_);
  write_line(j.dump() + "\n");
}

void CreateIds::write_line(const std::string& line) {
  if (!fd_) {
    fd_.reset(::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
    if (!fd_) {
      log_warn("request log {}: {}", path_.string(), std::strerror(errno));
      return;
    }
  }
  // One write: a killed agent leaves the line whole or not at all.
  ssize_t n = retry_eintr([&] { return ::write(fd_.get(), line.data(), line.size()); });
  if (n != static_cast<ssize_t>(line.size())) {
    log_warn("request log {}: {}", path_.string(), n < 0 ? std::strerror(errno) : "short write");
    return;
  }
  ++appended_;
}

void CreateIds::rewrite(const std::function<std::vector<Entry>()>& snapshot) {
  if (path_.empty()) return;
  std::lock_guard lock(mutex_);
  std::vector<Entry> entries = snapshot();
  if (entries.empty()) {  // no file rather than an empty one
    if (::unlink(path_.c_str()) != 0 && errno != ENOENT) throw_errno_fmt(errno, "remove {}", path_.string());
    fd_.reset();
    appended_ = 0;
    return;
  }
  std::string text;
  for (const auto& e : entries)
    text +=
        protocol::json{
            {"request_id", e.request_id}, {"sandbox", e.sandbox_id}, {"fingerprint", e.fingerprint}, {"at", e.at}}
            .dump() +
        "\n";
  auto tmp = path_;
  tmp += ".tmp";
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) throw_errno_fmt(errno, "create {}", tmp.string());
    std::string_view rest = text;
    while (!rest.empty()) {
      ssize_t n = retry_eintr([&] { return ::write(fd.get(), rest.data(), rest.size()); });
      if (n < 0) {
        int err = errno;
        ::unlink(tmp.c_str());
        throw_errno_fmt(err, "write {}", tmp.string());
      }
      rest.remove_prefix(static_cast<std::size_t>(n));
    }
  }
  if (::rename(tmp.c_str(), path_.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw_errno_fmt(err, "rename {} to {}", tmp.string(), path_.string());
  }
  fd_.reset();  // the next append opens the new file
  appended_ = 0;
}

void CreateIds::remove() {
  if (path_.empty()) return;
  std::lock_guard lock(mutex_);
  fd_.reset();
  appended_ = 0;
  if (::unlink(path_.c_str()) != 0 && errno != ENOENT)
    log_warn("remove request log {}: {}", path_.string(), std::strerror(errno));
}

std::size_t CreateIds::appended() const {
  std::lock_guard lock(mutex_);
  return appended_;
}

}  // namespace dsec::agent
