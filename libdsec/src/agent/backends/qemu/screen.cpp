#include "agent/backends/qemu/screen.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <map>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::qemu {
namespace {

using nlohmann::json;

constexpr std::string_view kPngSignature("\x89PNG\r\n\x1a\n", 8);
constexpr std::uint32_t kAbsMax = 0x7fff;  // QEMU's absolute axis range
// The fd set screenshots go through: far above the ones qemu_command numbers from 1 for a VM's disks and console.
constexpr std::int64_t kScreenshotFdSet = 4096;

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// Key names (lower case) -> QEMU key codes (qapi's QKeyCode). Letters and digits are their own codes.
const std::map<std::string, std::string, std::less<>>& key_names() {
  static const std::map<std::string, std::string, std::less<>> kNames = {
      {"ctrl", "ctrl"},
      {"control", "ctrl"},
      {"ctrl_l", "ctrl"},
      {"ctrl_r", "ctrl_r"},
      {"shift", "shift"},
      {"shift_l", "shift"},
      {"shift_r", "shift_r"},
      {"alt", "alt"},
      {"alt_l", "alt"},
      {"alt_r", "alt_r"},
      {"altgr", "alt_r"},
      {"super", "meta_l"},
      {"super_l", "meta_l"},
      {"super_r", "meta_r"},
      {"meta", "meta_l"},
      {"win", "meta_l"},
      {"cmd", "meta_l"},
      {"return", "ret"},
      {"enter", "ret"},
      {"kp_enter", "kp_enter"},
      {"escape", "esc"},
      {"esc", "esc"},
      {"backspace", "backspace"},
      {"tab", "tab"},
      {"space", "spc"},
      {"delete", "delete"},
      {"del", "delete"},
      {"insert", "insert"},
      {"home", "home"},
      {"end", "end"},
      {"page_up", "pgup"},
      {"pageup", "pgup"},
      {"prior", "pgup"},
      {"page_down", "pgdn"},
      {"pagedown", "pgdn"},
      {"next", "pgdn"},
      {"up", "up"},
      {"down", "down"},
      {"left", "left"},
      {"right", "right"},
      {"caps_lock", "caps_lock"},
      {"capslock", "caps_lock"},
      {"print", "print"},
      {"menu", "menu"},
      {"minus", "minus"},
      {"equal", "equal"},
      {"bracketleft", "bracket_left"},
      {"bracket_left", "bracket_left"},
      {"bracketright", "bracket_right"},
      {"bracket_right", "bracket_right"},
      {"backslash", "backslash"},
      {"semicolon", "semicolon"},
      {"apostrophe", "apostrophe"},
      {"grave", "grave_accent"},
      {"grave_accent", "grave_accent"},
      {"comma", "comma"},
      {"period", "dot"},
      {"dot", "dot"},
      {"slash", "slash"},
      {"-", "minus"},
      {"=", "equal"},
      {"[", "bracket_left"},
      {"]", "bracket_right"},
      {"\\", "backslash"},
      {";", "semicolon"},
      {"'", "apostrophe"},
      {"`", "grave_accent"},
      {",", "comma"},
      {".", "dot"},
      {"/", "slash"},
  };
  return kNames;
}

std::string key_code(std::string_view name) {
  std::string n = lower(name);
  if (n.size() == 1 && (std::isalnum(static_cast<unsigned char>(n[0])))) return n;
  if (n.size() >= 2 && n.size() <= 3 && n[0] == 'f' && std::all_of(n.begin() + 1, n.end(), ::isdigit)) {
    int f = std::stoi(n.substr(1));
    if (f >= 1 && f <= 12) return n;
  }
  auto it = key_names().find(n);
  if (it == key_names().end())
    throw Error(Code::kInvalidArgument,
                fmt::format("key: '{}' is not a key this knows (letters, digits, F1-F12, ctrl, shift, alt, super, "
                            "Return, Escape, BackSpace, Tab, space, Delete, Home, End, Page_Up, Page_Down, Up, "
                            "Down, Left, Right, and punctuation by name)",
                            name));
  return it->second;
}

json key_event(const std::string& qcode, bool down) {
  return {{"type", "key"}, {"data", {{"down", down}, {"key", {{"type", "qcode"}, {"data", qcode}}}}}};
}

json button_event(const std::string& button, bool down) {
  return {{"type", "btn"}, {"data", {{"down", down}, {"button", button}}}};
}

}  // namespace

std::string screenshot_png(QmpClient& qmp, std::chrono::milliseconds timeout, std::size_t max_bytes) {
  UniqueFd memfd(static_cast<int>(::memfd_create("dsec-screen", MFD_CLOEXEC)));
  if (!memfd) throw_errno(errno, "memfd_create for a screenshot");
  // QEMU opens /dev/fdset/N with the access mode it needs (write-only) and finds a descriptor of that mode in the set.
  UniqueFd writable(::open(fmt::format("/proc/self/fd/{}", memfd.get()).c_str(), O_WRONLY | O_CLOEXEC));
  if (!writable) throw_errno(errno, "reopen the screenshot's memfd");
  // Always the same fd set: QEMU 7.2 never frees a set screendump has opened (its entry stays after remove-fd), so a
  // new set per screenshot would grow QEMU by one per screenshot. The descriptor itself goes with remove-fd (closed by
  // QEMU at once while the VM runs, and when it runs again if it is stopped).
  json added = qmp.execute_with_fds("add-fd", {{"fdset-id", kScreenshotFdSet}}, {writable.get()}, timeout);
  const std::int64_t fd_in_qemu = added.at("fd").get<std::int64_t>();
  struct RemoveFd {
    QmpClient& qmp;
    std::int64_t fd;
    std::chrono::milliseconds timeout;
    ~RemoveFd() {
      try {
        qmp.execute("remove-fd", {{"fdset-id", kScreenshotFdSet}, {"fd", fd}}, timeout);
      } catch (...) {
      }
    }
  } remove{qmp, fd_in_qemu, timeout};
  try {
    qmp.execute("screendump", {{"filename", fmt::format("/dev/fdset/{}", kScreenshotFdSet)}, {"format", "png"}},
                timeout);
  } catch (const QmpError& e) {
    // QEMU 7.2 without a display: "There is no console to take a screendump from".
    if (lower(e.what()).find("no console") != std::string::npos)
      throw Error(Code::kFailedPrecondition, "this VM has no screen (create it with a display)");
    throw;
  }
  struct stat st {};
  if (::fstat(memfd.get(), &st) != 0) throw_errno(errno, "stat the screenshot");
  if (static_cast<std::uint64_t>(st.st_size) > max_bytes)
    throw Error(Code::kInternal,
                fmt::format("the screenshot is {} bytes, more than the {} allowed", st.st_size, max_bytes));
  std::string png(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t done = 0;
  while (done < png.size()) {
    ssize_t n = retry_eintr(
        [&] { return ::pread(memfd.get(), png.data() + done, png.size() - done, static_cast<off_t>(done)); });
    if (n <= 0) throw_errno(n < 0 ? errno : EIO, "read the screenshot");
    done += static_cast<std::size_t>(n);
  }
  try {
    (void)png_size(png);
  } catch (const Error&) {
    throw Error(Code::kInternal, "QEMU's screenshot is not a PNG");
  }
  return png;
}

std::pair<std::uint32_t, std::uint32_t> png_size(std::string_view png) {
  // The signature, then the IHDR chunk: length (13), "IHDR", width, height (big-endian).
  if (png.size() < 24 || png.substr(0, 8) != kPngSignature || png.substr(12, 4) != "IHDR")
    throw Error(Code::kInvalidArgument, "not a PNG");
  auto be32 = [&](std::size_t at) {
    return static_cast<std::uint32_t>(static_cast<unsigned char>(png[at])) << 24 |
           static_cast<std::uint32_t>(static_cast<unsigned char>(png[at + 1])) << 16 |
           static_cast<std::uint32_t>(static_cast<unsigned char>(png[at + 2])) << 8 |
           static_cast<std::uint32_t>(static_cast<unsigned char>(png[at + 3]));
  };
  return {be32(16), be32(20)};
}

std::vector<std::string> parse_key_combo(std::string_view combo) {
  std::vector<std::string> codes;
  if (combo.empty()) throw Error(Code::kInvalidArgument, "key: empty");
  // "+" alone, or a combination ending in "++", is the plus key: shift and '=' on the US keymap.
  std::size_t start = 0;
  while (start <= combo.size()) {
    std::size_t plus = combo.find('+', start);
    if (plus == start && plus + 1 == combo.size()) {  // a trailing "+" key
      codes.push_back("shift");
      codes.push_back("equal");
      break;
    }
    std::string_view part = combo.substr(start, plus == std::string_view::npos ? std::string_view::npos : plus - start);
    if (part.empty()) throw Error(Code::kInvalidArgument, fmt::format("key: '{}' has an empty key in it", combo));
    codes.push_back(key_code(part));
    if (plus == std::string_view::npos) break;
    start = plus + 1;
  }
  if (codes.size() > 8) throw Error(Code::kInvalidArgument, fmt::format("key: '{}' holds more than 8 keys", combo));
  return codes;
}

std::vector<std::vector<std::string>> text_to_key_presses(std::string_view text) {
  static const std::string kShifted = "~!@#$%^&*()_+{}|:\"<>?";
  static const std::string kUnshifted = "`1234567890-=[]\\;',./";
  std::vector<std::vector<std::string>> presses;
  presses.reserve(text.size());
  for (std::size_t i = 0; i < text.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '\n') {
      presses.push_back({"ret"});
    } else if (c == '\t') {
      presses.push_back({"tab"});
    } else if (c == ' ') {
      presses.push_back({"spc"});
    } else if (std::islower(c) || std::isdigit(c)) {
      presses.push_back({std::string(1, static_cast<char>(c))});
    } else if (std::isupper(c)) {
      presses.push_back({"shift", std::string(1, static_cast<char>(std::tolower(c)))});
    } else if (auto at = kShifted.find(static_cast<char>(c)); at != std::string::npos) {
      presses.push_back({"shift", key_code(std::string(1, kUnshifted[at]))});
    } else if (kUnshifted.find(static_cast<char>(c)) != std::string::npos) {
      presses.push_back({key_code(std::string(1, static_cast<char>(c)))});
    } else {
      throw Error(Code::kInvalidArgument,
                  fmt::format("text: the character at byte {} (0x{:02x}) has no key on the US keymap (printable "
                              "ASCII, newline and tab can be typed)",
                              i, c));
    }
  }
  return presses;
}

json key_press_events(const std::vector<std::string>& qcodes) {
  json events = json::array();
  for (const auto& k : qcodes) events.push_back(key_event(k, true));
  for (auto it = qcodes.rbegin(); it != qcodes.rend(); ++it) events.push_back(key_event(*it, false));
  return events;
}

json pointer_move_events(std::uint32_t x, std::uint32_t y, std::uint32_t width, std::uint32_t height) {
  if (width == 0 || height == 0 || x >= width || y >= height)
    throw Error(Code::kInvalidArgument,
                fmt::format("({}, {}) is outside the {}x{} screen (x from 0 to {}, y from 0 to {})", x, y, width,
                            height, width ? width - 1 : 0, height ? height - 1 : 0));
  auto scale = [](std::uint32_t v, std::uint32_t size) {
    return size <= 1
               ? 0u
               : static_cast<std::uint32_t>((static_cast<std::uint64_t>(v) * kAbsMax + (size - 1) / 2) / (size - 1));
  };
  return json::array({{{"type", "abs"}, {"data", {{"axis", "x"}, {"value", scale(x, width)}}}},
                      {{"type", "abs"}, {"data", {{"axis", "y"}, {"value", scale(y, height)}}}}});
}

json click_events(std::string_view button, int count) {
  std::string b = lower(button);
  if (b != "left" && b != "middle" && b != "right")
    throw Error(Code::kInvalidArgument, fmt::format("button: '{}' is not left, middle or right", button));
  if (count < 1 || count > 3) throw Error(Code::kInvalidArgument, "clicks: 1 to 3 (3: a triple click)");
  json events = json::array();
  for (int i = 0; i < count; ++i) {
    events.push_back(button_event(b, true));
    events.push_back(button_event(b, false));
  }
  return events;
}

json scroll_events(int notches) {
  if (notches == 0 || notches < -100 || notches > 100)
    throw Error(Code::kInvalidArgument, "scroll: 1 to 100 notches either way (negative: up)");
  const std::string wheel = notches < 0 ? "wheel-up" : "wheel-down";
  json events = json::array();
  for (int i = 0; i < std::abs(notches); ++i) {
    events.push_back(button_event(wheel, true));
    events.push_back(button_event(wheel, false));
  }
  return events;
}

void send_input(QmpClient& qmp, const json& events, std::chrono::milliseconds timeout) {
  try {
    qmp.execute("input-send-event", {{"events", events}}, timeout);
  } catch (const QmpError& e) {
    if (lower(e.what()).find("not running") != std::string::npos)
      throw Error(Code::kFailedPrecondition, "the VM is not running (asleep or paused): it takes no input");
    throw;
  }
}

}  // namespace dsec::agent::qemu
