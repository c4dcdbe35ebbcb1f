#include "gateway/e2b/multipart.hpp"

#include <algorithm>
#include <cctype>
#include <string_view>

#include "dsec/error.hpp"

namespace dsec::e2b {

std::vector<Upload> parse_multipart(const std::string& content_type, const std::string& body) {
  auto b = content_type.find("boundary=");
  if (b == std::string::npos) throw Error(Code::kInvalidArgument, "multipart body without a boundary");
  std::string boundary = content_type.substr(b + 9);
  if (auto semi = boundary.find(';'); semi != std::string::npos) boundary.resize(semi);
  if (boundary.size() >= 2 && boundary.front() == '"' && boundary.back() == '"')
    boundary = boundary.substr(1, boundary.size() - 2);
  if (boundary.empty() || boundary.size() > 70)
    throw Error(Code::kInvalidArgument, "multipart boundary: 1 to 70 characters");
  const std::string delimiter = "--" + boundary;
  std::vector<Upload> out;
  std::size_t pos = body.find(delimiter);
  if (pos == std::string::npos) throw Error(Code::kInvalidArgument, "multipart body without its boundary");
  for (;;) {
    pos += delimiter.size();
    if (body.compare(pos, 2, "--") == 0) break;  // the closing delimiter
    if (body.compare(pos, 2, "\r\n") != 0) throw Error(Code::kInvalidArgument, "malformed multipart body");
    pos += 2;
    const std::size_t headers_end = body.find("\r\n\r\n", pos);
    if (headers_end == std::string::npos) throw Error(Code::kInvalidArgument, "malformed multipart part headers");
    const std::string headers = body.substr(pos, headers_end - pos);
    const std::size_t data_start = headers_end + 4;
    const std::size_t next = body.find("\r\n" + delimiter, data_start);
    if (next == std::string::npos) throw Error(Code::kInvalidArgument, "multipart part without an end");
    std::string lower_headers = headers;
    std::transform(lower_headers.begin(), lower_headers.end(), lower_headers.begin(),
                   [](unsigned char c) { return std::tolower(c); });
    // A Content-Disposition parameter's quoted value.
    auto param = [&](std::string_view key) -> std::string {
      auto at = lower_headers.find(key);
      if (at == std::string::npos) return {};
      at += key.size();
      auto end = headers.find('"', at);
      return end == std::string::npos ? std::string() : headers.substr(at, end - at);
    };
    if (param(" name=\"") == "file")
      out.push_back(Upload{param("filename=\""), body.substr(data_start, next - data_start)});
    pos = next + 2;
  }
  return out;
}

}  // namespace dsec::e2b
