// A full VM's screen (kind "vm", docs/vm.md): what a computer-use agent sees and does. Sandbox::screenshot() gives a
// PNG of the display; Sandbox::input() sends actions (pointer moves, clicks, the wheel, drags, keys, text) in
// order and answers where the pointer is. The pointer is absolute, in the screen's pixels; keys are named as people
// and models name them ("ctrl+s", "Return", "alt+F4", "a"); text is typed on a US keyboard layout.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dsec {

struct InputAction {
  enum class Type {
    kMove,    // the pointer to (x, y)
    kClick,   // `button` pressed and released `count` times (2: a double click), at (x, y) when given
    kScroll,  // the wheel turned `dy` notches (negative: up), at (x, y) when given
    kDrag,    // `button` pressed at (x, y), the pointer moved to (to_x, to_y), released there
    kKey,     // a key combination, `keys` ("ctrl+shift+t")
    kType,    // `text` typed, a character every `interval_ms`
    kWait,    // nothing for `interval_ms` (at most 10 s): lets the guest draw between actions
  };
  Type type = Type::kMove;
  std::optional<std::uint32_t> x, y;
  std::uint32_t to_x = 0, to_y = 0;
  std::string button = "left";  // left, middle, right
  std::uint32_t count = 1;      // clicks: 1 to 3
  std::int32_t dy = 0;          // scroll notches: -100 to 100
  std::string keys;
  std::string text;               // at most 4096 characters
  std::uint32_t interval_ms = 0;  // kType: 0 is the agent's default pace; kWait: how long

  static InputAction move(std::uint32_t x, std::uint32_t y) {
    InputAction a;
    a.type = Type::kMove;
    a.x = x;
    a.y = y;
    return a;
  }
  static InputAction click(std::uint32_t x, std::uint32_t y, std::string button = "left", std::uint32_t count = 1) {
    InputAction a;
    a.type = Type::kClick;
    a.x = x;
    a.y = y;
    a.button = std::move(button);
    a.count = count;
    return a;
  }
  static InputAction scroll(std::int32_t dy) {
    InputAction a;
    a.type = Type::kScroll;
    a.dy = dy;
    return a;
  }
  static InputAction drag(std::uint32_t x, std::uint32_t y, std::uint32_t to_x, std::uint32_t to_y,
                          std::string button = "left") {
    InputAction a;
    a.type = Type::kDrag;
    a.x = x;
    a.y = y;
    a.to_x = to_x;
    a.to_y = to_y;
    a.button = std::move(button);
    return a;
  }
  static InputAction key(std::string combo) {
    InputAction a;
    a.type = Type::kKey;
    a.keys = std::move(combo);
    return a;
  }
  static InputAction type_text(std::string text, std::uint32_t interval_ms = 0) {
    InputAction a;
    a.type = Type::kType;
    a.text = std::move(text);
    a.interval_ms = interval_ms;
    return a;
  }
  static InputAction wait(std::uint32_t ms) {
    InputAction a;
    a.type = Type::kWait;
    a.interval_ms = ms;
    return a;
  }
};

// The screen as the agent drives it: its size (the last screenshot's, else the size asked for at create) and where
// it last put the pointer (none before the first pointer action: QEMU cannot read the guest's own cursor).
struct ScreenState {
  std::uint32_t width = 0;
  std::uint32_t height = 0;
  std::optional<std::uint32_t> cursor_x, cursor_y;
};

// A VNC server for a person to watch (and drive) a screen: "host:port" on the sandbox's node, and the password a
// viewer must give (VNC authentication; 8 characters, a new one per endpoint).
struct VncEndpoint {
  std::string address;
  std::string password;
};

inline constexpr std::size_t kMaxInputActions = 1000;
inline constexpr std::size_t kMaxTypedText = 4096;

}  // namespace dsec
