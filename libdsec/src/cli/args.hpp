// Command-line parsing for dsec: global options, per-command options, usage errors that carry the command's help.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/flags.hpp"

namespace dsec::cli {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// Bad command-line usage: printed with the command's help, exit status 2.
class UsageError : public std::runtime_error {
 public:
  UsageError(const std::string& message, std::string help = {}) : std::runtime_error(message), help_(std::move(help)) {}
  const std::string& help() const noexcept { return help_; }

 private:
  std::string help_;
};

struct GlobalOptions {
  std::string home;      // --home; empty: $DSEC_HOME, else /var/lib/dsec
  std::string endpoint;  // --endpoint; empty: $DSEC_ENDPOINT, else an embedded agent
  std::string store;     // --store; empty: $DSEC_STORE, else the directory store <home>/store
  std::string resolved_home() const;
  std::string resolved_endpoint() const;
  std::string resolved_store() const;
};

// The global options as flags into `global` (--help lists them from here).
flags::Table global_flags(GlobalOptions& global);

// If args[i] is a global option (--home DIR, --endpoint URL, --store URL, each also as --name=value), stores it,
// advances i past its value and returns true.
bool take_global_option(const std::vector<std::string>& args, std::size_t& i, GlobalOptions& global);

struct OptionSpec {
  std::string name;  // "--from"
  bool takes_value = false;
  bool repeatable = false;
};

struct ParsedArgs {
  std::vector<std::string> positional;
  std::map<std::string, std::vector<std::string>> values;  // options with values, in order given
  std::vector<std::string> flags;                          // options without values
  std::vector<std::string> command;                        // everything after "--"
  bool saw_dashdash = false;
  bool help = false;

  bool has(const std::string& name) const;
  std::optional<std::string> get(const std::string& name) const;
};

// Parses a command's arguments. Global options are accepted anywhere before "--". Unknown options, missing values
// and repeated single options are UsageErrors carrying `help`. With command_after > 0, the first word after that
// many positionals that is not an option starts the command (as "--" does), so `dsec exec ID ls -l` needs no "--"
// and `dsec run IMAGE --workdir /w make` takes --workdir as the option it is; a command that starts with "-" needs
// "--".
ParsedArgs parse_args(const std::vector<std::string>& args, const std::vector<OptionSpec>& spec, GlobalOptions& global,
                      const std::string& help, std::size_t command_after = 0);

// "12.3 MiB"
std::string human_bytes(unsigned long long bytes);
// "2025-05-20 14:03:11" in local time, "-" for 0.
std::string local_time(double unix_seconds);

}  // namespace dsec::cli
