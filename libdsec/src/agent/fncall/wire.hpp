// Frames between the agent and the fncall fork servers (the zygote, a call's parent and child; zygote.py speaks the
// other side): a u32 header length and a u32 blob length (little endian), a JSON header, the blob. File
// descriptors travel as SCM_RIGHTS with a frame's first bytes.
#pragma once

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/unique_fd.hpp"

namespace dsec::agent::fncall {

using nlohmann::json;

// A frame as read. The header comes from a process inside a sandbox, so it is read only through the accessors
// below, which take any JSON: a member that is missing or of another type is the fallback, never an exception.
struct Frame {
  json header;
  std::string blob;
  std::vector<UniqueFd> fds;

  // The message's "type"; empty when it has none.
  std::string type() const { return text("type"); }
  // A string member, or `fallback`.
  std::string text(const char* key, std::string fallback = {}) const;
  // An integer member that fits an int; nothing for anything else (1e300 too: converting it would be undefined
  // behaviour).
  std::optional<int> integer(const char* key) const;
  // A number member, or `fallback`.
  double number(const char* key, double fallback) const;
};

inline constexpr std::size_t kMaxFrameHeader = 1u << 20;
inline constexpr std::size_t kMaxFrameBlob = 256u << 20;

// Writes one frame (blocking; MSG_NOSIGNAL). Throws UNAVAILABLE when the peer is gone.
void send_frame(int sock, const json& header, std::string_view blob = {}, const std::vector<int>& fds = {});

// Reads one frame, waiting at most until `deadline` for it to start and to end. Returns false at end of file before
// the frame's first byte, or when the deadline passed first (`timed_out` then says so). Throws UNAVAILABLE for a
// peer that closes mid-frame and INTERNAL for a malformed one.
bool recv_frame(int sock, Frame& out, std::chrono::steady_clock::time_point deadline, bool* timed_out = nullptr);

}  // namespace dsec::agent::fncall
