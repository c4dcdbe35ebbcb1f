// Where a node agent listens, as a trainer writes it: "unix:/run/dsec/dsecd.sock" or "http://10.0.0.7:7070".
#pragma once

#include <string>
#include <string_view>

namespace dsec::detail {

struct Endpoint {
  std::string text;       // as given, for messages
  std::string unix_path;  // set for "unix:" endpoints
  std::string base_url;   // "http://host:port" (for a unix socket: "http://localhost")
};

// Parses "unix:/abs/path", "unix:///abs/path", "http://host[:port][/]" and "https://host[:port][/]". Throws
// Error(INVALID_ARGUMENT) naming the endpoint and what is wrong with it.
Endpoint parse_endpoint(std::string_view text);

// Percent-encodes everything but RFC 3986's unreserved characters, for query values and path segments.
std::string url_escape(std::string_view text);

}  // namespace dsec::detail
