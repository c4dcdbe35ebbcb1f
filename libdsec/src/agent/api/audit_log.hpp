// The node's audit log (dsecd --audit-log FILE): one JSON line per call (who, from where, what, which sandbox or
// group, the outcome), appended, never rewritten. Past max_bytes the file is rotated: FILE becomes FILE.1, FILE.1
// FILE.2, ..., and the oldest beyond `keep` goes. Tokens never appear in it (a caller is named by its tenant and role).
#pragma once

#include <cstdint>
#include <filesystem>
#include <mutex>
#include <string>
#include <string_view>

#include "common/unique_fd.hpp"

namespace dsec::agent::auth {

struct AuditEntry {
  std::string_view who;     // "tenant:team-a", "admin", "operator" (no token asked: the unix socket's owner)
  std::string_view peer;    // "unix", "10.0.0.7:51234"
  std::string_view method;  // "POST"
  std::string_view route;   // "/v1/sandboxes/{id}/exec"
  std::string_view target;  // the sandbox or group id, or ""
  int status = 0;           // the HTTP status answered
  std::string_view code;    // "OK", "NOT_FOUND", ...
};

class AuditLog {
 public:
  // Opens (creating, mode 0600) `path` for appending; FAILED_PRECONDITION when it cannot.
  AuditLog(std::filesystem::path path, std::uint64_t max_bytes = 64ull << 20, unsigned keep = 4);
  // Appends one line; a failed write is counted, never thrown (the call it records has been answered).
  void record(const AuditEntry& entry);
  std::uint64_t write_failures() const;
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  void rotate();  // mu_ held

  std::filesystem::path path_;
  std::uint64_t max_bytes_;
  unsigned keep_;
  mutable std::mutex mu_;
  UniqueFd fd_;
  std::uint64_t size_ = 0;
  std::uint64_t failures_ = 0;
};

}  // namespace dsec::agent::auth
