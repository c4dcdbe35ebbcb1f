#include "agent/registry/exec_journal.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <optional>

#include "common/log.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "image/store/digest.hpp"

namespace dsec::agent {
namespace fs = std::filesystem;
using protocol::json;

namespace {

double unix_now() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

ExecResult kept_result(ExecResult r) {
  if (r.stdout_data.size() > ExecJournal::kKeptOutput) {
    r.stdout_data.resize(ExecJournal::kKeptOutput);
    r.stdout_truncated = true;
  }
  if (r.stderr_data.size() > ExecJournal::kKeptOutput) {
    r.stderr_data.resize(ExecJournal::kKeptOutput);
    r.stderr_truncated = true;
  }
  return r;
}

Error outcome_unknown(const std::string& sandbox_id, const std::string& request_id) {
  return Error(Code::kDataLoss,
               fmt::format("outcome unknown: request '{}' of sandbox {} was under way when the node's agent "
                           "stopped; whether it was carried out cannot be known, and it is not carried out again",
                           request_id, sandbox_id),
               false, Fault::kInfrastructure, true);
}

}  // namespace

ExecJournal::ExecJournal(fs::path dir) : dir_(std::move(dir)) {
  if (dir_.empty()) return;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec))
    if (e.path().extension() == ".log") load(e.path());
}

std::string ExecJournal::fingerprint(const ExecRequest& r) {
  json j{{"argv", r.argv},
         {"shell", r.shell},
         {"env", r.env},
         {"cwd", r.cwd},
         {"stdin", image::sha256_digest(r.stdin_data)},
         {"user", r.user},
         {"timeout", r.timeout_seconds},
         {"max_output", r.max_output_bytes}};
  return image::sha256_digest(j.dump(-1, ' ', false, json::error_handler_t::replace));
}

fs::path ExecJournal::file_of(const std::string& sandbox_id) const { return dir_ / (sandbox_id + ".log"); }

std::uint64_t ExecJournal::append(const std::string& sandbox_id, Sandbox& sb, const std::string& line) {
  std::uint64_t at = sb.file_bytes;
  ++sb.lines;
  if (dir_.empty()) return at;
  auto open_file = [&] {
    return UniqueFd(::open(file_of(sandbox_id).c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
  };
  if (!sb.file) sb.file = open_file();
  if (!sb.file && errno == ENOENT) {  // the directory is made with the first id, and goes with the last sandbox's
    std::error_code ec;
    fs::create_directories(dir_, ec);
    sb.file = open_file();
  }
  std::string text = line + '\n';
  if (!sb.file || ::write(sb.file.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    // Kept in memory all the same: only a restart would forget it.
    log_warn("request ids of sandbox {}: cannot write {}: {}", sandbox_id, file_of(sandbox_id).string(),
             std::strerror(errno));
    return at;
  }
  sb.file_bytes += text.size();
  return at;
}

void ExecJournal::load(const fs::path& file) {
  const std::string sandbox_id = file.stem().string();
  std::ifstream in(file, std::ios::binary);
  Sandbox sb;
  std::string line;
  std::uint64_t at = 0;
  while (std::getline(in, line)) {
    std::uint64_t len = line.size() + 1;
    try {
      json j = json::parse(line);
      std::string id = j.at("id").get<std::string>();
      if (j.contains("started")) {
        if (!sb.ids.count(id)) sb.order.push_back(id);
        Entry& e = sb.ids[id];
        e = Entry{};
        e.fingerprint = j.at("fingerprint").get<std::string>();
      } else if (j.contains("result")) {
        if (auto it = sb.ids.find(id); it != sb.ids.end()) {
          it->second.state = State::kDone;
          it->second.result_at = at;
          it->second.result_len = len;
        }
      } else if (j.contains("forget")) {
        sb.ids.erase(id);
      }
    } catch (const std::exception&) {
      // A line cut short (a full disk): skipped.
    }
    at += len;
    ++sb.lines;
  }
  // What was under way when the agent stopped has no result and never will.
  for (auto& [id, e] : sb.ids)
    if (e.state == State::kRunning) e.state = State::kUnknown;
  std::erase_if(sb.order, [&](const std::string& id) { return !sb.ids.count(id); });
  sb.file_bytes = at;
  std::lock_guard lock(mutex_);
  sandboxes_[sandbox_id] = std::move(sb);
}

json ExecJournal::read_result(const std::string& sandbox_id, const Entry& entry) {
  if (entry.memory_result) return *entry.memory_result;
  std::string line(entry.result_len, '\0');
  UniqueFd fd(::open(file_of(sandbox_id).c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd || ::pread(fd.get(), line.data(), line.size(), static_cast<off_t>(entry.result_at)) !=
                 static_cast<ssize_t>(line.size()))
    throw Error(Code::kDataLoss, fmt::format("sandbox {}: the kept result of a request cannot be read back: {}",
                                             sandbox_id, std::strerror(errno)));
  try {
    return json::parse(line).at("result");
  } catch (const std::exception& e) {
    throw Error(Code::kDataLoss,
                fmt::format("sandbox {}: the kept result of a request does not read back: {}", sandbox_id, e.what()));
  }
}

ExecResult ExecJournal::run_once(const std::string& sandbox_id, const std::string& request_id,
                                 const std::string& fingerprint, const std::function<ExecResult()>& run) {
  std::optional<ExecResult> ran;
  json kept = run_once_json(sandbox_id, request_id, fingerprint, [&] {
    ran = run();
    return protocol::encode(kept_result(*ran));
  });
  if (ran) return std::move(*ran);  // this call ran it: its whole output, not only what is kept
  try {
    return protocol::decode_exec_result(kept);
  } catch (const std::exception& e) {
    throw Error(Code::kDataLoss,
                fmt::format("sandbox {}: the kept result of an exec does not read back: {}", sandbox_id, e.what()));
  }
}

json ExecJournal::run_once_json(const std::string& sandbox_id, const std::string& request_id,
                                const std::string& fingerprint, const std::function<json()>& run) {
  {
    std::unique_lock lock(mutex_);
    for (;;) {
      Sandbox& sb = sandboxes_[sandbox_id];
      auto it = sb.ids.find(request_id);
      if (it == sb.ids.end()) {
        sb.ids[request_id].fingerprint = fingerprint;  // kRunning
        sb.order.push_back(request_id);
        append(sandbox_id, sb, json{{"id", request_id}, {"fingerprint", fingerprint}, {"started", unix_now()}}.dump());
        evict(sandbox_id, sb);
        break;  // ours to run
      }
      Entry& e = it->second;
      if (e.fingerprint != fingerprint)
        throw Error(Code::kInvalidArgument,
                    fmt::format("request_id: '{}' was used for another request on sandbox {}; a request id names "
                                "one request",
                                request_id, sandbox_id));
      if (e.state == State::kUnknown) throw outcome_unknown(sandbox_id, request_id);
      if (e.state == State::kDone) {
        Entry copy = e;
        lock.unlock();
        return read_result(sandbox_id, copy);
      }
      done_.wait(lock);  // the first call runs: its result, or its failure (then this one runs it)
    }
  }

  json result;
  try {
    result = run();
  } catch (...) {
    std::lock_guard lock(mutex_);
    auto it = sandboxes_.find(sandbox_id);
    if (it != sandboxes_.end()) {
      Sandbox& sb = it->second;
      if (sb.ids.erase(request_id)) append(sandbox_id, sb, json{{"id", request_id}, {"forget", true}}.dump());
      std::erase(sb.order, request_id);
      // Nothing kept for it (its first exec failed, as on a sandbox destroyed meanwhile): no file either.
      if (sb.ids.empty()) forget_sandbox(sandbox_id);
    }
    done_.notify_all();
    throw;
  }
  std::string line = json{{"id", request_id}, {"result", result}}.dump(-1, ' ', false, json::error_handler_t::replace);
  std::lock_guard lock(mutex_);
  auto sb_it = sandboxes_.find(sandbox_id);
  if (sb_it != sandboxes_.end()) {
    Sandbox& sb = sb_it->second;
    if (auto it = sb.ids.find(request_id); it != sb.ids.end()) {
      std::uint64_t before = sb.file_bytes;
      it->second.result_at = append(sandbox_id, sb, line);
      it->second.result_len = sb.file_bytes - before;
      if (it->second.result_len == 0) it->second.memory_result = std::make_shared<json>(result);
      it->second.state = State::kDone;
    }
  }
  done_.notify_all();
  return result;
}

void ExecJournal::evict(const std::string& sandbox_id, Sandbox& sb) {
  while (sb.ids.size() > kIdsPerSandbox) {
    auto old = std::find_if(sb.order.begin(), sb.order.end(),
                            [&](const std::string& id) { return sb.ids.at(id).state != State::kRunning; });
    if (old == sb.order.end()) break;
    sb.ids.erase(*old);
    sb.order.erase(old);
  }
  if (sb.lines > 4 * sb.ids.size() + 64) compact(sandbox_id, sb);
}

void ExecJournal::compact(const std::string& sandbox_id, Sandbox& sb) {
  if (dir_.empty()) {
    sb.lines = sb.ids.size();
    return;
  }
  const fs::path file = file_of(sandbox_id);
  const fs::path tmp = dir_ / ("." + sandbox_id + ".new");
  std::string text;
  std::map<std::string, std::pair<std::uint64_t, std::uint64_t>> moved;  // id -> new result offset, length
  std::size_t lines = 0;
  try {
    for (const auto& id : sb.order) {
      const Entry& e = sb.ids.at(id);
      text += json{{"id", id}, {"fingerprint", e.fingerprint}, {"started", unix_now()}}.dump() + '\n';
      ++lines;
      if (e.state != State::kDone) continue;
      std::string line = json{{"id", id}, {"result", read_result(sandbox_id, e)}}.dump(-1, ' ', false,
                                                                                       json::error_handler_t::replace) +
                         '\n';
      moved[id] = {text.size(), line.size()};
      text += line;
      ++lines;
    }
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd || ::write(fd.get(), text.data(), text.size()) != static_cast<ssize_t>(text.size()))
      throw_errno(errno, "write " + tmp.string());
    if (::rename(tmp.c_str(), file.c_str()) != 0) throw_errno(errno, "rename " + tmp.string());
    sb.file.reset();  // the next line goes to the new file
  } catch (const std::exception& e) {
    ::unlink(tmp.c_str());
    log_warn("request ids of sandbox {}: compacting {}: {}", sandbox_id, file.string(), e.what());
    return;
  }
  for (auto& [id, where] : moved) {
    Entry& e = sb.ids.at(id);
    e.result_at = where.first;
    e.result_len = where.second;
  }
  sb.file_bytes = text.size();
  sb.lines = lines;
}

void ExecJournal::drop(const std::string& sandbox_id) {
  std::lock_guard lock(mutex_);
  forget_sandbox(sandbox_id);
  done_.notify_all();
}

void ExecJournal::forget_sandbox(const std::string& sandbox_id) {
  sandboxes_.erase(sandbox_id);
  if (dir_.empty()) return;
  ::unlink(file_of(sandbox_id).c_str());
  if (sandboxes_.empty()) ::rmdir(dir_.c_str());  // fails, harmlessly, while files of other sandboxes are there
}

void ExecJournal::retain(const std::set<std::string>& live) {
  std::vector<std::string> gone;
  {
    std::lock_guard lock(mutex_);
    for (const auto& [id, sb] : sandboxes_)
      if (!live.count(id)) gone.push_back(id);
  }
  for (const auto& id : gone) drop(id);
}

}  // namespace dsec::agent
