// dsec's command groups.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "cli/args.hpp"

namespace dsec::cli {

// dsec image build|ls|inspect|rm ...
int image_command(const std::vector<std::string>& args, GlobalOptions& global);

// dsec token new|hash: bearer tokens for dsecd --tokens.
int token_command(const std::vector<std::string>& args);

// dsec ps|run|exec|rm|node ...; nullopt when `command` is not one of them.
std::optional<int> sandbox_command(const std::string& command, const std::vector<std::string>& args,
                                   GlobalOptions& global);

}  // namespace dsec::cli
