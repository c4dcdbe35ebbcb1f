// The trainer's entry point: a Client talks to one or more node agents (dsecd) over HTTP/JSON, or starts a private
// one for itself when given no endpoints.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "dsec/retry.hpp"
#include "dsec/sandbox.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/spec.hpp"

namespace dsec {

namespace detail {
class ClientCore;
}

struct ClientOptions {
  // "unix:/run/dsec/dsecd.sock" or "http://10.0.0.7:7070". Empty: start an embedded agent on a private unix
  // socket, owned by this client and stopped with it.
  std::vector<std::string> endpoints;
  // Embedded agent only: its binary (default: $DSEC_AGENT, then next to this library's build, then PATH) and the
  // directory that holds its image store and state (default: $DSEC_HOME, then /var/lib/dsec).
  std::string agent_binary;
  std::string home;
  RetryPolicy retry;
  // Deadline for one call, through all its retries (exec adds its own timeout on top).
  std::chrono::milliseconds call_deadline{60'000};
  // How many creates create_many keeps in flight at once.
  std::size_t create_concurrency = 32;
};

class Client {
 public:
  explicit Client(ClientOptions options = {});
  ~Client();
  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;

  Sandbox create(const SandboxSpec& spec);
  // n sandboxes from one spec, created concurrently. All or nothing: if any create fails, the ones made are
  // destroyed and the first error is thrown.
  std::vector<Sandbox> create_many(std::size_t n, const SandboxSpec& spec);
  // A handle on an existing sandbox (not owning: destroying it is explicit).
  Sandbox attach(const std::string& id);
  std::vector<SandboxInfo> list(const Labels& labels = {}, const std::string& tenant = {});
  std::vector<NodeInfo> nodes();
  // The embedded agent's endpoint, or the first configured one.
  std::string endpoint() const;

 private:
  std::shared_ptr<detail::ClientCore> core_;
};

}  // namespace dsec
