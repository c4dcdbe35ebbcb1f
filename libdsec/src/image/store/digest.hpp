// Content addresses: "sha256:<64 lowercase hex>". Everything an image is made of (manifests, chunk indexes, chunk
// data, the layers themselves) is named by the sha256 of its bytes.
#pragma once

#include <cstddef>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

namespace dsec::image {

// Incremental sha256 (OpenSSL EVP underneath).
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(Sha256&&) noexcept;
  Sha256& operator=(Sha256&&) noexcept;
  void update(const void* data, std::size_t size);
  void update(std::string_view bytes) { update(bytes.data(), bytes.size()); }
  // "sha256:<hex>". The object can not be updated afterwards.
  std::string finish();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// "sha256:<hex>" of the bytes / of a file's contents.
std::string sha256_digest(std::string_view bytes);
std::string sha256_file(const std::filesystem::path& path);

// True for "sha256:" followed by exactly 64 lowercase hex digits.
bool is_digest(std::string_view text);
// The 64 hex digits of a digest; dsec::Error(INVALID_ARGUMENT) naming `what` when `digest` is not one.
std::string digest_hex(std::string_view digest, std::string_view what = "digest");

}  // namespace dsec::image
