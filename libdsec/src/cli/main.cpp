// dsec: the command-line tool. Image commands work on the node's local image store directly; sandbox commands talk
// to a node agent through dsec::Client.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "dsec/error.hpp"
#include "dsec/version.hpp"

namespace dsec::cli {
namespace {

constexpr std::string_view kHead = R"(usage: dsec [--home DIR] [--endpoint URL] [--store URL] COMMAND [ARGS...]

dsec drives dsec sandboxes and image stores.

Image commands (on an image store: --store, else $DSEC_STORE, else the directory <home>/store):
  image build NAME --from SOURCE   build an image layer (SOURCE: a directory, a tar, an OCI image, busybox-static,
                                   debootstrap:SUITE), optionally on top of --parent IMAGE
  image push NAME STORE            copy an image to another store (a directory or an http(s):// URL)
  image pull NAME STORE            copy an image from another store
  image ls                         list images
  image inspect NAME               show one image's manifest as JSON
  image rm NAME...                 remove image tags
  image gc                         remove blobs no image needs

Node access:
  token new TENANT [--admin]       make a bearer token and its line for dsecd --tokens
  token hash                       the SHA-256 of a token read on stdin

Sandbox commands (through a node agent):
  ps                               list sandboxes
  run IMAGE -- CMD...              create a sandbox, run CMD in it, destroy it
  exec ID -- CMD...                run CMD in an existing sandbox
  rm ID...                         destroy sandboxes
  snapshot ID NAME                 capture a sandbox's files as a new image NAME
  screenshot ID FILE               a PNG of a full VM's screen
  vnc ID [--stop]                  a VNC endpoint to watch a full VM's screen
  node                             show the node's capacity, load and images

Global options:
)";

constexpr std::string_view kTail = R"(  -h, --help        help (also after any command: dsec image build --help)
  --version         print dsec's version

Exit status: 0 success, 1 the operation failed (the message names the error code), 2 bad usage. `run` and `exec`
exit with the command's own status (128+N when a signal N ended it, 124 when it timed out) and with 125 when dsec
itself failed.
)";

std::string usage() {
  GlobalOptions unused;
  return fmt::format("{}{}{}", kHead, flags::help(global_flags(unused), 20), kTail);
}

int print_version() {
  fmt::print("dsec {} (protocol {})\n", dsec::kVersion, dsec::kProtocolVersion);
  return 0;
}

}  // namespace

int main_impl(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  GlobalOptions global;
  // Global options may come before the command; the command's parser also accepts them anywhere.
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      fmt::print("{}", usage());
      return 0;
    }
    if (a == "--version") return print_version();
    if (!take_global_option(args, i, global)) break;
  }
  if (i >= args.size()) {
    fmt::print(stderr, "{}", usage());
    return kExitUsage;
  }
  std::string command = args[i];
  std::vector<std::string> rest(args.begin() + static_cast<std::ptrdiff_t>(i + 1), args.end());

  if (command == "image") return image_command(rest, global);
  if (command == "token") return token_command(rest);
  if (command == "version") return print_version();
  if (command == "help") {
    fmt::print("{}", usage());
    return 0;
  }
  if (auto code = sandbox_command(command, rest, global)) return *code;
  fmt::print(stderr, "dsec: unknown command '{}'\n\n{}", command, usage());
  return kExitUsage;
}

}  // namespace dsec::cli

int main(int argc, char** argv) {
  try {
    return dsec::cli::main_impl(argc, argv);
  } catch (const dsec::cli::UsageError& e) {
    fmt::print(stderr, "dsec: {}\n", e.what());
    // The usage line only; the whole help is one --help away.
    if (!e.help().empty()) {
      std::string_view help = e.help();
      fmt::print(stderr, "{}\n(--help for more)\n", help.substr(0, help.find("\n\n")));
    }
    return dsec::cli::kExitUsage;
  } catch (const dsec::Error& e) {
    fmt::print(stderr, "dsec: {}: {}\n", e.code_name(), e.what());
    return dsec::cli::kExitFailure;
  } catch (const std::exception& e) {
    fmt::print(stderr, "dsec: INTERNAL: {}\n", e.what());
    return dsec::cli::kExitFailure;
  }
}
