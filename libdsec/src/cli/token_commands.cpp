// dsec token new|hash: bearer tokens for dsecd --tokens (http/tokens.hpp). The token is printed once; the
// node keeps only its hash.
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "http/tokens.hpp"

namespace dsec::cli {

namespace {

constexpr std::string_view kTokenHelp = R"(usage: dsec token new TENANT [--admin]
       dsec token hash < TOKEN

  new TENANT    makes a token for TENANT and prints it, and the line for dsecd's --tokens file
                (TENANT ROLE SHA256); the file keeps only the hash, so keep the token where the trainer reads it
                (ClientOptions::token, dsec.Client(token=...), $DSEC_TOKEN)
  --admin       an admin token: it sees every tenant's sandboxes (TENANT may be '-')
  hash          reads a token on stdin and prints its SHA-256, as the file wants it
)";

}  // namespace

int token_command(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    fmt::print("{}", kTokenHelp);
    return args.empty() ? kExitUsage : 0;
  }
  if (args[0] == "hash") {
    std::string token;
    std::getline(std::cin, token);
    while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
    if (token.empty()) throw UsageError("token hash: no token on stdin", std::string(kTokenHelp));
    fmt::print("{}\n", agent::auth::hex(agent::auth::hash_token(token)));
    return 0;
  }
  if (args[0] == "new") {
    bool admin = false;
    std::string tenant;
    for (std::size_t i = 1; i < args.size(); ++i) {
      if (args[i] == "--admin") admin = true;
      else if (tenant.empty()) tenant = args[i];
      else throw UsageError(fmt::format("token new: unexpected '{}'", args[i]), std::string(kTokenHelp));
    }
    if (tenant.empty()) throw UsageError("token new: name the tenant", std::string(kTokenHelp));
    if (!(admin && tenant == "-")) agent::auth::check_tenant_name(tenant);
    std::string token = agent::auth::new_token();
    fmt::print("token: {}\nline:  {} {} {}\n", token, tenant, admin ? "admin" : "tenant",
               agent::auth::hex(agent::auth::hash_token(token)));
    return 0;
  }
  throw UsageError(fmt::format("token: unknown subcommand '{}'", args[0]), std::string(kTokenHelp));
}

}  // namespace dsec::cli
