#include "http/tls.hpp"

#include <algorithm>
#include <cerrno>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <fmt/format.h>

#include "dsec/error.hpp"
#include "http/http.hpp"

namespace dsec::agent {

namespace {

// What an SSL_read or SSL_write that moved nothing means, as the plain socket would have said it.
boost::system::error_code tls_failure(SSL* ssl, int rc) {
  int why = SSL_get_error(ssl, rc);
  ERR_clear_error();
  switch (why) {
    case SSL_ERROR_ZERO_RETURN:
      return boost::asio::error::eof;
    case SSL_ERROR_WANT_READ:
    case SSL_ERROR_WANT_WRITE:
      return {ETIMEDOUT, boost::system::system_category()};
    case SSL_ERROR_SYSCALL:
      if (errno == EAGAIN || errno == EWOULDBLOCK) return {ETIMEDOUT, boost::system::system_category()};
      if (errno != 0) return {errno, boost::system::system_category()};
      return boost::asio::error::eof;  // the peer closed without close_notify
    default:
      return {EPROTO, boost::system::system_category()};
  }
}

int clamp_size(std::size_t size) { return static_cast<int>(std::min<std::size_t>(size, 1u << 30)); }

}  // namespace

std::size_t tls_read(SSL* ssl, void* data, std::size_t size, boost::system::error_code& ec) {
  errno = 0;
  int rc = SSL_read(ssl, data, clamp_size(size));
  if (rc > 0) return static_cast<std::size_t>(rc);
  ec = tls_failure(ssl, rc);
  return 0;
}

std::size_t tls_write(SSL* ssl, const void* data, std::size_t size, boost::system::error_code& ec) {
  errno = 0;
  int rc = SSL_write(ssl, data, clamp_size(size));
  if (rc > 0) return static_cast<std::size_t>(rc);
  ec = tls_failure(ssl, rc);
  return 0;
}

}  // namespace dsec::agent

namespace dsec::agent::auth {

namespace fs = std::filesystem;

std::string openssl_error() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out.empty() ? "no OpenSSL error queued" : out;
}

std::shared_ptr<TlsServerContext> TlsServerContext::load(const fs::path& cert, const fs::path& key,
                                                         const fs::path& client_ca) {
  std::shared_ptr<TlsServerContext> out(new TlsServerContext());
  out->ctx_ = SSL_CTX_new(TLS_server_method());
  if (!out->ctx_) throw Error(Code::kInternal, "SSL_CTX_new: " + openssl_error());
  SSL_CTX_set_min_proto_version(out->ctx_, TLS1_2_VERSION);
  SSL_CTX_set_options(out->ctx_, SSL_OP_NO_RENEGOTIATION);
  SSL_CTX_set_mode(out->ctx_, SSL_MODE_AUTO_RETRY);
  auto fail = [&](const std::string& what, const fs::path& file) {
    return Error(Code::kFailedPrecondition, fmt::format("{} {}: {}", what, file.string(), openssl_error()));
  };
  if (SSL_CTX_use_certificate_chain_file(out->ctx_, cert.c_str()) != 1) throw fail("--tls-cert", cert);
  if (SSL_CTX_use_PrivateKey_file(out->ctx_, key.c_str(), SSL_FILETYPE_PEM) != 1)
    throw Error(Code::kFailedPrecondition,
                fmt::format("--tls-key {}: not a PEM private key, or it is not the key of --tls-cert {}: {}",
                            key.string(), cert.string(), openssl_error()));
  if (SSL_CTX_check_private_key(out->ctx_) != 1)
    throw Error(Code::kFailedPrecondition, fmt::format("--tls-key {} is not the key of --tls-cert {}: {}", key.string(),
                                                       cert.string(), openssl_error()));
  // A certificate past its dates serves nobody: say so at start rather than in every client's handshake.
  if (X509* leaf = SSL_CTX_get0_certificate(out->ctx_)) {
    if (X509_cmp_current_time(X509_get0_notAfter(leaf)) <= 0)
      throw Error(Code::kFailedPrecondition, fmt::format("--tls-cert {} has expired", cert.string()));
    if (X509_cmp_current_time(X509_get0_notBefore(leaf)) >= 0)
      throw Error(Code::kFailedPrecondition, fmt::format("--tls-cert {} is not valid yet", cert.string()));
  }
  if (!client_ca.empty()) {
    if (SSL_CTX_load_verify_locations(out->ctx_, client_ca.c_str(), nullptr) != 1)
      throw fail("--tls-client-ca", client_ca);
    STACK_OF(X509_NAME)* names = SSL_load_client_CA_file(client_ca.c_str());
    if (names) SSL_CTX_set_client_CA_list(out->ctx_, names);
    SSL_CTX_set_verify(out->ctx_, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
    out->mutual_ = true;
  }
  return out;
}

TlsServerContext::~TlsServerContext() {
  if (ctx_) SSL_CTX_free(ctx_);
}

TlsSession::TlsSession(const TlsServerContext& ctx, int fd) : ssl_(SSL_new(ctx.get())) {
  if (!ssl_) throw Error(Code::kInternal, "SSL_new: " + openssl_error());
  if (SSL_set_fd(ssl_, fd) != 1) {
    SSL_free(ssl_);
    ssl_ = nullptr;
    throw Error(Code::kInternal, "SSL_set_fd: " + openssl_error());
  }
}

TlsSession::~TlsSession() {
  if (ssl_) SSL_free(ssl_);
}

bool TlsSession::accept(std::string& error) {
  ERR_clear_error();
  int rc = SSL_accept(ssl_);
  if (rc == 1) return true;
  int why = SSL_get_error(ssl_, rc);
  if (why == SSL_ERROR_WANT_READ || why == SSL_ERROR_WANT_WRITE) error = "the client stalled in the TLS handshake";
  else if (why == SSL_ERROR_SYSCALL) error = "the client went away during the TLS handshake";
  else error = "TLS handshake: " + openssl_error();
  return false;
}

std::string TlsSession::peer_subject() const {
  X509* cert = SSL_get1_peer_certificate(ssl_);
  if (!cert) return {};
  char buf[512];
  X509_NAME_oneline(X509_get_subject_name(cert), buf, sizeof buf);
  X509_free(cert);
  return buf;
}

void TlsSession::shutdown() {
  ERR_clear_error();
  (void)SSL_shutdown(ssl_);
  ERR_clear_error();
}

}  // namespace dsec::agent::auth
