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
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "agent/agent.hpp"
#include "agent/backends/container/warm_pool.hpp"
#include "common/flags.hpp"
#include "common/log.hpp"
#include "dsec/error.hpp"
#include "dsec/spec.hpp"
#include "dsec/version.hpp"

namespace {

using dsec::agent::AgentConfig;
using dsec::flags::FlagError;
namespace flags = dsec::flags;

constexpr std::string_view kHeader = R"(usage: dsecd [flags]

The dsec node agent: serves protocol v1 (docs/protocol.md) over HTTP on a unix socket and/or TCP.

)";

constexpr std::string_view kFooter = R"(  --help                  this text

Signals: SIGTERM or SIGINT stops the agent and destroys every sandbox; SIGUSR2 stops it and leaves every sandbox
running for the next start to take over (keep --home, --state-dir, --run-dir, --cgroup-name and --node-id).
)";

[[noreturn]] void fail(std::string_view message) {
  fmt::print(stderr, "dsecd: {}\n", message);
  std::exit(2);
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

// A comma-separated list into *target, replacing what it held.
flags::Flag list(std::string name, std::string arg, std::string help, std::vector<std::string>* target) {
  return flags::text(std::move(name), std::move(arg), std::move(help),
                     [target](std::string_view v) { *target = split_list(v); });
}

// "A-B" or "F:N": two unsigned numbers around a separator, digits only.
template <typename T>
bool parse_pair(std::string_view text, char separator, T& first, T& second) {
  auto num = [](std::string_view t, T& out) {
    auto [ptr, ec] = std::from_chars(t.data(), t.data() + t.size(), out);
    return !t.empty() && ec == std::errc() && ptr == t.data() + t.size();
  };
  auto at = text.find(separator);
  return at != std::string_view::npos && num(text.substr(0, at), first) && num(text.substr(at + 1), second);
}

std::filesystem::path self_directory() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  return ec ? std::filesystem::path{} : exe.parent_path();
}

// Where the agent listens and who may call it.
flags::Table listener_flags(AgentConfig& c) {
  return {
      flags::text("--socket", "PATH",
                  "listen on this unix socket (default <run-dir>/dsecd.sock when --listen is not given)",
                  &c.unix_socket),
      flags::text("--listen", "HOST:PORT",
                  "listen on TCP (\"127.0.0.1:7070\", \"[::1]:7070\", \":7070\" for all addresses); needs TLS and "
                  "--tokens or --tls-client-ca, or --insecure-no-tls (docs/security.md)",
                  &c.tcp_listen),
      flags::text("--tls-cert", "FILE", "the TCP listener's certificate chain (PEM)", &c.tls_cert),
      flags::text("--tls-key", "FILE", "its private key (PEM)", &c.tls_key),
      flags::text("--tls-client-ca", "FILE", "ask every TCP client for a certificate this CA signed (mutual TLS)",
                  &c.tls_client_ca),
      flags::boolean("--insecure-no-tls",
                     "plain HTTP on TCP: for tests and trusted networks only (without --tokens, anyone who reaches "
                     "the port controls the node)",
                     &c.insecure_no_tls),
      flags::text("--tokens", "FILE",
                  "bearer tokens, one per line: TENANT ROLE SHA256-HEX (role tenant or admin; `dsec token new` makes "
                  "one); every call over TCP needs one, and a tenant's reaches only its sandboxes",
                  &c.tokens_file),
      flags::boolean("--tokens-on-unix",
                     "calls over the unix socket need a token too (else the socket file's mode decides)",
                     &c.tokens_on_unix),
      flags::repeated("--tenant-quota", "T=LIMITS",
                      "at most so much for tenant T on this node: LIMITS is any of sandboxes:N, cpu:CORES, "
                      "memory:SIZE, comma-separated (\"team-a=sandboxes:100,cpu:64,memory:256Gi\"); repeat per tenant. "
                      "A create past one is 429 RESOURCE_EXHAUSTED naming the quota",
                      [&c](std::string_view v) {
                        auto [tenant, quota] = dsec::agent::parse_tenant_quota(v);
                        if (!c.tenant_quotas.emplace(tenant, quota).second)
                          throw FlagError(fmt::format("--tenant-quota: tenant '{}' given twice", tenant));
                      }),
      flags::text("--audit-log", "FILE",
                  "a JSON line per call (who, what, which sandbox, outcome), rotated at 64 MiB (default "
                  "<home>/audit/dsecd.log with --tokens, else none)",
                  &c.audit_log),
  };
}

// Images of OCI registries, imported on first use (docs/images.md).
flags::Table registry_flags(AgentConfig& c) {
  return {
      flags::repeated("--registry-auth", "HOST=USER:PASSWORD",
                      "credentials for a registry (repeat for more); else --registry-config's", &c.registry.auth,
                      "HOST=USER:PASSWORD"),
      flags::text("--registry-auth-file", "FILE",
                  "credentials for registries, one HOST=USER:PASSWORD a line (off the command line)",
                  &c.registry.auth_file),
      flags::text("--registry-config", "FILE",
                  "Docker's config.json to read registry credentials from (default $DOCKER_CONFIG/config.json, else "
                  "~/.docker/config.json; '' for none)",
                  &c.registry.docker_config),
      flags::repeated("--registry-mirror", "HOST=URL", "ask this mirror first for HOST's images (repeat for more)",
                      &c.registry.mirrors, "HOST=URL"),
      flags::repeated("--insecure-registry", "HOST",
                      "plain HTTP for HOST when HTTPS fails (loopback registries always may); repeat for more",
                      &c.registry.insecure, "a host[:port]"),
      flags::text("--registry-ca", "FILE", "a CA bundle to trust for registries instead of the system's",
                  &c.registry.ca_file),
      flags::text("--registry-platform", "OS/ARCH", "the image taken from a multi-platform index (default linux/amd64)",
                  &c.registry.platform),
      flags::text("--default-registry", "HOST",
                  "where bare names no store has come from (docker.io: python:3.12 is docker.io/library/python:3.12; "
                  "default: none, bare names are store images only)",
                  &c.default_registry),
      flags::seconds("--image-cache-ttl", "SECS",
                     "an imported registry tag is asked of its registry again after this long (default 60)",
                     &c.registry_tag_ttl, {.min = 1}),
      flags::seconds("--registry-import-wait", "SECS",
                     "the longest a create waits for an image being imported; the import goes on (default 600)",
                     &c.registry_import_wait, {.min = 1}),
  };
}

// Where the agent keeps images, layers and records; what the node is called and runs.
flags::Table storage_flags(AgentConfig& c) {
  return {
      flags::text("--home", "DIR",
                  "image store (<home>/store), layer cache and sandbox records (default /var/lib/dsec)", &c.home),
      flags::text("--state-dir", "DIR", "sandbox records, re-read at start-up (default <home>/state/sandboxes)",
                  &c.state_dir),
      flags::text("--run-dir", "DIR", "per-sandbox runtime files (default /run/dsec)", &c.run_dir),
      flags::repeated("--store", "URL",
                      "an image store: a directory (also a shared filesystem) or http(s)://...; repeat for more, "
                      "tried in order (default <home>/store)",
                      &c.stores, "a directory or URL"),
      flags::text("--snapshot-store", "URL", "where snapshots of sandboxes are committed (default: the first --store)",
                  &c.snapshot_store, "a directory or URL"),
      flags::text("--snapshot-staging", "DIR",
                  "where snapshots stage their files, about twice their size (default <run-dir>/.snapshots; emptied "
                  "at start)",
                  &c.snapshot_staging_dir, "a directory"),
      flags::size("--snapshot-max-size", "SIZE",
                  "the most file content one snapshot may hold, sparse files counted whole (default 16Gi)",
                  &c.snapshot_max_bytes, {.min = 1, .expect = "a size such as 16Gi"}),
      flags::text("--layer-cache", "DIR", "the local cache of image layers (default <home>/cache/layers)",
                  &c.layer_cache_dir),
      flags::size("--layer-cache-size", "SIZE", "evict layers no sandbox uses beyond this, e.g. 50Gi (default 20Gi)",
                  &c.layer_cache_bytes, {.min = 1, .expect = "a size such as 20Gi"}),
      flags::choice("--layer-mode", "MODE",
                    "auto: stream layers on demand (EROFS over FUSE) where the kernel can, else extract them whole; "
                    "lazy: stream or fail to start; extract: always extract (default auto)",
                    {"auto", "lazy", "extract"}, &c.layer_mode),
      flags::text("--node-id", "ID", "prefixes every sandbox id (default: the hostname)", &c.node_id),
      flags::repeated("--label", "KEY=VALUE",
                      "a label of this node, reported in GET /v1/node for placement (node_selector); repeat for more",
                      [&c](std::string_view v) {
                        auto eq = v.find('=');
                        if (eq == std::string_view::npos || eq == 0 || eq > 253 ||
                            v.find('\0') != std::string_view::npos)
                          flags::bad_value("--label", v, "KEY=VALUE with a non-empty key of at most 253 bytes");
                        c.labels[std::string(v.substr(0, eq))] = std::string(v.substr(eq + 1));
                      }),
      flags::text("--init", "PATH", "the dsec-init binary (default: dsec-init next to dsecd)", &c.init_binary),
      list("--backends", "LIST",
           "comma-separated: container, microvm, vm, null, fncall (default container,fncall,microvm,vm; null simulates "
           "the control plane; fncall serves function calls, POST /v1/fncall; microvm and vm are left out, and GET "
           "/v1/node says why, where QEMU or the microVMs' guest kernel is missing)",
           &c.backends),
  };
}

// --microvm-* or --vm-*: the flags both QEMU tiers take.
flags::Table qemu_tier_flags(std::string_view tier_name, dsec::agent::QemuTierConfig& tier) {
  const bool vm = tier_name == "vm";
  auto name = [tier_name](std::string_view what) { return fmt::format("--{}-{}", tier_name, what); };
  // A full VM's flag says what it shares with the microVMs' instead of repeating it.
  auto help = [vm](std::string_view what, std::string text) {
    return vm ? fmt::format("as --microvm-{}, for full VMs (kind vm, docs/vm.md)", what) : std::move(text);
  };
  return {
      flags::text(name("qemu"), "PATH", help("qemu", "qemu-system-x86_64 (default: found on PATH)"), &tier.qemu),
      flags::choice(name("accelerator"), "A",
                    help("accelerator",
                         "auto: KVM where it really runs the guest (probed at start), else TCG; kvm; tcg (default "
                         "auto)"),
                    {"auto", "kvm", "tcg"}, &tier.accelerator),
      flags::choice(name("templates"), "on|off",
                    help("templates",
                         "start microVMs from templates (a guest of the same image and shape booted once and frozen; "
                         "its RAM shared copy-on-write) instead of booting each (default on)"),
                    {"on", "off"}, [&tier](std::string_view v) { tier.templates = v == "on"; }),
      flags::size(name("template-memory"), "SIZE",
                  help("template-memory",
                       "guest RAM the templates may hold together; past it the least recently used template is "
                       "dropped (default: a quarter of the node's memory)"),
                  &tier.template_memory_bytes, {.min = 1, .expect = "a size such as 4Gi"}),
      flags::integer(name("pool"), "N",
                     help("pool",
                          "keep N microVMs of each shape in use (image, memory, CPUs, disk) restored from its "
                          "template, warmed up and idle, so that a create claims one (default 0: no pools)"),
                     &tier.pool_size, {.max = 1000, .expect = "at most 1000 VMs per shape"}),
      flags::seconds(
          name("pool-idle"), "SECS",
          help("pool-idle", "a shape's pool is stopped once no create of it came for this long (default 600)"),
          &tier.pool_idle, {.min = 1}),
      flags::seconds(name("boot-timeout"), "SECS",
                     vm ? "as --microvm-boot-timeout, for full VMs (kind vm, docs/vm.md): it covers the whole "
                          "system's start (default 300)"
                        : "how long a guest may take to answer after QEMU starts (default 30)",
                     &tier.boot_timeout, {.min = 1}),
  };
}

// Restarts, sandbox networks, user namespaces and the agent's cgroup.
flags::Table node_flags(AgentConfig& c) {
  return {
      flags::choice("--on-restart", "MODE",
                    "what to do at start with the sandboxes an earlier run left (it was killed, crashed, or left them "
                    "on SIGUSR2): adopt takes over those still alive and marks the dead ones failed; remove destroys "
                    "them all (default adopt)",
                    {"adopt", "remove"}, [&c](std::string_view v) { c.adopt_sandboxes = v == "adopt"; }),
      flags::integer("--netns-pool", "N", "network namespaces kept ready (default 32)", &c.netns_pool_size),
      flags::text("--network-range", "CIDR",
                  "sandboxes with a network get a /30 each from here (default 10.88.0.0/16; agents sharing a host "
                  "need ranges of their own)",
                  &c.network_range),
      flags::repeated("--egress-deny", "CIDR", "a network no sandbox may reach, whatever its rules (repeatable)",
                      &c.egress_deny),
      flags::boolean("--no-open-egress",
                     "refuse network mode \"open\" (every sandbox's egress then goes through rules)",
                     &c.allow_open_egress, false),
      flags::text("--dns-upstream", "IP[:P]",
                  "the resolver the agent asks for names sandboxes' rules allow (default: the first IPv4 nameserver "
                  "of /etc/resolv.conf)",
                  &c.dns_upstream),
      flags::text("--expose-ports", "A-B", "node ports that exposed sandbox ports get (default 30000-32767)",
                  [&c](std::string_view v) {
                    unsigned first = 0, last = 0;
                    if (!parse_pair(v, '-', first, last) || first < 1 || last > 65535 || last < first)
                      flags::bad_value("--expose-ports", v, "a range of ports such as 30000-32767");
                    c.expose_first = static_cast<std::uint16_t>(first);
                    c.expose_last = static_cast<std::uint16_t>(last);
                  }),
      flags::text("--expose-host", "HOST",
                  "the host in the addresses expose answers (default: this machine's host name)", &c.expose_host),
      flags::choice("--userns", "MODE",
                    "user namespaces for container sandboxes and fork servers: auto (when the kernel has idmapped "
                    "mounts; default), on (refuse to start without), off (host ids)",
                    {"auto", "on", "off"}, &c.userns),
      flags::text("--userns-range", "F:N", "their host ids: N blocks of 65536 from id F (default 268435456:16384)",
                  [&c](std::string_view v) {
                    std::uint32_t first = 0, blocks = 0;
                    if (!parse_pair(v, ':', first, blocks) || first == 0 || blocks == 0 ||
                        std::uint64_t{first} + std::uint64_t{blocks} * 65536 > 0xFFFFFFFFull)
                      flags::bad_value("--userns-range", v,
                                       "FIRST:BLOCKS with blocks of 65536 ids within 1..4294967294");
                    c.userns_first = first;
                    c.userns_blocks = blocks;
                  }),
      flags::text("--cgroup-name", "NAME", "cgroup subtree of this agent (default dsec)", &c.cgroup_name),
      flags::boolean("--cgroup-favordynmods",
                     "switch the host's cgroup locking to favour migrations (remounts a cgroup hierarchy with "
                     "favordynmods, kept until reboot): sandboxes join their cgroups without waiting for an RCU grace "
                     "period, which cuts create's tail latency; forks and exits host-wide get slightly slower. Off by "
                     "default: it is a host setting",
                     &c.cgroup_favordynmods),
  };
}

// Requests, connections and how far the node admits past its size.
flags::Table capacity_flags(AgentConfig& c) {
  return {
      flags::size("--max-body", "BYTES", "largest request body, e.g. 256Mi (default 256Mi)", &c.max_body_bytes,
                  {.min = 1, .expect = "a size such as 256Mi"}),
      flags::integer("--max-connections", "N", "connections served at once (default 4096)", &c.max_connections),
      flags::number("--cpu-overcommit", "R", "admit cpu requests up to cores x R (default 32)", &c.cpu_overcommit),
      flags::number("--memory-overcommit", "R", "admit memory limits up to RAM x R (default 2)", &c.memory_overcommit),
      flags::number("--memory-overcommit-ceiling", "R",
                    "admit further, up to RAM x R, while the memory really in use stays low: the limit follows what "
                    "the node's sandboxes use per byte they were granted (docs/qos.md; default: off)",
                    &c.memory_overcommit_ceiling),
  };
}

// The node's registration in etcd.
flags::Table etcd_flags(AgentConfig& c) {
  return {
      flags::text("--etcd", "URL[,URL...]",
                  "register this node in etcd (client URLs of its members, e.g. http://10.0.0.2:2379): endpoint and "
                  "node info under <prefix>nodes/<node id>, kept under a lease",
                  [&c](std::string_view v) {
                    c.etcd_endpoints = split_list(v);
                    if (c.etcd_endpoints.empty())
                      throw FlagError("--etcd needs at least one URL such as http://127.0.0.1:2379");
                    for (const auto& e : c.etcd_endpoints)
                      if (e.rfind("http://", 0) != 0 && e.rfind("https://", 0) != 0)
                        flags::bad_value("--etcd", e, "an http:// or https:// URL");
                  }),
      flags::text("--etcd-prefix", "PREFIX", "key prefix in etcd (default /dsec/)", &c.etcd_prefix,
                  "a key prefix such as /dsec/"),
      flags::text("--etcd-ca", "FILE", "the CA bundle of https:// etcd members (default: the system's)",
                  &c.etcd_ca_file),
      flags::text("--etcd-cert", "FILE",
                  "a client certificate for etcd (etcd --client-cert-auth), with --etcd-key FILE", &c.etcd_client_cert),
      flags::text("--etcd-key", "FILE", "its private key", &c.etcd_client_key),
      flags::seconds("--etcd-lease-ttl", "SECS",
                     "the registration's lease: renewed every TTL/3, gone TTL after the agent dies (default 10)",
                     &c.etcd_lease_ttl, {.min = 2, .max = 86400}),
      flags::text("--advertise", "URL",
                  "the endpoint clients dial, registered in etcd (default http://<the --listen address>)",
                  &c.advertise),
      flags::seconds("--etcd-stop-renewing-after", "SECS",
                     "tests only: stop renewing the lease after SECS, so the node leaves when it expires",
                     &c.etcd_stop_renewing_after),
  };
}

// Swap for sleeping sandboxes, warm pools and classes of service (docs/qos.md).
flags::Table memory_flags(AgentConfig& c) {
  constexpr flags::Limits kSwapSize{.min = 1u << 20, .expect = "a size of at least 1Mi, such as 8Gi"};
  return {
      flags::text("--swap-file", "PATH",
                  "swap for sleeping sandboxes (docs/node.md): a swap file at PATH of --swap-size, made when missing "
                  "(on a local disk filesystem: not tmpfs or overlay), reused when it is one of that size, turned on "
                  "at start and off at a clean shutdown",
                  [&c](std::string_view v) {
                    if (v.empty() || v.front() != '/') flags::bad_value("--swap-file", v, "an absolute path");
                    c.swap_file = std::string(v);
                  }),
      flags::size("--swap-size", "SIZE", "the swap file's size, e.g. 8Gi (needed with --swap-file)", &c.swap_file_bytes,
                  kSwapSize),
      flags::size("--zram-size", "SIZE",
                  "swap for sleeping sandboxes in compressed RAM: a zram device of its own with SIZE of "
                  "(uncompressed) room, used before the swap file, removed at a clean shutdown",
                  &c.zram_bytes, kSwapSize),
      flags::text("--zram-algorithm", "NAME", "the zram device's compression (default lz4 where the kernel offers it)",
                  &c.zram_algorithm, "a name such as lz4 or zstd"),
      flags::seconds("--sleep-reclaim-timeout", "SECS",
                     "how long a sleep may spend pushing a sandbox's memory out (default 60)", &c.sleep_reclaim_timeout,
                     {.min = 1, .max = 3600}),
      flags::repeated("--warm-pool",
                      "IMAGE,size=N[,cpu=C][,memory=M][,disk=D][,pids=P][,open_files=F][,priority=CLASS][,ksm=true]",
                      "keep N container sandboxes of IMAGE with these resources started ahead of creates; a create "
                      "of that image and those resources claims one (docs/qos.md). Repeatable; all pools together "
                      "must fit the node's capacity with overcommit",
                      [&c](std::string_view v) { c.warm_pools.push_back(dsec::agent::container::parse_warm_pool(v)); }),
      flags::text("--latency-cpus", "auto|none|LIST",
                  "CPUs reserved for priority=latency sandboxes where the kernel has no core scheduling "
                  "(docs/qos.md): they run there only, every other sandbox elsewhere. auto (the default): 1 CPU in "
                  "16 on nodes of 8 or more CPUs, none on smaller ones",
                  &c.latency_cpus, "auto, none or a cpu list such as 3 or 6-7"),
      flags::choice("--reclaim", "auto|idle|off",
                    "cold-memory reclaim to the node's swap (docs/qos.md), driven by the agent's idle tracking "
                    "(auto: idle)",
                    {"auto", "idle", "off"}, &c.reclaim),
      flags::seconds("--reclaim-age", "SECS",
                     "memory a standard sandbox has not touched this long is reclaimed; batch after a quarter of it, "
                     "latency never (default 120)",
                     &c.reclaim_age, {.min = 1, .max = 86400}),
  };
}

// Function calls (docs/fncall.md): pools of fork servers and what each call gets.
flags::Table fncall_flags(dsec::agent::FnCallConfig& f) {
  return {
      flags::text("--fncall-image", "REF",
                  "the image of function calls that name none (needs python3; gcc and g++ for C and C++)",
                  &f.default_image),
      flags::repeated(
          "--fncall-pool", "LANG=MIN:MAX",
          "fork servers per pool of language LANG (python, shell, c, cpp): pools of the default image "
          "keep MIN, all grow with load up to MAX; MAX 0 turns the language off; repeat per language "
          "(defaults python=1:8, shell=1:8, c=1:4, cpp=1:4)",
          [&f](std::string_view v) {
            auto eq = v.find('=');
            auto colon = v.find(':', eq == std::string_view::npos ? 0 : eq);
            if (eq == std::string_view::npos || colon == std::string_view::npos)
              flags::bad_value("--fncall-pool", v, "LANG=MIN:MAX (e.g. python=1:8)");
            auto min = flags::parse_unsigned("--fncall-pool", v.substr(eq + 1, colon - eq - 1));
            auto max = flags::parse_unsigned("--fncall-pool", v.substr(colon + 1));
            if (min > max || max > 1024) throw FlagError(fmt::format("--fncall-pool: '{}': MIN <= MAX <= 1024", v));
            f.pools[std::string(v.substr(0, eq))] = {static_cast<std::uint32_t>(min), static_cast<std::uint32_t>(max)};
          }),
      list("--fncall-warm", "LIST",
           "languages whose pools of the default image start with the agent (e.g. python,shell)", &f.warm),
      list("--fncall-python-preload", "LIST",
           "modules the Python fork servers import before forking calls, comma-separated (default: json re math "
           "collections itertools functools heapq bisect random string typing dataclasses decimal fractions datetime "
           "statistics copy operator; \"\" for none)",
           &f.python_preload),
      flags::text("--fncall-uid", "UID[:GID]", "the unprivileged user calls run as (default 65534:65534)",
                  [&f](std::string_view v) {
                    auto colon = v.find(':');
                    auto uid = flags::parse_unsigned("--fncall-uid", v.substr(0, colon));
                    auto gid = colon == std::string_view::npos
                                   ? uid
                                   : flags::parse_unsigned("--fncall-uid", v.substr(colon + 1));
                    if (uid == 0 || gid == 0 || uid > 0xfffffffe || gid > 0xfffffffe)
                      throw FlagError(fmt::format("--fncall-uid: '{}': calls run as an unprivileged user (not 0)", v));
                    f.uid = static_cast<std::uint32_t>(uid);
                    f.gid = static_cast<std::uint32_t>(gid);
                  }),
      list("--fncall-gpus", "LIST", "GPUs handed to calls: 0,1 for /dev/nvidia0, /dev/nvidia1 (default none)", &f.gpus),
      flags::integer("--fncall-gpu-shares", "N", "shares each GPU is cut into for calls that share one (default 4)",
                     &f.gpu_shares, {.min = 1, .max = 1024}),
      flags::integer("--fncall-queue", "N",
                     "calls that may wait for a fork server at once; more are RESOURCE_EXHAUSTED (default 4096)",
                     &f.queue_limit, {.min = 1}),
      flags::seconds("--fncall-queue-wait", "SECS", "how long a call may wait for a fork server (default 60)",
                     &f.queue_wait),
      flags::seconds("--fncall-idle", "SECS",
                     "fork servers idle this long stop, down to their pool's minimum (default 60)", &f.idle_timeout),
      flags::seconds("--fncall-compile-timeout", "SECS", "C and C++: the compiler's time limit (default 60)",
                     &f.compile_timeout, {.min = 1}),
      flags::size("--fncall-compile-memory", "SIZE", "C and C++: the compiler's memory limit (default 1Gi)",
                  &f.compile_memory_bytes, {.min = 16u << 20, .expect = "a size of 16Mi or more"}),
      flags::number("--fncall-call-cpu", "CORES", "CPU each call may use (default 1)", &f.call_cpu),
  };
}

// Every flag of dsecd, in the order --help lists them. ready_fd: --ready-fd's descriptor (-1: none).
flags::Table dsecd_flags(AgentConfig& c, int& ready_fd) {
  flags::Table table;
  auto add = [&table](flags::Table part) { std::move(part.begin(), part.end(), std::back_inserter(table)); };
  add(listener_flags(c));
  add(storage_flags(c));
  add(registry_flags(c));
  table.push_back(flags::text("--microvm-kernel", "PATH",
                              "the microVMs' guest kernel: a vmlinux/bzImage file (modules from a \"modules\" "
                              "directory beside it) or a directory as scripts/guest-kernel.sh lays it out (default "
                              "/var/cache/dsec/guest-kernel/current)",
                              &c.microvm.kernel));
  add(qemu_tier_flags("microvm", c.microvm));
  add(qemu_tier_flags("vm", c.vm));
  add(node_flags(c));
  add(capacity_flags(c));
  add(etcd_flags(c));
  add(memory_flags(c));
  add(fncall_flags(c.fncall));
  table.push_back(
      flags::integer("--ready-fd", "N", "write \"ready\\n\" to fd N and close it once listening", &ready_fd));
  table.push_back(flags::action("--version", "print the version", [] {
    fmt::print("dsecd {} (protocol {})\n", dsec::kVersion, dsec::kProtocolVersion);
    std::exit(0);
  }));
  return table;
}

// What the flags leave to each other: checks across flags, and defaults that depend on others.
void complete_config(AgentConfig& config) {
  if (!config.swap_file.empty() && config.swap_file_bytes == 0) fail("--swap-file needs --swap-size (e.g. 8Gi)");
  if (config.swap_file.empty() && config.swap_file_bytes != 0) fail("--swap-size needs --swap-file PATH");
  if (!config.zram_algorithm.empty() && config.zram_bytes == 0) fail("--zram-algorithm needs --zram-size");
  if (config.unix_socket.empty() && config.tcp_listen.empty()) config.unix_socket = config.run_dir / "dsecd.sock";
  if (config.init_binary.empty()) config.init_binary = self_directory() / "dsec-init";
  if (config.cgroup_name.empty() || config.cgroup_name.find('/') != std::string::npos || config.cgroup_name == "." ||
      config.cgroup_name == "..")
    fail(fmt::format("--cgroup-name: '{}' is not a single cgroup name", config.cgroup_name));
}

// The command line into a config; --help and --version print and exit 0, a bad flag exits 2.
AgentConfig parse_command_line(int argc, char** argv, int& ready_fd) {
  AgentConfig config;
  config.backends = {"container", "fncall", "microvm", "vm"};
  flags::Table table = dsecd_flags(config, ready_fd);
  try {
    if (flags::parse(table, {argv + 1, argv + argc}) == flags::Parsed::kHelp) {
      fmt::print("{}{}{}", kHeader, flags::help(table), kFooter);
      std::exit(0);
    }
  } catch (const std::exception& e) {  // FlagError, or dsec::Error from the parsers of quotas and warm pools
    fail(e.what());
  }
  complete_config(config);
  return config;
}

// Signals are taken synchronously by this thread; every thread started after this inherits the blocked mask. A shell
// starts background jobs with SIGINT ignored, and an ignored signal never reaches sigwait: restore the default.
sigset_t block_stop_signals() {
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
  return stop_signals;
}

// The log line that says what the node serves, and "ready\n" on --ready-fd.
void announce(dsec::agent::Agent& agent, int ready_fd) {
  const auto& c = agent.config();
  std::vector<std::string> serving = agent.registry().kinds();
  if (std::find(c.backends.begin(), c.backends.end(), "fncall") != c.backends.end()) serving.push_back("fncall");
  dsec::agent::log_info("node {} serving {} on {}{}{} (home {})", c.node_id, fmt::join(serving, ","),
                        c.unix_socket.empty() ? "" : c.unix_socket.string(),
                        !c.unix_socket.empty() && !c.tcp_listen.empty() ? " and " : "",
                        c.tcp_listen.empty() ? "" : agent.tcp_endpoint(), c.home.string());
  if (ready_fd >= 0) {
    constexpr std::string_view kReady = "ready\n";
    if (::write(ready_fd, kReady.data(), kReady.size()) != static_cast<ssize_t>(kReady.size()))
      dsec::agent::log_warn("--ready-fd {}: {}", ready_fd, std::strerror(errno));
    ::close(ready_fd);
  }
}

// Waits for a stop signal, then stops: SIGUSR2 leaves the sandboxes running, SIGTERM and SIGINT destroy them.
int serve_until_stopped(std::unique_ptr<dsec::agent::Agent> agent, const sigset_t& stop_signals) {
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

}  // namespace

int main(int argc, char** argv) {
  int ready_fd = -1;
  AgentConfig config = parse_command_line(argc, argv, ready_fd);
  sigset_t stop_signals = block_stop_signals();
  std::unique_ptr<dsec::agent::Agent> agent;
  try {
    agent = std::make_unique<dsec::agent::Agent>(config);
    agent->start();
  } catch (const std::exception& e) {
    fail(e.what());
  }
  announce(*agent, ready_fd);
  return serve_until_stopped(std::move(agent), stop_signals);
}
