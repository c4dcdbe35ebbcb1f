// A request target's query string and percent-escapes, decoded: what the agent's routes and the gateways read their
// parameters from. Pure functions over strings.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace dsec::agent {

// The query string decoded into (key, value) pairs, in order; keys may repeat (label=a=1&label=b=2).
class Query {
 public:
  Query() = default;
  explicit Query(std::vector<std::pair<std::string, std::string>> items) : items_(std::move(items)) {}

  const std::vector<std::pair<std::string, std::string>>& items() const noexcept { return items_; }
  // The last value of a key, if any.
  std::optional<std::string> get(std::string_view key) const;
  std::vector<std::string> get_all(std::string_view key) const;

 private:
  std::vector<std::pair<std::string, std::string>> items_;
};

// Decodes %XX escapes. '+' stays a literal plus (clients encode a space as %20). Throws INVALID_ARGUMENT, naming
// `what`, for a malformed escape.
std::string percent_decode(std::string_view text, std::string_view what);

// Parses "a=1&b=x%2Fy&flag" (a key without '=' gets an empty value). Throws INVALID_ARGUMENT on malformed escapes.
Query parse_query(std::string_view query);

}  // namespace dsec::agent
