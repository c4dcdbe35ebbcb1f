#include "client/exec_stream.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "common/protocol.hpp"

namespace dsec::detail {
using protocol::json;

void LineSplitter::feed(std::string_view bytes, const std::function<void(std::string_view line)>& on_line) {
  while (!bytes.empty()) {
    auto nl = bytes.find('\n');
    std::size_t length = nl == std::string_view::npos ? bytes.size() : nl;
    if (partial_.size() + length > max_line_)
      throw Error(Code::kInternal, fmt::format("the agent sent an NDJSON line longer than {} bytes", max_line_), false);
    if (nl == std::string_view::npos) {
      partial_.append(bytes);
      return;
    }
    std::string_view line = bytes.substr(0, nl);
    bytes.remove_prefix(nl + 1);
    std::string joined;  // the buffer is emptied before the callback, which may throw
    if (!partial_.empty()) {
      joined = std::move(partial_);
      partial_.clear();
      joined.append(line);
      line = joined;
    }
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (!line.empty()) on_line(line);
  }
}

void ExecStreamDecoder::feed(std::string_view bytes) {
  lines_.feed(bytes, [this](std::string_view text) { line(text); });
}

void ExecStreamDecoder::line(std::string_view text) {
  if (done()) throw Error(Code::kInternal, "the agent's exec stream went on after its final line", false);
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || j.size() != 1)
    throw Error(Code::kInternal,
                fmt::format("the agent's exec stream has a line that is not a one-key JSON object: {:.200}", text),
                false);
  // The key and value by the object's own iterator: a structured binding of *items().begin() would refer into a
  // temporary that is gone by the next line (AddressSanitizer: stack-use-after-scope).
  const auto first = j.cbegin();
  const std::string& key = first.key();
  const json& value = first.value();
  if (key == "stdout" || key == "stderr") {
    if (!value.is_string())
      throw Error(Code::kInternal, fmt::format("the agent's exec stream: \"{}\" is not a base64 string", key), false);
    std::string data;
    try {
      data = protocol::base64_decode(value.get_ref<const std::string&>());
    } catch (const Error& e) {
      throw Error(Code::kInternal, fmt::format("the agent's exec stream: \"{}\": {}", key, e.what()), false);
    }
    if (on_output_ && !data.empty()) on_output_(key == "stdout" ? 1 : 2, data);
  } else if (key == "result") {
    if (!value.is_object()) throw Error(Code::kInternal, "the agent's exec stream: \"result\" is not an object", false);
    result_ = protocol::decode_exec_result(value);
  } else if (key == "error") {
    // Not retryable whatever the agent says: the command ran, and its output is already delivered. The fault and
    // whether its outcome is unknown are the agent's.
    Error e = protocol::decode_error(value, 500);
    error_.emplace(e.code(), e.what(), false, e.fault(), e.outcome_unknown());
  } else {
    throw Error(Code::kInternal, fmt::format("the agent's exec stream has an unknown line \"{}\"", key), false);
  }
}

std::string_view StreamReplayFilter::fresh(int fd, std::string_view data) noexcept {
  const int i = fd == 2 ? 1 : 0;
  const std::uint64_t skip =
      delivered_[i] > seen_[i] ? std::min<std::uint64_t>(delivered_[i] - seen_[i], data.size()) : 0;
  seen_[i] += data.size();
  data.remove_prefix(static_cast<std::size_t>(skip));
  delivered_[i] += data.size();
  return data;
}

void StreamedCommand::new_attempt() {
  replay_.new_attempt();
  decoder_.emplace([this](int fd, std::string_view data) {
    data = replay_.fresh(fd, data);
    if (!data.empty() && on_output_) on_output_(fd, data);
  });
}

ExecResult ExecStreamDecoder::finish() {
  if (error_) throw *error_;
  if (!result_) {
    throw Error(Code::kUnavailable,
                lines_.pending() > 0 ? "the agent's exec stream ended in the middle of a line"
                                     : "the agent's exec stream ended without a result",
                false);
  }
  return *result_;
}

}  // namespace dsec::detail
