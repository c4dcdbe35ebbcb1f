#include "image/store/digest.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <openssl/evp.h>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

namespace dsec::image {

struct Sha256::State {
  EVP_MD_CTX* ctx = nullptr;
  ~State() { EVP_MD_CTX_free(ctx); }
};

Sha256::Sha256() : state_(std::make_unique<State>()) {
  state_->ctx = EVP_MD_CTX_new();
  if (!state_->ctx || EVP_DigestInit_ex(state_->ctx, EVP_sha256(), nullptr) != 1)
    throw Error(Code::kInternal, "sha256: OpenSSL could not start a digest");
}
Sha256::~Sha256() = default;
Sha256::Sha256(Sha256&&) noexcept = default;
Sha256& Sha256::operator=(Sha256&&) noexcept = default;

void Sha256::update(const void* data, std::size_t size) {
  if (size > 0 && EVP_DigestUpdate(state_->ctx, data, size) != 1) throw Error(Code::kInternal, "sha256: update failed");
}

std::string Sha256::finish() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(state_->ctx, md, &len) != 1) throw Error(Code::kInternal, "sha256: final failed");
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "sha256:";
  out.reserve(7 + 2 * len);
  for (unsigned int i = 0; i < len; ++i) {
    out.push_back(kHex[md[i] >> 4]);
    out.push_back(kHex[md[i] & 15]);
  }
  return out;
}

std::string sha256_digest(std::string_view bytes) {
  Sha256 h;
  h.update(bytes);
  return h.finish();
}

std::string sha256_file(const std::filesystem::path& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) throw_errno_fmt(errno, "open {}", path.string());
  Sha256 h;
  std::string buf(1u << 20, '\0');
  for (;;) {
    ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno_fmt(errno, "read {}", path.string());
    }
    if (n == 0) break;
    h.update(buf.data(), static_cast<std::size_t>(n));
  }
  return h.finish();
}

bool is_digest(std::string_view text) {
  constexpr std::string_view kPrefix = "sha256:";
  if (text.size() != kPrefix.size() + 64 || text.substr(0, kPrefix.size()) != kPrefix) return false;
  for (char c : text.substr(kPrefix.size()))
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

std::string digest_hex(std::string_view digest, std::string_view what) {
  if (!is_digest(digest))
    throw Error(Code::kInvalidArgument,
                fmt::format("{}: '{}' is not a sha256 digest (\"sha256:\" and 64 lowercase hex digits)", what,
                            digest.substr(0, 100)));
  return std::string(digest.substr(7));
}

}  // namespace dsec::image
