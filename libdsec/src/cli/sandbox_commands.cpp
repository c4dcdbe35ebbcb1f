// dsec ps | run | exec | rm | node: sandboxes through a node agent.
#include "cli/commands.hpp"

namespace dsec::cli {

std::optional<int> sandbox_command(const std::string& command, const std::vector<std::string>& args,
                                   GlobalOptions& global) {
  return std::nullopt;
}

}  // namespace dsec::cli
