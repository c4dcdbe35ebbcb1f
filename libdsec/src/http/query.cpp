#include "http/query.hpp"

#include <fmt/format.h>

#include "common/hex.hpp"
#include "dsec/error.hpp"

namespace dsec::agent {

std::optional<std::string> Query::get(std::string_view key) const {
  std::optional<std::string> out;
  for (const auto& [k, v] : items_)
    if (k == key) out = v;
  return out;
}

std::vector<std::string> Query::get_all(std::string_view key) const {
  std::vector<std::string> out;
  for (const auto& [k, v] : items_)
    if (k == key) out.push_back(v);
  return out;
}

std::string percent_decode(std::string_view text, std::string_view what) {
  std::string out;
  out.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (c != '%') {
      out.push_back(c);
      continue;
    }
    int hi = i + 1 < text.size() ? hex_value(text[i + 1]) : -1;
    int lo = i + 2 < text.size() ? hex_value(text[i + 2]) : -1;
    if (hi < 0 || lo < 0)
      throw Error(Code::kInvalidArgument,
                  fmt::format("{}: malformed percent-escape at byte {} (expected %XX with two hex digits)", what, i));
    out.push_back(static_cast<char>(hi * 16 + lo));
    i += 2;
  }
  return out;
}

Query parse_query(std::string_view query) {
  std::vector<std::pair<std::string, std::string>> items;
  std::size_t start = 0;
  while (start <= query.size()) {
    std::size_t end = query.find('&', start);
    if (end == std::string_view::npos) end = query.size();
    std::string_view item = query.substr(start, end - start);
    if (!item.empty()) {
      std::size_t eq = item.find('=');
      std::string_view raw_key = item.substr(0, eq);
      std::string key = percent_decode(raw_key, "query");
      std::string value = eq == std::string_view::npos
                              ? std::string{}
                              : percent_decode(item.substr(eq + 1), fmt::format("query {}", key));
      items.emplace_back(std::move(key), std::move(value));
    }
    start = end + 1;
  }
  return Query(std::move(items));
}

}  // namespace dsec::agent
