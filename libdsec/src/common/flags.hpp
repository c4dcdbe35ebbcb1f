// Command-line flags, one table per program: each flag's name, what its value is, its help text and where the value
// goes. dsecd, dsec and dsec-e2b parse with it: "--flag value" and "--flag=value", --help made from the table, and
// errors that name the flag and what it expected.
//
//   std::string listen;
//   std::uint64_t max_body = 256 << 20;
//   flags::Table table{
//       flags::text("--listen", "HOST:PORT", "where to serve", &listen),
//       flags::size("--max-body", "BYTES", "largest request body", &max_body, {.min = 1}),
//   };
//   if (flags::parse(table, args) == flags::Parsed::kHelp) print(flags::help(table));
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <limits>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::flags {

// Bad command-line input; the message names the flag and what it expected. The programs print it and exit 2.
class FlagError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// How a flag's value is read.
enum class Kind {
  kString,    // text (a choice among a few words, a path, a list the program splits)
  kInt,       // a non-negative integer
  kNumber,    // a positive real number, such as an overcommit ratio
  kSize,      // bytes as dsec::parse_size reads them: 512, 64Ki, 20Gi
  kDuration,  // whole seconds
  kBool,      // takes no value: given means set
  kRepeated,  // may be given again; each value is kept, in order
};

struct Flag {
  std::string name;  // "--listen" (or "-q")
  std::string arg;   // the value's name in --help ("HOST:PORT"); empty for kBool
  std::string help;  // what --help says of it: one paragraph, wrapped when printed
  Kind kind = Kind::kString;
  // Checks the value's text and stores it; throws FlagError. A kBool flag's is called with "".
  std::function<void(std::string_view value)> set;
};

using Table = std::vector<Flag>;

// The bounds of a number and, optionally, how its errors describe what was expected ("a size such as 16Gi").
struct Limits {
  std::uint64_t min = 0;
  std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
  std::string_view expect = {};
};

// "--flag: 'text' is not <expected>"
[[noreturn]] void bad_value(std::string_view flag, std::string_view text, std::string_view expected);
// Digits only, as a non-negative integer; else "--flag: 'text' is not a non-negative integer".
std::uint64_t parse_unsigned(std::string_view flag, std::string_view text);
// Checks n against limits: "--flag: N is not between MIN and MAX<unit>" (or at least MIN, at most MAX).
void check_limits(std::string_view flag, std::uint64_t n, const Limits& limits, std::string_view unit = {});

// Text into *target (a string or a path). With `needs`, an empty value is an error: "--flag needs <needs>".
Flag text(std::string name, std::string arg, std::string help, std::function<void(std::string_view)> set);
template <typename T>
Flag text(std::string name, std::string arg, std::string help, T* target, std::string_view needs = {});
// One of a few words.
Flag choice(std::string name, std::string arg, std::string help, std::initializer_list<std::string_view> choices,
            std::function<void(std::string_view)> set);
Flag choice(std::string name, std::string arg, std::string help, std::initializer_list<std::string_view> choices,
            std::string* target);
template <std::integral T>
Flag integer(std::string name, std::string arg, std::string help, T* target, Limits limits = {});
// A positive real number below a million: "--flag: 'text' is not a positive number".
Flag number(std::string name, std::string arg, std::string help, double* target);
// "--flag: 'text' is not <limits.expect>" when it is not a size or is out of limits.
Flag size(std::string name, std::string arg, std::string help, std::uint64_t* target, Limits limits = {});
template <typename Rep, typename Period>
Flag seconds(std::string name, std::string arg, std::string help, std::chrono::duration<Rep, Period>* target,
             Limits limits = {});
// Given: *target = value.
Flag boolean(std::string name, std::string help, bool* target, bool value = true);
// Given: `run` runs (--version prints and exits).
Flag action(std::string name, std::string help, std::function<void()> run);
Flag repeated(std::string name, std::string arg, std::string help, std::function<void(std::string_view)> add);
Flag repeated(std::string name, std::string arg, std::string help, std::vector<std::string>* target,
              std::string_view needs = {});

// If args[i] is a flag of the table ("--name", "--name=value", or "--name" and its value in args[i + 1]), sets it,
// leaves i on the last word it used and returns true. False for a word the table does not know. A missing value
// ("--name needs a value"), a value given to a kBool ("--name takes no value") or a bad value throws FlagError.
bool take(const Table& table, const std::vector<std::string>& args, std::size_t& i);

enum class Parsed { kDone, kHelp };
// Every word must be a flag of the table; "-h" or "--help" stops at once with kHelp. Anything else is FlagError
// ("unknown flag '--x' (see --help)").
Parsed parse(const Table& table, const std::vector<std::string>& args);

// --help's lines for the table: "  --name ARG", then its help from `column` (on a line of its own when the name is
// too long), wrapped at 120 columns.
std::string help(const Table& table, std::size_t column = 26);

// Implementation of the templates.

Flag text_flag(std::string name, std::string arg, std::string help, Kind kind, std::string_view needs,
               std::function<void(std::string_view)> set);
Flag unsigned_flag(std::string name, std::string arg, std::string help, Kind kind, Limits limits,
                   std::function<void(std::uint64_t)> set);

template <typename T>
Flag text(std::string name, std::string arg, std::string help, T* target, std::string_view needs) {
  return text_flag(std::move(name), std::move(arg), std::move(help), Kind::kString, needs,
                   [target](std::string_view v) { *target = T(std::string(v)); });
}

template <std::integral T>
Flag integer(std::string name, std::string arg, std::string help, T* target, Limits limits) {
  limits.max = std::min<std::uint64_t>(limits.max, static_cast<std::uint64_t>(std::numeric_limits<T>::max()));
  return unsigned_flag(std::move(name), std::move(arg), std::move(help), Kind::kInt, limits,
                       [target](std::uint64_t n) { *target = static_cast<T>(n); });
}

template <typename Rep, typename Period>
Flag seconds(std::string name, std::string arg, std::string help, std::chrono::duration<Rep, Period>* target,
             Limits limits) {
  return unsigned_flag(std::move(name), std::move(arg), std::move(help), Kind::kDuration, limits,
                       [target](std::uint64_t n) { *target = std::chrono::seconds(n); });
}

}  // namespace dsec::flags
