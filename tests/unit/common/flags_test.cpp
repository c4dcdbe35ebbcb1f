// common/flags: each kind of value, both forms, the errors and --help.
#include "common/flags.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dsec::flags {
namespace {

struct Options {
  std::string name;
  std::filesystem::path dir;
  std::uint32_t count = 7;
  double ratio = 1.0;
  std::uint64_t bytes = 0;
  std::chrono::milliseconds wait{0};
  bool quiet = false;
  bool color = true;
  std::vector<std::string> stores;
  std::string mode = "auto";
};

Table table_for(Options& o) {
  return {
      text("--name", "NAME", "what it is called", &o.name, "a name"),
      text("--dir", "DIR", "where it lives", &o.dir),
      integer("--count", "N", "how many", &o.count, {.min = 1, .max = 100}),
      number("--ratio", "R", "how much more", &o.ratio),
      size("--bytes", "SIZE", "how big", &o.bytes, {.min = 1 << 20, .expect = "a size of at least 1Mi"}),
      seconds("--wait", "SECS", "how long", &o.wait, {.min = 1, .max = 3600}),
      boolean("--quiet", "say less", &o.quiet),
      boolean("--no-color", "plain text", &o.color, false),
      repeated("--store", "URL", "an image store; repeatable", &o.stores, "a directory or URL"),
      choice("--mode", "MODE", "auto, on or off", {"auto", "on", "off"}, &o.mode),
  };
}

// Parses args into fresh Options; the FlagError's message when there is one.
std::string parse_error(const std::vector<std::string>& args) {
  Options o;
  try {
    parse(table_for(o), args);
  } catch (const FlagError& e) {
    return e.what();
  }
  return "";
}

TEST(Flags, EveryKindInBothForms) {
  Options o;
  Table t = table_for(o);
  EXPECT_EQ(parse(t, {"--name", "a", "--dir=/tmp/x", "--count", "12", "--ratio=2.5", "--bytes", "64Mi", "--wait=30",
                      "--quiet", "--no-color", "--store", "s1", "--store=s2", "--mode=off"}),
            Parsed::kDone);
  EXPECT_EQ(o.name, "a");
  EXPECT_EQ(o.dir, "/tmp/x");
  EXPECT_EQ(o.count, 12u);
  EXPECT_DOUBLE_EQ(o.ratio, 2.5);
  EXPECT_EQ(o.bytes, 64u << 20);
  EXPECT_EQ(o.wait, std::chrono::seconds(30));
  EXPECT_TRUE(o.quiet);
  EXPECT_FALSE(o.color);
  EXPECT_EQ(o.stores, (std::vector<std::string>{"s1", "s2"}));
  EXPECT_EQ(o.mode, "off");
}

TEST(Flags, LaterValuesReplaceEarlierOnesAndValuesMayLookLikeFlags) {
  Options o;
  Table t = table_for(o);
  parse(t, {"--dir", "a", "--dir", "--quiet", "--dir=", "--count=3", "--count", "4"});
  EXPECT_EQ(o.dir, "");  // "--dir=" gives an empty value, which --dir accepts
  EXPECT_FALSE(o.quiet);
  EXPECT_EQ(o.count, 4u);
  parse(t, {"--dir", "--quiet"});
  EXPECT_EQ(o.dir, "--quiet");
}

TEST(Flags, ErrorsNameTheFlagAndWhatItExpected) {
  EXPECT_EQ(parse_error({"--count", "x"}), "--count: 'x' is not a non-negative integer");
  EXPECT_EQ(parse_error({"--count", "-1"}), "--count: '-1' is not a non-negative integer");
  EXPECT_EQ(parse_error({"--count", "0"}), "--count: 0 is not between 1 and 100");
  EXPECT_EQ(parse_error({"--count=101"}), "--count: 101 is not between 1 and 100");
  EXPECT_EQ(parse_error({"--count", "4294967296"}), "--count: 4294967296 is not between 1 and 100");
  EXPECT_EQ(parse_error({"--ratio", "0"}), "--ratio: '0' is not a positive number");
  EXPECT_EQ(parse_error({"--ratio", "2x"}), "--ratio: '2x' is not a positive number");
  EXPECT_EQ(parse_error({"--bytes", "lots"}), "--bytes: 'lots' is not a size of at least 1Mi");
  EXPECT_EQ(parse_error({"--bytes", "12"}), "--bytes: '12' is not a size of at least 1Mi");
  EXPECT_EQ(parse_error({"--wait", "0"}), "--wait: 0 is not between 1 and 3600 seconds");
  EXPECT_EQ(parse_error({"--wait", "1m"}), "--wait: '1m' is not a non-negative integer");
  EXPECT_EQ(parse_error({"--mode", "maybe"}), "--mode: 'maybe' is not one of auto, on, off");
  EXPECT_EQ(parse_error({"--name="}), "--name needs a name");
  EXPECT_EQ(parse_error({"--store", ""}), "--store needs a directory or URL");
  EXPECT_EQ(parse_error({"--quiet=yes"}), "--quiet takes no value");
  EXPECT_EQ(parse_error({"--name"}), "--name needs a value");
  EXPECT_EQ(parse_error({"--bogus"}), "unknown flag '--bogus' (see --help)");
  EXPECT_EQ(parse_error({"--bogus=1"}), "unknown flag '--bogus' (see --help)");
  EXPECT_EQ(parse_error({"--names", "x"}), "unknown flag '--names' (see --help)");
  EXPECT_EQ(parse_error({"stray"}), "unknown flag 'stray' (see --help)");
}

TEST(Flags, RangesWithOneBound) {
  std::uint64_t n = 0;
  std::chrono::seconds s{0};
  Table t{integer("--queue", "N", "", &n, {.min = 1}), integer("--pool", "N", "", &n, {.max = 1000}),
          integer("--vms", "N", "", &n, {.max = 10, .expect = "at most 10 VMs per shape"}),
          seconds("--idle", "SECS", "", &s, {.min = 1}), seconds("--grace", "SECS", "", &s, {.min = 5})};
  auto error = [&t](std::vector<std::string> args) {
    try {
      parse(t, args);
    } catch (const FlagError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error({"--queue", "0"}), "--queue: 0 is not at least 1");
  EXPECT_EQ(error({"--pool", "1001"}), "--pool: 1001 is not at most 1000");
  EXPECT_EQ(error({"--vms", "11"}), "--vms: 11 is not at most 10 VMs per shape");
  EXPECT_EQ(error({"--idle", "0"}), "--idle: 0 is not at least 1 second");
  EXPECT_EQ(error({"--grace", "4"}), "--grace: 4 is not at least 5 seconds");
  EXPECT_EQ(error({"--queue", "18446744073709551615"}), "");
  EXPECT_EQ(n, 18446744073709551615ull);
}

TEST(Flags, HelpStopsParsing) {
  Options o;
  Table t = table_for(o);
  EXPECT_EQ(parse(t, {"--count", "3", "--help", "--bogus"}), Parsed::kHelp);
  EXPECT_EQ(o.count, 3u);
  EXPECT_EQ(parse(t, {"-h"}), Parsed::kHelp);
  EXPECT_EQ(parse(t, {"--name", "--help"}), Parsed::kDone);  // a value, not a request for help
  EXPECT_EQ(o.name, "--help");
}

TEST(Flags, TakeLeavesWhatItDoesNotKnow) {
  Options o;
  Table t = table_for(o);
  std::vector<std::string> args{"--count", "5", "positional", "--other", "--quiet"};
  std::size_t i = 0;
  EXPECT_TRUE(take(t, args, i));
  EXPECT_EQ(i, 1u);
  i = 2;
  EXPECT_FALSE(take(t, args, i));
  i = 3;
  EXPECT_FALSE(take(t, args, i));
  i = 4;
  EXPECT_TRUE(take(t, args, i));
  EXPECT_EQ(i, 4u);
  EXPECT_EQ(o.count, 5u);
  EXPECT_TRUE(o.quiet);
}

TEST(Flags, ActionsAndCustomSetters) {
  int runs = 0;
  std::vector<std::string> seen;
  Table t{action("--version", "print the version", [&runs] { ++runs; }),
          repeated("--label", "K=V", "a label", [&seen](std::string_view v) {
            if (v.find('=') == std::string_view::npos) bad_value("--label", v, "KEY=VALUE");
            seen.emplace_back(v);
          })};
  parse(t, {"--version", "--label", "a=1", "--label=b=2"});
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(seen, (std::vector<std::string>{"a=1", "b=2"}));
  try {
    parse(t, {"--label", "novalue"});
    FAIL() << "no error";
  } catch (const FlagError& e) {
    EXPECT_STREQ(e.what(), "--label: 'novalue' is not KEY=VALUE");
  }
}

TEST(Flags, HelpListsTheTable) {
  std::string dir;
  bool quiet = false;
  Table t{text("--dir", "DIR", "where it lives", &dir), boolean("--quiet", "say less", &quiet),
          text("--a-rather-long-flag", "VALUE", "its help goes on a line of its own", &dir),
          text("--wrapped", "W", std::string(30, 'x') + " " + std::string(60, 'y') + " " + std::string(20, 'z'), &dir)};
  EXPECT_EQ(help(t, 20),
            "  --dir DIR         where it lives\n"
            "  --quiet           say less\n"
            "  --a-rather-long-flag VALUE\n"
            "                    its help goes on a line of its own\n"
            "  --wrapped W       " +
                std::string(30, 'x') + " " + std::string(60, 'y') + "\n" + std::string(20, ' ') + std::string(20, 'z') +
                "\n");
}

}  // namespace
}  // namespace dsec::flags
