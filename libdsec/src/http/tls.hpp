// TLS for dsecd's TCP listener (OpenSSL): the node's certificate and key, and optionally a CA whose certificates
// clients must present (mutual TLS). TLS 1.2 at least. A connection's handshake runs on its own thread, under the
// listener's idle timeout, so a client that stalls in it holds only its own connection.
#pragma once

#include <filesystem>
#include <memory>
#include <string>

typedef struct ssl_ctx_st SSL_CTX;
typedef struct ssl_st SSL;

namespace dsec::agent::auth {

class TlsServerContext {
 public:
  // Loads the certificate chain and private key (PEM); with `client_ca`, a client without a certificate that CA
  // signed is refused in the handshake. FAILED_PRECONDITION naming the file and OpenSSL's reason when one is
  // missing, unreadable, expired or does not match the key.
  static std::shared_ptr<TlsServerContext> load(const std::filesystem::path& cert, const std::filesystem::path& key,
                                                const std::filesystem::path& client_ca = {});
  ~TlsServerContext();
  TlsServerContext(const TlsServerContext&) = delete;
  TlsServerContext& operator=(const TlsServerContext&) = delete;

  bool requires_client_certificate() const noexcept { return mutual_; }
  SSL_CTX* get() const noexcept { return ctx_; }

 private:
  TlsServerContext() = default;
  SSL_CTX* ctx_ = nullptr;
  bool mutual_ = false;
};

// One connection's TLS session over a connected socket (blocking, with the socket's send and receive timeouts).
class TlsSession {
 public:
  TlsSession(const TlsServerContext& ctx, int fd);
  ~TlsSession();
  TlsSession(const TlsSession&) = delete;
  TlsSession& operator=(const TlsSession&) = delete;

  // The server side of the handshake; false (with the reason in `error`) when it failed or timed out.
  bool accept(std::string& error);
  // The client certificate's subject ("CN=trainer-3,O=..."), empty without one.
  std::string peer_subject() const;
  SSL* get() const noexcept { return ssl_; }
  // Sends close_notify (best effort) before the socket is closed.
  void shutdown();

 private:
  SSL* ssl_ = nullptr;
};

// OpenSSL's last error as text (and the queue cleared).
std::string openssl_error();

}  // namespace dsec::agent::auth
