// The request ids of finished creates, kept on disk (<state>/requests.log) so that a create retried after an agent
// restart finds the sandbox the first one made rather than making a second. One JSON line per event, appended:
//   {"request_id": "r1", "sandbox": "n1-3f9a0c2b7e41", "fingerprint": "sha256:...", "at": 1795944106.86}
//   {"forget": "r1", "sandbox": "n1-3f9a0c2b7e41"}        (a batch rolled back: the create counts as failed)
// The registry rewrites the file from what it remembers when the appends outnumber that by far, and at start-up.
// Lines are written with one write(2) each and without fsync: a killed agent loses nothing it wrote; a machine that
// loses power loses its sandboxes too.
//
// Thread-safe.
#pragma once

#include <cstddef>
#include <filesystem>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "common/unique_fd.hpp"

namespace dsec::agent {

class CreateIds {
 public:
  struct Entry {
    std::string request_id;
    std::string sandbox_id;
    std::string fingerprint;  // the spec's, without its request_id
    double at = 0;            // unix seconds of the create
  };

  // An empty path keeps nothing.
  explicit CreateIds(std::filesystem::path path);
  CreateIds(const CreateIds&) = delete;
  CreateIds& operator=(const CreateIds&) = delete;

  // The finished creates in the order they were written, without those forgotten after. A line that does not parse
  // (a file cut short by a full disk) is skipped.
  std::vector<Entry> load() const;
  // Best effort: a failure is logged, and the create it records is then only remembered while the agent runs.
  void append(const Entry& entry);
  void forget(const std::string& request_id, const std::string& sandbox_id);
  // Replaces the file by the entries `snapshot` returns (called with appends held off, so none is lost between the
  // snapshot and the new file); no entries, no file. Throws dsec::Error when the new file cannot be written; the old
  // one then stays.
  void rewrite(const std::function<std::vector<Entry>()>& snapshot);
  // Removes the file (a later append starts a new one).
  void remove();
  // Lines appended since the last rewrite (or load).
  std::size_t appended() const;

 private:
  void write_line(const std::string& line);  // caller holds mutex_

  std::filesystem::path path_;
  mutable std::mutex mutex_;
  UniqueFd fd_;  // opened for appending on first use
  std::size_t appended_ = 0;
};

}  // namespace dsec::agent
