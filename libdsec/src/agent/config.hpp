// How one node agent is set up. Filled from dsecd's flags; the embedded agent gets the defaults plus a private
// socket and home.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "agent/registry/tenant_quota.hpp"
#include "dsec/spec.hpp"
#include "image/registry/registry_client.hpp"

namespace dsec::agent {

// The fncall backend (docs/fncall.md): warm pools of fork servers for function calls.
struct FnCallConfig {
  // The image of calls that name none (a name in the agent's stores, or pinned); empty: such calls are refused.
  std::string default_image;
  // Fork servers per pool, by language ("python", "shell", "c", "cpp"): a pool of the default image keeps at least
  // `min` and grows with load up to `max`; pools of other images start on first use and go when idle. max 0: the
  // node does not serve that language.
  struct Bounds {
    std::uint32_t min = 1;
    std::uint32_t max = 8;
  };
  std::map<std::string, Bounds, std::less<>> pools{
      {"python", {1, 8}}, {"shell", {1, 8}}, {"c", {1, 4}}, {"cpp", {1, 4}}};
  // Languages whose pools of the default image start with the agent (the others start on first use).
  std::vector<std::string> warm;
  // Modules the Python fork servers import before forking calls; missing ones are skipped (and reported).
  std::vector<std::string> python_preload{"json",    "re",        "math",     "collections", "itertools", "functools",
                                          "heapq",   "bisect",    "random",   "string",      "typing",    "dataclasses",
                                          "decimal", "fractions", "datetime", "statistics",  "copy",      "operator"};
  // Calls run as this unprivileged user and group.
  std::uint32_t uid = 65534;
  std::uint32_t gid = 65534;
  // GPUs the node hands to calls ("0", "1", ... for /dev/nvidia0, ...), each cut into `gpu_shares` shares for
  // calls that share one.
  std::vector<std::string> gpus;
  std::uint32_t gpu_shares = 4;
  // Calls that may wait for a fork server at once (beyond: RESOURCE_EXHAUSTED), and how long one may wait.
  std::size_t queue_limit = 4096;
  std::chrono::seconds queue_wait{60};
  // A fork server idle this long is stopped (down to the pool's min); a pool of another image than the default
  // with no server left is removed.
  std::chrono::seconds idle_timeout{60};
  // C and C++: the compiler's own limits (the call's are applied to the program it built).
  std::chrono::seconds compile_timeout{60};
  std::uint64_t compile_memory_bytes = 1ull << 30;
  // CPU (cores, a CFS quota) each call may use.
  double call_cpu = 1.0;
};

// A warm pool of container sandboxes (dsecd --warm-pool, backends/container/warm_pool.hpp): `size` sandboxes of
// `image` with `resources` started ahead of any create; a create of that image and those resources claims one.
struct WarmPoolConfig {
  std::string image;
  Resources resources;
  std::uint32_t size = 0;
};

// A QEMU tier: the microvm backend (docs/microvm.md: one QEMU microvm per sandbox, a kernel of the node's) or the
// vm backend (docs/vm.md: a q35 machine booting the image's own kernel and systemd, with a screen).
struct QemuTierConfig {
  std::filesystem::path qemu;    // qemu-system-x86_64; empty: found on PATH
  std::filesystem::path kernel;  // microvm: the guest kernel (a file or a directory as scripts/guest-kernel.sh lays
                                 // it out); empty: /var/cache/dsec/guest-kernel/current. A full VM boots its image's.
  std::string accelerator = "auto";    // auto (KVM where it really runs the guest, else TCG) | kvm | tcg
  std::uint32_t tcg_tb_size_mib = 32;  // TCG's translation cache per VM
  // QEMU processes run as uid_base + n (gid the same), n < uid_count: a uid of its own per VM.
  std::uint32_t uid_base = 2000000000u;
  std::uint32_t uid_count = 65536;
  // Host memory a VM may use beyond its guest RAM (QEMU's heap, TCG's translation cache): part of its cgroup limit.
  std::uint64_t overhead_bytes = 160ull << 20;
  // How long a guest may take from QEMU's start to its agent's first answer (under TCG, on a loaded node, a boot
  // takes seconds), and how often a boot that did not answer is tried again.
  std::chrono::milliseconds boot_timeout{30000};
  std::uint32_t boot_attempts = 2;
  // Creates start from a template (a guest of the same image, memory, vCPUs and disk booted once and frozen) instead
  // of booting: a restore, its RAM shared copy-on-write with the template. The first create of a shape boots it.
  bool templates = true;
  // Guest RAM the templates may hold together (each holds its guest's RAM whole); past it the least recently used
  // go. 0: a quarter of the node's memory.
  std::uint64_t template_memory_bytes = 0;
  // Pre-booted pools (with templates): this many VMs of each shape in use kept restored, warmed up and idle, so a
  // create of the shape claims one instead of starting a VM. A shape's pool starts with its first create and goes
  // once no create of it came for pool_idle. Pooled VMs cost memory and CPU while they wait; 0: no pools.
  std::uint32_t pool_size = 0;
  std::chrono::milliseconds pool_idle{600000};
};
using MicroVmConfig = QemuTierConfig;

// The full VM tier's defaults: its QEMU processes get uids of their own range, a screen's memory and a whole
// system's boot (minutes under TCG) are allowed for.
inline QemuTierConfig default_vm_config() {
  QemuTierConfig c;
  c.uid_base = 2000000000u + 65536;
  c.overhead_bytes = 256ull << 20;
  c.boot_timeout = std::chrono::milliseconds(300000);
  c.boot_attempts = 1;
  c.tcg_tb_size_mib = 64;
  return c;
}

struct AgentConfig {
  std::string node_id;                // default: hostname; prefixes every sandbox id
  std::filesystem::path unix_socket;  // listen here (empty: no unix socket)
  std::string tcp_listen;             // "127.0.0.1:7070" (empty: no TCP)
  // Security of the listeners (docs/security.md). TCP speaks TLS with tls_cert/tls_key (and, with tls_client_ca,
  // asks every client for a certificate that CA signed); plain HTTP on TCP needs insecure_no_tls (tests, a trusted
  // network). With TLS, TCP also needs tokens or client certificates: a listener anyone can drive is refused.
  std::filesystem::path tls_cert, tls_key, tls_client_ca;
  bool insecure_no_tls = false;
  // Bearer tokens (http/tokens.hpp): every call over TCP needs one; with tokens_on_unix, calls over the unix
  // socket too (else the socket file's mode is its access control, and its callers are the operator).
  std::filesystem::path tokens_file;
  bool tokens_on_unix = false;
  // One JSON line per call (agent/api/audit_log.hpp); empty: <home>/audit/dsecd.log when tokens are used, else none.
  std::filesystem::path audit_log;
  // Per-tenant limits on this node (dsecd --tenant-quota; agent/registry/tenant_quota.hpp).
  TenantQuotas tenant_quotas;
  std::filesystem::path home = "/var/lib/dsec";  // store/ (images), cache/layers/, state/ (sandbox records)
  std::filesystem::path run_dir = "/run/dsec";   // per-sandbox runtime dirs (init sockets)
  std::filesystem::path state_dir;               // sandbox records; empty: <home>/state/sandboxes
  std::filesystem::path init_binary;             // dsec-init; default: next to dsecd
  std::string cgroup_name = "dsec";              // cgroup subtree (per agent: "dsec-<node_id>" when several run)
  std::size_t max_body_bytes = 256u << 20;       // request bodies (file uploads) larger than this are refused
  std::size_t max_header_bytes = 16u << 10;
  std::size_t max_connections = 4096;
  std::size_t netns_pool_size = 32;  // pre-created network namespaces
  // User namespaces of container sandboxes and fork servers (backends/container/user_namespace.hpp): "auto" (when
  // the kernel can), "on" (refuse to start without), "off" (host ids). Blocks of 65,536 host ids from userns_first,
  // userns_blocks of them, claimed host-wide in userns_claims_dir so that agents sharing a host never share a block.
  std::string userns = "auto";
  std::uint32_t userns_first = 268435456;
  std::uint32_t userns_blocks = 16384;
  std::filesystem::path userns_claims_dir = "/run/dsec-userns";
  // Sandbox networks (agent/network/node_network.hpp, docs/networking.md): the /30s of sandboxes with a network
  // come from network_range (agents sharing a host need ranges of their own); egress_deny is what no sandbox may
  // reach whatever its rules; allow_open_egress lets specs ask for mode "open".
  std::string network_range = "10.88.0.0/16";
  std::vector<std::string> egress_deny;
  bool allow_open_egress = true;
  // Where the sandboxes' DNS resolver asks for the names their rules allow: "IP[:PORT]"; empty: the first IPv4
  // nameserver of /etc/resolv.conf.
  std::string dns_upstream;
  // Exposed ports: the node's ports they get (dsecd --expose-ports FIRST-LAST) and the host name in the addresses
  // expose answers (--expose-host; default: the host name).
  std::uint16_t expose_first = 30000, expose_last = 32767;
  std::string expose_host;
  std::chrono::milliseconds reaper_interval{1000};
  std::chrono::seconds idle_timeout{120};  // a connection silent this long (reading or writing) is closed
  // Kinds this agent serves: "container", "null" (sandboxes), and "fncall" (function calls, POST /v1/fncall).
  // dsecd's own default (without --backends) is container and fncall.
  std::vector<std::string> backends{"container"};
  FnCallConfig fncall;
  QemuTierConfig microvm;
  QemuTierConfig vm = default_vm_config();
  // At start-up, the sandboxes an earlier run left (it was killed, crashed, or left them on purpose) are taken over
  // (true; dsecd --on-restart adopt) or destroyed (false; --on-restart remove). See Registry::recover_earlier_run.
  bool adopt_sandboxes = true;
  // Switch the host's cgroup locking to favour migrations (see enable_cgroup_favordynmods): cuts create's tail
  // latency; a host-wide setting, so off unless asked for.
  bool cgroup_favordynmods = false;
  // Image stores, tried in order: directories or "http(s)://" URLs. Empty: <home>/store, where `dsec image build`
  // puts images.
  std::vector<std::string> stores;
  // Snapshots (POST /v1/sandboxes/{id}/snapshot) are committed to this store (empty: the first of `stores`, else
  // <home>/store) and staged in snapshot_staging_dir (empty: <run_dir>/.snapshots; it needs about twice a snapshot's
  // files, three times at a moment, and is emptied at start). A snapshot's files may add up to snapshot_max_bytes
  // (sparse files counted whole).
  std::string snapshot_store;
  std::filesystem::path snapshot_staging_dir;
  std::uint64_t snapshot_max_bytes = 16ull << 30;
  // Registry images, imported into the first store on first use (docs/images.md): credentials, mirrors, insecure
  // hosts, CA and platform; the default registry of bare names (empty: none); how long an imported tag is trusted
  // before its registry is asked again; how long a create waits for an import.
  image::registry::RegistryFlags registry;
  std::string default_registry;
  std::chrono::seconds registry_tag_ttl{60};
  std::chrono::seconds registry_import_wait{600};
  std::filesystem::path layer_cache_dir;          // empty: <home>/cache/layers
  std::uint64_t layer_cache_bytes = 20ull << 30;  // unused layers are evicted beyond this
  std::string layer_mode = "auto";                // auto | lazy (EROFS over FUSE) | extract
  double cpu_overcommit = 32.0;                   // cpu is compressible: idle sandboxes use a few % of their quota
  double memory_overcommit = 2.0;                 // memory limits are ceilings; most sandboxes stay far below
  // Overcommit that follows real use (qos/usage_overcommit.hpp): admission may go up to memory x this ratio while
  // the memory really in use stays low. 0: off (memory_overcommit is the limit).
  double memory_overcommit_ceiling = 0;
  // The node's labels (dsecd --label k=v), reported in GET /v1/node; a create's node_selector must match them.
  std::map<std::string, std::string> labels;
  // Discovery: register in etcd under <etcd_prefix>nodes/<node_id> with a lease (empty: no registration). The
  // advertised endpoint is what clients dial; default http://<the bound TCP address>.
  std::vector<std::string> etcd_endpoints;
  std::string etcd_prefix = "/dsec/";
  std::filesystem::path etcd_ca_file, etcd_client_cert, etcd_client_key;  // TLS to https:// members
  std::chrono::seconds etcd_lease_ttl{10};
  std::string advertise;
  std::chrono::milliseconds etcd_stop_renewing_after{0};  // tests: let the lease expire (0: renew until stopped)
  // Swap for sleeping sandboxes (agent/node/swap.hpp): a swap file of swap_file_bytes at swap_file, and/or a zram
  // device of zram_bytes; none by default. The agent turns off at shutdown what it turned on.
  std::filesystem::path swap_file;
  std::uint64_t swap_file_bytes = 0;
  std::uint64_t zram_bytes = 0;
  std::string zram_algorithm;  // empty: lz4 where offered
  // How long a sleep may spend pushing a sandbox's memory out; what is left when it runs out stays resident.
  std::chrono::milliseconds sleep_reclaim_timeout{60000};
  // Classes of service (docs/qos.md). CPUs reserved for latency sandboxes where the kernel has no core scheduling:
  // "auto", "none" or a cpu list (qos/kernel_qos.hpp, resolve_cpu_reservation).
  std::string latency_cpus = "auto";
  // Cold-memory reclaim (qos/reclaimer.hpp): "auto" or "idle" (the agent's own idle tracking) or "off". Memory of a
  // standard sandbox unused for reclaim_age goes to the node's swap (batch: after a quarter of it; latency: never).
  std::string reclaim = "auto";
  std::chrono::seconds reclaim_age{120};
  // Warm pools of container sandboxes (dsecd --warm-pool, repeatable): checked against the node's capacity at start.
  std::vector<WarmPoolConfig> warm_pools;
};

}  // namespace dsec::agent
