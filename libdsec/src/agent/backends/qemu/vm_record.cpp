#include "agent/backends/qemu/vm_record.hpp"

#include <stdexcept>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::agent::qemu {

std::string encode_layers(const std::vector<layers::LayerImage>& images) {
  std::string out;
  for (const auto& l : images) out += l.file.string() + "\t" + l.data_file.string() + "\n";
  return out;
}

std::vector<layers::LayerImage> decode_layers(std::string_view kind, const std::string& text) {
  std::vector<layers::LayerImage> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    auto nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(pos, nl - pos);
    auto tab = line.find('\t');
    if (tab == std::string::npos)
      throw Error(Code::kInvalidArgument, fmt::format("{} record: malformed layer line", kind));
    out.push_back({line.substr(0, tab), line.substr(tab + 1)});
    pos = nl + 1;
  }
  return out;
}

const std::string& state_value(std::string_view kind, const BackendState& state, const char* name) {
  auto it = state.find(name);
  if (it == state.end()) throw Error(Code::kInvalidArgument, fmt::format("{} record: no {}", kind, name));
  return it->second;
}

std::uint64_t state_number(std::string_view kind, const BackendState& state, const char* name) {
  const std::string& v = state_value(kind, state, name);
  try {
    std::size_t used = 0;
    std::uint64_t n = std::stoull(v, &used);
    if (used != v.size()) throw std::invalid_argument(v);
    return n;
  } catch (const std::exception&) {
    throw Error(Code::kInvalidArgument, fmt::format("{} record: {} is not a number", kind, name));
  }
}

std::string encode_display(const DisplaySpec& display) {
  switch (display.kind) {
    case DisplaySpec::Kind::kNone:
      return "none";
    case DisplaySpec::Kind::kVga:
      return fmt::format("vga {}x{}", display.width, display.height);
    case DisplaySpec::Kind::kVirtioGpu:
      return fmt::format("virtio-gpu {}x{}", display.width, display.height);
  }
  return "none";
}

DisplaySpec decode_display(std::string_view kind, const std::string& text) {
  if (text == "none") return {};
  auto malformed = [&] {
    return Error(Code::kInvalidArgument, fmt::format("{} record: malformed display '{}'", kind, text.substr(0, 60)));
  };
  auto space = text.find(' ');
  if (space == std::string::npos) throw malformed();
  std::string device = text.substr(0, space);
  auto size = parse_display(std::string_view(text).substr(space + 1));
  if (!size || (device != "vga" && device != "virtio-gpu")) throw malformed();
  return make_display(device == "vga" ? DisplaySpec::Kind::kVga : DisplaySpec::Kind::kVirtioGpu, size->width,
                      size->height);
}

}  // namespace dsec::agent::qemu
