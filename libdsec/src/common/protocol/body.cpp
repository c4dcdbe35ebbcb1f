#include "common/protocol/body.hpp"

#include <openssl/evp.h>

#include <fmt/format.h>

#include "common/protocol/fields_internal.hpp"

namespace dsec::protocol {

using namespace fields;

json parse_body(std::string_view body) {
  if (body.empty()) return json::object();
  try {
    return json::parse(body);
  } catch (const json::exception& e) {
    // Syntax errors, and numbers too large for a double (1e999: out_of_range, not a parse_error).
    throw Error(Code::kInvalidArgument, fmt::format("request body is not valid JSON: {}", e.what()));
  }
}

std::string base64_encode(std::string_view bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3), '\0');
  int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
  out.resize(static_cast<std::size_t>(n));
  return out;
}

std::string base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) throw Error(Code::kInvalidArgument, "malformed base64: length is not a multiple of 4");
  std::string out(3 * (text.size() / 4), '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  if (n < 0) throw Error(Code::kInvalidArgument, "malformed base64");
  std::size_t len = static_cast<std::size_t>(n);
  // EVP_DecodeBlock keeps the padding bytes as zeros; drop them.
  if (!text.empty() && text.back() == '=') --len;
  if (text.size() >= 2 && text[text.size() - 2] == '=') --len;
  out.resize(len);
  return out;
}

}  // namespace dsec::protocol
