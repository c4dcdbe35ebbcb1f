// What the files of the Registry (registry.cpp and the other files of agent/registry) share: a live sandbox's record,
// an entry of the request-id table, and the helpers more than one of them uses.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "agent/backends/backend.hpp"
#include "agent/registry/registry.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent {

inline constexpr double kEpsilon = 1e-9;

// Two creates with one request_id must ask for the same thing; the request_id itself is not part of it. A digest:
// request ids are remembered by the hundred thousand, and on disk.
std::string spec_fingerprint(const SandboxSpec& spec);  // in registry.cpp

inline Error as_error(const std::exception& e) {
  if (const auto* err = dynamic_cast<const Error*>(&e)) return *err;
  return Error(Code::kInternal, e.what());
}

// Writes `text` to `path` through a temporary file and a rename, so a reader sees the old content or the new one
// (in records.cpp).
void write_file_replacing(const std::filesystem::path& path, std::string_view text, std::string_view what);

inline std::int64_t steady_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Registry::Record {
  mutable std::mutex mutex;  // guards info.state, info.message and image_hold
  SandboxInfo info;
  SandboxSpec spec;
  std::vector<std::filesystem::path> layers;
  std::string image_manifest;              // as the client sent it (empty: the agent resolved the image in its stores)
  std::string fingerprint;                 // of the spec, for its request_id
  BackendState backend_state;              // what the backend needs to take the sandbox over after a restart
  std::shared_ptr<const void> image_hold;  // the image's files stay while the sandbox lives
  std::atomic<bool> hold_pending{false};   // adopted, but its image could not be acquired again yet
  std::unique_ptr<BackendSandbox> sandbox;
  // One writer of the record's file at a time; once it is removed (the sandbox is gone), a late writer (a sleep, a
  // liveness check racing the destroy) must not bring it back.
  mutable std::mutex file_mutex;
  mutable bool file_removed = false;
  std::atomic<bool> destroying{false};
  std::mutex power_mutex;  // one sleep or wake at a time
  // The last sleep or wake that carried a request id, and what it answered (guarded by power_mutex).
  std::string power_request_id;
  bool power_request_sleep = false;
  SleepReport power_report;
  bool cpu_released = false;  // asleep: its cpu is not in live_cpu_ (guarded by the registry's mutex_)
  // Idle tracking for the cold-memory reclaimer (Registry::reclaim_cold), steady-clock milliseconds: the last call
  // that used it (acquire()), and its last reclaim (guarded by power_mutex).
  std::atomic<std::int64_t> last_used_ms{steady_ms()};
  std::int64_t last_reclaim_ms = 0;

  SandboxInfo snapshot() const {
    std::lock_guard lock(mutex);
    return info;
  }
};

struct Registry::RequestEntry {
  enum class State { kPending, kDone, kFailed };
  State state = State::kPending;
  std::string fingerprint;
  std::string sandbox_id;
  std::optional<Error> error;
  double at = 0;
};

}  // namespace dsec::agent
