// What the HTTP server tells its owner about connections and about the requests it answers itself (refusals, bodies
// it could not parse): the agent's and the gateway's metrics count them.
#pragma once

#include <string_view>

namespace dsec::agent {

class ServerEvents {
 public:
  virtual ~ServerEvents() = default;
  virtual void connection_opened() = 0;
  virtual void connection_closed() = 0;
  virtual void connection_refused() = 0;
  virtual void tls_handshake_failed() = 0;
  virtual void count_request(std::string_view route, std::string_view method, int status) = 0;
};

}  // namespace dsec::agent
