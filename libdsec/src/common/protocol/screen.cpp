#include "common/protocol/screen.hpp"

#include <fmt/format.h>

#include "common/protocol/limits.hpp"
#include "dsec/error.hpp"

namespace dsec::protocol {
namespace {

using nlohmann::json;

[[noreturn]] void bad(const std::string& field, std::string_view what) {
  throw Error(Code::kInvalidArgument, fmt::format("{}: {}", field, what));
}

std::uint64_t number_at(const json& a, const char* key, const std::string& at, std::uint64_t max) {
  const json& v = a.at(key);
  if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<std::int64_t>() >= 0))
    bad(at + "." + key, "must be a non-negative integer");
  std::uint64_t n = v.get<std::uint64_t>();
  if (n > max) bad(at + "." + key, fmt::format("at most {}", max));
  return n;
}

std::string string_at(const json& a, const char* key, const std::string& at) {
  const json& v = a.at(key);
  if (!v.is_string()) bad(at + "." + key, "must be a string");
  return v.get<std::string>();
}

const char* type_name(InputAction::Type t) {
  switch (t) {
    case InputAction::Type::kMove:
      return "move";
    case InputAction::Type::kClick:
      return "click";
    case InputAction::Type::kScroll:
      return "scroll";
    case InputAction::Type::kDrag:
      return "drag";
    case InputAction::Type::kKey:
      return "key";
    case InputAction::Type::kType:
      return "type";
    case InputAction::Type::kWait:
      return "wait";
  }
  return "move";
}

// One action of an input request at `at`, its fields read into `out` as its type allows them.
struct ActionFields {
  const json& a;
  const std::string& at;
  const std::string& type;
  InputAction& out;

  bool has(const char* k) const { return a.contains(k) && !a.at(k).is_null(); }
  void allow_only(std::initializer_list<const char*> keys) const {
    for (auto it = a.begin(); it != a.end(); ++it) {
      bool known = it.key() == "type";
      for (const char* k : keys) known = known || it.key() == k;
      if (!known) bad(at + "." + it.key(), fmt::format("not a field of a {} action", type));
    }
  }
  void point(bool required) {
    if (has("x") != has("y")) bad(at, "x and y go together");
    if (!has("x")) {
      if (required) bad(at + ".x", "missing (a pixel of the screen)");
      return;
    }
    out.x = static_cast<std::uint32_t>(number_at(a, "x", at, kMaxScreenCoordinate));
    out.y = static_cast<std::uint32_t>(number_at(a, "y", at, kMaxScreenCoordinate));
  }
  void button() {
    if (!has("button")) return;
    out.button = string_at(a, "button", at);
    if (out.button != "left" && out.button != "middle" && out.button != "right")
      bad(at + ".button", fmt::format("'{}' is not left, middle or right", out.button.substr(0, 40)));
  }
};

InputAction decode_action(const json& a, const std::string& at) {
  if (!a.is_object()) bad(at, "must be an object with a \"type\"");
  if (!a.contains("type")) bad(at + ".type", "missing (move, click, scroll, drag, key, type or wait)");
  const std::string type = string_at(a, "type", at);
  InputAction out;
  ActionFields f{a, at, type, out};
  if (type == "move") {
    f.allow_only({"x", "y"});
    out.type = InputAction::Type::kMove;
    f.point(true);
  } else if (type == "click") {
    f.allow_only({"x", "y", "button", "count"});
    out.type = InputAction::Type::kClick;
    f.point(false);
    f.button();
    if (f.has("count")) {
      out.count = static_cast<std::uint32_t>(number_at(a, "count", at, 3));
      if (out.count == 0) bad(at + ".count", "from 1 to 3");
    }
  } else if (type == "scroll") {
    f.allow_only({"x", "y", "dy"});
    out.type = InputAction::Type::kScroll;
    f.point(false);
    if (!f.has("dy") || !a.at("dy").is_number_integer()) bad(at + ".dy", "an integer number of notches is needed");
    std::int64_t dy = a.at("dy").get<std::int64_t>();
    if (dy < -100 || dy > 100 || dy == 0) bad(at + ".dy", "from -100 to 100 notches, not 0");
    out.dy = static_cast<std::int32_t>(dy);
  } else if (type == "drag") {
    f.allow_only({"x", "y", "to_x", "to_y", "button"});
    out.type = InputAction::Type::kDrag;
    f.point(true);
    if (!f.has("to_x") || !f.has("to_y")) bad(at + ".to_x", "a drag needs to_x and to_y");
    out.to_x = static_cast<std::uint32_t>(number_at(a, "to_x", at, kMaxScreenCoordinate));
    out.to_y = static_cast<std::uint32_t>(number_at(a, "to_y", at, kMaxScreenCoordinate));
    f.button();
  } else if (type == "key") {
    f.allow_only({"keys"});
    out.type = InputAction::Type::kKey;
    if (!f.has("keys")) bad(at + ".keys", "missing (a key combination such as \"ctrl+s\")");
    out.keys = string_at(a, "keys", at);
    if (out.keys.empty() || out.keys.size() > 128) bad(at + ".keys", "1 to 128 characters");
  } else if (type == "type") {
    f.allow_only({"text", "interval_ms"});
    out.type = InputAction::Type::kType;
    if (!f.has("text")) bad(at + ".text", "missing");
    out.text = string_at(a, "text", at);
    if (out.text.size() > kMaxTypedText) bad(at + ".text", fmt::format("at most {} characters", kMaxTypedText));
    if (f.has("interval_ms"))
      out.interval_ms = static_cast<std::uint32_t>(number_at(a, "interval_ms", at, kMaxTypeIntervalMs));
  } else if (type == "wait") {
    f.allow_only({"interval_ms"});
    out.type = InputAction::Type::kWait;
    if (!f.has("interval_ms")) bad(at + ".interval_ms", "missing (milliseconds, at most 10000)");
    out.interval_ms = static_cast<std::uint32_t>(number_at(a, "interval_ms", at, kMaxInputWaitMs));
  } else {
    bad(at + ".type", fmt::format("'{}' is not move, click, scroll, drag, key, type or wait", type.substr(0, 40)));
  }
  return out;
}

}  // namespace

json encode_input(const std::vector<InputAction>& actions) {
  json list = json::array();
  for (const InputAction& a : actions) {
    json j{{"type", type_name(a.type)}};
    if (a.type != InputAction::Type::kKey && a.type != InputAction::Type::kType && a.type != InputAction::Type::kWait) {
      if (a.x) j["x"] = *a.x;  // one without the other is sent as it is, for the agent to refuse
      if (a.y) j["y"] = *a.y;
    }
    switch (a.type) {
      case InputAction::Type::kMove:
        break;
      case InputAction::Type::kClick:
        j["button"] = a.button;
        j["count"] = a.count;
        break;
      case InputAction::Type::kScroll:
        j["dy"] = a.dy;
        break;
      case InputAction::Type::kDrag:
        j["to_x"] = a.to_x;
        j["to_y"] = a.to_y;
        j["button"] = a.button;
        break;
      case InputAction::Type::kKey:
        j["keys"] = a.keys;
        break;
      case InputAction::Type::kType:
        j["text"] = a.text;
        if (a.interval_ms) j["interval_ms"] = a.interval_ms;
        break;
      case InputAction::Type::kWait:
        j["interval_ms"] = a.interval_ms;
        break;
    }
    list.push_back(std::move(j));
  }
  return json{{"actions", std::move(list)}};
}

std::vector<InputAction> decode_input(const json& j) {
  if (!j.is_object() || !j.contains("actions")) bad("actions", "missing: the body is {\"actions\": [...]}");
  for (auto it = j.begin(); it != j.end(); ++it)
    if (it.key() != "actions") bad(it.key(), "not a field of an input request");
  const json& list = j.at("actions");
  if (!list.is_array() || list.empty()) bad("actions", "must be a non-empty list of actions");
  if (list.size() > kMaxInputActions) bad("actions", fmt::format("at most {} actions a request", kMaxInputActions));
  std::vector<InputAction> out;
  out.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i) out.push_back(decode_action(list[i], fmt::format("actions[{}]", i)));
  return out;
}

json encode(const ScreenState& s) {
  json j{{"width", s.width}, {"height", s.height}, {"cursor", nullptr}};
  if (s.cursor_x && s.cursor_y) j["cursor"] = json{{"x", *s.cursor_x}, {"y", *s.cursor_y}};
  return j;
}

ScreenState decode_screen_state(const json& j) {
  auto fail = [](std::string_view what) {
    throw Error(Code::kInternal, fmt::format("the agent's screen state is malformed: {}", what));
  };
  if (!j.is_object()) fail("not an object");
  ScreenState s;
  try {
    s.width = j.at("width").get<std::uint32_t>();
    s.height = j.at("height").get<std::uint32_t>();
    if (auto c = j.find("cursor"); c != j.end() && c->is_object()) {
      s.cursor_x = c->at("x").get<std::uint32_t>();
      s.cursor_y = c->at("y").get<std::uint32_t>();
    }
  } catch (const json::exception& e) {
    fail(e.what());
  }
  return s;
}

}  // namespace dsec::protocol
