#include "agent/backends/qemu/vm_screen.hpp"

#include <thread>

#include <fmt/format.h>

#include "agent/backends/qemu/screen.hpp"

namespace dsec::agent::qemu {
namespace {

using nlohmann::json;

constexpr auto kQmpTimeout = std::chrono::seconds(10);
constexpr int kDragSteps = 8;
constexpr auto kDragStepPause = std::chrono::milliseconds(15);

void pause(std::uint32_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

}  // namespace

VmScreen::VmScreen(std::string sandbox_id, std::uint32_t width, std::uint32_t height, RunningVm vm,
                   std::shared_ptr<network::NodeNetwork> network)
    : id_(std::move(sandbox_id)), vm_(std::move(vm)), width_(width), height_(height), network_(std::move(network)) {}

VmScreen::~VmScreen() {
  try {
    stop_vnc();
  } catch (...) {
  }
}

VncEndpoint VmScreen::vnc() {
  if (!network_)
    throw Error(Code::kFailedPrecondition,
                fmt::format("sandbox {}: this node has no ports to give a VNC screen (it serves no networks)", id_));
  (void)vm_();  // not while it sleeps
  std::lock_guard lock(vnc_mu_);
  if (!vnc_) {
    const std::uint16_t port = network_->claim_agent_port();
    try {
      vnc_ = std::make_unique<VncListener>(id_, port, vm_);
    } catch (...) {
      network_->release_agent_port(port);
      throw;
    }
  }
  return VncEndpoint{network_->address_of(vnc_->port()), vnc_->password()};
}

void VmScreen::stop_vnc() {
  std::lock_guard lock(vnc_mu_);
  if (!vnc_) return;
  const std::uint16_t port = vnc_->port();
  vnc_.reset();
  network_->release_agent_port(port);
}

std::string VmScreen::screenshot_png() {
  std::shared_ptr<VmInstance> vm = vm_();
  std::string png = vm->with_qmp([](QmpClient& qmp) { return qemu::screenshot_png(qmp, kQmpTimeout); });
  auto [w, h] = png_size(png);
  std::lock_guard lock(mu_);
  // The guest may draw at another size than the one offered (its own mode setting): pointer pixels follow it.
  if (w > 0 && h > 0 && (w != width_ || h != height_)) {
    width_ = w;
    height_ = h;
    if (cursor_x_ && (*cursor_x_ >= w || *cursor_y_ >= h)) cursor_x_.reset(), cursor_y_.reset();
  }
  return png;
}

ScreenState VmScreen::input(const std::vector<InputAction>& actions) {
  std::shared_ptr<VmInstance> vm = vm_();
  std::lock_guard lock(mu_);
  for (std::size_t i = 0; i < actions.size(); ++i) {
    try {
      run(*vm, actions[i]);
    } catch (const Error& e) {
      if (actions.size() == 1) throw;
      throw Error(e.code(),
                  fmt::format("actions[{}]: {}{}", i, e.what(),
                              i > 0 ? fmt::format(" (actions 0 to {} took effect)", i - 1) : ""),
                  e.retryable(), e.fault());
    }
  }
  return state_locked();
}

ScreenState VmScreen::state() {
  std::lock_guard lock(mu_);
  return state_locked();
}

ScreenState VmScreen::state_locked() const {
  ScreenState s;
  s.width = width_;
  s.height = height_;
  s.cursor_x = cursor_x_;
  s.cursor_y = cursor_y_;
  return s;
}

void VmScreen::send(VmInstance& vm, const json& events) {
  vm.with_qmp([&](QmpClient& qmp) { send_input(qmp, events, kQmpTimeout); });
}

void VmScreen::pointer_to(VmInstance& vm, std::uint32_t x, std::uint32_t y) {
  send(vm, pointer_move_events(x, y, width_, height_));
  cursor_x_ = x;
  cursor_y_ = y;
}

void VmScreen::run(VmInstance& vm, const InputAction& a) {
  using Type = InputAction::Type;
  // Each button event on its own (see the header).
  auto buttons = [&](const json& events) {
    for (const json& e : events) send(vm, json::array({e}));
  };
  switch (a.type) {
    case Type::kMove:
      if (!a.x || !a.y) throw Error(Code::kInvalidArgument, "move: x and y are needed");
      pointer_to(vm, *a.x, *a.y);
      return;
    case Type::kClick:
      if (a.x && a.y) pointer_to(vm, *a.x, *a.y);
      buttons(click_events(a.button, static_cast<int>(a.count)));
      return;
    case Type::kScroll:
      if (a.x && a.y) pointer_to(vm, *a.x, *a.y);
      send(vm, scroll_events(a.dy));
      return;
    case Type::kDrag: {
      if (!a.x || !a.y) throw Error(Code::kInvalidArgument, "drag: x and y are needed");
      json press_release = click_events(a.button, 1);
      (void)pointer_move_events(a.to_x, a.to_y, width_, height_);  // refused before anything is pressed
      pointer_to(vm, *a.x, *a.y);
      send(vm, json::array({press_release[0]}));
      const std::int64_t x0 = *a.x, y0 = *a.y;
      for (int step = 1; step <= kDragSteps; ++step) {
        std::this_thread::sleep_for(kDragStepPause);
        auto along = [&](std::int64_t from, std::int64_t to) {
          return static_cast<std::uint32_t>(from + (to - from) * step / kDragSteps);
        };
        pointer_to(vm, along(x0, a.to_x), along(y0, a.to_y));
      }
      send(vm, json::array({press_release[1]}));
      return;
    }
    case Type::kKey:
      send(vm, key_press_events(parse_key_combo(a.keys)));
      return;
    case Type::kType: {
      const auto presses = text_to_key_presses(a.text);  // refuses the whole text before typing any of it
      const std::uint32_t interval = a.interval_ms ? a.interval_ms : kDefaultTypeIntervalMs;
      for (std::size_t i = 0; i < presses.size(); ++i) {
        if (i > 0) pause(interval);
        send(vm, key_press_events(presses[i]));
      }
      return;
    }
    case Type::kWait:
      pause(a.interval_ms);
      return;
  }
}

}  // namespace dsec::agent::qemu
