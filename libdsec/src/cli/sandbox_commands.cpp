// dsec ps | run | exec | rm | snapshot | node: sandboxes through a node agent (dsec::Client).
#include <limits.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/args.hpp"
#include "cli/commands.hpp"
#include "common/protocol/node.hpp"
#include "common/protocol/sandbox.hpp"
#include "dsec/client.hpp"
#include "dsec/error.hpp"

namespace dsec::cli {
namespace {

namespace fs = std::filesystem;

// run/exec: the command's own status is the exit status, so dsec's failures and timeouts get codes of their own
// (as in `docker run` and timeout(1)).
constexpr int kExitDsecFailed = 125;
constexpr int kExitTimedOut = 124;
constexpr std::string_view kDefaultSocket = "/run/dsec/dsecd.sock";

constexpr std::string_view kEndpointHelp =
    "The agent is --endpoint, else $DSEC_ENDPOINT, else the system agent's socket /run/dsec/dsecd.sock when it\n"
    "exists.";

constexpr std::string_view kPsHelp = R"(usage: dsec ps [--label KEY=VALUE]... [--tenant T] [--json] [--endpoint URL]

Lists the sandboxes of the node agent(s): id, image, state, kind, creation and expiry time.
  --label KEY=VALUE   only sandboxes carrying this label (repeatable: all must match)
  --tenant T          only sandboxes of tenant T
  --json              a JSON array instead of a table
)";

constexpr std::string_view kRunHelp = R"(usage: dsec run IMAGE [options] [--] [CMD [ARG...]]

Creates a sandbox from IMAGE, runs CMD in it (none given: the image's Entrypoint and Cmd, for an image from an OCI
registry that names them), prints its output as it comes, destroys the sandbox and exits with
CMD's status (128+N if signal N ended it, 124 if it timed out, 125 if dsec failed). Without --endpoint and with no
system agent running, a private agent is started for the command (on --home's image store).
  --cpu CORES          cpu limit (default 1; fractions allowed)
  --memory SIZE        memory limit, e.g. 512Mi (default 512Mi)
  --disk SIZE          writable layer size, e.g. 1Gi (default 1Gi)
  --pids N             process limit (default 512)
  --env KEY=VALUE      environment (repeatable)
  --label KEY=VALUE    sandbox label (repeatable)
  --tenant T           owner of the sandbox
  --workdir DIR        working directory (default: the image's WorkingDir, else /)
  --user USER          run CMD (and every later exec) as USER: a name of the image's /etc/passwd, UID or UID:GID
                       (default root)
  --protect PATH       make PATH a directory only root inside may enter, before CMD runs (repeatable)
  --timeout SECONDS    wall-clock limit for CMD (default 600)
  --ttl SECONDS        the agent destroys the sandbox after this long (default 3600; 0 = never)
  --kind KIND          backend (default container): container, microvm, or vm (a full VM with a screen)
  --display WxH        a full VM's screen, e.g. 1280x800, or none (default for kind vm: 1024x768)
  -i, --interactive    send this process's standard input to CMD
  --keep               do not destroy the sandbox; print its id on stderr (with no CMD: just create it and print
                       the id on stdout)
)";

constexpr std::string_view kExecHelp = R"(usage: dsec exec ID [options] [--] CMD [ARG...]

Runs CMD in sandbox ID, prints its output as it comes, and exits with its status (128+N if signal N ended it, 124
if it timed out, 125 if dsec failed).
  --env KEY=VALUE      environment (repeatable)
  --workdir DIR        working directory (default: the sandbox's)
  --user USER          run as USER: a name of the sandbox's /etc/passwd, UID or UID:GID (default: the sandbox's
                       user, root unless it was created with one)
  --timeout SECONDS    wall-clock limit (default 600)
  -i, --interactive    send this process's standard input to CMD
)";

constexpr std::string_view kRmHelp = R"(usage: dsec rm ID... [--endpoint URL]

Destroys sandboxes. Destroying one that is already gone is not an error.
)";

constexpr std::string_view kScreenshotHelp = R"(usage: dsec screenshot ID FILE [--endpoint URL]

Writes a PNG of full VM ID's screen to FILE ("-": standard output). A sandbox without a screen (other kinds, or a
VM made with --display none) or a sleeping one is an error.
)";

constexpr std::string_view kVncHelp = R"(usage: dsec vnc ID [--stop] [--endpoint URL]

Prints a VNC endpoint (host:port on the sandbox's node) where a person can watch full VM ID's screen with any VNC
viewer, and drive it, and on a second line the password the viewer asks for (VNC authentication). The same one
while it lasts; stop it when done.
  --stop    end it (viewers connected stay until they close)
)";

constexpr std::string_view kSnapshotHelp = R"(usage: dsec snapshot ID NAME [--json] [--endpoint URL]

Captures sandbox ID's files as a new image NAME ("repo" or "repo:tag") in its node's snapshot store: its image's
layers plus one layer of what it changed. Prints the new image, pinned (NAME@sha256:...), which `dsec run` and
creates take as an image. Files only: its processes are not part of the snapshot. A NAME that exists is an error
(a snapshot never moves a tag).

  --json    print the whole answer: the layer, what was captured, how long the sandbox was frozen
)";

constexpr std::string_view kNodeHelp = R"(usage: dsec node [--json] [--endpoint URL]

Shows each node agent's id, version, capacity, load, backends and images. Without --endpoint and with no system
agent running, it starts a private agent and shows this machine.

  --json    a JSON array of the nodes, each in the fields of GET /v1/node's answer (docs/protocol.md)
)";

std::string with_endpoint_help(std::string_view help) { return fmt::format("{}\n{}\n", help, kEndpointHelp); }

// The agent to talk to: --endpoint, $DSEC_ENDPOINT, the system agent's socket. Empty: none (an embedded agent).
std::string pick_endpoint(const GlobalOptions& global) {
  std::string e = global.resolved_endpoint();
  if (!e.empty()) return e;
  std::error_code ec;
  if (fs::is_socket(fs::path(kDefaultSocket), ec)) return "unix:" + std::string(kDefaultSocket);
  return {};
}

ClientOptions client_options(const GlobalOptions& global, const std::string& endpoint) {
  ClientOptions o;
  if (!endpoint.empty()) o.endpoints = {endpoint};
  o.home = global.resolved_home();
  // An image store named with --store or $DSEC_STORE: names are resolved there (an embedded agent streams from it).
  if (!global.store.empty() || std::getenv("DSEC_STORE")) o.stores = {global.resolved_store()};
  // An installed dsec finds the dsecd installed beside it.
  char self[PATH_MAX];
  ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = '\0';
    fs::path beside = fs::path(self).parent_path() / "dsecd";
    if (::access(beside.c_str(), X_OK) == 0) o.agent_binary = beside.string();
  }
  return o;
}

// ps, exec and rm are about sandboxes that outlive the command, so a private agent would be pointless.
std::string require_endpoint(const GlobalOptions& global, const std::string& command, const std::string& help) {
  std::string e = pick_endpoint(global);
  if (e.empty())
    throw UsageError(fmt::format("{} needs a running agent: pass --endpoint unix:/path/to/dsecd.sock or "
                                 "http://host:port, set $DSEC_ENDPOINT, or start dsecd (its default socket is {})",
                                 command, kDefaultSocket),
                     help);
  return e;
}

std::pair<std::string, std::string> split_kv(const std::string& text, const std::string& option,
                                             const std::string& help) {
  auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw UsageError(fmt::format("{} wants KEY=VALUE, got '{}'", option, text), help);
  return {text.substr(0, eq), text.substr(eq + 1)};
}

std::map<std::string, std::string> kv_option(const ParsedArgs& p, const std::string& option, const std::string& help) {
  std::map<std::string, std::string> out;
  if (auto it = p.values.find(option); it != p.values.end())
    for (const auto& v : it->second) out.insert(split_kv(v, option, help));
  return out;
}

double number_option(const ParsedArgs& p, const std::string& option, double fallback, const std::string& help) {
  auto v = p.get(option);
  if (!v) return fallback;
  try {
    std::size_t used = 0;
    double d = std::stod(*v, &used);
    if (used != v->size() || !std::isfinite(d) || d < 0) throw std::invalid_argument(*v);
    return d;
  } catch (const std::exception&) {
    throw UsageError(fmt::format("{} wants a non-negative number, got '{}'", option, *v), help);
  }
}

std::uint64_t size_option(const ParsedArgs& p, const std::string& option, std::uint64_t fallback,
                          const std::string& help) {
  auto v = p.get(option);
  if (!v) return fallback;
  auto bytes = parse_size(*v);
  if (!bytes) throw UsageError(fmt::format("{} wants a size such as 512Mi or 2G, got '{}'", option, *v), help);
  return *bytes;
}

std::string read_all_stdin() {
  return std::string(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
}

void write_all(std::FILE* f, const std::string& data) {
  if (!data.empty()) std::fwrite(data.data(), 1, data.size(), f);
  std::fflush(f);
}

// Runs the command with its output copied to this process's stdout and stderr as it arrives.
ExecResult exec_live(const Sandbox& sb, const ExecRequest& req) {
  return sb.exec_stream(req, [](int fd, std::string_view data) {
    std::FILE* f = fd == 2 ? stderr : stdout;
    std::fwrite(data.data(), 1, data.size(), f);
    std::fflush(f);
  });
}

// Prints an exec's output (none left after exec_live) and turns its outcome into this process's exit status.
int finish_exec(const ExecResult& r, double timeout) {
  write_all(stdout, r.stdout_data);
  write_all(stderr, r.stderr_data);
  if (r.stdout_truncated || r.stderr_truncated) fmt::print(stderr, "dsec: output was truncated\n");
  if (r.timed_out) {
    fmt::print(stderr, "dsec: the command timed out after {:g} s and was killed\n", timeout);
    return kExitTimedOut;
  }
  if (r.signal != 0) return 128 + r.signal;
  return r.exit_code;
}

// A failure of dsec itself inside run/exec: printed like any error, status 125.
template <typename F>
int run_or_125(F&& f) {
  try {
    return f();
  } catch (const UsageError&) {
    throw;
  } catch (const Error& e) {
    fmt::print(stderr, "dsec: {}: {}\n", e.code_name(), e.what());
    return kExitDsecFailed;
  } catch (const std::exception& e) {
    fmt::print(stderr, "dsec: INTERNAL: {}\n", e.what());
    return kExitDsecFailed;
  }
}

std::string labels_text(const Labels& labels) {
  std::string out;
  for (const auto& [k, v] : labels) out += fmt::format("{}{}={}", out.empty() ? "" : ",", k, v);
  return out.empty() ? "-" : out;
}

int cmd_ps(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help = with_endpoint_help(kPsHelp);
  ParsedArgs p = parse_args(args, {{"--label", true, true}, {"--tenant", true}, {"--json", false}}, global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (!p.positional.empty()) throw UsageError("ps takes no arguments", help);
  Labels labels = kv_option(p, "--label", help);
  std::string endpoint = require_endpoint(global, "ps", help);
  Client client(client_options(global, endpoint));
  auto sandboxes = client.list(labels, p.get("--tenant").value_or(""));
  if (p.has("--json")) {
    nlohmann::json out = nlohmann::json::array();
    // The agent's own SandboxInfo encoding, as GET /v1/sandboxes answers it.
    for (const auto& s : sandboxes) out.push_back(protocol::encode(s));
    fmt::print("{}\n", out.dump(2));
    return 0;
  }
  std::size_t id_w = 2, image_w = 5;
  for (const auto& s : sandboxes) {
    id_w = std::max(id_w, s.id.size());
    image_w = std::max(image_w, s.image.size());
  }
  fmt::print("{:<{}}  {:<{}}  {:<9}  {:<9}  {:<19}  {:<19}  {}\n", "ID", id_w, "IMAGE", image_w, "STATE", "KIND",
             "CREATED", "EXPIRES", "LABELS");
  for (const auto& s : sandboxes)
    fmt::print("{:<{}}  {:<{}}  {:<9}  {:<9}  {:<19}  {:<19}  {}\n", s.id, id_w, s.image, image_w, s.state, s.kind,
               local_time(s.created_at), local_time(s.expires_at), labels_text(s.labels));
  return 0;
}

// The spec `dsec run` asks for, from its options.
SandboxSpec run_spec(const ParsedArgs& p, const std::string& help) {
  SandboxSpec spec;
  spec.image = p.positional[0];
  spec.kind = p.get("--kind").value_or(spec.kind);
  spec.display = p.get("--display").value_or("");
  spec.resources.cpu = number_option(p, "--cpu", spec.resources.cpu, help);
  spec.resources.memory_bytes = size_option(p, "--memory", spec.resources.memory_bytes, help);
  spec.resources.disk_bytes = size_option(p, "--disk", spec.resources.disk_bytes, help);
  spec.resources.pids = static_cast<std::uint32_t>(number_option(p, "--pids", spec.resources.pids, help));
  spec.ttl = std::chrono::seconds(static_cast<long long>(number_option(p, "--ttl", 3600, help)));
  spec.env = kv_option(p, "--env", help);
  spec.labels = kv_option(p, "--label", help);
  spec.tenant = p.get("--tenant").value_or("");
  spec.workdir = p.get("--workdir").value_or(spec.workdir);
  spec.user = p.get("--user").value_or("");
  if (auto it = p.values.find("--protect"); it != p.values.end()) spec.protected_paths = it->second;
  return spec;
}

int cmd_run(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help = with_endpoint_help(kRunHelp);
  ParsedArgs p = parse_args(args,
                            {{"--cpu", true},
                             {"--memory", true},
                             {"--disk", true},
                             {"--pids", true},
                             {"--env", true, true},
                             {"--label", true, true},
                             {"--tenant", true},
                             {"--workdir", true},
                             {"--user", true},
                             {"--protect", true, true},
                             {"--timeout", true},
                             {"--ttl", true},
                             {"--kind", true},
                             {"--display", true},
                             {"-i", false},
                             {"--interactive", false},
                             {"--keep", false}},
                            global, help, /*command_after=*/1);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (p.positional.empty()) throw UsageError("run needs an IMAGE", help);
  bool keep = p.has("--keep");

  const SandboxSpec spec = run_spec(p, help);
  double timeout = number_option(p, "--timeout", 600, help);
  std::string stdin_data = (p.has("-i") || p.has("--interactive")) ? read_all_stdin() : std::string();

  std::string endpoint = pick_endpoint(global);
  if (keep && endpoint.empty())
    throw UsageError("--keep needs a running agent (--endpoint): a private agent and its sandboxes end with dsec",
                     help);

  return run_or_125([&] {
    Client client(client_options(global, endpoint));
    Sandbox sb = client.create(spec);
    if (p.command.empty() && keep) {
      fmt::print("{}\n", sb.release());
      return 0;
    }
    ExecRequest req;
    req.argv = p.command;
    if (req.argv.empty()) {
      // No command: the image's own (Entrypoint, then Cmd), as `docker run IMAGE` runs it.
      req.argv = sb.info().image_command;
      if (req.argv.empty()) {
        sb.destroy();
        throw UsageError(fmt::format("run needs a command: image {} names none (no Entrypoint or Cmd); dsec run "
                                     "IMAGE -- CMD [ARG...]",
                                     spec.image),
                         help);
      }
    }
    req.timeout_seconds = timeout;
    req.stdin_data = std::move(stdin_data);
    ExecResult r = exec_live(sb, req);
    if (keep) {
      fmt::print(stderr, "dsec: kept sandbox {}\n", sb.release());
    } else {
      sb.destroy();
    }
    return finish_exec(r, timeout);
  });
}

int cmd_exec(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help = with_endpoint_help(kExecHelp);
  ParsedArgs p = parse_args(args,
                            {{"--env", true, true},
                             {"--workdir", true},
                             {"--user", true},
                             {"--timeout", true},
                             {"-i", false},
                             {"--interactive", false}},
                            global, help, /*command_after=*/1);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (p.positional.empty()) throw UsageError("exec needs a sandbox ID", help);
  if (p.command.empty()) throw UsageError("exec needs a command: dsec exec ID -- CMD [ARG...]", help);
  ExecRequest req;
  req.argv = p.command;
  req.env = kv_option(p, "--env", help);
  req.cwd = p.get("--workdir").value_or("");
  req.user = p.get("--user").value_or("");
  req.timeout_seconds = number_option(p, "--timeout", 600, help);
  if (p.has("-i") || p.has("--interactive")) req.stdin_data = read_all_stdin();
  std::string endpoint = require_endpoint(global, "exec", help);

  return run_or_125([&] {
    Client client(client_options(global, endpoint));
    Sandbox sb = client.attach(p.positional[0]);
    ExecResult r = exec_live(sb, req);
    sb.release();
    return finish_exec(r, req.timeout_seconds);
  });
}

int cmd_rm(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help = with_endpoint_help(kRmHelp);
  ParsedArgs p = parse_args(args, {}, global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (p.positional.empty()) throw UsageError("rm needs at least one sandbox ID", help);
  std::string endpoint = require_endpoint(global, "rm", help);
  Client client(client_options(global, endpoint));
  int status = 0;
  for (const auto& id : p.positional) {
    try {
      client.attach(id).destroy();
      fmt::print("{}\n", id);
    } catch (const Error& e) {
      fmt::print(stderr, "dsec: {}: {}\n", e.code_name(), e.what());
      status = kExitFailure;
    }
  }
  return status;
}

int cmd_screenshot(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help = with_endpoint_help(kScreenshotHelp);
  ParsedArgs p = parse_args(args, {}, global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (p.positional.size() != 2) throw UsageError("screenshot needs a sandbox ID and a FILE", help);
  std::string endpoint = require_endpoint(global, "screenshot", help);
  Client client(client_options(global, endpoint));
  const std::string png = client.attach(p.positional[0]).screenshot();
  const std::string& file = p.positional[1];
  if (file == "-") {
    std::fwrite(png.data(), 1, png.size(), stdout);
    return std::fflush(stdout) == 0 ? 0 : kExitFailure;
  }
  std::ofstream out(file, std::ios::binary | std::ios::trunc);
  out.write(png.data(), static_cast<std::streamsize>(png.size()));
  if (!out.flush()) throw Error(Code::kPermissionDenied, fmt::format("cannot write {}", file));
  return 0;
}

int cmd_vnc(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help = with_endpoint_help(kVncHelp);
  ParsedArgs p = parse_args(args, {{"--stop", false}}, global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (p.positional.size() != 1) throw UsageError("vnc needs a sandbox ID", help);
  std::string endpoint = require_endpoint(global, "vnc", help);
  Client client(client_options(global, endpoint));
  Sandbox sb = client.attach(p.positional[0]);
  if (p.has("--stop")) {
    sb.stop_vnc();
    return 0;
  }
  const VncEndpoint vnc = sb.vnc_endpoint();
  fmt::print("{}\n{}\n", vnc.address, vnc.password);
  return 0;
}

int cmd_snapshot(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help = with_endpoint_help(kSnapshotHelp);
  ParsedArgs p = parse_args(args, {{"--json", false}}, global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (p.positional.size() != 2) throw UsageError("snapshot needs a sandbox ID and an image NAME", help);
  std::string endpoint = require_endpoint(global, "snapshot", help);
  Client client(client_options(global, endpoint));
  SnapshotResult r = client.attach(p.positional[0]).snapshot(p.positional[1]);
  if (!p.has("--json")) {
    fmt::print("{}\n", r.image);
    return 0;
  }
  nlohmann::json j{{"image", r.image},
                   {"sandbox", r.sandbox_id},
                   {"parent", r.parent},
                   {"store", r.store},
                   {"layer", {{"digest", r.layer_digest}, {"size", r.layer_bytes}, {"stored_size", r.stored_bytes}}},
                   {"file_bytes", r.file_bytes},
                   {"entries", r.entries},
                   {"frozen_seconds", r.frozen_seconds},
                   {"seconds", r.seconds}};
  fmt::print("{}\n", j.dump(2));
  return 0;
}

int cmd_node(const std::vector<std::string>& args, GlobalOptions& global) {
  const std::string help = with_endpoint_help(kNodeHelp);
  ParsedArgs p = parse_args(args, {{"--json", false}}, global, help);
  if (p.help) {
    fmt::print("{}", help);
    return 0;
  }
  if (!p.positional.empty()) throw UsageError("node takes no arguments", help);
  Client client(client_options(global, pick_endpoint(global)));
  auto nodes = client.nodes();
  if (p.has("--json")) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& n : nodes) out.push_back(protocol::encode(n));
    fmt::print("{}\n", out.dump(2));
    return 0;
  }
  for (const auto& n : nodes) {
    fmt::print("node {}  (dsecd {}, protocol {}, endpoint {})\n", n.id, n.version, n.protocol, client.endpoint());
    fmt::print("  capacity   {} cores, {} memory, {} disk ({} free)\n", n.cores, human_bytes(n.memory_bytes),
               human_bytes(n.disk_bytes), human_bytes(n.disk_free_bytes));
    fmt::print(
        "  load       {} sandboxes, {:g} cores and {} memory requested (overcommit x{:g} cpu, x{:g} memory), "
        "load1 {:.2f}\n",
        n.sandboxes, n.cpu_requested, human_bytes(n.memory_requested), n.cpu_overcommit, n.memory_overcommit, n.load1);
    fmt::print("  in use     {} memory; pressure (avg10) cpu {:.1f}%, memory {:.1f}% (full {:.1f}%), io full {:.1f}%\n",
               human_bytes(n.memory_used_bytes), n.pressure.cpu_some, n.pressure.memory_some, n.pressure.memory_full,
               n.pressure.io_full);
    fmt::print("  qos        core scheduling {}; latency cpus {}; reclaim {} ({} released); ksm {}\n",
               n.qos.core_scheduling ? "yes" : "no", n.qos.latency_cpus.empty() ? "none" : n.qos.latency_cpus,
               n.qos.reclaim.empty() ? "-" : n.qos.reclaim, human_bytes(n.qos.reclaimed_bytes),
               n.qos.ksm ? fmt::format("yes ({} sandboxes)", n.qos.ksm_sandboxes) : std::string("no"));
    fmt::print("  backends   {}\n", fmt::join(n.backends, ", "));
    fmt::print("  cgroups    {}\n", n.cgroup_version.empty() ? "-" : n.cgroup_version);
    fmt::print("  images     {}\n", n.images.empty() ? std::string("-") : fmt::format("{}", fmt::join(n.images, ", ")));
  }
  return 0;
}

}  // namespace

std::optional<int> sandbox_command(const std::string& command, const std::vector<std::string>& args,
                                   GlobalOptions& global) {
  if (command == "ps") return cmd_ps(args, global);
  if (command == "run") return cmd_run(args, global);
  if (command == "exec") return cmd_exec(args, global);
  if (command == "rm") return cmd_rm(args, global);
  if (command == "snapshot") return cmd_snapshot(args, global);
  if (command == "screenshot") return cmd_screenshot(args, global);
  if (command == "vnc") return cmd_vnc(args, global);
  if (command == "node") return cmd_node(args, global);
  return std::nullopt;
}

}  // namespace dsec::cli
