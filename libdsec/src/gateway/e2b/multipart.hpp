// multipart/form-data as E2B's SDKs upload files (`POST /files`): every part named "file", its file name the path
// the bytes go to.
#pragma once

#include <string>
#include <vector>

namespace dsec::e2b {

struct Upload {
  std::string path;  // as the caller named it (relative ones are under the user's home)
  std::string data;
};

// The parts named "file", in order. INVALID_ARGUMENT for a body that is not multipart with the Content-Type's
// boundary (none, empty, or over 70 characters as RFC 2046 allows), or a part without its end.
std::vector<Upload> parse_multipart(const std::string& content_type, const std::string& body);

}  // namespace dsec::e2b
