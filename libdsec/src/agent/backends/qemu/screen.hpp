// A VM's screen, through its QMP monitor: what a computer-use agent sees (a PNG of the display) and does (keys, text,
// an absolute pointer, buttons, the wheel).
//
// Screenshots: QEMU encodes the PNG itself (screendump with format "png", QEMU 7.1+) into a memfd the agent hands it
// with add-fd (opened write-only: QEMU's fd sets match the access mode), so QEMU, which runs as a uid of its own,
// opens no file of the node; the bytes are checked to be a PNG and capped before they go anywhere.
//
// Input: input-send-event. Keys are named as people and computer-use models name them ("ctrl+s", "Return", "alt+F4",
// "a"; case does not matter) and sent as QEMU key codes; text is typed on the US keymap (shift where a character
// needs it), printable ASCII, newline and tab. The pointer is absolute (the USB tablet), in the screen's pixels. A
// VM that is not running refuses input: FAILED_PRECONDITION.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "agent/backends/qemu/qmp.hpp"

namespace dsec::agent::qemu {

inline constexpr std::size_t kMaxScreenshotBytes = 64u << 20;

// A PNG of the VM's display now. FAILED_PRECONDITION when the VM has no display; INTERNAL when QEMU's answer is not
// a PNG or is larger than `max_bytes`.
std::string screenshot_png(QmpClient& qmp, std::chrono::milliseconds timeout,
                           std::size_t max_bytes = kMaxScreenshotBytes);
// The width and height a PNG's header gives (INVALID_ARGUMENT when `png` is not a PNG).
std::pair<std::uint32_t, std::uint32_t> png_size(std::string_view png);

// The QEMU key codes of a key combination: names joined by '+' ("ctrl+shift+t"), modifiers first as given.
// INVALID_ARGUMENT naming a key it does not know.
std::vector<std::string> parse_key_combo(std::string_view combo);
// The key presses that type `text` on the US keymap, one combination per character. INVALID_ARGUMENT naming the
// first character with no key there.
std::vector<std::vector<std::string>> text_to_key_presses(std::string_view text);

// The input-send-event events of pressing a combination (every key down in order, then up in reverse).
nlohmann::json key_press_events(const std::vector<std::string>& qcodes);
// Moving the absolute pointer to pixel (x, y) of a width x height screen (INVALID_ARGUMENT outside it).
nlohmann::json pointer_move_events(std::uint32_t x, std::uint32_t y, std::uint32_t width, std::uint32_t height);
// A button ("left", "middle", "right") pressed and released, `count` times (2: a double click).
nlohmann::json click_events(std::string_view button, int count);
// The wheel turned `notches` (negative: up, away from the user; positive: down).
nlohmann::json scroll_events(int notches);

// Sends events (input-send-event); FAILED_PRECONDITION when the VM is not running.
void send_input(QmpClient& qmp, const nlohmann::json& events, std::chrono::milliseconds timeout);

}  // namespace dsec::agent::qemu
