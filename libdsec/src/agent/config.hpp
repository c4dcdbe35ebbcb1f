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

namespace dsec::agent {

struct AgentConfig {
  std::string node_id;                        // default: hostname; prefixes every sandbox id
  std::filesystem::path unix_socket;          // listen here (empty: no unix socket)
  std::string tcp_listen;                     // "127.0.0.1:7070" (empty: no TCP)
  std::filesystem::path home = "/var/lib/dsec";   // store/ (images), cache/layers/, state/ (sandbox records)
  std::filesystem::path run_dir = "/run/dsec";    // per-sandbox runtime dirs (init sockets)
  std::filesystem::path state_dir;            // sandbox records; empty: <home>/state/sandboxes
  std::filesystem::path init_binary;          // dsec-init; default: next to dsecd
  std::string cgroup_name = "dsec";           // cgroup subtree (per agent: "dsec-<node_id>" when several run)
  std::size_t max_body_bytes = 256u << 20;    // request bodies (file uploads) larger than this are refused
  std::size_t max_header_bytes = 16u << 10;
  std::size_t max_connections = 4096;
  std::size_t netns_pool_size = 32;           // pre-created network namespaces
  std::chrono::milliseconds reaper_interval{1000};
  std::chrono::seconds idle_timeout{120};     // a connection silent this long (reading or writing) is closed
  std::vector<std::string> backends{"container"};  // kinds this agent serves: "container", "null"
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
  std::filesystem::path layer_cache_dir;                // empty: <home>/cache/layers
  std::uint64_t layer_cache_bytes = 20ull << 30;        // unused layers are evicted beyond this
  std::string layer_mode = "auto";                      // auto | lazy (EROFS over FUSE) | extract
  double cpu_overcommit = 32.0;   // cpu is compressible: idle sandboxes use a few % of their quota
  double memory_overcommit = 2.0;  // memory limits are ceilings; most sandboxes stay far below
  // The node's labels (dsecd --label k=v), reported in GET /v1/node; a create's node_selector must match them.
  std::map<std::string, std::string> labels;
  // Discovery: register in etcd under <etcd_prefix>nodes/<node_id> with a lease (empty: no registration). The
  // advertised endpoint is what clients dial; default http://<the bound TCP address>.
  std::vector<std::string> etcd_endpoints;
  std::string etcd_prefix = "/dsec/";
  std::chrono::seconds etcd_lease_ttl{10};
  std::string advertise;
  std::chrono::milliseconds etcd_stop_renewing_after{0};  // tests: let the lease expire (0: renew until stopped)
  // Swap for sleeping sandboxes (agent/swap.hpp): a swap file of swap_file_bytes at swap_file, and/or a zram device
  // of zram_bytes; none by default. The agent turns off at shutdown what it turned on.
  std::filesystem::path swap_file;
  std::uint64_t swap_file_bytes = 0;
  std::uint64_t zram_bytes = 0;
  std::string zram_algorithm;                  // empty: lz4 where offered
  // How long a sleep may spend pushing a sandbox's memory out; what is left when it runs out stays resident.
  std::chrono::milliseconds sleep_reclaim_timeout{60000};
};

}  // namespace dsec::agent
