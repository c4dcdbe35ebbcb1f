#include "client/endpoint.hpp"

#include <cctype>
#include <charconv>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::detail {
namespace {

[[noreturn]] void bad_endpoint(std::string_view text, std::string_view why) {
  throw Error(
      Code::kInvalidArgument,
      fmt::format("endpoint '{}': {} (examples: \"unix:/run/dsec/dsecd.sock\", \"http://10.0.0.7:7070\")", text, why));
}

bool host_char_ok(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_'; }

}  // namespace

Endpoint parse_endpoint(std::string_view text) {
  Endpoint ep;
  ep.text = std::string(text);
  if (text.empty()) bad_endpoint(text, "is empty");

  if (text.starts_with("unix:")) {
    std::string_view path = text.substr(5);
    if (path.starts_with("//")) path.remove_prefix(2);  // unix:///run/x.sock
    if (path.empty() || path.front() != '/') bad_endpoint(text, "a unix socket path must be absolute");
    if (path.find('\0') != std::string_view::npos) bad_endpoint(text, "contains NUL");
    // sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
    if (path.size() > 107) bad_endpoint(text, "a unix socket path is at most 107 bytes");
    ep.unix_path = std::string(path);
    ep.base_url = "http://localhost";
    return ep;
  }

  std::string_view scheme;
  if (text.starts_with("http://")) scheme = "http://";
  else if (text.starts_with("https://")) scheme = "https://";
  else bad_endpoint(text, "must start with unix:, http:// or https://");

  std::string_view rest = text.substr(scheme.size());
  if (rest.ends_with('/')) rest.remove_suffix(1);
  if (rest.find('/') != std::string_view::npos) bad_endpoint(text, "must not carry a path (the agent serves /v1/...)");
  if (rest.empty()) bad_endpoint(text, "has no host");

  std::string_view host = rest;
  std::string_view port;
  if (rest.front() == '[') {  // [::1]:7070
    auto close = rest.find(']');
    if (close == std::string_view::npos) bad_endpoint(text, "unterminated IPv6 address");
    host = rest.substr(0, close + 1);
    std::string_view after = rest.substr(close + 1);
    if (!after.empty()) {
      if (after.front() != ':') bad_endpoint(text, "unexpected characters after the IPv6 address");
      port = after.substr(1);
    }
    for (char c : host.substr(1, host.size() - 2))
      if (!(std::isxdigit(static_cast<unsigned char>(c)) || c == ':' || c == '.'))
        bad_endpoint(text, "malformed IPv6 address");
  } else {
    auto colon = rest.rfind(':');
    if (colon != std::string_view::npos) {
      host = rest.substr(0, colon);
      port = rest.substr(colon + 1);
    }
    if (host.empty()) bad_endpoint(text, "has no host");
    for (char c : host)
      if (!host_char_ok(c)) bad_endpoint(text, fmt::format("'{}' is not allowed in a host name", c));
  }
  if (rest.find('@') != std::string_view::npos) bad_endpoint(text, "must not carry user information");
  if (!port.empty() || (rest.back() == ':')) {
    unsigned value = 0;
    auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
    if (port.empty() || ec != std::errc() || ptr != port.data() + port.size() || value == 0 || value > 65535)
      bad_endpoint(text, "the port must be a number in 1..65535");
  }
  ep.base_url = std::string(scheme) + std::string(rest);
  return ep;
}

std::string url_escape(std::string_view text) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  std::string out;
  out.reserve(text.size());
  for (char ch : text) {
    auto c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~') {
      out.push_back(ch);
    } else {
      out.push_back('%');
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  return out;
}

}  // namespace dsec::detail
