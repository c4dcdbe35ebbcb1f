// The v1 wire's bodies: JSON parsed with a position on error, and binary data as base64 inside JSON.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace dsec::protocol {

using nlohmann::json;

// Parses a request or response body; a syntax error is INVALID_ARGUMENT with the parser's position.
json parse_body(std::string_view body);

// Binary data travels base64-encoded inside JSON.
std::string base64_encode(std::string_view bytes);
std::string base64_decode(std::string_view text);  // throws INVALID_ARGUMENT on malformed input

}  // namespace dsec::protocol
