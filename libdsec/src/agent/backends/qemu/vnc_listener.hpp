// A full VM's screen for a person to watch an episode (and to take over from the model when needed): a TCP port of
// the node's expose range (NodeNetwork::claim_agent_port) on which the agent accepts connections and hands each one
// to QEMU's VNC server (QMP getfd + add_client; QEMU runs with "-vnc none", a VNC server with no listener of its
// own). QEMU speaks VNC on the accepted socket itself: the agent relays nothing. Whoever reaches the node's port
// sees the screen and can drive it, as with a sandbox's exposed ports.
//
// While the sandbox sleeps, connections are closed at once; after a wake they go to the new QEMU. The listener is
// the agent's: it ends with the sandbox, or when the agent stops (a restarted agent makes a new one on request).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "agent/backends/qemu/vm_instance.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::qemu {

class VncListener {
 public:
  using RunningVm = std::function<std::shared_ptr<VmInstance>()>;

  // Listens on 0.0.0.0:`port` (UNAVAILABLE when it cannot) and starts accepting. A viewer must give the password
  // (VNC authentication, done by QEMU: a connection is handed to it with the password set, never with skipauth).
  VncListener(std::string sandbox_id, std::uint16_t port, RunningVm vm);
  ~VncListener();  // stops accepting; connections already handed to QEMU stay with it
  VncListener(const VncListener&) = delete;
  VncListener& operator=(const VncListener&) = delete;

  std::uint16_t port() const noexcept { return port_; }
  const std::string& password() const noexcept { return password_; }
  std::uint64_t connections() const noexcept { return connections_.load(); }

 private:
  void run();
  void hand_over(UniqueFd connection);

  std::string id_;
  std::uint16_t port_;
  std::string password_;  // 8 random letters and digits: VNC authentication reads no more
  RunningVm vm_;
  UniqueFd listener_;
  UniqueFd stop_;  // an eventfd: the accept loop ends when it is written
  std::atomic<std::uint64_t> connections_{0};
  std::thread thread_;
};

}  // namespace dsec::agent::qemu
