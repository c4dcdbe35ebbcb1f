#include "agent/backends/microvm/vm_record.hpp"

#include <stdexcept>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::agent::microvm {

std::string encode_layers(const std::vector<layers::LayerImage>& images) {
  std::string out;
  for (const auto& l : images) out += l.file.string() + "\t" + l.data_file.string() + "\n";
  return out;
}

std::vector<layers::LayerImage> decode_layers(const std::string& text) {
  std::vector<layers::LayerImage> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    auto nl = text.find('\n', pos);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(pos, nl - pos);
    auto tab = line.find('\t');
    if (tab == std::string::npos) throw Error(Code::kInvalidArgument, "microvm record: malformed layer line");
    out.push_back({line.substr(0, tab), line.substr(tab + 1)});
    pos = nl + 1;
  }
  return out;
}

const std::string& state_value(const BackendState& state, const char* name) {
  auto it = state.find(name);
  if (it == state.end()) throw Error(Code::kInvalidArgument, fmt::format("microvm record: no {}", name));
  return it->second;
}

std::uint64_t state_number(const BackendState& state, const char* name) {
  const std::string& v = state_value(state, name);
  try {
    std::size_t used = 0;
    std::uint64_t n = std::stoull(v, &used);
    if (used != v.size()) throw std::invalid_argument(v);
    return n;
  } catch (const std::exception&) {
    throw Error(Code::kInvalidArgument, fmt::format("microvm record: {} is not a number", name));
  }
}

}  // namespace dsec::agent::microvm
