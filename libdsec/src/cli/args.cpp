#include "cli/args.hpp"

#include <algorithm>
#include <cstdlib>
#include <ctime>

#include <fmt/format.h>

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

namespace {

// "--name=value" or "--name value": returns the value and advances i, or nullopt if args[i] is not this option.
std::optional<std::string> take_value(const std::vector<std::string>& args, std::size_t& i, const std::string& name,
                                      const std::string& help) {
  const std::string& a = args[i];
  if (a == name) {
    if (i + 1 >= args.size()) throw UsageError(fmt::format("{} needs a value", name), help);
    return args[++i];
  }
  if (a.starts_with(name + "=")) return a.substr(name.size() + 1);
  return std::nullopt;
}

}  // namespace

bool take_global_option(const std::vector<std::string>& args, std::size_t& i, GlobalOptions& global) {
  if (auto v = take_value(args, i, "--home", {})) {
    if (v->empty()) throw UsageError("--home needs a directory");
    global.home = *v;
    return true;
  }
  if (auto v = take_value(args, i, "--endpoint", {})) {
    if (v->empty()) throw UsageError("--endpoint needs unix:/path or http://host:port");
    global.endpoint = *v;
    return true;
  }
  if (auto v = take_value(args, i, "--store", {})) {
    if (v->empty()) throw UsageError("--store needs a directory or an http(s):// URL");
    global.store = *v;
    return true;
  }
  return false;
}

bool ParsedArgs::has(const std::string& name) const {
  return values.count(name) > 0 || std::find(flags.begin(), flags.end(), name) != flags.end();
}

std::optional<std::string> ParsedArgs::get(const std::string& name) const {
  auto it = values.find(name);
  if (it == values.end() || it->second.empty()) return std::nullopt;
  return it->second.back();
}

ParsedArgs parse_args(const std::vector<std::string>& args, const std::vector<OptionSpec>& spec, GlobalOptions& global,
                      const std::string& help, std::size_t command_after) {
  ParsedArgs out;
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
      bool matched = false;
      for (const auto& opt : spec) {
        if (opt.takes_value) {
          if (auto v = take_value(args, i, opt.name, help)) {
            auto& slot = out.values[opt.name];
            if (!slot.empty() && !opt.repeatable) throw UsageError(fmt::format("{} given twice", opt.name), help);
            slot.push_back(*v);
            matched = true;
            break;
          }
        } else if (a == opt.name) {
          out.flags.push_back(opt.name);
          matched = true;
          break;
        } else if (a.starts_with(opt.name + "=")) {
          throw UsageError(fmt::format("{} takes no value", opt.name), help);
        }
      }
      if (!matched) throw UsageError(fmt::format("unknown option {}", a), help);
      continue;
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
