// A full VM's screen as a sandbox serves it (agent Screen): screenshots and input through the VM's QMP monitor
// (qemu/screen.hpp), the pointer's last position, the screen's size as the guest draws it.
//
// Input is paced for the devices it goes through: QEMU's USB HID devices queue 16 events and drop what comes
// beyond, and the guest reads them at its USB polling rate (slower under TCG). So every button press and release
// goes as its own input-send-event (a press and its release in one would fold into one report, and the click be
// lost), and text goes a character at a time, `interval_ms` apart.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "agent/backends/backend.hpp"
#include "agent/backends/qemu/vm_instance.hpp"
#include "agent/backends/qemu/vnc_listener.hpp"
#include "agent/network/node_network.hpp"

namespace dsec::agent::qemu {

inline constexpr std::uint32_t kDefaultTypeIntervalMs = 30;

class VmScreen final : public Screen {
 public:
  // The running VM, or an Error (FAILED_PRECONDITION while the sandbox sleeps, NOT_FOUND once it is destroyed).
  using RunningVm = std::function<std::shared_ptr<VmInstance>()>;

  // `network` gives the VNC endpoint its port (null: the node has none to give).
  VmScreen(std::string sandbox_id, std::uint32_t width, std::uint32_t height, RunningVm vm,
           std::shared_ptr<network::NodeNetwork> network);
  ~VmScreen() override;

  std::string screenshot_png() override;
  ScreenState input(const std::vector<InputAction>& actions) override;
  ScreenState state() override;
  VncEndpoint vnc() override;
  void stop_vnc() override;

 private:
  void run(VmInstance& vm, const InputAction& a);
  void pointer_to(VmInstance& vm, std::uint32_t x, std::uint32_t y);
  void send(VmInstance& vm, const nlohmann::json& events);
  ScreenState state_locked() const;

  std::string id_;
  RunningVm vm_;
  std::mutex mu_;  // one input request at a time; guards what follows
  std::uint32_t width_, height_;
  std::optional<std::uint32_t> cursor_x_, cursor_y_;
  std::shared_ptr<network::NodeNetwork> network_;
  std::mutex vnc_mu_;  // guards vnc_ (apart from mu_, which a long input request holds)
  std::unique_ptr<VncListener> vnc_;
};

}  // namespace dsec::agent::qemu
