// The wire format of a full VM's screen (POST /v1/sandboxes/{id}/input, and the screen state both screen routes
// answer), shared by the client and the agent. Decoders throw INVALID_ARGUMENT naming the field
// ("actions[2].button: ...").
#pragma once

#include <vector>

#include <nlohmann/json.hpp>

#include "dsec/screen.hpp"

namespace dsec::protocol {

// {"actions": [{"type": "move", "x": 10, "y": 20}, {"type": "click", "button": "right", "count": 2},
//              {"type": "scroll", "dy": -3}, {"type": "drag", "x", "y", "to_x", "to_y"}, {"type": "key", "keys":
//              "ctrl+s"}, {"type": "type", "text": "hello", "interval_ms": 30}, {"type": "wait", "interval_ms": 200}]}
nlohmann::json encode_input(const std::vector<InputAction>& actions);
std::vector<InputAction> decode_input(const nlohmann::json& j);

// {"width", "height", "cursor": {"x", "y"} or null}
nlohmann::json encode(const ScreenState& state);
ScreenState decode_screen_state(const nlohmann::json& j);

}  // namespace dsec::protocol
