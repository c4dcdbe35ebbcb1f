// A full VM's screen on the wire and in the spec (common/protocol/screen, SandboxSpec::display) and in a sandbox's
// record (qemu/vm_record): what is accepted, what is refused and how it says so.
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "agent/backends/qemu/qemu_command.hpp"
#include "agent/backends/qemu/vm_record.hpp"
#include "common/protocol.hpp"
#include "common/protocol/screen.hpp"
#include "dsec/error.hpp"

namespace dsec {
namespace {

using nlohmann::json;

std::string refusal(const json& body) {
  try {
    (void)protocol::decode_input(body);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << body.dump();
  return {};
}

json one(json action) { return json{{"actions", json::array({std::move(action)})}}; }

TEST(ScreenProtocol, EveryActionRoundTrips) {
  std::vector<InputAction> in{InputAction::move(10, 20),
                              InputAction::click(5, 6, "right", 2),
                              InputAction::scroll(-3),
                              InputAction::drag(1, 2, 300, 400, "middle"),
                              InputAction::key("ctrl+shift+t"),
                              InputAction::type_text("hello\n", 45),
                              InputAction::wait(250)};
  InputAction click_here;
  click_here.type = InputAction::Type::kClick;  // no x, y: where the pointer is
  in.push_back(click_here);
  std::vector<InputAction> out = protocol::decode_input(protocol::encode_input(in));
  ASSERT_EQ(out.size(), in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(out[i].type, in[i].type) << i;
    EXPECT_EQ(out[i].x, in[i].x) << i;
    EXPECT_EQ(out[i].y, in[i].y) << i;
  }
  EXPECT_EQ(out[1].button, "right");
  EXPECT_EQ(out[1].count, 2u);
  EXPECT_EQ(out[2].dy, -3);
  EXPECT_EQ(out[3].to_x, 300u);
  EXPECT_EQ(out[3].to_y, 400u);
  EXPECT_EQ(out[3].button, "middle");
  EXPECT_EQ(out[4].keys, "ctrl+shift+t");
  EXPECT_EQ(out[5].text, "hello\n");
  EXPECT_EQ(out[5].interval_ms, 45u);
  EXPECT_EQ(out[6].interval_ms, 250u);
  EXPECT_FALSE(out[7].x.has_value());
}

TEST(ScreenProtocol, MalformedInputIsRefusedNamingTheField) {
  EXPECT_NE(refusal(json::object()).find("actions"), std::string::npos);
  EXPECT_NE(refusal(json{{"actions", json::array()}}).find("non-empty"), std::string::npos);
  EXPECT_NE(refusal(json{{"actions", "click"}}).find("actions"), std::string::npos);
  EXPECT_NE(refusal(json{{"actions", json::array({1})}}).find("actions[0]"), std::string::npos);
  EXPECT_NE(refusal(json{{"actions", json::array()}, {"extra", 1}}).find("extra"), std::string::npos);
  EXPECT_NE(refusal(one({{"x", 1}})).find("actions[0].type"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "teleport"}})).find("teleport"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "move"}, {"x", 1}})).find("together"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "move"}})).find("actions[0].x"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "move"}, {"x", -1}, {"y", 2}})).find("non-negative"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "move"}, {"x", 1}, {"y", 2}, {"z", 3}})).find("actions[0].z"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "move"}, {"x", 70000}, {"y", 2}})).find("at most"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "click"}, {"button", "fourth"}})).find("fourth"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "click"}, {"count", 0}})).find("count"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "click"}, {"count", 4}})).find("count"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "scroll"}, {"dy", 0}})).find("dy"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "scroll"}, {"dy", 101}})).find("dy"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "scroll"}, {"dy", 1.5}})).find("dy"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "drag"}, {"x", 1}, {"y", 1}})).find("to_x"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "key"}})).find("keys"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "key"}, {"keys", ""}})).find("keys"), std::string::npos);
  EXPECT_NE(refusal(one({{"type", "type"}, {"text", std::string(kMaxTypedText + 1, 'a')}})).find("text"),
            std::string::npos);
  EXPECT_NE(refusal(one({{"type", "type"}, {"text", "a"}, {"interval_ms", 5000}})).find("interval_ms"),
            std::string::npos);
  EXPECT_NE(refusal(one({{"type", "wait"}, {"interval_ms", 10001}})).find("interval_ms"), std::string::npos);
  json many = json::array();
  for (std::size_t i = 0; i <= kMaxInputActions; ++i) many.push_back({{"type", "wait"}, {"interval_ms", 0}});
  EXPECT_NE(refusal(json{{"actions", many}}).find("at most"), std::string::npos);
}

TEST(ScreenProtocol, StateRoundTrips) {
  ScreenState s;
  s.width = 1280;
  s.height = 800;
  ScreenState back = protocol::decode_screen_state(protocol::encode(s));
  EXPECT_EQ(back.width, 1280u);
  EXPECT_FALSE(back.cursor_x.has_value());
  s.cursor_x = 7;
  s.cursor_y = 9;
  back = protocol::decode_screen_state(protocol::encode(s));
  EXPECT_EQ(back.cursor_x, 7u);
  EXPECT_EQ(back.cursor_y, 9u);
  EXPECT_THROW(protocol::decode_screen_state(json{{"width", "wide"}}), Error);
}

TEST(SpecDisplay, SizesAreParsedAndBoundsHeld) {
  auto d = parse_display("1280x800");
  ASSERT_TRUE(d);
  EXPECT_EQ(d->width, 1280u);
  EXPECT_EQ(d->height, 800u);
  EXPECT_TRUE(parse_display("320x200"));
  EXPECT_TRUE(parse_display("3840x2160"));
  for (const char* bad : {"", "none", "319x200", "320x199", "3841x2160", "99999x99999", "1280", "x800", "1280x",
                          "12a0x800", "1280x800x2", "-1x800", "1280 x 800"})
    EXPECT_FALSE(parse_display(bad)) << bad;
}

TEST(SpecDisplay, OnlyFullVmsHaveAScreen) {
  json spec{{"image", "desktop"}, {"kind", "vm"}, {"display", "1280x800"}};
  EXPECT_EQ(protocol::decode_spec(spec).display, "1280x800");
  spec["display"] = "none";
  EXPECT_EQ(protocol::decode_spec(spec).display, "none");
  spec["display"] = "huge";
  try {
    (void)protocol::decode_spec(spec);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("display"), std::string::npos) << e.what();
  }
  json container{{"image", "busybox"}, {"kind", "container"}, {"display", "800x600"}};
  try {
    (void)protocol::decode_spec(container);
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no screen"), std::string::npos) << e.what();
  }
  // A spec without a display encodes as before (request-id fingerprints do not change).
  SandboxSpec plain;
  EXPECT_FALSE(protocol::encode(plain).contains("display"));
}

TEST(VmRecordDisplay, RoundTripsAndRefusesMalformed) {
  using agent::qemu::DisplaySpec;
  DisplaySpec vga = agent::qemu::make_display(DisplaySpec::Kind::kVga, 1920, 1080);
  EXPECT_GE(std::uint64_t{vga.vgamem_mb} << 20, 2ull * 1920 * 1080 * 4);
  EXPECT_EQ(vga.vgamem_mb & (vga.vgamem_mb - 1), 0u);  // a power of two
  EXPECT_EQ(agent::qemu::make_display(DisplaySpec::Kind::kVga, 1024, 768).vgamem_mb, 16u);
  DisplaySpec back = agent::qemu::decode_display("vm", agent::qemu::encode_display(vga));
  EXPECT_EQ(back.kind, DisplaySpec::Kind::kVga);
  EXPECT_EQ(back.width, 1920u);
  EXPECT_EQ(back.height, 1080u);
  EXPECT_EQ(back.vgamem_mb, vga.vgamem_mb);
  EXPECT_EQ(agent::qemu::decode_display("vm", "none").kind, DisplaySpec::Kind::kNone);
  for (const char* bad : {"", "vga", "vga huge", "cirrus 1024x768", "vga 1x1"})
    EXPECT_THROW(agent::qemu::decode_display("vm", bad), Error) << bad;
}

}  // namespace
}  // namespace dsec
