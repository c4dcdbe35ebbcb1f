// dsec image build | ls | inspect | rm: the node's local image store.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "dsec/error.hpp"
#include "image/store.hpp"

namespace dsec::cli {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kImageHelp = R"(usage: dsec image COMMAND [--home DIR] ...

  build NAME --from SOURCE [--include PKG,...] [--mirror URL] [--busybox PATH] [-q]
  ls [--json]
  inspect NAME
  rm NAME...

Images live in <home>/images (home: --home, else $DSEC_HOME, else /var/lib/dsec). Run any of them with --help.
)";

constexpr std::string_view kBuildHelp = R"(usage: dsec image build NAME --from SOURCE [options]

Builds image NAME ("busybox" means "busybox:latest") into the store, replacing an image of that name. The build
happens in a temporary directory and is renamed into place, so a failed build leaves no image behind.

SOURCE is one of:
  DIR                    a copy of directory DIR (modes, owners, symlinks and hard links kept; device nodes skipped)
  busybox-static         a tiny image from the host's static busybox (apt-get install busybox-static)
  debootstrap:SUITE      Debian SUITE (e.g. bookworm), debootstrap --variant=minbase, from the Debian mirror in
                         /etc/apt/sources.list*; the tree is cached under <home>/cache so a rebuild does not
                         download again. Needs root and debootstrap.
  (a directory that happens to be named like the words above: write it as ./busybox-static)

Options:
  --from SOURCE          what to build from (required)
  --include PKG,...      debootstrap: extra Debian packages, e.g. --include python3,git (repeatable)
  --mirror URL           debootstrap: the Debian archive to use instead of apt's
  --busybox PATH         busybox-static: the binary to use (default /bin/busybox)
  -q, --quiet            no progress output
  --home DIR             dsec's state directory

Examples:
  dsec image build busybox --from busybox-static
  dsec image build python:bookworm --from debootstrap:bookworm --include python3
  dsec image build myapp:v1 --from ./rootfs
)";

constexpr std::string_view kLsHelp = R"(usage: dsec image ls [--json] [--home DIR]

Lists the images in the store: name, size, creation time and source. --json prints a JSON array.
)";

constexpr std::string_view kInspectHelp = R"(usage: dsec image inspect NAME [--home DIR]

Prints one image's record as JSON: name, directory, layers, size, creation time, source and build notes.
)";

constexpr std::string_view kRmHelp = R"(usage: dsec image rm NAME... [--home DIR]

Removes images from the store. Fails (status 1) if any of them does not exist; the others are still removed.
)";

image::ImageStore open_store(const GlobalOptions& global) {
  return image::ImageStore(fs::path(global.resolved_home()) / "images");
}

nlohmann::json to_json(const image::ImageRecord& r) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& l : r.layers) layers.push_back(l.string());
  return {{"name", r.name},         {"dir", r.dir.string()},     {"layers", layers},
          {"size_bytes", r.size_bytes}, {"created_at", r.created_at}, {"source", r.source},
          {"notes", r.notes}};
}

std::string elapsed_text(double seconds) {
  if (seconds < 60) return fmt::format("{:.1f}s", seconds);
  int s = static_cast<int>(seconds + 0.5);
  return fmt::format("{}m{:02d}s", s / 60, s % 60);
}

std::vector<std::string> split_commas(const std::vector<std::string>& values) {
  std::vector<std::string> out;
  for (const auto& v : values) {
    std::size_t start = 0;
    while (start <= v.size()) {
      std::size_t comma = v.find(',', start);
      std::string part = v.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
      if (!part.empty()) out.push_back(part);
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  }
  return out;
}

int image_build(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help(kBuildHelp);
  ParsedArgs p = parse_args(args,
                            {{"--from", true},
                             {"--include", true, true},
                             {"--mirror", true},
                             {"--busybox", true},
                             {"-q", false},
                             {"--quiet", false}},
                            global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (p.positional.size() != 1)
    throw UsageError(p.positional.empty() ? "image build needs a NAME" : "image build takes one NAME", help);
  auto from = p.get("--from");
  if (!from || from->empty()) throw UsageError("image build needs --from SOURCE", help);
  const std::string& name = p.positional[0];
  image::normalize_name(name);  // a bad name is an error before anything is built

  bool is_debootstrap = from->starts_with("debootstrap:");
  bool is_busybox = *from == "busybox-static";
  if (p.has("--include") && !is_debootstrap) throw UsageError("--include only applies to --from debootstrap:SUITE", help);
  if (p.has("--mirror") && !is_debootstrap) throw UsageError("--mirror only applies to --from debootstrap:SUITE", help);
  if (p.has("--busybox") && !is_busybox) throw UsageError("--busybox only applies to --from busybox-static", help);

  image::ImageStore store = open_store(global);
  bool quiet = p.has("-q") || p.has("--quiet");
  if (!quiet) store.set_log([](std::string_view line) { fmt::print(stderr, "{}\n", line); });

  auto started = std::chrono::steady_clock::now();
  image::ImageRecord record;
  if (is_debootstrap) {
    std::string suite = from->substr(std::string_view("debootstrap:").size());
    if (suite.empty()) throw UsageError("--from debootstrap:SUITE needs a suite, e.g. debootstrap:bookworm", help);
    auto includes = split_commas(p.values.count("--include") ? p.values.at("--include") : std::vector<std::string>{});
    record = store.build_debootstrap(name, suite, includes, p.get("--mirror").value_or(""));
  } else if (is_busybox) {
    record = store.build_busybox(name, p.get("--busybox").value_or("/bin/busybox"));
  } else {
    record = store.build_from_directory(name, *from);
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  fmt::print("built {} ({}) in {}: {}\n", record.name, human_bytes(record.size_bytes), elapsed_text(seconds),
             record.dir.string());
  return 0;
}

int image_ls(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help(kLsHelp);
  ParsedArgs p = parse_args(args, {{"--json", false}}, global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (!p.positional.empty()) throw UsageError("image ls takes no arguments", help);
  auto images = open_store(global).list();
  if (p.has("--json")) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& r : images) out.push_back(to_json(r));
    fmt::print("{}\n", out.dump(2));
    return 0;
  }
  std::size_t width = 4;
  for (const auto& r : images) width = std::max(width, r.name.size());
  fmt::print("{:<{}}  {:>10}  {:<19}  {}\n", "NAME", width, "SIZE", "CREATED", "SOURCE");
  for (const auto& r : images)
    fmt::print("{:<{}}  {:>10}  {:<19}  {}\n", r.name, width, human_bytes(r.size_bytes), local_time(r.created_at),
               r.source);
  return 0;
}

int image_inspect(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help(kInspectHelp);
  ParsedArgs p = parse_args(args, {}, global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (p.positional.size() != 1) throw UsageError("image inspect takes one NAME", help);
  fmt::print("{}\n", to_json(open_store(global).resolve(p.positional[0])).dump(2));
  return 0;
}

int image_rm(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help(kRmHelp);
  ParsedArgs p = parse_args(args, {}, global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (p.positional.empty()) throw UsageError("image rm needs at least one NAME", help);
  image::ImageStore store = open_store(global);
  int status = 0;
  for (const auto& name : p.positional) {
    try {
      store.remove(name);
      fmt::print("removed {}\n", image::normalize_name(name));
    } catch (const Error& e) {
      fmt::print(stderr, "dsec: {}: {}\n", e.code_name(), e.what());
      status = kExitFailure;
    }
  }
  return status;
}

}  // namespace

int image_command(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help(kImageHelp);
  std::size_t i = 0;
  for (; i < args.size(); ++i) {
    if (args[i] == "-h" || args[i] == "--help") {
      fmt::print("{}", help);
      return 0;
    }
    if (!take_global_option(args, i, global)) break;
  }
  if (i >= args.size()) throw UsageError("image needs a command", help);
  const std::string& sub = args[i];
  std::vector<std::string> rest(args.begin() + static_cast<std::ptrdiff_t>(i + 1), args.end());
  if (sub == "build") return image_build(rest, global);
  if (sub == "ls" || sub == "list") return image_ls(rest, global);
  if (sub == "inspect") return image_inspect(rest, global);
  if (sub == "rm" || sub == "remove") return image_rm(rest, global);
  throw UsageError(fmt::format("unknown image command '{}'", sub), help);
}

}  // namespace dsec::cli
