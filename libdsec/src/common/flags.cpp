#include "common/flags.hpp"

#include <charconv>
#include <exception>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dsec/spec.hpp"

namespace dsec::flags {

void bad_value(std::string_view flag, std::string_view text, std::string_view expected) {
  throw FlagError(fmt::format("{}: '{}' is not {}", flag, text, expected));
}

std::uint64_t parse_unsigned(std::string_view flag, std::string_view text) {
  std::uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty())
    bad_value(flag, text, "a non-negative integer");
  return v;
}

void check_limits(std::string_view flag, std::uint64_t n, const Limits& limits, std::string_view unit) {
  if (n >= limits.min && n <= limits.max) return;
  if (!limits.expect.empty()) throw FlagError(fmt::format("{}: {} is not {}", flag, n, limits.expect));
  auto with_unit = [unit](std::uint64_t bound) {
    if (unit.empty()) return fmt::format("{}", bound);
    return fmt::format("{} {}{}", bound, unit, bound == 1 ? "" : "s");
  };
  // A maximum at the limit of the target's type is none a user would name: below the minimum says "at least".
  const bool no_max = limits.max >= std::numeric_limits<std::uint32_t>::max();
  if (no_max && n < limits.min)
    throw FlagError(fmt::format("{}: {} is not at least {}", flag, n, with_unit(limits.min)));
  if (limits.min == 0) throw FlagError(fmt::format("{}: {} is not at most {}", flag, n, with_unit(limits.max)));
  throw FlagError(fmt::format("{}: {} is not between {} and {}", flag, n, limits.min, with_unit(limits.max)));
}

Flag text_flag(std::string name, std::string arg, std::string help, Kind kind, std::string_view needs,
               std::function<void(std::string_view)> set) {
  if (!needs.empty()) {
    set = [name, needs = std::string(needs), set = std::move(set)](std::string_view v) {
      if (v.empty()) throw FlagError(fmt::format("{} needs {}", name, needs));
      set(v);
    };
  }
  return Flag{std::move(name), std::move(arg), std::move(help), kind, std::move(set)};
}

Flag unsigned_flag(std::string name, std::string arg, std::string help, Kind kind, Limits limits,
                   std::function<void(std::uint64_t)> set) {
  auto parse = [name, limits, kind, set = std::move(set)](std::string_view v) {
    std::uint64_t n = parse_unsigned(name, v);
    check_limits(name, n, limits, kind == Kind::kDuration ? "second" : "");
    set(n);
  };
  return Flag{std::move(name), std::move(arg), std::move(help), kind, std::move(parse)};
}

Flag text(std::string name, std::string arg, std::string help, std::function<void(std::string_view)> set) {
  return text_flag(std::move(name), std::move(arg), std::move(help), Kind::kString, {}, std::move(set));
}

Flag choice(std::string name, std::string arg, std::string help, std::initializer_list<std::string_view> choices,
            std::function<void(std::string_view)> set) {
  auto check = [name, words = std::vector<std::string_view>(choices), set = std::move(set)](std::string_view v) {
    if (std::find(words.begin(), words.end(), v) == words.end())
      bad_value(name, v, fmt::format("one of {}", fmt::join(words, ", ")));
    set(v);
  };
  return Flag{std::move(name), std::move(arg), std::move(help), Kind::kString, std::move(check)};
}

Flag choice(std::string name, std::string arg, std::string help, std::initializer_list<std::string_view> choices,
            std::string* target) {
  return choice(std::move(name), std::move(arg), std::move(help), choices,
                [target](std::string_view v) { *target = std::string(v); });
}

Flag number(std::string name, std::string arg, std::string help, double* target) {
  auto parse = [name, target](std::string_view v) {
    try {
      std::size_t used = 0;
      double n = std::stod(std::string(v), &used);
      if (used == v.size() && n > 0 && n < 1e6) {
        *target = n;
        return;
      }
    } catch (const std::exception&) {
    }
    bad_value(name, v, "a positive number");
  };
  return Flag{std::move(name), std::move(arg), std::move(help), Kind::kNumber, std::move(parse)};
}

Flag size(std::string name, std::string arg, std::string help, std::uint64_t* target, Limits limits) {
  auto parse = [name, target, min = limits.min, max = limits.max,
                expect =
                    std::string(limits.expect.empty() ? "a size such as 64Mi" : limits.expect)](std::string_view v) {
    auto n = dsec::parse_size(v);
    if (!n || *n < min || *n > max) bad_value(name, v, expect);
    *target = *n;
  };
  return Flag{std::move(name), std::move(arg), std::move(help), Kind::kSize, std::move(parse)};
}

Flag boolean(std::string name, std::string help, bool* target, bool value) {
  return Flag{
      std::move(name), {}, std::move(help), Kind::kBool, [target, value](std::string_view) { *target = value; }};
}

Flag action(std::string name, std::string help, std::function<void()> run) {
  return Flag{std::move(name), {}, std::move(help), Kind::kBool, [run = std::move(run)](std::string_view) { run(); }};
}

Flag repeated(std::string name, std::string arg, std::string help, std::function<void(std::string_view)> add) {
  return text_flag(std::move(name), std::move(arg), std::move(help), Kind::kRepeated, {}, std::move(add));
}

Flag repeated(std::string name, std::string arg, std::string help, std::vector<std::string>* target,
              std::string_view needs) {
  return text_flag(std::move(name), std::move(arg), std::move(help), Kind::kRepeated, needs,
                   [target](std::string_view v) { target->emplace_back(v); });
}

bool take(const Table& table, const std::vector<std::string>& args, std::size_t& i) {
  std::string_view word = args[i];
  for (const Flag& flag : table) {
    if (!word.starts_with(flag.name)) continue;
    std::string_view rest = word.substr(flag.name.size());
    if (rest.empty()) {
      if (flag.kind == Kind::kBool) {
        flag.set({});
      } else {
        if (i + 1 >= args.size()) throw FlagError(fmt::format("{} needs a value", flag.name));
        flag.set(args[++i]);
      }
      return true;
    }
    if (rest.front() != '=') continue;
    if (flag.kind == Kind::kBool) throw FlagError(fmt::format("{} takes no value", flag.name));
    flag.set(rest.substr(1));
    return true;
  }
  return false;
}

Parsed parse(const Table& table, const std::vector<std::string>& args) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "-h" || args[i] == "--help") return Parsed::kHelp;
    if (take(table, args, i)) continue;
    std::string_view word = args[i];
    if (word.starts_with("--")) word = word.substr(0, word.find('='));
    throw FlagError(fmt::format("unknown flag '{}' (see --help)", word));
  }
  return Parsed::kDone;
}

namespace {

// Appends `text` wrapped at 120 columns, its lines after the first indented to `column`; `at` is the column the
// output stands at.
void append_wrapped(std::string& out, std::string_view text, std::size_t column, std::size_t at) {
  constexpr std::size_t kWidth = 120;
  bool first = true;
  while (!text.empty()) {
    std::size_t end = text.find(' ');
    std::string_view word = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    if (word.empty()) continue;
    if (!first && at + 1 + word.size() > kWidth) {
      out += '\n';
      out.append(column, ' ');
      at = column;
    } else if (!first) {
      out += ' ';
      ++at;
    }
    out += word;
    at += word.size();
    first = false;
  }
  out += '\n';
}

}  // namespace

std::string help(const Table& table, std::size_t column) {
  std::string out;
  for (const Flag& flag : table) {
    std::string left = "  " + flag.name + (flag.arg.empty() ? "" : " " + flag.arg);
    out += left;
    if (left.size() + 1 > column) {
      out += '\n';
      out.append(column, ' ');
    } else {
      out.append(column - left.size(), ' ');
    }
    append_wrapped(out, flag.help, column, column);
  }
  return out;
}

}  // namespace dsec::flags
