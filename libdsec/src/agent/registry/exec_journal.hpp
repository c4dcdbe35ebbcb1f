// Exactly-once requests (docs/protocol.md, "Request ids"): an exec, a session's run, a spawn, a write to a
// process's stdin or a signal sent with a request id is carried out at most once per sandbox, whatever retries
// arrive, also after an agent restart. A retry while the first call runs waits for it; a retry after it gets the
// first call's answer again; the same id with another request is INVALID_ARGUMENT. An id whose request was under way
// when the agent died has no answer and never will (the restarted agent kills such commands): a retry of it is
// answered DATA_LOSS with "outcome unknown", which clients raise as dsec.OutcomeUnknown, never carrying it out a
// second time. The router keys ids by what they are for ("spawn/<id>", "session/<name>/<id>", ...).
//
// Kept on disk per sandbox, <dir>/<sandbox id>.log, one JSON line per event, each one write(2) without fsync (a
// killed agent loses nothing; a machine that loses power loses its sandboxes too):
//   {"id": "r1", "fingerprint": "...", "started": 1795944106.86}
//   {"id": "r1", "result": <the answer: an ExecResult with output kept up to kKeptOutput per stream, or JSON>}
//   {"id": "r1", "forget": true}       (the request failed before it was carried out: a retry may run it)
// In memory only each id's state and where its result line is; results are read back from the file. The last
// kIdsPerSandbox ids of each sandbox are remembered; the file is rewritten when most of it is forgotten lines.
//
// Thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>

#include "common/protocol.hpp"
#include "common/unique_fd.hpp"
#include "dsec/exec.hpp"

namespace dsec::agent {

class ExecJournal {
 public:
  static constexpr std::size_t kIdsPerSandbox = 256;
  static constexpr std::size_t kKeptOutput = 1u << 20;

  // An empty dir keeps the ids in memory only (they do not survive a restart). Loads what an earlier run left.
  explicit ExecJournal(std::filesystem::path dir);
  ExecJournal(const ExecJournal&) = delete;
  ExecJournal& operator=(const ExecJournal&) = delete;

  // Runs `run` once for (sandbox, request id): the first call runs it and records its result (output over
  // kKeptOutput per stream is not kept: a repeat's result says truncated); a repeat returns that result, waiting
  // while the first runs. `run` throwing forgets the id (the error is the first call's; a retry runs it then).
  // Throws INVALID_ARGUMENT when the id was used for a request with another fingerprint, DATA_LOSS when its first
  // call's outcome is unknown.
  ExecResult run_once(const std::string& sandbox_id, const std::string& request_id, const std::string& fingerprint,
                      const std::function<ExecResult()>& run);
  // The same for any request whose answer is JSON: `run`'s answer is kept whole (keep it small).
  protocol::json run_once_json(const std::string& sandbox_id, const std::string& request_id,
                               const std::string& fingerprint, const std::function<protocol::json()>& run);
  // Forgets every id of a sandbox that is gone, and its file.
  void drop(const std::string& sandbox_id);
  // Forgets the sandboxes not in `live` (after a restart, those that did not come back).
  void retain(const std::set<std::string>& live);

  // What identifies an exec request for its id: everything it asks to run and how.
  static std::string fingerprint(const ExecRequest& request);

 private:
  enum class State { kRunning, kDone, kUnknown };
  struct Entry {
    State state = State::kRunning;
    std::string fingerprint;
    std::uint64_t result_at = 0;   // offset of its result line in the file
    std::uint64_t result_len = 0;  // 0: kept in memory (no file)
    std::shared_ptr<protocol::json> memory_result;
  };
  struct Sandbox {
    std::unordered_map<std::string, Entry> ids;
    std::deque<std::string> order;  // oldest first
    std::uint64_t file_bytes = 0;
    std::size_t lines = 0;
    UniqueFd file;  // open for appending once the sandbox's first line was written
  };

  std::filesystem::path file_of(const std::string& sandbox_id) const;
  // Appends a line to the sandbox's file; returns its offset (caller holds mutex_).
  std::uint64_t append(const std::string& sandbox_id, Sandbox& sb, const std::string& line);
  protocol::json read_result(const std::string& sandbox_id, const Entry& entry);
  void load(const std::filesystem::path& file);
  void evict(const std::string& sandbox_id, Sandbox& sb);    // caller holds mutex_
  void compact(const std::string& sandbox_id, Sandbox& sb);  // caller holds mutex_
  // Forgets a sandbox's ids and removes its file (and the directory after the last). Caller holds mutex_.
  void forget_sandbox(const std::string& sandbox_id);

  std::filesystem::path dir_;
  std::mutex mutex_;
  std::condition_variable done_;
  std::unordered_map<std::string, Sandbox> sandboxes_;
};

}  // namespace dsec::agent
