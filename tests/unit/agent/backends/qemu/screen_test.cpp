// How a VM's screen is driven (agent/backends/qemu/screen), without a VM: key names to QEMU key codes, text to key
// presses on the US keymap, pixels to the tablet's absolute range, buttons and the wheel, and a PNG's size. (With a
// real QEMU: QemuRealArgv.Q35ScreenshotsAndInput.)
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "agent/backends/qemu/screen.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::qemu {
namespace {

using ::testing::ElementsAre;
using V = std::vector<std::string>;

TEST(QemuScreen, KeyCombosNameKeysAsPeopleDo) {
  EXPECT_EQ(parse_key_combo("ctrl+s"), (V{"ctrl", "s"}));
  EXPECT_EQ(parse_key_combo("Ctrl+Shift+T"), (V{"ctrl", "shift", "t"}));
  EXPECT_EQ(parse_key_combo("Return"), V{"ret"});
  EXPECT_EQ(parse_key_combo("alt+F4"), (V{"alt", "f4"}));
  EXPECT_EQ(parse_key_combo("super"), V{"meta_l"});
  EXPECT_EQ(parse_key_combo("BackSpace"), V{"backspace"});
  EXPECT_EQ(parse_key_combo("Page_Down"), V{"pgdn"});
  EXPECT_EQ(parse_key_combo("ctrl+/"), (V{"ctrl", "slash"}));
  EXPECT_EQ(parse_key_combo("+"), (V{"shift", "equal"}));
  EXPECT_EQ(parse_key_combo("ctrl++"), (V{"ctrl", "shift", "equal"}));
  for (const char* bad : {"", "ctrl+", "ctrl++a", "hyper", "F13", "f0", "ctrl+nosuch", "a+b+c+d+e+f+g+h+i"}) {
    try {
      parse_key_combo(bad);
      ADD_FAILURE() << "took '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument) << bad;
    }
  }
}

TEST(QemuScreen, TextIsTypedOnTheUsKeymap) {
  auto presses = text_to_key_presses("aZ1 !_\"~\n\t");
  ASSERT_EQ(presses.size(), 10u);
  EXPECT_EQ(presses[0], V{"a"});
  EXPECT_EQ(presses[1], (V{"shift", "z"}));
  EXPECT_EQ(presses[2], V{"1"});
  EXPECT_EQ(presses[3], V{"spc"});
  EXPECT_EQ(presses[4], (V{"shift", "1"}));
  EXPECT_EQ(presses[5], (V{"shift", "minus"}));
  EXPECT_EQ(presses[6], (V{"shift", "apostrophe"}));
  EXPECT_EQ(presses[7], (V{"shift", "grave_accent"}));
  EXPECT_EQ(presses[8], V{"ret"});
  EXPECT_EQ(presses[9], V{"tab"});
  EXPECT_TRUE(text_to_key_presses("").empty());
  try {
    text_to_key_presses("ok\xc3\xa9");
    ADD_FAILURE() << "typed a character with no key";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_THAT(e.what(), ::testing::HasSubstr("byte 2"));
  }
  EXPECT_THROW(text_to_key_presses(std::string("a\0b", 3)), Error);
}

TEST(QemuScreen, EventsForKeysPointerButtonsAndWheel) {
  auto keys = key_press_events({"ctrl", "s"});
  ASSERT_EQ(keys.size(), 4u);  // down in order, up in reverse
  EXPECT_EQ(keys[0]["data"]["key"]["data"], "ctrl");
  EXPECT_EQ(keys[0]["data"]["down"], true);
  EXPECT_EQ(keys[2]["data"]["key"]["data"], "s");
  EXPECT_EQ(keys[2]["data"]["down"], false);
  EXPECT_EQ(keys[3]["data"]["key"]["data"], "ctrl");
  // Corners of the screen are the ends of the tablet's range; the middle is its middle.
  auto corner = pointer_move_events(1279, 799, 1280, 800);
  EXPECT_EQ(corner[0]["data"]["value"], 0x7fff);
  EXPECT_EQ(corner[1]["data"]["value"], 0x7fff);
  auto origin = pointer_move_events(0, 0, 1280, 800);
  EXPECT_EQ(origin[0]["data"]["value"], 0);
  EXPECT_NEAR(pointer_move_events(640, 400, 1281, 801)[0]["data"]["value"].get<int>(), 0x7fff / 2, 1);
  EXPECT_THROW(pointer_move_events(1280, 0, 1280, 800), Error);
  EXPECT_THROW(pointer_move_events(0, 800, 1280, 800), Error);
  EXPECT_EQ(click_events("left", 2).size(), 4u);
  EXPECT_EQ(click_events("Right", 1)[0]["data"]["button"], "right");
  EXPECT_THROW(click_events("thumb", 1), Error);
  EXPECT_THROW(click_events("left", 0), Error);
  auto up = scroll_events(-2);
  ASSERT_EQ(up.size(), 4u);
  EXPECT_EQ(up[0]["data"]["button"], "wheel-up");
  EXPECT_EQ(scroll_events(1)[0]["data"]["button"], "wheel-down");
  EXPECT_THROW(scroll_events(0), Error);
  EXPECT_THROW(scroll_events(1000), Error);
}

TEST(QemuScreen, PngSizeFromItsHeader) {
  std::string png("\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR\0\0\x05\x00\0\0\x03\x20", 24);
  auto [w, h] = png_size(png);
  EXPECT_EQ(w, 1280u);
  EXPECT_EQ(h, 800u);
  EXPECT_THROW(png_size("GIF89a......................"), Error);
  EXPECT_THROW(png_size(png.substr(0, 20)), Error);
}

}  // namespace
}  // namespace dsec::agent::qemu
