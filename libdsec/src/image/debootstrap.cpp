#include "image/debootstrap.hpp"

#include <sys/stat.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include <fmt/format.h>

#include "common/syscall.hpp"
#include "dsec/error.hpp"
#include "image/fs_tree.hpp"
#include "image/process.hpp"
#include "image/rootfs_builders.hpp"

namespace dsec::image {
namespace fs = std::filesystem;
namespace {

constexpr std::size_t kMaxReadableCacheKey = 80;
// Part of the cache file name: a change to what clean_debootstrap_tree takes out must change it, so a tree cleaned
// the old way is not reused.
constexpr std::string_view kTreeFlavor = "minbase-slim";

// Documentation, manual pages and translations: about a third of a minbase+python3 tree, read by no sandbox task.
// The same rules go into the image's dpkg configuration, so packages installed inside a sandbox stay slim too.
constexpr std::string_view kDpkgSlimConfig =
    "# Written by dsec's image builder: no documentation, manual pages or translations in sandbox images.\n"
    "path-exclude /usr/share/doc/*\n"
    "path-include /usr/share/doc/*/copyright\n"
    "path-exclude /usr/share/man/*\n"
    "path-exclude /usr/share/info/*\n"
    "path-exclude /usr/share/groff/*\n"
    "path-exclude /usr/share/lintian/*\n"
    "path-exclude /usr/share/linda/*\n"
    "path-exclude /usr/share/locale/*\n"
    "path-include /usr/share/locale/locale.alias\n";
constexpr std::string_view kHosts =
    "127.0.0.1\tlocalhost\n"
    "::1\tlocalhost ip6-localhost ip6-loopback\n";

std::string trim(std::string_view s) {
  std::size_t a = s.find_first_not_of(" \t\r\n");
  if (a == std::string_view::npos) return {};
  std::size_t b = s.find_last_not_of(" \t\r\n");
  return std::string(s.substr(a, b - a + 1));
}

std::vector<std::string> split_ws(std::string_view s) {
  std::vector<std::string> out;
  std::istringstream in{std::string(s)};
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool contains(const std::vector<std::string>& v, std::string_view x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

bool is_security(const AptSource& s, const std::string& uri) {
  if (uri.find("debian-security") != std::string::npos || uri.find("/security") != std::string::npos) return true;
  return std::any_of(s.suites.begin(), s.suites.end(),
                     [](const std::string& x) { return x.ends_with("-security") || x.ends_with("/updates"); });
}

bool usable_uri(std::string_view uri) {
  return uri.starts_with("http://") || uri.starts_with("https://") || uri.starts_with("file:/");
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// FNV-1a: a stable short hash for cache file names.
std::uint64_t fnv1a(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

void check_suite(const std::string& suite) {
  bool ok = !suite.empty() && suite.size() <= 64 && std::isalnum(static_cast<unsigned char>(suite[0]));
  for (char c : suite)
    if (!(std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) || c == '-' ||
          c == '.'))
      ok = false;
  if (!ok)
    throw Error(Code::kInvalidArgument,
                fmt::format("invalid Debian suite '{}': expected a name such as bookworm or stable", suite));
}

void check_mirror(const std::string& mirror) {
  bool ok = usable_uri(mirror);
  for (char c : mirror)
    if (std::isspace(static_cast<unsigned char>(c)) || c == ',' || c == '\'' || c == '"') ok = false;
  if (!ok)
    throw Error(Code::kInvalidArgument,
                fmt::format("invalid Debian mirror '{}': expected an http://, https:// or file:/ URL", mirror));
}

// Removes the entries of `dir` (not `dir` itself), all of them or the regular files only. Returns bytes freed.
std::uint64_t empty_dir(const fs::path& dir, bool regular_files_only, const std::vector<std::string>& keep = {}) {
  std::uint64_t freed = 0;
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(dir, ec))) return 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (contains(keep, entry.path().filename().string())) continue;
    auto st = entry.symlink_status();
    if (regular_files_only) {
      if (fs::is_directory(st)) {
        freed += empty_dir(entry.path(), true);
        continue;
      }
      if (!fs::is_regular_file(st)) continue;
    }
    freed += fs::is_regular_file(st) ? entry.file_size(ec) : fs::is_directory(st) ? tree_size(entry.path()) : 0;
    remove_tree(entry.path());
  }
  return freed;
}

// Replaces `path` (a file or a symlink debootstrap left) with a regular file holding `content`.
void replace_file(const fs::path& path, std::string_view content) {
  ::unlink(path.c_str());
  std::ofstream out(path, std::ios::trunc);
  out << content;
  out.close();
  if (!out) throw Error(Code::kInternal, fmt::format("write {} failed", path.string()));
  ::chmod(path.c_str(), 0644);
}

}  // namespace

std::vector<AptSource> parse_one_line_sources(std::string_view text) {
  std::vector<AptSource> out;
  std::istringstream in{std::string(text)};
  for (std::string line; std::getline(in, line);) {
    if (auto hash = line.find('#'); hash != std::string::npos) line.erase(hash);
    auto words = split_ws(line);
    if (words.size() < 3) continue;
    std::size_t i = 1;
    if (words[i].starts_with("[")) {  // options, possibly spread over several words
      while (i < words.size() && !words[i].ends_with("]")) ++i;
      ++i;
    }
    if (i + 1 >= words.size()) continue;
    AptSource s;
    s.types = {words[0]};
    s.uris = {words[i]};
    s.suites = {words[i + 1]};
    s.components.assign(words.begin() + static_cast<std::ptrdiff_t>(i + 2), words.end());
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<AptSource> parse_deb822_sources(std::string_view text) {
  std::vector<AptSource> out;
  std::map<std::string, std::string> fields;
  std::string last_key;
  auto flush = [&] {
    if (!fields.empty() && lower(trim(fields["enabled"])) != "no" && fields.count("uris")) {
      AptSource s;
      s.types = split_ws(fields["types"]);
      s.uris = split_ws(fields["uris"]);
      s.suites = split_ws(fields["suites"]);
      s.components = split_ws(fields["components"]);
      out.push_back(std::move(s));
    }
    fields.clear();
    last_key.clear();
  };
  std::istringstream in{std::string(text)};
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.starts_with("#")) continue;
    if (trim(line).empty()) {
      flush();
      continue;
    }
    if (line[0] == ' ' || line[0] == '\t') {  // continuation of the last field
      if (!last_key.empty()) fields[last_key] += " " + trim(line);
      continue;
    }
    auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    last_key = lower(trim(line.substr(0, colon)));
    fields[last_key] = trim(line.substr(colon + 1));
  }
  flush();
  return out;
}

std::string pick_debian_mirror(const std::vector<AptSource>& sources, std::string_view suite) {
  std::string fallback;
  for (const auto& s : sources) {
    if (!contains(s.types, "deb")) continue;
    for (const auto& raw : s.uris) {
      std::string uri = raw;
      while (uri.size() > 1 && uri.back() == '/') uri.pop_back();
      if (!usable_uri(uri) || is_security(s, uri)) continue;
      if (contains(s.suites, suite)) return uri;
      if (fallback.empty()) fallback = uri;
    }
  }
  return fallback;
}

std::string find_debian_mirror(std::string_view suite, const fs::path& apt_dir) {
  std::vector<AptSource> sources;
  std::vector<std::string> read;
  fs::path list = apt_dir / "sources.list";
  if (fs::is_regular_file(list)) {
    auto more = parse_one_line_sources(read_text(list));
    sources.insert(sources.end(), more.begin(), more.end());
    read.push_back(list.string());
  }
  std::vector<fs::path> parts;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(apt_dir / "sources.list.d", ec))
    if (entry.path().extension() == ".list" || entry.path().extension() == ".sources") parts.push_back(entry.path());
  std::sort(parts.begin(), parts.end());
  for (const auto& p : parts) {
    auto more = p.extension() == ".list" ? parse_one_line_sources(read_text(p)) : parse_deb822_sources(read_text(p));
    sources.insert(sources.end(), more.begin(), more.end());
    read.push_back(p.string());
  }
  std::string mirror = pick_debian_mirror(sources, suite);
  if (mirror.empty())
    throw Error(
        Code::kFailedPrecondition,
        fmt::format("no Debian mirror for '{}' in apt's sources ({}); pass one explicitly (--mirror URL)", suite,
                    read.empty() ? std::string("none found under ") + apt_dir.string()
                                 : fmt::format("{}", fmt::join(read, ", "))));
  return mirror;
}

std::vector<std::string> normalize_packages(const std::vector<std::string>& packages) {
  std::vector<std::string> out;
  for (const auto& raw : packages) {
    std::string p = trim(raw);
    if (p.empty()) continue;
    bool ok = p.size() >= 2 &&
              (std::islower(static_cast<unsigned char>(p[0])) || std::isdigit(static_cast<unsigned char>(p[0])));
    for (char c : p)
      if (!(std::islower(static_cast<unsigned char>(c)) || std::isdigit(static_cast<unsigned char>(c)) || c == '+' ||
            c == '-' || c == '.'))
        ok = false;
    if (!ok)
      throw Error(Code::kInvalidArgument,
                  fmt::format("invalid Debian package name '{}': lower-case letters, digits, '+', '-' and '.'", p));
    out.push_back(std::move(p));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string debootstrap_cache_name(std::string_view suite, std::string_view arch,
                                   const std::vector<std::string>& normalized_packages) {
  std::string joined = fmt::format("{}", fmt::join(normalized_packages, "+"));
  std::string tail;
  if (!joined.empty()) {
    tail = "+" + joined;
    if (tail.size() > kMaxReadableCacheKey) tail = fmt::format("+{}...{:016x}", tail.substr(1, 40), fnv1a(joined));
  }
  return fmt::format("debootstrap-{}-{}-{}{}.tar.zst", suite, arch, kTreeFlavor, tail);
}

std::string host_debian_arch() {
  struct utsname u {};
  if (::uname(&u) != 0) throw_errno(errno, "uname");
  std::string m = u.machine;
  if (m == "x86_64") return "amd64";
  if (m == "aarch64") return "arm64";
  if (m == "i386" || m == "i486" || m == "i586" || m == "i686") return "i386";
  if (m.starts_with("armv7")) return "armhf";
  if (m == "ppc64le") return "ppc64el";
  if (m == "s390x" || m == "riscv64" || m == "mips64el") return m;
  throw Error(Code::kFailedPrecondition, fmt::format("no Debian architecture known for machine type {}", m));
}

void clean_debootstrap_tree(const fs::path& rootfs, std::vector<std::string>& notes) {
  std::uint64_t freed = 0;
  freed += empty_dir(rootfs / "var/cache/apt/archives", false, {"partial", "lock"});
  freed += empty_dir(rootfs / "var/cache/apt/archives/partial", false);
  for (const char* bin : {"pkgcache.bin", "srcpkgcache.bin"}) {
    std::error_code ec;
    fs::path p = rootfs / "var/cache/apt" / bin;
    freed += fs::is_regular_file(fs::symlink_status(p)) ? fs::file_size(p, ec) : 0;
    ::unlink(p.c_str());
  }
  freed += empty_dir(rootfs / "var/lib/apt/lists", false, {"partial", "lock"});
  freed += empty_dir(rootfs / "var/log", true);
  freed += empty_dir(rootfs / "tmp", false);
  freed += empty_dir(rootfs / "var/tmp", false);
  for (const char* d : {"var/cache/debconf", "var/lib/dpkg"}) {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(rootfs / d, ec))
      if (entry.path().filename().string().ends_with("-old") && entry.is_regular_file()) {
        freed += entry.file_size(ec);
        ::unlink(entry.path().c_str());
      }
  }
  std::uint64_t slimmed = 0;
  {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(rootfs / "usr/share/doc", ec)) {
      if (fs::is_directory(entry.symlink_status())) {
        slimmed += empty_dir(entry.path(), false, {"copyright"});
      } else if (fs::is_regular_file(entry.symlink_status())) {
        slimmed += entry.file_size(ec);
        ::unlink(entry.path().c_str());
      }
    }
  }
  for (const char* d :
       {"usr/share/man", "usr/share/info", "usr/share/groff", "usr/share/lintian", "usr/share/linda", "var/cache/man"})
    slimmed += empty_dir(rootfs / d, false);
  slimmed += empty_dir(rootfs / "usr/share/locale", false, {"locale.alias"});
  fs::create_directories(rootfs / "etc/dpkg/dpkg.cfg.d");
  replace_file(rootfs / "etc/dpkg/dpkg.cfg.d/dsec-slim", kDpkgSlimConfig);

  remove_tree(rootfs / "debootstrap");
  std::size_t devices = 0;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(rootfs / "dev", ec)) {
    (void)entry;
    ++devices;
  }
  empty_dir(rootfs / "dev", false);
  for (const char* d : {"dev", "proc", "sys", "run", "tmp"}) fs::create_directories(rootfs / d);
  ::chmod((rootfs / "tmp").c_str(), 01777);

  replace_file(rootfs / "etc/hostname", "");
  replace_file(rootfs / "etc/resolv.conf", "");
  replace_file(rootfs / "etc/hosts", kHosts);

  notes.push_back(fmt::format("removed {:.1f} MiB of apt package cache and lists, logs and temporary files",
                              static_cast<double>(freed) / (1 << 20)));
  notes.push_back(
      fmt::format("removed {:.1f} MiB of documentation, manual pages and translations (kept: copyright "
                  "files; /etc/dpkg/dpkg.cfg.d/dsec-slim keeps later installs slim too)",
                  static_cast<double>(slimmed) / (1 << 20)));
  if (devices > 0) notes.push_back(fmt::format("emptied /dev ({} entries; a sandbox gets its own /dev)", devices));
  notes.push_back("replaced /etc/hostname, /etc/resolv.conf and /etc/hosts copied from the build host");
}

namespace {

// Unpacks a tree cached by an earlier bootstrap into `rootfs`. False (with the cache removed) when it is unusable.
bool unpack_cached_tree(const fs::path& cache, const fs::path& rootfs, std::vector<std::string>& notes,
                        const std::function<void(std::string_view)>& say) {
  say(fmt::format("using the cached debootstrap tree {}", cache.string()));
  try {
    unpack_tree(cache, rootfs, notes);
    notes.push_back(fmt::format("unpacked from the cached debootstrap tree {}", cache.string()));
    return true;
  } catch (const Error& e) {
    say(fmt::format("warning: the cached tree {} is unusable ({}); removing it and bootstrapping again", cache.string(),
                    e.what()));
    notes.clear();
    remove_tree(rootfs);
    ::unlink(cache.c_str());
    return false;
  }
}

// Runs debootstrap into `rootfs`; its seconds. A failure is UNAVAILABLE when a download failed, else INTERNAL, with
// the end of its output and of its log.
double run_debootstrap(const std::vector<std::string>& argv, const fs::path& rootfs, const std::string& suite,
                       const std::string& from, const std::function<void(std::string_view)>& say) {
  ProcessOptions options;
  options.env = {"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                 "LANG=C.UTF-8",
                 "LC_ALL=C.UTF-8",
                 "DEBIAN_FRONTEND=noninteractive",
                 "DEBCONF_NONINTERACTIVE_SEEN=true",
                 "HOME=/root"};
  options.on_line = [&](std::string_view line) { say(line); };
  auto started = std::chrono::steady_clock::now();
  ProcessResult result;
  try {
    result = run_process(argv, options);
  } catch (...) {
    unmount_below(rootfs);
    throw;
  }
  // debootstrap unmounts what it mounted in the target when it exits normally; not always when it fails.
  unmount_below(rootfs);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (result.ok()) return seconds;
  std::string log_tail;
  fs::path dlog = rootfs / "debootstrap/debootstrap.log";
  if (fs::is_regular_file(dlog)) {
    ProcessResult fake;
    fake.err = read_text(dlog);
    log_tail = "\n--- debootstrap.log ---\n" + fake.tail(15);
  }
  std::string all = result.out + result.err;
  bool download = all.find("Failed getting") != std::string::npos ||
                  all.find("Couldn't download") != std::string::npos ||
                  all.find("Failed to download") != std::string::npos;
  throw Error(
      download ? Code::kUnavailable : Code::kInternal,
      fmt::format("debootstrap {} from {} {}:\n{}{}", suite, from, result.status_text(), result.tail(), log_tail));
}

}  // namespace

std::string make_debootstrap_tree(const fs::path& dest, const std::string& suite,
                                  const std::vector<std::string>& include_packages, const std::string& mirror,
                                  const fs::path& cache_dir, const LogSink& log, std::vector<std::string>& notes) {
  check_suite(suite);
  std::vector<std::string> packages = normalize_packages(include_packages);
  if (!mirror.empty()) check_mirror(mirror);
  std::string arch = host_debian_arch();
  fs::path cache = cache_dir / debootstrap_cache_name(suite, arch, packages);
  std::string source =
      fmt::format("debootstrap:{} --variant=minbase{}", suite,
                  packages.empty() ? std::string() : fmt::format(" --include={}", fmt::join(packages, ",")));

  std::function<void(std::string_view)> say = [&](std::string_view line) {
    if (log) log(line);
  };
  const fs::path rootfs = dest;
  struct Unmount {
    const fs::path& p;
    ~Unmount() {
      try {
        unmount_below(p);
      } catch (...) {
      }
    }
  } unmount_on_exit{rootfs};

  if (fs::is_regular_file(cache) && unpack_cached_tree(cache, rootfs, notes, say)) return source;

  if (::geteuid() != 0)
    throw Error(Code::kPermissionDenied, "debootstrap needs root (it chroots and creates device nodes); run as root");
  std::string from = mirror.empty() ? find_debian_mirror(suite) : mirror;
  check_mirror(from);

  std::vector<std::string> argv{"debootstrap", "--variant=minbase", "--components=main", "--arch=" + arch};
  if (!packages.empty()) argv.push_back(fmt::format("--include={}", fmt::join(packages, ",")));
  argv.insert(argv.end(), {suite, rootfs.string(), from});
  say(fmt::format("running: {}", fmt::join(argv, " ")));
  const double seconds = run_debootstrap(argv, rootfs, suite, from, say);

  clean_debootstrap_tree(rootfs, notes);
  for (const auto& n : notes) say(n);
  say(fmt::format("caching the tree as {}", cache.string()));
  std::error_code ec;
  fs::create_directories(cache_dir, ec);
  pack_tree(rootfs, cache);
  notes.insert(notes.begin(),
               fmt::format("bootstrapped from {} in {:.0f} s; tree cached as {}", from, seconds, cache.string()));
  return source + " from " + from;
}

}  // namespace dsec::image
