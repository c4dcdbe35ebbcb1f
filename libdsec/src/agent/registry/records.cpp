// A live sandbox's record on disk, <state>/<id>.json: written whole through a temporary file and a rename (as group
// leases are: write_file_replacing), renamed to <id>.destroying while a destroy is under way, removed once the sandbox
// is gone, and parsed back at start-up.
#include "agent/registry/registry.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "agent/registry/registry_internal.hpp"
#include "common/log.hpp"
#include "common/protocol.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent {
namespace {

constexpr int kRecordVersion = 2;

void write_all(int fd, std::string_view data, const std::filesystem::path& path) {
  while (!data.empty()) {
    ssize_t n = retry_eintr([&] { return ::write(fd, data.data(), data.size()); });
    if (n < 0) throw_errno_fmt(errno, "write {}", path.string());
    data.remove_prefix(static_cast<std::size_t>(n));
  }
}

}  // namespace

void write_file_replacing(const std::filesystem::path& path, std::string_view text, std::string_view what) {
  auto tmp = path;
  tmp += ".tmp";
  {
    UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
    if (!fd) throw_errno_fmt(errno, "create {} {}", what, tmp.string());
    write_all(fd.get(), text, tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw_errno_fmt(err, "rename {} to {}", tmp.string(), path.string());
  }
}

void Registry::write_record(const Record& record) const {
  if (options_.state_dir.empty()) return;
  std::lock_guard file_lock(record.file_mutex);
  if (record.file_removed) return;
  const SandboxInfo info = record.snapshot();
  protocol::json layers = protocol::json::array();
  for (const auto& l : record.layers) layers.push_back(l.string());
  protocol::json j{{"version", kRecordVersion},
                   {"info", protocol::encode(info)},
                   {"spec", protocol::encode(record.spec)},
                   {"layers", layers}};
  if (!record.image_manifest.empty()) j["image_manifest"] = record.image_manifest;
  if (!record.fingerprint.empty()) j["request_fingerprint"] = record.fingerprint;
  if (!record.backend_state.empty()) {
    protocol::json backend = protocol::json::object();
    for (const auto& [k, v] : record.backend_state) backend[k] = v;
    j["backend"] = std::move(backend);
  }
  write_file_replacing(options_.state_dir / (info.id + ".json"), j.dump(2) + "\n", "sandbox record");
}

std::shared_ptr<Registry::Record> Registry::parse_record(const std::string& text) {
  const protocol::json j = protocol::json::parse(text);
  auto record = std::make_shared<Record>();
  record->info = protocol::decode_sandbox_info(j.at("info"));
  record->spec = protocol::decode_spec(j.at("spec"));
  if (auto it = j.find("layers"); it != j.end())
    for (const auto& layer : *it) record->layers.emplace_back(layer.get<std::string>());
  record->image_manifest = j.value("image_manifest", "");
  record->fingerprint = j.value("request_fingerprint", "");
  if (auto it = j.find("backend"); it != j.end())
    for (const auto& [k, v] : it->items()) record->backend_state[k] = v.get<std::string>();
  if (record->info.id.empty() || record->info.kind.empty())
    throw Error(Code::kInvalidArgument, "the record names no sandbox id or kind");
  return record;
}

void Registry::remove_record_file(const Record& record) const {
  std::lock_guard file_lock(record.file_mutex);
  record.file_removed = true;
  remove_record_file(record.info.id);
}

void Registry::remove_record_file(const std::string& id) const {
  if (options_.state_dir.empty()) return;
  for (const char* suffix : {".json", ".destroying"}) {
    auto path = options_.state_dir / (id + suffix);
    if (::unlink(path.c_str()) != 0 && errno != ENOENT)
      log_warn("remove sandbox record {}: {}", path.string(), std::strerror(errno));
  }
}

void Registry::mark_destroying(const Record& record, bool destroying) const {
  if (options_.state_dir.empty()) return;
  std::lock_guard file_lock(record.file_mutex);
  const auto live = options_.state_dir / (record.info.id + ".json");
  const auto going = options_.state_dir / (record.info.id + ".destroying");
  if (destroying) {
    if (record.file_removed) return;
    // One rename, not a rewrite: a destroy costs the node one metadata operation more than before, not a file.
    if (::rename(live.c_str(), going.c_str()) != 0)
      log_warn("sandbox {}: mark its record as being destroyed: {}", record.info.id, std::strerror(errno));
    record.file_removed = true;  // nothing may write <id>.json again
    return;
  }
  // The destroy failed: the sandbox lives on.
  if (::rename(going.c_str(), live.c_str()) != 0 && errno != ENOENT)
    log_warn("sandbox {}: restore its record after a failed destroy: {}", record.info.id, std::strerror(errno));
  record.file_removed = false;
}

}  // namespace dsec::agent
