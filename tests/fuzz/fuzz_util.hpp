// What the fuzz targets share: reporting a broken property (abort, so libFuzzer keeps the input), checking the code
// of a dsec::Error, and cutting an input into parts.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "dsec/error.hpp"

namespace fuzz {

[[noreturn]] inline void fail(std::string_view what) {
  std::fprintf(stderr, "\n*** dsec fuzz: property violated: %.*s\n", static_cast<int>(what.size()), what.data());
  std::abort();
}

// Bad input must be refused with the code the decoder documents.
inline void expect_code(const dsec::Error& e, dsec::Code code, std::string_view what) {
  if (e.code() != code)
    fail(std::string(what) + ": threw " + std::string(e.code_name()) + " (expected " +
         std::string(dsec::code_name(code)) + "): " + e.what());
}

// Reads an input front to back: small integers from its first bytes, the rest as text.
class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : rest_(reinterpret_cast<const char*>(data), size) {}
  std::uint8_t byte() {
    if (rest_.empty()) return 0;
    auto b = static_cast<std::uint8_t>(rest_.front());
    rest_.remove_prefix(1);
    return b;
  }
  // Up to the next `sep` (consumed), or everything left.
  std::string_view until(char sep) { return until(std::string_view(&sep, 1)); }
  std::string_view until(std::string_view sep) {
    std::size_t at = rest_.find(sep);
    std::string_view out = rest_.substr(0, at);
    rest_.remove_prefix(at == std::string_view::npos ? rest_.size() : at + sep.size());
    return out;
  }
  std::string_view rest() {
    std::string_view out = rest_;
    rest_ = {};
    return out;
  }
  bool empty() const noexcept { return rest_.empty(); }

 private:
  std::string_view rest_;
};

}  // namespace fuzz
