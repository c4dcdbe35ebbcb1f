#include "cli/args.hpp"

#include <algorithm>
#include <cstdlib>
#include <ctime>

#include <fmt/format.h>

#include "common/flags.hpp"

namespace dsec::cli {

std::string GlobalOptions::resolved_home() const {
  if (!home.empty()) return home;
  if (const char* env = std::getenv("DSEC_HOME"); env && *env) return env;
  return "/var/lib/dsec";
}

std::string GlobalOptions::resolved_endpoint() const {
  if (!endpoint.empty()) return endpoint;
  if (const char* env = std::getenv("DSEC_ENDPOINT"); env && *env) return env;
  return {};
}

std::string GlobalOptions::resolved_store() const {
  if (!store.empty()) return store;
  if (const char* env = std::getenv("DSEC_STORE"); env && *env) return env;
  return resolved_home() + "/store";
}

flags::Table global_flags(GlobalOptions& global) {
  return {
      flags::text("--home", "DIR", "dsec's state directory (default: $DSEC_HOME, else /var/lib/dsec)", &global.home,
                  "a directory"),
      flags::text("--store", "URL",
                  "image store: a directory (also a shared filesystem) or http(s)://host/path (default: $DSEC_STORE, "
                  "else DIR/store)",
                  &global.store, "a directory or an http(s):// URL"),
      flags::text("--endpoint", "URL",
                  "node agent: unix:/path/to/dsecd.sock or http://host:port (default: $DSEC_ENDPOINT; without one, "
                  "sandbox commands start a private agent on DIR for the duration of the command)",
                  &global.endpoint, "unix:/path or http://host:port"),
  };
}

bool take_global_option(const std::vector<std::string>& args, std::size_t& i, GlobalOptions& global) {
  try {
    return flags::take(global_flags(global), args, i);
  } catch (const flags::FlagError& e) {
    throw UsageError(e.what());
  }
}

bool ParsedArgs::has(const std::string& name) const {
  return values.count(name) > 0 || std::find(flags.begin(), flags.end(), name) != flags.end();
}

std::optional<std::string> ParsedArgs::get(const std::string& name) const {
  auto it = values.find(name);
  if (it == values.end() || it->second.empty()) return std::nullopt;
  return it->second.back();
}

namespace {

// A command's options as flags that record themselves in `out`: values in order given (a single option given twice
// is an error), options without values by name.
flags::Table command_flags(const std::vector<OptionSpec>& spec, ParsedArgs& out) {
  flags::Table table;
  for (const OptionSpec& opt : spec) {
    const std::string& name = opt.name;
    if (!opt.takes_value) {
      table.push_back(flags::action(name, {}, [&out, name] { out.flags.push_back(name); }));
      continue;
    }
    auto add = [&out, name, repeatable = opt.repeatable](std::string_view value) {
      auto& slot = out.values[name];
      if (!slot.empty() && !repeatable) throw flags::FlagError(fmt::format("{} given twice", name));
      slot.emplace_back(value);
    };
    table.push_back(opt.repeatable ? flags::repeated(name, "VALUE", {}, add) : flags::text(name, "VALUE", {}, add));
  }
  return table;
}

}  // namespace

ParsedArgs parse_args(const std::vector<std::string>& args, const std::vector<OptionSpec>& spec, GlobalOptions& global,
                      const std::string& help, std::size_t command_after) {
  ParsedArgs out;
  const flags::Table table = command_flags(spec, out);
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      out.saw_dashdash = true;
      out.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i + 1), args.end());
      break;
    }
    // Past the positionals, options are still options (dsec run IMAGE --workdir DIR CMD); the first word that is
    // not one starts the command.
    if (command_after > 0 && out.positional.size() >= command_after && !(a.size() > 1 && a[0] == '-')) {
      out.command.assign(args.begin() + static_cast<std::ptrdiff_t>(i), args.end());
      break;
    }
    if (a == "-h" || a == "--help") {
      out.help = true;
      continue;
    }
    if (a.size() > 1 && a[0] == '-') {
      if (take_global_option(args, i, global)) continue;
      try {
        if (flags::take(table, args, i)) continue;
      } catch (const flags::FlagError& e) {
        throw UsageError(e.what(), help);
      }
      throw UsageError(fmt::format("unknown option {}", a), help);
    }
    out.positional.push_back(a);
  }
  return out;
}

std::string human_bytes(unsigned long long bytes) {
  constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", bytes) : fmt::format("{:.1f} {}", v, kUnits[u]);
}

std::string local_time(double unix_seconds) {
  if (unix_seconds <= 0) return "-";
  std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  localtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", &tm);
  return buf;
}

}  // namespace dsec::cli
