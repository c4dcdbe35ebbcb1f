#include "dsec/spec.hpp"

#include <cctype>
#include <charconv>
#include <cmath>

namespace dsec {

std::optional<std::uint64_t> parse_size(std::string_view text) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.front()))) text.remove_prefix(1);
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
  if (text.empty()) return std::nullopt;
  std::size_t digits = 0;
  while (digits < text.size() && (std::isdigit(static_cast<unsigned char>(text[digits])) || text[digits] == '.'))
    ++digits;
  if (digits == 0) return std::nullopt;
  double value = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + digits, value);
  if (ec != std::errc() || ptr != text.data() + digits || !std::isfinite(value) || value < 0) return std::nullopt;
  std::string_view suffix = text.substr(digits);
  if (!suffix.empty() && (suffix.back() == 'B' || suffix.back() == 'b') && suffix != "b") suffix.remove_suffix(1);
  double mult = 1;
  if (suffix.empty()) {
    mult = 1;
  } else {
    char unit = static_cast<char>(std::toupper(static_cast<unsigned char>(suffix[0])));
    int power = 0;
    switch (unit) {
      case 'K': power = 1; break;
      case 'M': power = 2; break;
      case 'G': power = 3; break;
      case 'T': power = 4; break;
      default: return std::nullopt;
    }
    std::string_view rest = suffix.substr(1);
    double base = 1000;
    if (rest == "i" || rest == "I") base = 1024;
    else if (!rest.empty()) return std::nullopt;
    mult = std::pow(base, power);
  }
  double bytes = value * mult;
  if (bytes > 1.8e19) return std::nullopt;
  return static_cast<std::uint64_t>(std::llround(bytes));
}

}  // namespace dsec
