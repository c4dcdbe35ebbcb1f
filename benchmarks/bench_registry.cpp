// dsec-bench registry: an image of an OCI registry, imported into a dsec store next to the peers' way of getting
// it (skopeo copy to an OCI layout, then umoci unpack), and the first creates of it.
//
// The image is Debian bookworm with python3, build-essential, git, python3-dev and cmake (debootstrap, cached in
// <home>/cache), cut into three OCI layers (the system without /usr/lib, /usr/share, /usr/include and /usr/libexec;
// then /usr/lib; then the rest), gzip-compressed, written as an OCI layout under <home>/cache (kept for the next
// run) and pushed with skopeo into a private docker-registry on loopback; a second image adds a small task layer on
// the same three. Measured, each from a registry whose files were dropped from the page cache:
//   1. import of the image into an empty store (dsec's registry client and importer, in this process), next to
//      skopeo copy + umoci unpack of it;
//   2. the second image after the first (only its own layer is new), next to the same for the peers;
//   3. a create of the image on a fresh agent whose store lacks it, to its first exec's answer (import on first use);
//   4. a create of the imported image on a cold node (a fresh agent, an empty layer cache, the store's blobs out of
//      the page cache), to its first exec's answer, with the bytes it fetched.
//   5. with Debian's docker.io installed: `docker pull` of both images into a dockerd of the benchmark's own.
#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <netinet/in.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <thread>

#include <nlohmann/json.hpp>

#include "bench.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"
#include "image/build.hpp"
#include "image/fs_tree.hpp"
#include "image/registry/import.hpp"
#include "image/registry/registry_client.hpp"
#include "image/rootfs_builders.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/digest.hpp"

namespace dsec::bench {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr std::string_view kPackages = "python3,build-essential,git,python3-dev,cmake";
constexpr const char* kRegistryBinary = "/usr/bin/docker-registry";
constexpr const char* kSkopeo = "/usr/bin/skopeo";
constexpr const char* kUmoci = "/usr/bin/umoci";
constexpr const char* kDockerd = "/usr/sbin/dockerd";
constexpr const char* kDocker = "/usr/bin/docker";

std::string human(double bytes) {
  if (bytes >= (1ull << 30)) return fmt::format("{:.2f} GiB", bytes / (1ull << 30));
  if (bytes >= (1 << 20)) return fmt::format("{:.1f} MiB", bytes / (1 << 20));
  return fmt::format("{:.0f} KiB", bytes / 1024);
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::uint64_t bytes_of(const fs::path& p) { return static_cast<std::uint64_t>(fs::file_size(p)); }

// A blob of the layout: stored under its digest; returns its descriptor.
json put_blob(const fs::path& layout, const fs::path& file, const std::string& media_type) {
  std::string digest = image::sha256_file(file);
  fs::path dest = layout / "blobs" / "sha256" / image::digest_hex(digest);
  fs::create_directories(dest.parent_path());
  if (!fs::exists(dest)) fs::copy_file(file, dest);
  return {{"mediaType", media_type}, {"digest", digest}, {"size", bytes_of(dest)}};
}

json put_json_blob(const fs::path& layout, const json& doc, const std::string& media_type, const fs::path& scratch) {
  std::ofstream(scratch, std::ios::trunc | std::ios::binary) << doc.dump();
  json d = put_blob(layout, scratch, media_type);
  fs::remove(scratch);
  return d;
}

struct Layer {
  json descriptor;
  std::string diff_id;
  std::uint64_t tar_bytes = 0;
};

// A gzip layer of the tree's `members` (tar's own argument list: paths and --exclude options).
Layer make_layer(const fs::path& layout, const fs::path& tree, const std::vector<std::string>& members,
                 const fs::path& scratch) {
  fs::path tar = scratch / "layer.tar";
  std::vector<std::string> argv{"/bin/tar", "--numeric-owner", "--xattrs", "-C", tree.string(), "-cf", tar.string()};
  argv.insert(argv.end(), members.begin(), members.end());
  run_command(argv);
  Layer l;
  l.diff_id = image::sha256_file(tar);
  l.tar_bytes = bytes_of(tar);
  run_command({"/bin/gzip", "-n", "-6", "-f", tar.string()});
  l.descriptor = put_blob(layout, tar.string() + ".gz", "application/vnd.oci.image.layer.v1.tar+gzip");
  fs::remove(tar.string() + ".gz");
  return l;
}

// An image of the layout tagged `tag`: its config (with the layers' diff_ids) and manifest.
void add_image(const fs::path& layout, const std::vector<Layer>& layers, const std::string& tag,
               const fs::path& scratch, json& index) {
  json diff_ids = json::array(), descriptors = json::array();
  for (const auto& l : layers) {
    diff_ids.push_back(l.diff_id);
    descriptors.push_back(l.descriptor);
  }
  json config = {{"architecture", "amd64"},
                 {"os", "linux"},
                 {"config", {{"Env", {"PATH=/usr/local/bin:/usr/bin:/bin"}}, {"WorkingDir", "/"}, {"Cmd", {"bash"}}}},
                 {"rootfs", {{"type", "layers"}, {"diff_ids", diff_ids}}}};
  json manifest = {
      {"schemaVersion", 2},
      {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
      {"config", put_json_blob(layout, config, "application/vnd.oci.image.config.v1+json", scratch / "config.json")},
      {"layers", descriptors}};
  json d = put_json_blob(layout, manifest, "application/vnd.oci.image.manifest.v1+json", scratch / "manifest.json");
  d["annotations"] = {{"org.opencontainers.image.ref.name", tag}};
  index["manifests"].push_back(d);
}

// The OCI layout of the two bench images, made once under <home>/cache (the debootstrap tree is cached there too).
fs::path prepare_layout(const std::string& home, const fs::path& work, std::vector<std::string>& notes) {
  fs::path layout = fs::path(home) / "cache" / "registry-bench-layout";
  if (fs::exists(layout / "index.json")) return layout;
  fs::path tree = work / "tree", scratch = work / "scratch";
  fs::create_directories(scratch);
  std::vector<std::string> packages;
  for (std::size_t start = 0; start <= kPackages.size();) {
    std::size_t comma = kPackages.find(',', start);
    packages.emplace_back(
        kPackages.substr(start, comma == std::string_view::npos ? std::string_view::npos : comma - start));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  fmt::print(stderr, "dsec-bench: debootstrap bookworm +{} (cached in {}/cache)\n", kPackages, home);
  image::make_debootstrap_tree(
      tree, "bookworm", packages, "", fs::path(home) / "cache",
      [](std::string_view line) { fmt::print(stderr, "  {}\n", line); }, notes);
  fs::path partial = work / "layout";
  fs::create_directories(partial / "blobs" / "sha256");
  std::vector<Layer> layers;
  fmt::print(stderr, "dsec-bench: writing the OCI layout (3 gzip layers)\n");
  layers.push_back(make_layer(
      partial, tree,
      {"--exclude=./usr/lib", "--exclude=./usr/share", "--exclude=./usr/include", "--exclude=./usr/libexec", "."},
      scratch));
  layers.push_back(make_layer(partial, tree, {"./usr/lib"}, scratch));
  std::vector<std::string> rest;
  for (const char* d : {"./usr/share", "./usr/include", "./usr/libexec"})
    if (fs::exists(tree / fs::path(d).relative_path())) rest.emplace_back(d);
  layers.push_back(make_layer(partial, tree, rest, scratch));
  json index = {{"schemaVersion", 2}, {"manifests", json::array()}};
  add_image(partial, layers, "env", scratch, index);
  // The task image: the same three layers and a small project of its own.
  fs::path task = work / "task";
  fs::create_directories(task / "task" / "tests");
  std::ofstream(task / "task" / "solution.py") << "def add(a, b):\n    return a + b\n";
  std::ofstream(task / "task" / "tests" / "test_add.py")
      << "import unittest\nfrom solution import add\n\n\nclass T(unittest.TestCase):\n"
         "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n";
  std::vector<Layer> task_layers = layers;
  task_layers.push_back(make_layer(partial, task, {"./task"}, scratch));
  add_image(partial, task_layers, "task", scratch, index);
  std::ofstream(partial / "oci-layout") << R"({"imageLayoutVersion": "1.0.0"})";
  std::ofstream(partial / "index.json") << index.dump();
  image::remove_tree(tree);
  fs::create_directories(layout.parent_path());
  fs::rename(partial, layout);
  return layout;
}

// Drops every file under `dir` from the page cache.
void evict_tree(const fs::path& dir) {
  ::sync();
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (ec || !it->is_regular_file()) continue;
    UniqueFd fd(::open(it->path().c_str(), O_RDONLY | O_CLOEXEC));
    if (fd) ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
  }
}

int free_port() {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) throw_errno(errno, "bind 127.0.0.1:0");
  socklen_t len = sizeof a;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  return ntohs(a.sin_port);
}

// A private docker-registry on loopback, killed with the object.
class LocalRegistry {
 public:
  explicit LocalRegistry(const fs::path& dir) : dir_(dir), port_(free_port()) {
    fs::create_directories(dir_ / "storage");
    std::ofstream(dir_ / "config.yml") << fmt::format(
        "version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {}\n"
        "  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{}\n",
        (dir_ / "storage").string(), port_);
    const std::string config = (dir_ / "config.yml").string();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      ::dup2(null, 2);
      ::execl(kRegistryBinary, kRegistryBinary, "serve", config.c_str(), nullptr);
      ::_exit(127);
    }
    for (int i = 0; i < 200; ++i) {
      UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(static_cast<std::uint16_t>(port_));
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
    }
    throw Error(Code::kUnavailable, fmt::format("docker-registry did not start on 127.0.0.1:{}", port_));
  }
  ~LocalRegistry() {
    if (pid_ > 0) {
      ::kill(-pid_, SIGKILL);
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  LocalRegistry(const LocalRegistry&) = delete;
  LocalRegistry& operator=(const LocalRegistry&) = delete;
  std::string host() const { return fmt::format("127.0.0.1:{}", port_); }
  fs::path storage() const { return dir_ / "storage"; }

 private:
  fs::path dir_;
  int port_;
  pid_t pid_ = -1;
};

// Debian's Docker engine as a peer: a dockerd of its own (its data, run directory and socket under `dir`; no
// firewall rules, no bridge), stopped and its files removed with the object. Loopback registries are insecure to it
// by default, as to dsec.
class LocalDockerd {
 public:
  explicit LocalDockerd(const fs::path& dir) : dir_(dir) {
    fs::create_directories(dir_);
    const std::string log_path = (dir_ / "dockerd.log").string();
    const std::string data = "--data-root=" + (dir_ / "data").string();
    const std::string exec = "--exec-root=" + (dir_ / "exec").string();
    const std::string pidfile = "--pidfile=" + (dir_ / "dockerd.pid").string();
    const std::string host = "--host=unix://" + socket();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      int log = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      ::dup2(log, 1);
      ::dup2(log, 2);
      ::execl(kDockerd, kDockerd, data.c_str(), exec.c_str(), pidfile.c_str(), host.c_str(), "--iptables=false",
              "--ip6tables=false", "--bridge=none", "--storage-driver=overlay2", nullptr);
      ::_exit(127);
    }
    for (int i = 0; i < 600; ++i) {
      if (::access(socket().c_str(), F_OK) == 0 && docker_ok({"version"})) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    throw Error(Code::kUnavailable, fmt::format("dockerd did not start (log {})", (dir_ / "dockerd.log").string()));
  }
  ~LocalDockerd() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      for (int i = 0; i < 200 && ::waitpid(pid_, nullptr, WNOHANG) == 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      ::kill(-pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    try {
      image::remove_tree(dir_);
    } catch (...) {
    }
  }
  LocalDockerd(const LocalDockerd&) = delete;
  LocalDockerd& operator=(const LocalDockerd&) = delete;

  std::string socket() const { return (dir_ / "docker.sock").string(); }
  // `docker pull REF` against this engine: seconds.
  double pull(const std::string& ref) {
    auto t0 = Clock::now();
    run_command({kDocker, "--host", "unix://" + socket(), "pull", "--quiet", ref});
    return seconds_since(t0);
  }

 private:
  bool docker_ok(std::vector<std::string> args) const {
    std::vector<std::string> argv{kDocker, "--host", "unix://" + socket()};
    argv.insert(argv.end(), args.begin(), args.end());
    std::vector<char*> a;  // made before the fork: the child only calls what is safe after one
    a.reserve(argv.size() + 1);
    for (auto& s : argv) a.push_back(s.data());
    a.push_back(nullptr);
    pid_t pid = ::fork();
    if (pid == 0) {
      int null = ::open("/dev/null", O_WRONLY);
      ::dup2(null, 1);
      ::dup2(null, 2);
      ::execv(a[0], a.data());
      ::_exit(127);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }

  fs::path dir_;
  pid_t pid_ = -1;
};

struct ImportRun {
  double seconds = 0;
  double download = 0, unpack = 0, store = 0;  // summed over the layers converted
  std::uint64_t downloaded = 0;
  std::size_t converted = 0, reused = 0, layers = 0;
  std::uint64_t image_bytes = 0, stored_bytes = 0;
};

ImportRun dsec_import(image::registry::RegistryClient& client, image::BlobStore& store, const fs::path& store_dir,
                      const std::string& ref) {
  image::registry::ImportOptions o;
  o.work_dir = store_dir / ".tmp";
  image::registry::ImportResult r = image::registry::import_image(client, store, image::parse_reference(ref), o);
  return ImportRun{r.seconds,
                   r.seconds_download,
                   r.seconds_unpack,
                   r.seconds_store,
                   r.bytes_downloaded,
                   r.layers_converted,
                   r.layers_reused,
                   r.image.manifest.layers.size(),
                   r.image.manifest.size(),
                   r.image.manifest.stored_size()};
}

// skopeo copy into an OCI layout (shared by the two images, as a peer's local cache), then umoci unpack of it.
std::pair<double, double> peer_pull(const std::string& ref, const fs::path& layout, const std::string& tag,
                                    const fs::path& bundle) {
  auto t0 = Clock::now();
  run_command({kSkopeo, "--insecure-policy", "copy", "--quiet", "--src-tls-verify=false", "docker://" + ref,
               fmt::format("oci:{}:{}", layout.string(), tag)});
  double copy = seconds_since(t0);
  auto t1 = Clock::now();
  run_command(
      {kUmoci, "--log", "error", "unpack", "--image", fmt::format("{}:{}", layout.string(), tag), bundle.string()});
  return {copy, seconds_since(t1)};
}

ClientOptions fresh_node(const Options& o, const std::string& home) {
  ClientOptions c;
  c.home = home;
  c.agent_binary = o.agent_binary;
  c.agent_args = {"--backends", "container"};
  c.agent_start_timeout = std::chrono::seconds(60);
  c.call_deadline = std::chrono::minutes(30);
  c.request_timeout = std::chrono::minutes(30);
  return c;
}

struct FirstCreate {
  double create_ms = 0, exec_ms = 0;
  std::uint64_t fetched = 0;
};

FirstCreate first_create(const Options& o, const std::string& home, const std::string& ref) {
  Client client(fresh_node(o, home));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the agent's namespace pool fills
  std::string before = agent_get(client.endpoint(), "/metrics");
  SandboxSpec spec;
  spec.image = ref;
  spec.resources.memory_bytes = 512ull << 20;
  FirstCreate f;
  auto t0 = Clock::now();
  Sandbox sb = client.create(spec);
  f.create_ms = ms_since(t0);
  ExecRequest req;
  req.argv = {"python3", "-c", "import json, sqlite3; print(json.dumps([1]))"};
  auto t1 = Clock::now();
  ExecResult r = sb.exec(req);
  f.exec_ms = ms_since(t1);
  if (r.exit_code != 0 || r.stdout_data != "[1]\n")
    throw Error(Code::kInternal, fmt::format("first exec of {}: exit {}: {} {}", ref, r.exit_code, r.stdout_data,
                                             r.stderr_data.substr(0, 400)));
  std::string after = agent_get(client.endpoint(), "/metrics");
  f.fetched = metric(after, "dsec_layer_fetched_bytes_total") - metric(before, "dsec_layer_fetched_bytes_total");
  sb.destroy();
  client.close();
  return f;
}

}  // namespace

void run_registry(const Options& o, const std::string& home) {
  for (const char* tool : {kRegistryBinary, kSkopeo, kUmoci})
    if (::access(tool, X_OK) != 0)
      throw Error(Code::kFailedPrecondition,
                  fmt::format("{} is missing (scripts/install-deps.sh installs docker-registry, skopeo, umoci)", tool));
  fs::path work = image::make_scratch_dir(fs::temp_directory_path(), "dsec-bench-registry-");
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      try {
        image::remove_tree(p);
      } catch (...) {
      }
    }
  } cleanup{work};
  std::vector<std::string> notes;
  fs::path layout = prepare_layout(home, work, notes);

  LocalRegistry registry(work / "registry");
  fmt::print(stderr, "dsec-bench: pushing to docker-registry at {}\n", registry.host());
  for (const char* tag : {"env", "task"})
    run_command({kSkopeo, "--insecure-policy", "copy", "--quiet", "--dest-tls-verify=false",
                 fmt::format("oci:{}:{}", layout.string(), tag),
                 fmt::format("docker://{}/bench/{}:v1", registry.host(), tag)});
  const std::string env_ref = fmt::format("{}/bench/env:v1", registry.host());
  const std::string task_ref = fmt::format("{}/bench/task:v1", registry.host());

  image::registry::RegistryClient client(image::registry::RegistryOptions{});
  // 1. and 2.: dsec's import, then the peers', each from a registry out of the page cache.
  fs::path store_dir = work / "store";
  auto store = image::open_directory_store(store_dir);
  evict_tree(registry.storage());
  ImportRun first = dsec_import(client, *store, store_dir, env_ref);
  evict_tree(registry.storage());
  ImportRun second = dsec_import(client, *store, store_dir, task_ref);
  evict_tree(registry.storage());
  auto [peer_copy, peer_unpack] = peer_pull(env_ref, work / "peer-layout", "env", work / "bundle-env");
  evict_tree(registry.storage());
  auto [peer_copy2, peer_unpack2] = peer_pull(task_ref, work / "peer-layout", "task", work / "bundle-task");
  image::remove_tree(work / "bundle-env");
  image::remove_tree(work / "bundle-task");
  // Docker's pull of the same two images, where Debian's engine is installed.
  std::optional<std::pair<double, double>> docker;
  if (::access(kDockerd, X_OK) == 0 && ::access(kDocker, X_OK) == 0) {
    LocalDockerd engine(work / "docker");
    evict_tree(registry.storage());
    double env_s = engine.pull(env_ref);
    evict_tree(registry.storage());
    docker = std::make_pair(env_s, engine.pull(task_ref));
  }

  std::uint64_t compressed = 0;
  {
    json index = json::parse(std::ifstream(layout / "index.json"));
    for (const auto& m : index["manifests"])
      if (m["annotations"]["org.opencontainers.image.ref.name"] == "env") {
        json manifest =
            json::parse(std::ifstream(layout / "blobs" / "sha256" / image::digest_hex(m["digest"].get<std::string>())));
        for (const auto& l : manifest["layers"]) compressed += l["size"].get<std::uint64_t>();
      }
  }

  // 3.: a fresh agent whose store lacks the image (import on first use).
  fs::path cold_home = work / "node-home";
  fs::create_directories(cold_home / "store");
  evict_tree(registry.storage());
  FirstCreate on_demand = first_create(o, cold_home.string(), env_ref);
  // 4.: the imported image on a cold node: a fresh agent (empty layer cache), the store out of the page cache.
  evict_tree(cold_home / "store");
  FirstCreate cold = first_create(o, cold_home.string(), env_ref);

  const double unpacked = static_cast<double>(first.image_bytes);
  fmt::print(
      "\nregistry: an image of {} layers, {} compressed (gzip), {} as dsec's EROFS layers "
      "(debootstrap bookworm +{}), from docker-registry on loopback; TCG/KVM play no part\n",
      first.layers, human(static_cast<double>(compressed)), human(unpacked), kPackages);
  fmt::print("  {:<58} {:>9} {:>12}\n", "", "seconds", "downloaded");
  fmt::print("  {:<58} {:>9.2f} {:>12}   ({:.0f} MiB/s compressed)\n",
             "dsec import (EROFS layers, chunked, in the store)", first.seconds,
             human(static_cast<double>(first.downloaded)), static_cast<double>(compressed) / (1 << 20) / first.seconds);
  fmt::print("    its stages, summed over the layers: download {:.2f} s, unpack {:.2f} s, EROFS + chunks {:.2f} s\n",
             first.download, first.unpack, first.store);
  fmt::print("  {:<58} {:>9.2f}\n", "skopeo copy to an OCI layout + umoci unpack", peer_copy + peer_unpack);
  fmt::print("  {:<58} {:>9.2f}\n", "  of which skopeo copy", peer_copy);
  fmt::print("  {:<58} {:>9.2f}\n", "  of which umoci unpack", peer_unpack);
  fmt::print("  {:<58} {:>9.2f} {:>12}   ({} of {} layers new; {:.0f}% of the first import's time)\n",
             "second image sharing the 3 layers: dsec import", second.seconds,
             human(static_cast<double>(second.downloaded)), second.converted, second.layers,
             100.0 * second.seconds / first.seconds);
  fmt::print("  {:<58} {:>9.2f}   (copy {:.2f} + unpack {:.2f})\n", "second image: skopeo copy + umoci unpack",
             peer_copy2 + peer_unpack2, peer_copy2, peer_unpack2);
  fmt::print("  {:<58} {:>9.2f}   (create {:.0f} ms incl. the import, first exec {:.0f} ms)\n",
             "create of a not-yet-imported image, to its first exec", (on_demand.create_ms + on_demand.exec_ms) / 1000,
             on_demand.create_ms, on_demand.exec_ms);
  fmt::print("  {:<58} {:>9.2f} {:>12}   (create {:.0f} ms, first exec {:.0f} ms; fetched {:.1f}% of the image)\n",
             "create of the imported image on a cold node, to first exec", (cold.create_ms + cold.exec_ms) / 1000,
             human(static_cast<double>(cold.fetched)), cold.create_ms, cold.exec_ms,
             100.0 * static_cast<double>(cold.fetched) / static_cast<double>(first.stored_bytes));
  if (docker) {
    fmt::print("  {:<58} {:>9.2f}\n", "docker pull (Debian's dockerd 20.10, overlay2)", docker->first);
    fmt::print("  {:<58} {:>9.2f}\n", "second image: docker pull", docker->second);
  } else {
    fmt::print("  docker pull: Debian's docker.io is not installed (/usr/sbin/dockerd); not measured\n");
  }
  for (const auto& n : notes) fmt::print("  note: {}\n", n);
}

}  // namespace dsec::bench
