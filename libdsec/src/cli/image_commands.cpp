// dsec image build | push | pull | ls | inspect | rm | gc: images in directory and HTTP stores.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "dsec/error.hpp"
#include "image/build.hpp"
#include "image/registry/import.hpp"
#include "image/registry/registry_client.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/manifest.hpp"

namespace dsec::cli {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kImageHelp = R"(usage: dsec image COMMAND [--store URL] [--home DIR] ...

  build NAME --from SOURCE [--parent IMAGE [--diff]] [--role ROLE] [--include PKG,...] [--mirror URL] [-q]
  push NAME STORE
  pull NAME STORE
  pull REGISTRY/REPOSITORY[:TAG|@DIGEST]... | --from-file LIST [-j N]
  ls [--json]
  inspect NAME
  rm NAME...
  gc [--dry-run] [--grace SECONDS]

An image is a manifest of immutable EROFS layers (roles: base, toolchain, task, snapshot), stored as zstd chunks in
a content-addressed store: a directory (also any shared filesystem), or an HTTP(S) server (reads with Range
requests; writes with PUT and DELETE, e.g. nginx's dav module). The store is --store, else $DSEC_STORE, else the
directory <home>/store (home: --home, else $DSEC_HOME, else /var/lib/dsec). Run any command with --help.
)";

constexpr std::string_view kBuildHelp = R"(usage: dsec image build NAME --from SOURCE [options]

Builds one layer from SOURCE and tags NAME ("busybox" means "busybox:latest") in the store. With --parent, the image
is the parent's layers plus the new one; the new layer holds only SOURCE, and OCI whiteouts in a tar or OCI source
hide the parent's files. With --parent and --diff (the default for busybox-static and debootstrap sources), SOURCE
is a whole root filesystem and the new layer holds only what differs from the parent: new and changed files, and
whiteouts for what SOURCE lacks. Nothing is tagged until every blob is stored, so a failed build leaves no image
behind.

SOURCE is one of:
  DIR | dir:DIR          a directory as it is (owners, modes, times, xattrs, hard links kept; device nodes,
                         sockets and mounts below it left out; overlayfs whiteouts kept)
  FILE | tar:FILE        a tar (plain, gzip, zstd, xz), '-' or tar:- for standard input; OCI whiteouts applied
  oci:PATH               an OCI image layout (skopeo copy ... oci:PATH) or a tar of one (docker save); the layers
                         are applied in order with their whiteouts and become one dsec layer
  busybox-static         a tiny image from the host's static busybox (apt-get install busybox-static)
  debootstrap:SUITE      Debian SUITE (e.g. bookworm), debootstrap --variant=minbase, from the mirror in
                         /etc/apt/sources.list*; the tree is cached under <home>/cache. Needs root and debootstrap.

Options:
  --from SOURCE          what to build from (required)
  --parent IMAGE         build on this image (in the same store)
  --diff                 with --parent: keep only SOURCE's difference from the parent (needs root)
  --role ROLE            base, toolchain, task or snapshot (default: base, or task with --parent)
  --include PKG,...      debootstrap: extra Debian packages, e.g. --include python3,git (repeatable)
  --mirror URL           debootstrap: the Debian archive to use instead of apt's
  --busybox PATH         busybox-static: the binary to use (default /bin/busybox)
  --max-size SIZE        tar and OCI sources: the most file content they may unpack to (default 64Gi)
  -q, --quiet            no progress output

Examples:
  dsec image build busybox --from busybox-static
  dsec image build debian:bookworm --from debootstrap:bookworm --include python3
  dsec image build py:dev --parent debian:bookworm --role toolchain --from ./toolchain-root
  dsec image build cc --parent debian:bookworm --role toolchain --from debootstrap:bookworm \
      --include python3,build-essential
  dsec image build swe/task-17 --parent py:dev --from tar:task-17.tar.gz
  dsec image build app --from oci:./app-oci
)";

constexpr std::string_view kPushHelp = R"(usage: dsec image push NAME STORE [-q]

Copies image NAME from the store (--store) to STORE (a directory or an http(s):// URL): the blobs STORE lacks, then
the manifest, then the tag. Blobs are content-addressed, so layers STORE has already are not sent again.
)";

constexpr std::string_view kPullHelp = R"(usage: dsec image pull NAME STORE [-q]
       dsec image pull REFERENCE... [registry options] [-q]
       dsec image pull --from-file LIST [-j N] [registry options]

With NAME and STORE: copies image NAME from STORE (a directory or an http(s):// URL) into the store (--store). Nodes
do not need this: they stream the chunks a sandbox reads; pull makes a whole local copy.

With REFERENCEs of OCI registries (the first part names a host: "registry.example:5000/swebench/task:v1",
"localhost/app@sha256:..."; with --default-registry also bare names): imports each image into the store, one dsec
layer per OCI layer (layers the store has from other images are not fetched again), keeping the image's
configuration (Env, Entrypoint, Cmd, WorkingDir, User, ...). Agents import on first use too; pulling ahead makes the
first create fast. --from-file reads one reference per line ('#' starts a comment) and imports -j at a time.

Registry options:
  --registry-auth HOST=USER:PASSWORD   credentials for a registry (repeatable); else ~/.docker/config.json's
  --registry-mirror HOST=URL           ask this mirror first for HOST's images (repeatable)
  --insecure-registry HOST             plain HTTP for HOST when HTTPS fails (loopback registries always may)
  --registry-ca FILE                   CA bundle to trust for registries
  --default-registry HOST              where bare names come from (docker.io: "python:3.12" is
                                       docker.io/library/python:3.12)
  --platform OS/ARCH                   the image to take from a multi-platform index (default linux/amd64)
  --max-size SIZE                      the most file content one layer may unpack to (default 64Gi)
  -j, --jobs N                         with --from-file: images imported at once (default 4)
)";

constexpr std::string_view kLsHelp = R"(usage: dsec image ls [--json] [--all]

Lists the images in the store: name, layers, size, creation time and source. --json prints a JSON array. --all also
lists the layers imports converted from registries (oci-layer/sha256:...), each kept by a tag of its own.
)";

constexpr std::string_view kInspectHelp = R"(usage: dsec image inspect NAME

Prints an image's manifest as JSON, with its digest.
)";

constexpr std::string_view kRmHelp = R"(usage: dsec image rm NAME...

Removes image tags from the store. Fails (status 1) if any of them does not exist; the others are still removed.
The blobs stay until `dsec image gc`: other images may share them.
)";

constexpr std::string_view kGcHelp = R"(usage: dsec image gc [--dry-run] [--grace SECONDS]

Removes the blobs of the store that no tagged image needs. Blobs written in the last --grace seconds (default 600)
are kept, so an image being built or pushed at the same time loses nothing. --dry-run only lists them.
)";

std::unique_ptr<image::BlobStore> open_store(const GlobalOptions& global) {
  return image::open_store(global.resolved_store());
}

// Progress on a terminal: one line rewritten in place, at most ten times a second.
class ProgressLine {
 public:
  explicit ProgressLine(bool enabled) : enabled_(enabled && ::isatty(STDERR_FILENO)) {}
  ~ProgressLine() { finish(); }

  image::ProgressFn fn() {
    if (!enabled_) return {};
    return [this](std::string_view what, std::uint64_t done, std::uint64_t total) { update(what, done, total); };
  }

  void finish() {
    if (shown_) std::fputs("\r\033[K", stderr);
    shown_ = false;
  }

 private:
  void update(std::string_view what, std::uint64_t done, std::uint64_t total) {
    auto now = std::chrono::steady_clock::now();
    if (shown_ && done != total && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    if (!shown_) started_ = now;
    const double seconds = std::chrono::duration<double>(now - started_).count();
    std::string rate =
        seconds > 0.5 && done > 0
            ? fmt::format(", {}/s", human_bytes(static_cast<unsigned long long>(static_cast<double>(done) / seconds)))
            : std::string();
    std::string line = total > 0 ? fmt::format("{}: {:3.0f}% of {}{}", what,
                                               100.0 * static_cast<double>(done) / static_cast<double>(total),
                                               human_bytes(total), rate)
                                 : std::string(what);
    fmt::print(stderr, "\r\033[K{}", line.substr(0, 110));
    std::fflush(stderr);
    shown_ = true;
  }

  bool enabled_;
  bool shown_ = false;
  std::chrono::steady_clock::time_point last_{}, started_{};
};

nlohmann::json to_json(const image::ResolvedManifest& image) {
  nlohmann::json j = nlohmann::json::parse(image.json);
  j["digest"] = image.digest;
  j["reference"] = image.reference.to_string();
  j["size"] = image.manifest.size();
  j["stored_size"] = image.manifest.stored_size();
  return j;
}

std::string elapsed_text(double seconds) {
  if (seconds < 60) return fmt::format("{:.1f}s", seconds);
  int s = static_cast<int>(std::lround(seconds));
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

std::uint64_t parse_size_option(const std::string& text, const std::string& help) {
  std::size_t pos = 0;
  unsigned long long n = 0;
  try {
    n = std::stoull(text, &pos);
  } catch (const std::exception&) {
    throw UsageError(fmt::format("--max-size: '{}' is not a size", text), help);
  }
  std::string unit = text.substr(pos);
  int shift = 0;
  if (unit == "Ki" || unit == "K") shift = 10;
  else if (unit == "Mi" || unit == "M") shift = 20;
  else if (unit == "Gi" || unit == "G") shift = 30;
  else if (unit == "Ti" || unit == "T") shift = 40;
  else if (!unit.empty()) throw UsageError(fmt::format("--max-size: unknown unit '{}'", unit), help);
  return static_cast<std::uint64_t>(n) << shift;
}

template <typename Fn>
int with_help(const std::vector<std::string>& args, const std::vector<OptionSpec>& spec, GlobalOptions& global,
              std::string_view help_text, Fn&& fn) {
  const std::string help(help_text);
  ParsedArgs p = parse_args(args, spec, global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  return fn(p, help);
}

int image_build(const std::vector<std::string>& args, GlobalOptions& global) {
  return with_help(
      args,
      {{"--from", true},
       {"--parent", true},
       {"--diff", false},
       {"--role", true},
       {"--include", true, true},
       {"--mirror", true},
       {"--busybox", true},
       {"--max-size", true},
       {"-q", false},
       {"--quiet", false}},
      global, kBuildHelp, [&](const ParsedArgs& p, const std::string& help) {
        if (p.positional.size() != 1)
          throw UsageError(p.positional.empty() ? "image build needs a NAME" : "image build takes one NAME", help);
        auto from = p.get("--from");
        if (!from || from->empty()) throw UsageError("image build needs --from SOURCE", help);
        image::BuildOptions options;
        options.reference = image::parse_reference(p.positional[0]).tagged();  // a bad name fails before any work
        options.source = image::LayerSource::parse(*from);
        const bool is_debootstrap = options.source.kind == image::LayerSource::Kind::kDebootstrap;
        const bool is_busybox = options.source.kind == image::LayerSource::Kind::kBusybox;
        if (p.has("--include") && !is_debootstrap)
          throw UsageError("--include only applies to --from debootstrap:SUITE", help);
        if (p.has("--mirror") && !is_debootstrap)
          throw UsageError("--mirror only applies to --from debootstrap:SUITE", help);
        if (p.has("--busybox") && !is_busybox)
          throw UsageError("--busybox only applies to --from busybox-static", help);
        if (auto role = p.get("--role")) options.role = image::parse_layer_role(*role);
        options.parent = p.get("--parent").value_or("");
        if (p.has("--diff")) {
          if (options.parent.empty()) throw UsageError("--diff needs --parent IMAGE", help);
          options.diff = true;
        }
        options.include_packages =
            split_commas(p.values.count("--include") ? p.values.at("--include") : std::vector<std::string>{});
        options.mirror = p.get("--mirror").value_or("");
        options.busybox = p.get("--busybox").value_or("/bin/busybox");
        if (auto max = p.get("--max-size")) options.max_bytes = parse_size_option(*max, help);
        const fs::path home = global.resolved_home();
        options.cache_dir = home / "cache";
        std::string store_url = global.resolved_store();
        // Scratch space on the store's filesystem when the store is a directory (the finished data blob is then
        // linked into place, not copied), else under home.
        bool directory_store = store_url.find("://") == std::string::npos || store_url.starts_with("file://");
        options.work_dir = directory_store
                               ? fs::path(store_url.starts_with("file://") ? store_url.substr(7) : store_url) / ".tmp"
                               : home / "tmp";
        const bool quiet = p.has("-q") || p.has("--quiet");
        ProgressLine progress(!quiet);
        if (!quiet)
          options.log = [&](std::string_view line) {
            progress.finish();
            fmt::print(stderr, "{}\n", line);
          };
        options.progress = progress.fn();

        auto store = image::open_store(store_url);
        auto started = std::chrono::steady_clock::now();
        image::BuildResult r = image::build_image(*store, options);
        progress.finish();
        double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
        const image::Manifest& m = r.image.manifest;
        fmt::print("built {} in {}: layer {} ({}, {} as EROFS, {} stored{}), {} layer{} in all\n",
                   r.image.reference.to_string(), elapsed_text(seconds), r.layer.digest.substr(0, 19),
                   to_string(r.layer.role), human_bytes(r.layer.size), human_bytes(r.layer.stored_size),
                   std::string(r.diff ? ", the difference from the parent" : "") +
                       (r.layer_existed ? ", already in the store" : ""),
                   m.layers.size(), m.layers.size() == 1 ? "" : "s");
        return 0;
      });
}

int copy_command(const std::vector<std::string>& args, GlobalOptions& global, std::string_view help_text, bool push) {
  return with_help(args, {{"-q", false}, {"--quiet", false}}, global, help_text,
                   [&](const ParsedArgs& p, const std::string& help) {
                     if (p.positional.size() != 2)
                       throw UsageError(fmt::format("image {} needs NAME and STORE", push ? "push" : "pull"), help);
                     image::ImageReference ref = image::parse_reference(p.positional[0]);
                     auto local = open_store(global);
                     auto other = image::open_store(p.positional[1]);
                     image::BlobStore& from = push ? *local : *other;
                     image::BlobStore& to = push ? *other : *local;
                     ProgressLine progress(!(p.has("-q") || p.has("--quiet")));
                     auto started = std::chrono::steady_clock::now();
                     std::uint64_t bytes = image::copy_image(from, to, ref, progress.fn());
                     progress.finish();
                     double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
                     fmt::print("{} {} {} {}: {} copied in {}\n", push ? "pushed" : "pulled", ref.to_string(),
                                push ? "to" : "from", other->url(), human_bytes(bytes), elapsed_text(seconds));
                     return 0;
                   });
}

// Scratch space on the store's filesystem when the store is a directory (finished blobs are then linked into
// place, not copied), else under home.
fs::path scratch_for(const GlobalOptions& global) {
  std::string store_url = global.resolved_store();
  bool directory_store = store_url.find("://") == std::string::npos || store_url.starts_with("file://");
  return directory_store ? fs::path(store_url.starts_with("file://") ? store_url.substr(7) : store_url) / ".tmp"
                         : fs::path(global.resolved_home()) / "tmp";
}

std::vector<std::string> references_in(const std::string& file) {
  std::FILE* f = file == "-" ? stdin : std::fopen(file.c_str(), "r");
  if (!f) throw Error(Code::kNotFound, fmt::format("--from-file {}: {}", file, std::strerror(errno)));
  std::vector<std::string> out;
  char* line = nullptr;
  std::size_t cap = 0;
  while (::getline(&line, &cap, f) >= 0) {
    std::string text(line);
    text = text.substr(0, text.find('#'));
    auto first = text.find_first_not_of(" \t\r\n");
    if (first == std::string::npos) continue;
    text = text.substr(first, text.find_last_not_of(" \t\r\n") - first + 1);
    out.push_back(text);
  }
  std::free(line);
  if (f != stdin) std::fclose(f);
  return out;
}

int registry_pull(const ParsedArgs& p, GlobalOptions& global, const std::string& help) {
  namespace reg = image::registry;
  reg::RegistryFlags flags;
  auto all = [&](const char* name) { return p.values.count(name) ? p.values.at(name) : std::vector<std::string>{}; };
  flags.auth = all("--registry-auth");
  flags.mirrors = all("--registry-mirror");
  flags.insecure = all("--insecure-registry");
  flags.ca_file = p.get("--registry-ca").value_or("");
  flags.platform = p.get("--platform").value_or("");
  reg::RegistryClient client(reg::registry_options(flags));
  const std::string default_registry = p.get("--default-registry").value_or("");
  std::vector<std::string> refs = p.positional;
  if (auto list = p.get("--from-file")) {
    auto more = references_in(*list);
    refs.insert(refs.end(), more.begin(), more.end());
  }
  if (refs.empty()) throw UsageError("image pull needs a REFERENCE or --from-file LIST", help);
  std::vector<image::ImageReference> parsed;
  for (const auto& r : refs) {
    image::ImageReference ref = reg::with_default_registry(image::parse_reference(r), default_registry);
    if (ref.registry().empty())
      throw UsageError(fmt::format("'{}' names no registry host (REGISTRY/REPOSITORY[:TAG]); to copy from a dsec "
                                   "store: dsec image pull NAME STORE; or give --default-registry",
                                   r),
                       help);
    parsed.push_back(std::move(ref));
  }
  int jobs = 4;
  if (auto j = p.get("-j") ? p.get("-j") : p.get("--jobs")) {
    try {
      jobs = std::stoi(*j);
    } catch (const std::exception&) {
      jobs = 0;
    }
    if (jobs < 1 || jobs > 64) throw UsageError("-j needs a number from 1 to 64", help);
  }
  const std::uint64_t max_bytes = p.get("--max-size") ? parse_size_option(*p.get("--max-size"), help) : 64ull << 30;
  auto store = open_store(global);
  const bool quiet = p.has("-q") || p.has("--quiet");
  const bool one_at_a_time = parsed.size() == 1 || jobs == 1;
  std::mutex out_mu;
  std::atomic<std::size_t> next{0};
  std::atomic<int> failures{0};
  auto worker = [&] {
    for (;;) {
      std::size_t i = next.fetch_add(1);
      if (i >= parsed.size()) return;
      reg::ImportOptions options;
      options.work_dir = scratch_for(global);
      options.max_bytes = max_bytes;
      ProgressLine progress(!quiet && one_at_a_time);
      options.progress = progress.fn();
      try {
        reg::ImportResult r = reg::import_image(client, *store, parsed[i], options);
        progress.finish();
        std::lock_guard lock(out_mu);
        fmt::print("pulled {} in {}: {} layer{} ({} converted, {} stored before), {} downloaded, as {}\n",
                   r.image.reference.tagged(), elapsed_text(r.seconds), r.image.manifest.layers.size(),
                   r.image.manifest.layers.size() == 1 ? "" : "s", r.layers_converted, r.layers_reused,
                   human_bytes(r.bytes_downloaded), r.image.digest);
        std::fflush(stdout);
      } catch (const Error& e) {
        progress.finish();
        std::lock_guard lock(out_mu);
        fmt::print(stderr, "dsec: {}: {}: {}\n", parsed[i].to_string(), e.code_name(), e.what());
        ++failures;
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 1; t < std::min<int>(jobs, static_cast<int>(parsed.size())); ++t) threads.emplace_back(worker);
  worker();
  for (auto& t : threads) t.join();
  return failures ? kExitFailure : 0;
}

int pull_command(const std::vector<std::string>& args, GlobalOptions& global) {
  return with_help(args,
                   {{"-q", false},
                    {"--quiet", false},
                    {"--registry-auth", true, true},
                    {"--registry-mirror", true, true},
                    {"--insecure-registry", true, true},
                    {"--registry-ca", true},
                    {"--default-registry", true},
                    {"--platform", true},
                    {"--max-size", true},
                    {"--from-file", true},
                    {"-j", true},
                    {"--jobs", true}},
                   global, kPullHelp, [&](const ParsedArgs& p, const std::string& help) {
                     // NAME STORE: a copy between dsec stores, when STORE is one (a path or a URL), not a reference.
                     auto names_registry = [](const std::string& text) {
                       try {
                         return !image::parse_reference(text).registry().empty();
                       } catch (const Error&) {
                         return false;  // a path or a URL
                       }
                     };
                     const bool store_copy = p.positional.size() == 2 && !p.has("--from-file") &&
                                             !p.has("--default-registry") && !names_registry(p.positional[0]) &&
                                             !names_registry(p.positional[1]);
                     if (store_copy) {
                       std::vector<std::string> copy_args = p.positional;
                       if (p.has("-q") || p.has("--quiet")) copy_args.push_back("-q");
                       return copy_command(copy_args, global, kPullHelp, false);
                     }
                     return registry_pull(p, global, help);
                   });
}

int image_ls(const std::vector<std::string>& args, GlobalOptions& global) {
  return with_help(
      args, {{"--json", false}, {"--all", false}}, global, kLsHelp, [&](const ParsedArgs& p, const std::string& help) {
        if (!p.positional.empty()) throw UsageError("image ls takes no arguments", help);
        auto store = open_store(global);
        std::vector<image::ResolvedManifest> images;
        std::vector<std::string> damaged;
        for (const auto& tagged : store->list_refs()) {
          if (image::is_oci_layer_ref(tagged) && !p.has("--all")) continue;
          try {
            images.push_back(image::fetch_manifest(*store, image::parse_reference(tagged)));
          } catch (const Error& e) {
            if (e.code() == Code::kUnavailable) throw;
            damaged.push_back(fmt::format("{}: {}", tagged, e.what()));
          }
        }
        if (p.has("--json")) {
          nlohmann::json out = nlohmann::json::array();
          for (const auto& image : images) out.push_back(to_json(image));
          fmt::print("{}\n", out.dump(2));
        } else {
          std::size_t width = 4;
          for (const auto& i : images) width = std::max(width, i.reference.tagged().size());
          fmt::print("{:<{}}  {:<15}  {:>6}  {:>10}  {:>10}  {:<19}  {}\n", "NAME", width, "DIGEST", "LAYERS", "SIZE",
                     "STORED", "CREATED", "SOURCE");
          for (const auto& i : images)
            fmt::print("{:<{}}  {:<15}  {:>6}  {:>10}  {:>10}  {:<19}  {}\n", i.reference.tagged(), width,
                       i.digest.substr(7, 12), i.manifest.layers.size(), human_bytes(i.manifest.size()),
                       human_bytes(i.manifest.stored_size()), local_time(i.manifest.created_at), i.manifest.source);
        }
        for (const auto& d : damaged) fmt::print(stderr, "dsec: damaged image {}\n", d);
        return damaged.empty() ? 0 : kExitFailure;
      });
}

int image_inspect(const std::vector<std::string>& args, GlobalOptions& global) {
  return with_help(args, {}, global, kInspectHelp, [&](const ParsedArgs& p, const std::string& help) {
    if (p.positional.size() != 1) throw UsageError("image inspect takes one NAME", help);
    auto store = open_store(global);
    fmt::print("{}\n", to_json(image::fetch_manifest(*store, image::parse_reference(p.positional[0]))).dump(2));
    return 0;
  });
}

int image_rm(const std::vector<std::string>& args, GlobalOptions& global) {
  return with_help(args, {}, global, kRmHelp, [&](const ParsedArgs& p, const std::string& help) {
    if (p.positional.empty()) throw UsageError("image rm needs at least one NAME", help);
    auto store = open_store(global);
    int status = 0;
    for (const auto& name : p.positional) {
      try {
        image::ImageReference ref = image::parse_reference(name);
        if (!store->remove_ref(ref.tagged()))
          throw Error(Code::kNotFound, fmt::format("image {} is not in store {}", ref.tagged(), store->url()));
        fmt::print("removed {}\n", ref.tagged());
      } catch (const Error& e) {
        fmt::print(stderr, "dsec: {}: {}\n", e.code_name(), e.what());
        status = kExitFailure;
      }
    }
    return status;
  });
}

int image_gc(const std::vector<std::string>& args, GlobalOptions& global) {
  return with_help(args, {{"--dry-run", false}, {"--grace", true}}, global, kGcHelp,
                   [&](const ParsedArgs& p, const std::string& help) {
                     if (!p.positional.empty()) throw UsageError("image gc takes no arguments", help);
                     long grace = 600;
                     if (auto g = p.get("--grace")) {
                       try {
                         grace = std::stol(*g);
                       } catch (const std::exception&) {
                         throw UsageError("--grace needs a number of seconds", help);
                       }
                       if (grace < 0) throw UsageError("--grace needs a number of seconds", help);
                     }
                     auto store = open_store(global);
                     const bool dry = p.has("--dry-run");
                     image::GcResult r = image::collect_garbage(*store, std::chrono::seconds(grace), dry);
                     for (const auto& d : r.removed) fmt::print("{} {}\n", dry ? "would remove" : "removed", d);
                     for (const auto& d : r.damaged_refs)
                       fmt::print(stderr, "dsec: damaged image {} (its blobs are kept)\n", d);
                     fmt::print("{} {} blobs ({}), kept {}\n", dry ? "would remove" : "removed", r.removed.size(),
                                human_bytes(r.removed_bytes), r.kept);
                     return 0;
                   });
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
  if (sub == "push") return copy_command(rest, global, kPushHelp, true);
  if (sub == "pull") return pull_command(rest, global);
  if (sub == "ls" || sub == "list") return image_ls(rest, global);
  if (sub == "inspect") return image_inspect(rest, global);
  if (sub == "rm" || sub == "remove") return image_rm(rest, global);
  if (sub == "gc") return image_gc(rest, global);
  throw UsageError(fmt::format("unknown image command '{}'", sub), help);
}

}  // namespace dsec::cli
