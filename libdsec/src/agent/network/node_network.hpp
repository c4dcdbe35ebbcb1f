// The node side of sandbox networking (docs/networking.md): each sandbox with a network (mode egress or open) gets
// a veth pair, routed, with a /30 of its own from the node's range (the host end .1, the sandbox's eth0 .2, its
// default route through .1), NAT to the node's uplink, and its rules as elements of one nftables table per agent
// (`inet dsec_<agent>`), keyed by the sandbox's address: 2,000 sandboxes with rules are one table and a few sets,
// not 2,000 chains. The backends call it with the sandbox's network namespace; the rules change atomically (one
// nftables transaction) while the sandbox runs or sleeps.
//
// Whatever the rules, a sandbox never reaches the node itself (the input chain drops everything from sandbox
// interfaces: the agent's API, the node's addresses), other sandboxes (nothing but replies is forwarded to a
// sandbox interface), link-local and metadata addresses, multicast, or the agent's --egress-deny networks, and a
// packet whose source is not the sandbox's own address is dropped.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <chrono>
#include <memory>

#include "agent/network/dns_resolver.hpp"
#include "agent/node/host_id_claims.hpp"
#include "agent/node/host_id_pool.hpp"
#include "common/network_rules.hpp"
#include "dsec/network.hpp"

struct nft_ctx;

namespace dsec::agent::network {

using ::dsec::network::Cidr;

struct NodeNetworkOptions {
  std::string range = "10.88.0.0/16";                  // sandboxes' /30s come from here
  std::vector<std::string> egress_deny;                // CIDRs no sandbox may reach (dsecd --egress-deny)
  bool allow_open = true;                              // mode "open" allowed (dsecd --no-open-egress forbids it)
  std::string table;                                   // nftables table name: dsec_<agent>
  std::filesystem::path claims_dir = "/run/dsec-net";  // host-wide claims of /30s (agents sharing a host)
  // Exposed ports (expose): node ports from this range, claimed host-wide in ports_claims_dir, reached as
  // <expose_host>:<node port> (dsecd --expose-host; default: the node's host name).
  std::uint16_t expose_first = 30000, expose_last = 32767;
  std::string expose_host;
  std::filesystem::path ports_claims_dir = "/run/dsec-ports";
  std::filesystem::path run_dir;  // the agent's: names its claims
  // Where the sandboxes' DNS resolver asks for allowed names (dsecd --dns-upstream): "IP[:PORT]"; empty: the first
  // IPv4 nameserver of the node's /etc/resolv.conf.
  std::string dns_upstream;
};

// Limits on a sandbox's link (SandboxSpec::resources), 0 = none; they live in its network namespace (a token bucket
// on its eth0, a connection count in a small table of its own), out of its reach and gone with it.
struct LinkLimits {
  std::uint32_t egress_mbps = 0;
  std::uint32_t connections = 0;
};

// What a sandbox's network is on the node, kept in its record for a restart.
struct Attachment {
  std::uint32_t block = 0;  // the /30's first address: host end block+1, sandbox block+2
  std::string interface;    // host end of the veth pair: dsh-<block in hex>
  std::uint32_t sandbox_address() const { return block + 2; }
  std::uint32_t gateway() const { return block + 1; }
};

class NodeNetwork {
 public:
  // Checks the options (INVALID_ARGUMENT naming the flag); touches nothing on the host until the first attach.
  explicit NodeNetwork(NodeNetworkOptions options);
  ~NodeNetwork();

  // Throws INVALID_ARGUMENT for a malformed policy and FAILED_PRECONDITION for "open" on a node that forbids it.
  void check(const NetworkPolicy& policy) const;

  // Gives the sandbox `id`, whose network namespace is `netns_fd`, its link and rules. Nothing is left on failure.
  Attachment attach(const std::string& id, int netns_fd, const NetworkPolicy& policy, const LinkLimits& limits = {});
  // Replaces the sandbox's rules in one transaction; connections the new rules forbid are cut.
  void update(const std::string& id, const NetworkPolicy& policy);
  // Removes the link, the rules, the sandbox's connection tracking entries and gives the /30 back.
  void detach(const std::string& id);
  // A sandbox taken over after a restart: its /30 and exposed ports claimed back and its rules in force again.
  // False if its link is gone or another agent holds its /30.
  bool adopt(const std::string& id, const Attachment& a, const NetworkPolicy& policy,
             const std::map<std::uint16_t, std::uint16_t>& exposed = {});

  // Exposes TCP port `port` of the sandbox at a port of the node: the answer is "<expose_host>:<node port>",
  // reachable by anyone who reaches the node, but by no sandbox. INVALID_ARGUMENT for a port outside 1-65535 or
  // one exposed already, RESOURCE_EXHAUSTED when the node's range is used up, FAILED_PRECONDITION without a link.
  std::string expose(const std::string& id, std::uint32_t port);
  void unexpose(const std::string& id, std::uint32_t port);  // NOT_FOUND when it is not exposed
  // The sandbox's exposed ports: its port -> the node's port.
  std::map<std::uint16_t, std::uint16_t> exposed(const std::string& id) const;
  std::string address_of(std::uint16_t node_port) const;
  // A port of the same range for a listener of the agent's own (a full VM's VNC screen): claimed host-wide like an
  // exposed port, with no rule; back with release_agent_port. RESOURCE_EXHAUSTED when the range is used up.
  std::uint16_t claim_agent_port();
  void release_agent_port(std::uint16_t node_port);

  // At the agent's stop: with no sandbox left on a network, the table goes (an agent that leaves its sandboxes for
  // the next start keeps their rules in force). Also run by the destructor.
  void shutdown();

  std::string describe() const;  // node info: "routed (10.88.0.0/16, N sandboxes)" or "unused"
  std::size_t attached() const;
  // Its traffic since its link was made (the link's own counters) and the new connections its rules refused since
  // the agent started (an nftables counter of its own). NOT_FOUND-free: a sandbox without a link has none.
  NetworkUsage usage(const std::string& id) const;
  // Every sandbox's, for the agent's metrics (one listing of the table's counters).
  std::map<std::string, NetworkUsage> usage_of_all() const;
  // The resolv.conf a sandbox with a link gets: its gateway, where (like any address) port 53 reaches the resolver.
  static std::string resolv_conf(const Attachment& a);

  static constexpr std::size_t kMaxPinsPerSandbox = 512;

 private:
  using Clock = std::chrono::steady_clock;
  struct Pin {
    std::size_t rule = 0;  // the name rule that admitted it
    Clock::time_point expires;
  };
  using Pins = std::map<std::pair<std::string, std::uint32_t>, Pin>;
  struct Sandbox {
    Attachment link;
    NetworkPolicy policy;
    std::vector<std::string> elements;               // "set { element }" lines of the table that are this sandbox's
    std::map<std::uint16_t, std::uint16_t> exposed;  // its port -> the node's port
    Pins pins;                                       // (name, address) the resolver handed out
  };
  std::string exposed_element(const Sandbox& s, std::uint16_t port, std::uint16_t node_port) const;
  void release_node_port(std::uint16_t node_port);
  void ensure_table();  // under mu_
  // The sandbox's rules and pins as set elements.
  std::vector<std::string> elements_of(const Attachment& a, const NetworkPolicy& policy, const Pins& pins = {}) const;
  // What the sandbox's pins admit, box by box (they may overlap).
  static std::vector<::dsec::network::AllowedBox> pin_boxes(const NetworkPolicy& policy, const Pins& pins);
  // Puts elements_of(s) in force in one transaction (under mu_); whether any element went.
  bool commit(Sandbox& s, const char* what);
  Sandbox* by_address(std::uint32_t address);  // under mu_
  // The resolver's questions (dns_resolver.hpp), from its thread.
  std::optional<bool> may_resolve(std::uint32_t source, const std::string& name);
  bool pin(std::uint32_t source, const std::string& name, const std::vector<ResolvedAddress>& answers);
  void expire_pins();
  void run(const std::string& script, const char* what);    // under mu_
  std::string list_json(const std::string& command) const;  // under mu_: a listing, as nftables' JSON
  NetworkUsage usage_of(const Sandbox& s, const std::map<std::string, std::uint64_t>& refused) const;
  std::map<std::string, std::uint64_t> refused_counters(const std::string& only = "") const;  // under mu_
  void apply_elements(const std::vector<std::string>& remove, const std::vector<std::string>& add, const char* what);
  // Drops the tracking entries of `address`'s connections; with `still_allowed`, not those of connections the
  // sandbox made that it says are allowed (destination, protocol, port; kNoPort for none).
  using AllowedNow = std::function<bool(std::uint32_t, std::uint32_t, std::uint32_t)>;
  void forget_connections(std::uint32_t address, const AllowedNow* still_allowed = nullptr);
  // After a rule change, off the caller's path: a dump of the kernel's whole connection table costs ~15 ms here.
  void forget_connections_later(std::uint32_t address);
  void forgetter();

  NodeNetworkOptions options_;
  Cidr range_;
  std::vector<Cidr> deny_;
  DnsUpstream upstream_;
  HostIdPool blocks_;
  std::optional<HostIdClaims> claims_;
  HostIdPool node_ports_;
  std::optional<HostIdClaims> port_claims_;
  mutable std::mutex mu_;
  mutable nft_ctx* nft_ = nullptr;
  bool table_ready_ = false;
  std::map<std::string, Sandbox> sandboxes_;
  std::map<std::uint32_t, std::string> by_address_;  // a sandbox's address -> its id
  std::unique_ptr<DnsResolver> dns_;                 // made with the table
  std::mutex forget_mu_;
  std::condition_variable forget_wake_;
  std::vector<std::uint32_t> to_forget_;
  bool forget_stop_ = false;
  std::thread forget_thread_;
};

}  // namespace dsec::agent::network
