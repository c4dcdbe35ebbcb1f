#include "dsec/spec.hpp"

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>

namespace dsec {

std::string_view priority_name(Priority p) noexcept {
  switch (p) {
    case Priority::kLatency:
      return "latency";
    case Priority::kBatch:
      return "batch";
    case Priority::kStandard:
      break;
  }
  return "standard";
}

std::optional<Priority> parse_priority(std::string_view name) {
  for (Priority p : {Priority::kStandard, Priority::kLatency, Priority::kBatch})
    if (name == priority_name(p)) return p;
  return std::nullopt;
}

std::optional<DisplaySize> parse_display(std::string_view text) {
  auto number = [](std::string_view digits) -> std::optional<std::uint32_t> {
    if (digits.empty() || digits.size() > 5) return std::nullopt;
    std::uint32_t v = 0;
    for (char c : digits) {
      if (c < '0' || c > '9') return std::nullopt;
      v = v * 10 + static_cast<std::uint32_t>(c - '0');
    }
    return v;
  };
  std::size_t x = text.find('x');
  if (x == std::string_view::npos) return std::nullopt;
  auto w = number(text.substr(0, x));
  auto h = number(text.substr(x + 1));
  if (!w || !h || *w < 320 || *w > 3840 || *h < 200 || *h > 2160) return std::nullopt;
  return DisplaySize{*w, *h};
}

std::optional<std::uint64_t> parse_size(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  if (text.empty()) return std::nullopt;
  std::size_t digits = 0;
  bool fraction = false;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.')) {
    fraction |= text[digits] == '.';
    ++digits;
  }
  if (digits == 0) return std::nullopt;
  std::string_view suffix = text.substr(digits);
  if (!suffix.empty() && (suffix.back() == 'B' || suffix.back() == 'b') && suffix != "b") suffix.remove_suffix(1);
  std::uint64_t mult = 1;
  if (!suffix.empty()) {
    char unit = static_cast<char>(std::toupper(static_cast<unsigned char>(suffix[0])));
    int power = 0;
    switch (unit) {
      case 'K':
        power = 1;
        break;
      case 'M':
        power = 2;
        break;
      case 'G':
        power = 3;
        break;
      case 'T':
        power = 4;
        break;
      default:
        return std::nullopt;
    }
    std::string_view rest = suffix.substr(1);
    std::uint64_t base = 1000;
    if (rest == "i" || rest == "I") base = 1024;
    else if (!rest.empty()) return std::nullopt;
    for (int i = 0; i < power; ++i) mult *= base;
  }
  if (!fraction) {
    // Whole numbers exactly, to the byte: no rounding through a double, and no product that wraps.
    std::uint64_t value = 0;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + digits, value);
    if (ec != std::errc() || ptr != text.data() + digits) return std::nullopt;
    if (value > std::numeric_limits<std::uint64_t>::max() / mult) return std::nullopt;
    return value * mult;
  }
  double value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + digits, value);
  if (ec != std::errc() || ptr != text.data() + digits || !std::isfinite(value) || value < 0) return std::nullopt;
  double bytes = value * static_cast<double>(mult);
  if (bytes >= 9.2e18) return std::nullopt;  // llround answers a signed 64-bit number
  return static_cast<std::uint64_t>(std::llround(bytes));
}

}  // namespace dsec
