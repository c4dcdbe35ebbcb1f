// dsecd: the dsec node agent. Flags into an AgentConfig, then listen until SIGTERM or SIGINT and shut down in order
// (stop accepting, destroy every sandbox, release the backends, remove the socket file). Startup failures print one
// line to stderr and exit 2.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "agent/agent.hpp"
#include "agent/backends/container/warm_pool.hpp"
#include "common/log.hpp"
#include "dsec/error.hpp"
#include "dsec/spec.hpp"
#include "dsec/version.hpp"

namespace {

constexpr std::string_view kUsage = R"(usage: dsecd [flags]

The dsec node agent: serves protocol v1 (docs/protocol.md) over HTTP on a unix socket and/or TCP.

  --socket PATH           listen on this unix socket (default <run-dir>/dsecd.sock when --listen is not given)
  --listen HOST:PORT      listen on TCP ("127.0.0.1:7070", "[::1]:7070", ":7070" for all addresses); needs TLS
                          and --tokens or --tls-client-ca, or --insecure-no-tls (docs/security.md)
  --tls-cert FILE         the TCP listener's certificate chain (PEM)
  --tls-key FILE          its private key (PEM)
  --tls-client-ca FILE    ask every TCP client for a certificate this CA signed (mutual TLS)
  --insecure-no-tls       plain HTTP on TCP: for tests and trusted networks only (without --tokens, anyone who
                          reaches the port controls the node)
  --tokens FILE           bearer tokens, one per line: TENANT ROLE SHA256-HEX (role tenant or admin; `dsec token
                          new` makes one); every call over TCP needs one, and a tenant's reaches only its sandboxes
  --tokens-on-unix        calls over the unix socket need a token too (else the socket file's mode decides)
  --tenant-quota T=LIMITS at most so much for tenant T on this node: LIMITS is any of sandboxes:N, cpu:CORES,
                          memory:SIZE, comma-separated ("team-a=sandboxes:100,cpu:64,memory:256Gi"); repeat per
                          tenant. A create past one is 429 RESOURCE_EXHAUSTED naming the quota
  --audit-log FILE        a JSON line per call (who, what, which sandbox, outcome), rotated at 64 MiB (default
                          <home>/audit/dsecd.log with --tokens, else none)
  --home DIR              image store (<home>/store), layer cache and sandbox records (default /var/lib/dsec)
  --state-dir DIR         sandbox records, re-read at start-up (default <home>/state/sandboxes)
  --run-dir DIR           per-sandbox runtime files (default /run/dsec)
  --store URL             an image store: a directory (also a shared filesystem) or http(s)://...; repeat for
                          more, tried in order (default <home>/store)
  --snapshot-store URL    where snapshots of sandboxes are committed (default: the first --store)
  --snapshot-staging DIR  where snapshots stage their files, about twice their size (default <run-dir>/.snapshots;
                          emptied at start)
  --snapshot-max-size SIZE
                          the most file content one snapshot may hold, sparse files counted whole (default 16Gi)
  --layer-cache DIR       the local cache of image layers (default <home>/cache/layers)
  --layer-cache-size SIZE evict layers no sandbox uses beyond this, e.g. 50Gi (default 20Gi)
  --layer-mode MODE       auto: stream layers on demand (EROFS over FUSE) where the kernel can, else extract them
                          whole; lazy: stream or fail to start; extract: always extract (default auto)
  --node-id ID            prefixes every sandbox id (default: the hostname)
  --label KEY=VALUE       a label of this node, reported in GET /v1/node for placement (node_selector); repeat
                          for more
  --init PATH             the dsec-init binary (default: dsec-init next to dsecd)
  --backends LIST         comma-separated: container, microvm, vm, null, fncall (default
                          container,fncall,microvm,vm; null simulates the control plane; fncall serves function
                          calls, POST /v1/fncall; microvm and vm are left out, and GET /v1/node says why, where QEMU
                          or the microVMs' guest kernel is missing)
  --microvm-kernel PATH   the microVMs' guest kernel: a vmlinux/bzImage file (modules from a "modules" directory
                          beside it) or a directory as scripts/guest-kernel.sh lays it out (default
                          /var/cache/dsec/guest-kernel/current)
  --microvm-qemu PATH     qemu-system-x86_64 (default: found on PATH)
  --microvm-accelerator A auto: KVM where it really runs the guest (probed at start), else TCG; kvm; tcg
                          (default auto)
  --microvm-templates on|off
                          start microVMs from templates (a guest of the same image and shape booted once and
                          frozen; its RAM shared copy-on-write) instead of booting each (default on)
  --microvm-template-memory SIZE
                          guest RAM the templates may hold together; past it the least recently used template
                          is dropped (default: a quarter of the node's memory)
  --microvm-pool N        keep N microVMs of each shape in use (image, memory, CPUs, disk) restored from its
                          template, warmed up and idle, so that a create claims one (default 0: no pools)
  --microvm-pool-idle SECS
                          a shape's pool is stopped once no create of it came for this long (default 600)
  --microvm-boot-timeout SECS
                          how long a guest may take to answer after QEMU starts (default 30)
  --vm-qemu, --vm-accelerator, --vm-templates, --vm-template-memory, --vm-pool, --vm-pool-idle, --vm-boot-timeout
                          the same for full VMs (kind vm, docs/vm.md), which boot their image's own kernel; their
                          boot timeout covers the whole system's start (default 300)
  --on-restart MODE       what to do at start with the sandboxes an earlier run left (it was killed, crashed, or
                          left them on SIGUSR2): adopt takes over those still alive and marks the dead ones failed;
                          remove destroys them all (default adopt)
  --netns-pool N          network namespaces kept ready (default 32)
  --network-range CIDR    sandboxes with a network get a /30 each from here (default 10.88.0.0/16; agents sharing
                          a host need ranges of their own)
  --egress-deny CIDR      a network no sandbox may reach, whatever its rules (repeatable)
  --no-open-egress        refuse network mode "open" (every sandbox's egress then goes through rules)
  --dns-upstream IP[:P]   the resolver the agent asks for names sandboxes' rules allow (default: the first IPv4
                          nameserver of /etc/resolv.conf)
  --expose-ports A-B      node ports that exposed sandbox ports get (default 30000-32767)
  --expose-host HOST      the host in the addresses expose answers (default: this machine's host name)
  --userns MODE           user namespaces for container sandboxes and fork servers: auto (when the kernel has
                          idmapped mounts; default), on (refuse to start without), off (host ids)
  --userns-range F:N      their host ids: N blocks of 65536 from id F (default 268435456:16384)
  --cgroup-name NAME      cgroup subtree of this agent (default dsec)
  --cgroup-favordynmods   switch the host's cgroup locking to favour migrations (remounts a cgroup hierarchy with
                          favordynmods, kept until reboot): sandboxes join their cgroups without waiting for an RCU
                          grace period, which cuts create's tail latency; forks and exits host-wide get slightly
                          slower. Off by default: it is a host setting
  --max-body BYTES        largest request body, e.g. 256Mi (default 256Mi)
  --max-connections N     connections served at once (default 4096)
  --cpu-overcommit R      admit cpu requests up to cores x R (default 32)
  --memory-overcommit R   admit memory limits up to RAM x R (default 2)
  --memory-overcommit-ceiling R
                          admit further, up to RAM x R, while the memory really in use stays low: the limit follows
                          what the node's sandboxes use per byte they were granted (docs/qos.md; default: off)
  --etcd URL[,URL...]     register this node in etcd (client URLs of its members, e.g. http://10.0.0.2:2379):
                          endpoint and node info under <prefix>nodes/<node id>, kept under a lease
  --etcd-prefix PREFIX    key prefix in etcd (default /dsec/)
  --etcd-ca FILE          the CA bundle of https:// etcd members (default: the system's)
  --etcd-cert FILE        a client certificate for etcd (etcd --client-cert-auth), with --etcd-key FILE
  --etcd-key FILE
  --etcd-lease-ttl SECS   the registration's lease: renewed every TTL/3, gone TTL after the agent dies (default 10)
  --advertise URL         the endpoint clients dial, registered in etcd (default http://<the --listen address>)
  --etcd-stop-renewing-after SECS
                          tests only: stop renewing the lease after SECS, so the node leaves when it expires
  --swap-file PATH        swap for sleeping sandboxes (docs/node.md): a swap file at PATH of --swap-size, made when
                          missing (on a local disk filesystem: not tmpfs or overlay), reused when it is one of that
                          size, turned on at start and off at a clean shutdown
  --swap-size SIZE        the swap file's size, e.g. 8Gi (needed with --swap-file)
  --zram-size SIZE        swap for sleeping sandboxes in compressed RAM: a zram device of its own with SIZE of
                          (uncompressed) room, used before the swap file, removed at a clean shutdown
  --zram-algorithm NAME   the zram device's compression (default lz4 where the kernel offers it)
  --sleep-reclaim-timeout SECS
                          how long a sleep may spend pushing a sandbox's memory out (default 60)
  --warm-pool IMAGE,size=N[,cpu=C][,memory=M][,disk=D][,pids=P][,open_files=F][,priority=CLASS][,ksm=true]
                          keep N container sandboxes of IMAGE with these resources started ahead of creates; a
                          create of that image and those resources claims one (docs/qos.md). Repeatable; all pools
                          together must fit the node's capacity with overcommit
  --latency-cpus auto|none|LIST
                          CPUs reserved for priority=latency sandboxes where the kernel has no core scheduling
                          (docs/qos.md): they run there only, every other sandbox elsewhere. auto (the default):
                          1 CPU in 16 on nodes of 8 or more CPUs, none on smaller ones
  --reclaim auto|idle|off  cold-memory reclaim to the node's swap (docs/qos.md), driven by the agent's idle
                          tracking (auto: idle)
  --reclaim-age SECS      memory a standard sandbox has not touched this long is reclaimed; batch after a quarter
                          of it, latency never (default 120)
  --fncall-image REF      the image of function calls that name none (needs python3; gcc and g++ for C and C++)
  --fncall-pool LANG=MIN:MAX
                          fork servers per pool of language LANG (python, shell, c, cpp): pools of the default
                          image keep MIN, all grow with load up to MAX; MAX 0 turns the language off; repeat per
                          language (defaults python=1:8, shell=1:8, c=1:4, cpp=1:4)
  --fncall-warm LIST      languages whose pools of the default image start with the agent (e.g. python,shell)
  --fncall-python-preload LIST
                          modules the Python fork servers import before forking calls (default json,re,math,
                          collections,itertools,functools,heapq,bisect,random,string,typing,dataclasses,decimal,
                          fractions,datetime,statistics,copy,operator; "" for none)
  --fncall-uid UID[:GID]  the unprivileged user calls run as (default 65534:65534)
  --fncall-gpus LIST      GPUs handed to calls: 0,1 for /dev/nvidia0, /dev/nvidia1 (default none)
  --fncall-gpu-shares N   shares each GPU is cut into for calls that share one (default 4)
  --fncall-queue N        calls that may wait for a fork server at once; more are RESOURCE_EXHAUSTED (default 4096)
  --fncall-queue-wait SECS
                          how long a call may wait for a fork server (default 60)
  --fncall-idle SECS      fork servers idle this long stop, down to their pool's minimum (default 60)
  --fncall-compile-timeout SECS
                          C and C++: the compiler's time limit (default 60)
  --fncall-compile-memory SIZE
                          C and C++: the compiler's memory limit (default 1Gi)
  --fncall-call-cpu CORES CPU each call may use (default 1)
  --ready-fd N            write "ready\n" to fd N and close it once listening
  --version               print the version
  --help                  this text

Signals: SIGTERM or SIGINT stops the agent and destroys every sandbox; SIGUSR2 stops it and leaves every sandbox
running for the next start to take over (keep --home, --state-dir, --run-dir, --cgroup-name and --node-id).
)";

[[noreturn]] void fail(std::string_view message) {
  fmt::print(stderr, "dsecd: {}\n", message);
  std::exit(2);
}

std::uint64_t parse_unsigned(std::string_view flag, std::string_view text) {
  std::uint64_t v = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || ptr != text.data() + text.size() || text.empty())
    fail(fmt::format("{}: '{}' is not a non-negative integer", flag, text));
  return v;
}

double parse_ratio(std::string_view flag, std::string_view text) {
  try {
    std::size_t used = 0;
    double v = std::stod(std::string(text), &used);
    if (used == text.size() && v > 0 && v < 1e6) return v;
  } catch (const std::exception&) {
  }
  fail(fmt::format("{}: '{}' is not a positive number", flag, text));
}

std::vector<std::string> split_list(std::string_view text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= text.size()) {
    std::size_t end = text.find(',', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view item = text.substr(start, end - start);
    if (!item.empty()) out.emplace_back(item);
    start = end + 1;
  }
  return out;
}

std::filesystem::path self_directory() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::path{} : exe.parent_path();
}

}  // namespace

// "--microvm-pool" -> {"microvm", "pool"}, "--vm-pool" -> {"vm", "pool"}: the flags both QEMU tiers take.
std::optional<std::pair<std::string_view, std::string_view>> qemu_tier_flag(std::string_view flag) {
  static constexpr std::string_view kNames[] = {"qemu", "accelerator", "templates",   "template-memory",
                                                "pool", "pool-idle",   "boot-timeout"};
  for (std::string_view tier : {std::string_view("microvm"), std::string_view("vm")}) {
    std::string prefix = fmt::format("--{}-", tier);
    if (!flag.starts_with(prefix)) continue;
    std::string_view name = flag.substr(prefix.size());
    for (std::string_view known : kNames)
      if (name == known) return std::pair{tier, name};
  }
  return std::nullopt;
}

void set_qemu_tier_flag(dsec::agent::QemuTierConfig& tier, std::string_view flag, std::string_view name,
                        std::string_view value) {
  if (name == "qemu") {
    tier.qemu = std::string(value);
  } else if (name == "accelerator") {
    if (value != "auto" && value != "kvm" && value != "tcg")
      fail(fmt::format("{}: '{}' is not one of auto, kvm, tcg", flag, value));
    tier.accelerator = std::string(value);
  } else if (name == "templates") {
    if (value != "on" && value != "off") fail(fmt::format("{}: '{}' is not on or off", flag, value));
    tier.templates = value == "on";
  } else if (name == "template-memory") {
    auto size = dsec::parse_size(value);
    if (!size || *size == 0) fail(fmt::format("{}: '{}' is not a size such as 4Gi", flag, value));
    tier.template_memory_bytes = *size;
  } else if (name == "pool") {
    std::size_t n = parse_unsigned(flag, value);
    if (n > 1000) fail(fmt::format("{}: at most 1000 VMs per shape", flag));
    tier.pool_size = static_cast<std::uint32_t>(n);
  } else if (name == "pool-idle") {
    std::size_t secs = parse_unsigned(flag, value);
    if (secs == 0) fail(fmt::format("{}: must be at least 1", flag));
    tier.pool_idle = std::chrono::seconds(secs);
  } else if (name == "boot-timeout") {
    std::size_t secs = parse_unsigned(flag, value);
    if (secs == 0) fail(fmt::format("{}: must be at least 1", flag));
    tier.boot_timeout = std::chrono::seconds(secs);
  }
}

int main(int argc, char** argv) {
  using dsec::agent::AgentConfig;
  AgentConfig config;
  config.backends = {"container", "fncall", "microvm", "vm"};
  std::optional<int> ready_fd;

  std::vector<std::string_view> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string_view flag = args[i];
    std::string_view value;
    if (auto eq = flag.find('='); flag.substr(0, 2) == "--" && eq != std::string_view::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else if (flag != "--help" && flag != "-h" && flag != "--version" && flag != "--cgroup-favordynmods" &&
               flag != "--insecure-no-tls" && flag != "--tokens-on-unix" && flag != "--no-open-egress") {
      if (i + 1 >= args.size()) fail(fmt::format("{} needs a value (see --help)", flag));
      value = args[++i];
    }
    if (flag == "--help" || flag == "-h") {
      fmt::print("{}", kUsage);
      return 0;
    } else if (flag == "--version") {
      fmt::print("dsecd {} (protocol {})\n", dsec::kVersion, dsec::kProtocolVersion);
      return 0;
    } else if (flag == "--socket") {
      config.unix_socket = std::string(value);
    } else if (flag == "--listen") {
      config.tcp_listen = std::string(value);
    } else if (flag == "--etcd-ca") {
      config.etcd_ca_file = std::string(value);
    } else if (flag == "--etcd-cert") {
      config.etcd_client_cert = std::string(value);
    } else if (flag == "--etcd-key") {
      config.etcd_client_key = std::string(value);
    } else if (flag == "--tls-cert") {
      config.tls_cert = std::string(value);
    } else if (flag == "--tls-key") {
      config.tls_key = std::string(value);
    } else if (flag == "--tls-client-ca") {
      config.tls_client_ca = std::string(value);
    } else if (flag == "--insecure-no-tls") {
      config.insecure_no_tls = true;
    } else if (flag == "--tokens") {
      config.tokens_file = std::string(value);
    } else if (flag == "--tokens-on-unix") {
      config.tokens_on_unix = true;
    } else if (flag == "--tenant-quota") {
      try {
        auto [tenant, quota] = dsec::agent::parse_tenant_quota(value);
        if (!config.tenant_quotas.emplace(tenant, quota).second)
          fail(fmt::format("--tenant-quota: tenant '{}' given twice", tenant));
      } catch (const dsec::Error& e) {
        fail(e.what());
      }
    } else if (flag == "--audit-log") {
      config.audit_log = std::string(value);
    } else if (flag == "--state-dir") {
      config.state_dir = std::string(value);
    } else if (flag == "--home") {
      config.home = std::string(value);
    } else if (flag == "--run-dir") {
      config.run_dir = std::string(value);
    } else if (flag == "--store") {
      if (value.empty()) fail("--store needs a directory or URL");
      config.stores.emplace_back(value);
    } else if (flag == "--snapshot-store") {
      if (value.empty()) fail("--snapshot-store needs a directory or URL");
      config.snapshot_store = std::string(value);
    } else if (flag == "--snapshot-staging") {
      if (value.empty()) fail("--snapshot-staging needs a directory");
      config.snapshot_staging_dir = std::string(value);
    } else if (flag == "--snapshot-max-size") {
      auto size = dsec::parse_size(value);
      if (!size || *size == 0) fail(fmt::format("--snapshot-max-size: '{}' is not a size such as 16Gi", value));
      config.snapshot_max_bytes = *size;
    } else if (flag == "--layer-cache") {
      config.layer_cache_dir = std::string(value);
    } else if (flag == "--layer-cache-size") {
      auto size = dsec::parse_size(value);
      if (!size || *size == 0) fail(fmt::format("--layer-cache-size: '{}' is not a size such as 20Gi", value));
      config.layer_cache_bytes = *size;
    } else if (flag == "--layer-mode") {
      if (value != "auto" && value != "lazy" && value != "extract")
        fail(fmt::format("--layer-mode: '{}' is not one of auto, lazy, extract", value));
      config.layer_mode = std::string(value);
    } else if (flag == "--node-id") {
      config.node_id = std::string(value);
    } else if (flag == "--label") {
      auto eq = value.find('=');
      if (eq == std::string_view::npos || eq == 0 || eq > 253 || value.find('\0') != std::string_view::npos)
        fail(fmt::format("--label: '{}' is not KEY=VALUE with a non-empty key of at most 253 bytes", value));
      config.labels[std::string(value.substr(0, eq))] = std::string(value.substr(eq + 1));
    } else if (flag == "--init") {
      config.init_binary = std::string(value);
    } else if (flag == "--backends") {
      config.backends = split_list(value);
    } else if (flag == "--microvm-kernel") {
      config.microvm.kernel = std::string(value);
    } else if (auto tier_flag = qemu_tier_flag(flag)) {
      set_qemu_tier_flag(tier_flag->first == "vm" ? config.vm : config.microvm, flag, tier_flag->second, value);
    } else if (flag == "--on-restart") {
      if (value != "adopt" && value != "remove")
        fail(fmt::format("--on-restart: '{}' is not one of adopt, remove", value));
      config.adopt_sandboxes = value == "adopt";
    } else if (flag == "--netns-pool") {
      config.netns_pool_size = parse_unsigned(flag, value);
    } else if (flag == "--network-range") {
      config.network_range = std::string(value);
    } else if (flag == "--egress-deny") {
      config.egress_deny.emplace_back(value);
    } else if (flag == "--dns-upstream") {
      config.dns_upstream = std::string(value);
    } else if (flag == "--no-open-egress") {
      config.allow_open_egress = false;
    } else if (flag == "--expose-ports") {
      auto dash = value.find('-');
      unsigned first = 0, last = 0;
      auto num = [](std::string_view t, unsigned& out) {
        auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
        return !t.empty() && ec == std::errc() && ptr == t.data() + t.size();
      };
      if (dash == std::string_view::npos || !num(value.substr(0, dash), first) || !num(value.substr(dash + 1), last) ||
          first < 1 || last > 65535 || last < first)
        fail(fmt::format("--expose-ports: '{}' is not a range of ports such as 30000-32767", value));
      config.expose_first = static_cast<std::uint16_t>(first);
      config.expose_last = static_cast<std::uint16_t>(last);
    } else if (flag == "--expose-host") {
      config.expose_host = std::string(value);
    } else if (flag == "--userns") {
      if (value != "auto" && value != "on" && value != "off")
        fail(fmt::format("--userns: '{}' is not one of auto, on, off", value));
      config.userns = std::string(value);
    } else if (flag == "--userns-range") {
      auto colon = value.find(':');
      std::uint32_t first = 0, blocks = 0;
      auto parse = [](std::string_view t, std::uint32_t& out) {
        auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
        return !t.empty() && ec == std::errc() && ptr == t.data() + t.size();
      };
      if (colon == std::string_view::npos || !parse(value.substr(0, colon), first) ||
          !parse(value.substr(colon + 1), blocks) || first == 0 || blocks == 0 ||
          std::uint64_t{first} + std::uint64_t{blocks} * 65536 > 0xFFFFFFFFull)
        fail(fmt::format("--userns-range: '{}' is not FIRST:BLOCKS with blocks of 65536 ids within 1..4294967294",
                         value));
      config.userns_first = first;
      config.userns_blocks = blocks;
    } else if (flag == "--cgroup-favordynmods") {
      config.cgroup_favordynmods = true;
    } else if (flag == "--cgroup-name") {
      config.cgroup_name = std::string(value);
    } else if (flag == "--max-body") {
      auto size = dsec::parse_size(value);
      if (!size || *size == 0) fail(fmt::format("--max-body: '{}' is not a size such as 256Mi", value));
      config.max_body_bytes = *size;
    } else if (flag == "--max-connections") {
      config.max_connections = parse_unsigned(flag, value);
    } else if (flag == "--cpu-overcommit") {
      config.cpu_overcommit = parse_ratio(flag, value);
    } else if (flag == "--memory-overcommit") {
      config.memory_overcommit = parse_ratio(flag, value);
    } else if (flag == "--memory-overcommit-ceiling") {
      config.memory_overcommit_ceiling = parse_ratio(flag, value);
    } else if (flag == "--etcd") {
      config.etcd_endpoints = split_list(value);
      if (config.etcd_endpoints.empty()) fail("--etcd needs at least one URL such as http://127.0.0.1:2379");
      for (const auto& e : config.etcd_endpoints)
        if (e.rfind("http://", 0) != 0 && e.rfind("https://", 0) != 0)
          fail(fmt::format("--etcd: '{}' is not an http:// or https:// URL", e));
    } else if (flag == "--etcd-prefix") {
      if (value.empty()) fail("--etcd-prefix needs a key prefix such as /dsec/");
      config.etcd_prefix = std::string(value);
    } else if (flag == "--etcd-lease-ttl") {
      auto ttl = parse_unsigned(flag, value);
      if (ttl < 2 || ttl > 86400) fail(fmt::format("--etcd-lease-ttl: {} is not between 2 and 86400 seconds", ttl));
      config.etcd_lease_ttl = std::chrono::seconds(ttl);
    } else if (flag == "--advertise") {
      config.advertise = std::string(value);
    } else if (flag == "--etcd-stop-renewing-after") {
      config.etcd_stop_renewing_after = std::chrono::seconds(parse_unsigned(flag, value));
    } else if (flag == "--swap-file") {
      if (value.empty() || value.front() != '/') fail(fmt::format("--swap-file: '{}' is not an absolute path", value));
      config.swap_file = std::string(value);
    } else if (flag == "--swap-size" || flag == "--zram-size") {
      auto size = dsec::parse_size(value);
      if (!size || *size < (1u << 20))
        fail(fmt::format("{}: '{}' is not a size of at least 1Mi, such as 8Gi", flag, value));
      (flag == "--swap-size" ? config.swap_file_bytes : config.zram_bytes) = *size;
    } else if (flag == "--zram-algorithm") {
      if (value.empty()) fail("--zram-algorithm needs a name such as lz4 or zstd");
      config.zram_algorithm = std::string(value);
    } else if (flag == "--sleep-reclaim-timeout") {
      auto secs = parse_unsigned(flag, value);
      if (secs < 1 || secs > 3600)
        fail(fmt::format("--sleep-reclaim-timeout: {} is not between 1 and 3600 seconds", secs));
      config.sleep_reclaim_timeout = std::chrono::seconds(secs);
    } else if (flag == "--warm-pool") {
      try {
        config.warm_pools.push_back(dsec::agent::container::parse_warm_pool(value));
      } catch (const dsec::Error& e) {
        fail(e.what());
      }
    } else if (flag == "--latency-cpus") {
      if (value.empty()) fail("--latency-cpus needs auto, none or a cpu list such as 3 or 6-7");
      config.latency_cpus = std::string(value);
    } else if (flag == "--reclaim") {
      if (value != "auto" && value != "idle" && value != "off")
        fail(fmt::format("--reclaim: '{}' is not auto, idle or off", value));
      config.reclaim = std::string(value);
    } else if (flag == "--reclaim-age") {
      auto secs = parse_unsigned(flag, value);
      if (secs < 1 || secs > 86400) fail(fmt::format("--reclaim-age: {} is not between 1 and 86400 seconds", secs));
      config.reclaim_age = std::chrono::seconds(secs);
    } else if (flag == "--fncall-image") {
      config.fncall.default_image = std::string(value);
    } else if (flag == "--fncall-pool") {
      auto eq = value.find('=');
      auto colon = value.find(':', eq == std::string_view::npos ? 0 : eq);
      if (eq == std::string_view::npos || colon == std::string_view::npos)
        fail(fmt::format("--fncall-pool: '{}' is not LANG=MIN:MAX (e.g. python=1:8)", value));
      std::string language(value.substr(0, eq));
      auto min = parse_unsigned(flag, value.substr(eq + 1, colon - eq - 1));
      auto max = parse_unsigned(flag, value.substr(colon + 1));
      if (min > max || max > 1024) fail(fmt::format("--fncall-pool: '{}': MIN <= MAX <= 1024", value));
      config.fncall.pools[language] = {static_cast<std::uint32_t>(min), static_cast<std::uint32_t>(max)};
    } else if (flag == "--fncall-warm") {
      config.fncall.warm = split_list(value);
    } else if (flag == "--fncall-python-preload") {
      config.fncall.python_preload = split_list(value);
    } else if (flag == "--fncall-uid") {
      auto colon = value.find(':');
      auto uid = parse_unsigned(flag, value.substr(0, colon));
      auto gid = colon == std::string_view::npos ? uid : parse_unsigned(flag, value.substr(colon + 1));
      if (uid == 0 || gid == 0 || uid > 0xfffffffe || gid > 0xfffffffe)
        fail(fmt::format("--fncall-uid: '{}': calls run as an unprivileged user (not 0)", value));
      config.fncall.uid = static_cast<std::uint32_t>(uid);
      config.fncall.gid = static_cast<std::uint32_t>(gid);
    } else if (flag == "--fncall-gpus") {
      config.fncall.gpus = split_list(value);
    } else if (flag == "--fncall-gpu-shares") {
      auto n = parse_unsigned(flag, value);
      if (n < 1 || n > 1024) fail(fmt::format("--fncall-gpu-shares: {} is not from 1 to 1024", n));
      config.fncall.gpu_shares = static_cast<std::uint32_t>(n);
    } else if (flag == "--fncall-queue") {
      config.fncall.queue_limit = parse_unsigned(flag, value);
      if (config.fncall.queue_limit == 0) fail("--fncall-queue: at least 1");
    } else if (flag == "--fncall-queue-wait") {
      config.fncall.queue_wait = std::chrono::seconds(parse_unsigned(flag, value));
    } else if (flag == "--fncall-idle") {
      config.fncall.idle_timeout = std::chrono::seconds(parse_unsigned(flag, value));
    } else if (flag == "--fncall-compile-timeout") {
      auto secs = parse_unsigned(flag, value);
      if (secs < 1) fail("--fncall-compile-timeout: at least 1 second");
      config.fncall.compile_timeout = std::chrono::seconds(secs);
    } else if (flag == "--fncall-compile-memory") {
      auto size = dsec::parse_size(value);
      if (!size || *size < (16u << 20))
        fail(fmt::format("--fncall-compile-memory: '{}' is not a size of 16Mi or more", value));
      config.fncall.compile_memory_bytes = *size;
    } else if (flag == "--fncall-call-cpu") {
      config.fncall.call_cpu = parse_ratio(flag, value);
    } else if (flag == "--ready-fd") {
      ready_fd = static_cast<int>(parse_unsigned(flag, value));
    } else {
      fail(fmt::format("unknown flag '{}' (see --help)", flag));
    }
  }
  if (!config.swap_file.empty() && config.swap_file_bytes == 0) fail("--swap-file needs --swap-size (e.g. 8Gi)");
  if (config.swap_file.empty() && config.swap_file_bytes != 0) fail("--swap-size needs --swap-file PATH");
  if (!config.zram_algorithm.empty() && config.zram_bytes == 0) fail("--zram-algorithm needs --zram-size");
  if (config.unix_socket.empty() && config.tcp_listen.empty()) config.unix_socket = config.run_dir / "dsecd.sock";
  if (config.init_binary.empty()) config.init_binary = self_directory() / "dsec-init";
  if (config.cgroup_name.empty() || config.cgroup_name.find('/') != std::string::npos || config.cgroup_name == "." ||
      config.cgroup_name == "..")
    fail(fmt::format("--cgroup-name: '{}' is not a single cgroup name", config.cgroup_name));

  // Signals are taken synchronously by this thread; every thread started below inherits the blocked mask. A shell
  // starts background jobs with SIGINT ignored, and an ignored signal never reaches sigwait: restore the default.
  ::signal(SIGTERM, SIG_DFL);
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGUSR2, SIG_DFL);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGUSR2);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  std::unique_ptr<dsec::agent::Agent> agent;
  try {
    agent = std::make_unique<dsec::agent::Agent>(config);
    agent->start();
  } catch (const std::exception& e) {
    fail(e.what());
  }
  const auto& c = agent->config();
  std::vector<std::string> serving = agent->registry().kinds();
  if (std::find(c.backends.begin(), c.backends.end(), "fncall") != c.backends.end()) serving.push_back("fncall");
  dsec::agent::log_info("node {} serving {} on {}{}{} (home {})", c.node_id, fmt::join(serving, ","),
                        c.unix_socket.empty() ? "" : c.unix_socket.string(),
                        !c.unix_socket.empty() && !c.tcp_listen.empty() ? " and " : "",
                        c.tcp_listen.empty() ? "" : agent->tcp_endpoint(), c.home.string());
  if (ready_fd) {
    constexpr std::string_view kReady = "ready\n";
    if (::write(*ready_fd, kReady.data(), kReady.size()) != static_cast<ssize_t>(kReady.size()))
      dsec::agent::log_warn("--ready-fd {}: {}", *ready_fd, std::strerror(errno));
    ::close(*ready_fd);
  }

  int sig = 0;
  while (sigwait(&stop_signals, &sig) != 0) {
  }
  if (sig == SIGUSR2) {
    // The sandbox objects would destroy their sandboxes with the agent: it is left undestroyed, on purpose.
    agent->leave();
    (void)agent.release();
    dsec::agent::log_info("SIGUSR2: stopped; sandboxes left running");
    std::fflush(stderr);
    std::_Exit(0);
  }
  dsec::agent::log_info("{}: shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  agent->stop();
  agent.reset();
  dsec::agent::log_info("stopped");
  return 0;
}
