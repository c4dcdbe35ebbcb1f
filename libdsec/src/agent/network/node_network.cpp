#include "agent/network/node_network.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <libnetfilter_conntrack/libnetfilter_conntrack.h>
#include <nftables/libnftables.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sched.h>

#include <algorithm>
#include <cstring>
#include <fstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "agent/network/netlink.hpp"
#include "common/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::network {
namespace {

using ::dsec::network::ipv4_to_string;
using ::dsec::network::parse_cidr;

constexpr const char* kPeerName = "eth0";

// The name of a sandbox's counter of refused connections: r_<its block in hex>, like its interface.
std::string refused_counter(const Attachment& a) { return fmt::format("r_{:08x}", a.block); }

std::uint64_t link_statistic(const std::string& interface, const char* name) {
  std::ifstream f(fmt::format("/sys/class/net/{}/statistics/{}", interface, name));
  std::uint64_t v = 0;
  f >> v;
  return v;
}

// Runs an nftables script inside the network namespace `netns_fd`: from a thread of its own that enters it, so
// that the context's netlink socket is that namespace's.
void run_nft_in(int netns_fd, const std::string& script, const char* what) {
  std::string error;
  std::thread t([&] {
    if (::setns(netns_fd, CLONE_NEWNET) != 0) {
      error = fmt::format("enter the sandbox's network namespace: {}", std::strerror(errno));
      return;
    }
    nft_ctx* ctx = nft_ctx_new(NFT_CTX_DEFAULT);
    if (!ctx) {
      error = "cannot make an nftables context";
      return;
    }
    nft_ctx_buffer_output(ctx);
    nft_ctx_buffer_error(ctx);
    if (nft_run_cmd_from_buffer(ctx, script.c_str()) != 0) error = nft_ctx_get_error_buffer(ctx);
    nft_ctx_free(ctx);
  });
  t.join();
  while (!error.empty() && error.back() == '\n') error.pop_back();
  if (!error.empty()) throw Error(Code::kInternal, fmt::format("nftables: {}: {}", what, error.substr(0, 2000)));
}

std::string range_text(std::uint32_t lo, std::uint32_t hi) {
  return lo == hi ? ipv4_to_string(lo) : fmt::format("{}-{}", ipv4_to_string(lo), ipv4_to_string(hi));
}
std::string number_range(std::uint32_t lo, std::uint32_t hi) {
  return lo == hi ? std::to_string(lo) : fmt::format("{}-{}", lo, hi);
}

// Collects the connection-tracking entries of one IPv4 address (either end of the original direction), but those
// of connections the sandbox made that `still_allowed` (when given) says its rules allow now.
struct Entries {
  std::uint32_t address_be = 0;
  const std::function<bool(std::uint32_t, std::uint32_t, std::uint32_t)>* still_allowed = nullptr;
  std::vector<nf_conntrack*> found;
};

int collect(enum nf_conntrack_msg_type, struct nf_conntrack* ct, void* data) {
  auto* e = static_cast<Entries*>(data);
  if (nfct_get_attr_u8(ct, ATTR_ORIG_L3PROTO) != AF_INET) return NFCT_CB_CONTINUE;
  const bool made_by_it = nfct_get_attr_u32(ct, ATTR_ORIG_IPV4_SRC) == e->address_be;
  if (!made_by_it && nfct_get_attr_u32(ct, ATTR_ORIG_IPV4_DST) != e->address_be) return NFCT_CB_CONTINUE;
  if (made_by_it && e->still_allowed) {
    const std::uint32_t proto = nfct_get_attr_u8(ct, ATTR_ORIG_L4PROTO);
    const std::uint32_t port = proto == IPPROTO_TCP || proto == IPPROTO_UDP
                                   ? ntohs(nfct_get_attr_u16(ct, ATTR_ORIG_PORT_DST))
                                   : ::dsec::network::kNoPort;
    if ((*e->still_allowed)(ntohl(nfct_get_attr_u32(ct, ATTR_ORIG_IPV4_DST)), proto, port)) return NFCT_CB_CONTINUE;
  }
  if (nf_conntrack* copy = nfct_clone(ct)) e->found.push_back(copy);
  return NFCT_CB_CONTINUE;
}

}  // namespace

NodeNetwork::NodeNetwork(NodeNetworkOptions options)
    : options_(std::move(options)),
      range_([&] {
        auto c = parse_cidr(options_.range);
        if (!c || c->prefix > 28)
          throw Error(Code::kInvalidArgument,
                      fmt::format("--network-range: '{}' is not an IPv4 network of at least 16 addresses such as "
                                  "10.88.0.0/16",
                                  options_.range));
        return *c;
      }()),
      blocks_(range_.first(), static_cast<std::uint32_t>((std::uint64_t{range_.last()} - range_.first() + 1) / 4), 4,
              "sandbox network addresses"),
      node_ports_(
          options_.expose_first,
          options_.expose_last >= options_.expose_first ? options_.expose_last - options_.expose_first + 1u : 0u, 1,
          "node ports for exposed sandbox ports") {
  if (options_.expose_first == 0 || options_.expose_last < options_.expose_first)
    throw Error(Code::kInvalidArgument, fmt::format("--expose-ports: {}-{} is not a range of ports within 1-65535",
                                                    options_.expose_first, options_.expose_last));
  if (options_.expose_host.empty()) {
    char name[256] = {};
    ::gethostname(name, sizeof name - 1);
    options_.expose_host = name;
  }
  for (const auto& d : options_.egress_deny) {
    auto c = parse_cidr(d);
    if (!c) throw Error(Code::kInvalidArgument, fmt::format("--egress-deny: '{}' is not an IPv4 network", d));
    deny_.push_back(*c);
  }
  upstream_ = options_.dns_upstream.empty() ? upstream_from_resolv_conf().value_or(DnsUpstream{})
                                            : parse_dns_upstream(options_.dns_upstream);
  if (options_.table.empty()) options_.table = "dsec";
  for (char& c : options_.table)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_') c = '_';
}

NodeNetwork::~NodeNetwork() {
  dns_.reset();  // its thread calls in here (and takes mu_)
  {
    std::lock_guard lock(forget_mu_);
    forget_stop_ = true;
  }
  forget_wake_.notify_all();
  if (forget_thread_.joinable()) forget_thread_.join();
  shutdown();
  std::lock_guard lock(mu_);
  if (nft_) nft_ctx_free(nft_);
}

void NodeNetwork::shutdown() {
  std::lock_guard lock(mu_);
  if (!table_ready_ || !sandboxes_.empty()) return;
  try {
    run(fmt::format("delete table inet {}\n", options_.table), "remove the sandboxes' table");
  } catch (const std::exception& e) {
    log_warn("{}", e.what());
  }
  table_ready_ = false;
}

void NodeNetwork::check(const NetworkPolicy& policy) const {
  ::dsec::network::validate(policy);
  if (policy.mode == "open" && !options_.allow_open)
    throw Error(Code::kFailedPrecondition, "network.mode: this node forbids open egress (dsecd --no-open-egress)");
}

void NodeNetwork::run(const std::string& script, const char* what) {
  if (!nft_) {
    nft_ = nft_ctx_new(NFT_CTX_DEFAULT);
    if (!nft_) throw Error(Code::kInternal, "nftables: cannot make a context");
    nft_ctx_buffer_output(nft_);
    nft_ctx_buffer_error(nft_);
  }
  if (nft_run_cmd_from_buffer(nft_, script.c_str()) != 0) {
    std::string err = nft_ctx_get_error_buffer(nft_);
    while (!err.empty() && err.back() == '\n') err.pop_back();
    throw Error(Code::kInternal, fmt::format("nftables: {}: {}", what, err.substr(0, 2000)));
  }
}

void NodeNetwork::ensure_table() {
  if (table_ready_) return;
  // Routing between the sandboxes' links and the uplink.
  {
    std::ofstream f("/proc/sys/net/ipv4/ip_forward");
    f << "1\n";
    if (!f) throw Error(Code::kFailedPrecondition, "cannot turn on IPv4 forwarding (/proc/sys/net/ipv4/ip_forward)");
  }
  if (!claims_) claims_.emplace(options_.claims_dir, options_.run_dir);
  if (!port_claims_) port_claims_.emplace(options_.ports_claims_dir, options_.run_dir);
  if (!dns_) {
    DnsDecisions decisions;
    decisions.may_resolve = [this](std::uint32_t source, const std::string& name) { return may_resolve(source, name); };
    decisions.pin = [this](std::uint32_t source, const std::string& name, const std::vector<ResolvedAddress>& a) {
      return pin(source, name, a);
    };
    decisions.expire = [this] { expire_pins(); };
    dns_ = std::make_unique<DnsResolver>(upstream_, std::move(decisions));
  }
  std::string blocked = "169.254.0.0/16, 0.0.0.0/8, 127.0.0.0/8, 224.0.0.0/3, " + ::dsec::network::to_string(range_);
  for (const Cidr& d : deny_) blocked += ", " + ::dsec::network::to_string(d);
  const std::string& t = options_.table;
  // The whole table at once, replacing what an earlier run left (a restart re-adds its sandboxes' elements).
  const std::string script = fmt::format(R"(table inet {t}
delete table inet {t}
table inet {t} {{
  set ifaces {{ type ifname; }}
  set ifaddr {{ type ifname . ipv4_addr; }}
  set open {{ type ipv4_addr; }}
  set allow {{ type ipv4_addr . ipv4_addr . inet_proto . inet_service; flags interval; }}
  set pinned {{ type ipv4_addr . ipv4_addr . inet_proto . inet_service; flags interval; }}
  set blocked {{ type ipv4_addr; flags interval; elements = {{ {blocked} }} }}
  map exposed {{ type inet_service : ipv4_addr . inet_service; }}
  map refused_by {{ type ifname : counter; }}
  counter refused {{ }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname @ifaces ct state established,related accept
    iifname @ifaces iifname . ip saddr @ifaddr udp dport {dns} ct status dnat accept
    iifname @ifaces ct state new counter name iifname map @refused_by
    iifname @ifaces drop
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname @ifaces meta nfproto ipv4 udp dport 53 redirect to :{dns}
    fib daddr type local meta l4proto tcp dnat ip to tcp dport map @exposed
  }}
  chain output {{
    type nat hook output priority -100; policy accept;
    fib daddr type local meta l4proto tcp dnat ip to tcp dport map @exposed
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    oifname @ifaces ct state established,related accept
    iifname @ifaces iifname . ip saddr != @ifaddr drop
    iifname @ifaces meta nfproto ipv6 drop
    iifname @ifaces ip daddr @blocked ct state new counter name iifname map @refused_by
    iifname @ifaces ip daddr @blocked counter name refused drop
    ct status dnat accept
    oifname @ifaces drop
    iifname @ifaces ip saddr @open accept
    iifname @ifaces ip saddr . ip daddr . meta l4proto . th dport @allow accept
    iifname @ifaces ip saddr . ip daddr . meta l4proto . th dport @pinned accept
    iifname @ifaces ct state new counter name iifname map @refused_by
    iifname @ifaces counter name refused drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    iifname @ifaces oifname != @ifaces masquerade
  }}
}}
)",
                                         fmt::arg("t", t), fmt::arg("blocked", blocked), fmt::arg("dns", dns_->port()));
  run(script, "make the sandboxes' table");
  table_ready_ = true;
}

std::vector<std::string> NodeNetwork::elements_of(const Attachment& a, const NetworkPolicy& policy,
                                                  const Pins& pins) const {
  const std::string addr = ipv4_to_string(a.sandbox_address());
  std::vector<std::string> out{fmt::format("ifaces {{ \"{}\" }}", a.interface),
                               fmt::format("ifaddr {{ \"{}\" . {} }}", a.interface, addr),
                               fmt::format("counter {}", refused_counter(a)),
                               fmt::format("refused_by {{ \"{}\" : \"{}\" }}", a.interface, refused_counter(a))};
  auto add_boxes = [&](const char* set, const std::vector<::dsec::network::AllowedBox>& boxes) {
    for (const auto& b : boxes) {
      if (b.port_lo > 65535) continue;  // only "no port": no tcp or udp packet is that
      out.push_back(fmt::format("{} {{ {} . {} . {} . {} }}", set, addr, range_text(b.addr_lo, b.addr_hi),
                                number_range(b.proto_lo, b.proto_hi),
                                number_range(b.port_lo, std::min<std::uint32_t>(b.port_hi, 65535))));
    }
  };
  if (policy.mode == "open") out.push_back(fmt::format("open {{ {} }}", addr));
  if (policy.mode == "egress") {
    add_boxes("allow", ::dsec::network::compile_egress(policy));
    // The pins of several names may overlap (one address, two names): the set needs them disjoint.
    add_boxes("pinned", ::dsec::network::make_disjoint(pin_boxes(policy, pins)));
  }
  return out;
}

std::vector<::dsec::network::AllowedBox> NodeNetwork::pin_boxes(const NetworkPolicy& policy, const Pins& pins) {
  std::vector<::dsec::network::AllowedBox> out;
  for (const auto& [key, pin] : pins) {
    auto boxes = ::dsec::network::compile_pin(policy, pin.rule, key.second);
    out.insert(out.end(), boxes.begin(), boxes.end());
  }
  return out;
}

bool NodeNetwork::commit(Sandbox& s, const char* what) {
  std::vector<std::string> elements = elements_of(s.link, s.policy, s.pins);
  // One transaction: the old rules and the new never both hold, and a failure leaves the old ones.
  std::vector<std::string> remove, add;
  for (const auto& e : s.elements)
    if (std::find(elements.begin(), elements.end(), e) == elements.end()) remove.push_back(e);
  for (const auto& e : elements)
    if (std::find(s.elements.begin(), s.elements.end(), e) == s.elements.end()) add.push_back(e);
  apply_elements(remove, add, what);
  s.elements = std::move(elements);
  return !remove.empty();
}

NodeNetwork::Sandbox* NodeNetwork::by_address(std::uint32_t address) {
  auto it = by_address_.find(address);
  if (it == by_address_.end()) return nullptr;
  auto s = sandboxes_.find(it->second);
  return s == sandboxes_.end() ? nullptr : &s->second;
}

std::optional<bool> NodeNetwork::may_resolve(std::uint32_t source, const std::string& name) {
  std::lock_guard lock(mu_);
  Sandbox* s = by_address(source);
  if (!s) return std::nullopt;
  if (s->policy.mode == "open") return !name.empty();
  auto rule = ::dsec::network::name_rule_for(s->policy, name);
  return rule && s->policy.rules[*rule].allow;
}

bool NodeNetwork::pin(std::uint32_t source, const std::string& name, const std::vector<ResolvedAddress>& answers) {
  std::lock_guard lock(mu_);
  Sandbox* s = by_address(source);
  if (!s) return false;
  if (s->policy.mode == "open") return true;  // everything is allowed already
  auto rule = ::dsec::network::name_rule_for(s->policy, name);
  if (!rule || !s->policy.rules[*rule].allow) return false;
  auto before = s->pins;
  const auto now = Clock::now();
  for (const ResolvedAddress& a : answers) {
    // As long as the sandbox may cache the answer, and a little longer (a client's clock, a slow first connect).
    const auto lifetime = std::chrono::seconds(std::max<std::uint32_t>(a.ttl, 30) + 120);
    Pin& p = s->pins[{name, a.address}];
    p.rule = *rule;
    p.expires = std::max(p.expires, now + lifetime);
  }
  if (s->pins.size() > kMaxPinsPerSandbox) {
    s->pins = std::move(before);
    log_warn("sandbox {}: {} resolved addresses admitted at once already; '{}' refused", ipv4_to_string(source),
             kMaxPinsPerSandbox, name);
    return false;
  }
  try {
    commit(*s, "admit resolved addresses");
  } catch (const std::exception& e) {
    s->pins = std::move(before);
    log_warn("{}", e.what());
    return false;
  }
  return true;
}

void NodeNetwork::expire_pins() {
  std::lock_guard lock(mu_);
  const auto now = Clock::now();
  for (auto& [id, s] : sandboxes_) {
    bool gone = false;
    for (auto it = s.pins.begin(); it != s.pins.end();)
      if (it->second.expires <= now) {
        it = s.pins.erase(it);
        gone = true;
      } else {
        ++it;
      }
    if (!gone) continue;
    try {
      commit(s, "retire resolved addresses past their time");
    } catch (const std::exception& e) {
      log_warn("sandbox {}: {}", id, e.what());
    }
  }
}

std::string NodeNetwork::list_json(const std::string& command) const {
  if (!nft_) return "";
  nft_ctx_output_set_flags(nft_, NFT_CTX_OUTPUT_JSON);
  const int rc = nft_run_cmd_from_buffer(nft_, command.c_str());
  nft_ctx_output_set_flags(nft_, 0);
  if (rc != 0) {
    log_warn("nftables: {}: {}", command, nft_ctx_get_error_buffer(nft_));
    return "";
  }
  return nft_ctx_get_output_buffer(nft_);
}

std::map<std::string, std::uint64_t> NodeNetwork::refused_counters(const std::string& only) const {
  std::map<std::string, std::uint64_t> out;
  if (!table_ready_) return out;
  const std::string text = only.empty() ? list_json(fmt::format("list counters table inet {}", options_.table))
                                        : list_json(fmt::format("list counter inet {} {}", options_.table, only));
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (!j.is_object() || !j.contains("nftables") || !j["nftables"].is_array()) return out;
  for (const auto& item : j["nftables"]) {
    if (!item.is_object() || !item.contains("counter")) continue;
    const auto& c = item["counter"];
    if (c.is_object() && c.value("table", "") == options_.table && c.contains("name") && c.contains("packets"))
      out[c["name"].get<std::string>()] = c["packets"].get<std::uint64_t>();
  }
  return out;
}

NetworkUsage NodeNetwork::usage_of(const Sandbox& s, const std::map<std::string, std::uint64_t>& refused) const {
  NetworkUsage u;
  // The host's end of the pair: what it receives the sandbox sent.
  u.bytes_out = link_statistic(s.link.interface, "rx_bytes");
  u.packets_out = link_statistic(s.link.interface, "rx_packets");
  u.bytes_in = link_statistic(s.link.interface, "tx_bytes");
  u.packets_in = link_statistic(s.link.interface, "tx_packets");
  if (auto it = refused.find(refused_counter(s.link)); it != refused.end()) u.refused = it->second;
  for (const auto& [key, pin] : s.pins) u.resolved[key.first].push_back(ipv4_to_string(key.second));
  return u;
}

NetworkUsage NodeNetwork::usage(const std::string& id) const {
  std::lock_guard lock(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) return {};
  return usage_of(it->second, refused_counters(refused_counter(it->second.link)));
}

std::map<std::string, NetworkUsage> NodeNetwork::usage_of_all() const {
  std::lock_guard lock(mu_);
  std::map<std::string, NetworkUsage> out;
  if (sandboxes_.empty()) return out;
  const auto refused = refused_counters();
  for (const auto& [id, s] : sandboxes_) out[id] = usage_of(s, refused);
  return out;
}

std::string NodeNetwork::resolv_conf(const Attachment& a) {
  return fmt::format(
      "# Written by dsec: names are resolved by the node's agent, which answers those the sandbox's\n"
      "# network rules allow (any address's port 53 reaches it).\nnameserver {}\n",
      ipv4_to_string(a.gateway()));
}

void NodeNetwork::apply_elements(const std::vector<std::string>& remove, const std::vector<std::string>& add,
                                 const char* what) {
  // Entries "counter NAME" are objects of the table: made before the elements that name them, removed after.
  auto object = [](const std::string& e) { return e.starts_with("counter "); };
  std::string script;
  for (const auto& e : remove)
    if (!object(e)) script += fmt::format("delete element inet {} {}\n", options_.table, e);
  for (const auto& e : remove)
    if (object(e)) script += fmt::format("delete {} inet {} {}\n", "counter", options_.table, e.substr(8));
  for (const auto& e : add)
    if (object(e)) script += fmt::format("add {} inet {} {}\n", "counter", options_.table, e.substr(8));
  for (const auto& e : add)
    if (!object(e)) script += fmt::format("add element inet {} {}\n", options_.table, e);
  if (!script.empty()) run(script, what);
}

void NodeNetwork::forget_connections(std::uint32_t address, const AllowedNow* still_allowed) {
  // Entries the sandbox's connections left (libnetfilter_conntrack, over ctnetlink): with them gone, replies to a
  // connection the rules now forbid are no longer "established" and are dropped too. Without them, the sandbox's
  // own packets, checked one by one against its rules, are what cuts such a connection.
  nfct_handle* h = nfct_open(CONNTRACK, 0);
  if (!h) {
    log_warn("connection tracking: cannot open ctnetlink: {}", std::strerror(errno));
    return;
  }
  Entries entries;
  entries.address_be = htonl(address);
  entries.still_allowed = still_allowed;
  nfct_callback_register(h, NFCT_T_ALL, collect, &entries);
  std::uint32_t family = AF_INET;
  if (nfct_query(h, NFCT_Q_DUMP, &family) != 0)
    log_warn("connection tracking: list entries of {}: {}", ipv4_to_string(address), std::strerror(errno));
  nfct_callback_unregister(h);
  for (nf_conntrack* ct : entries.found) {
    (void)nfct_query(h, NFCT_Q_DESTROY, ct);  // gone meanwhile is fine
    nfct_destroy(ct);
  }
  nfct_close(h);
}

Attachment NodeNetwork::attach(const std::string& id, int netns_fd, const NetworkPolicy& policy,
                               const LinkLimits& limits) {
  check(policy);
  std::lock_guard lock(mu_);
  if (sandboxes_.count(id)) throw Error(Code::kAlreadyExists, fmt::format("sandbox {} has a network already", id));
  ensure_table();
  Attachment a;
  a.block = blocks_.take([this](std::uint32_t first) { return claims_->claim(first); });
  a.interface = fmt::format("dsh-{:08x}", a.block);
  Netlink host;
  struct Undo {
    NodeNetwork& self;
    Netlink& host;
    Attachment& a;
    bool armed = true;
    ~Undo() {
      if (!armed) return;
      try {
        host.delete_link(a.interface);
      } catch (...) {
      }
      self.claims_->release(a.block);
      self.blocks_.give_back(a.block);
    }
  } undo{*this, host, a};
  host.delete_link(a.interface);  // a leftover of a crash, if any
  host.create_veth(a.interface, kPeerName, netns_fd);
  int index = host.index_of(a.interface);
  if (index == 0) throw Error(Code::kInternal, fmt::format("veth {} vanished after it was made", a.interface));
  host.add_address(index, a.gateway(), 30);
  host.set_up(index);
  Netlink inside(netns_fd);
  int peer = inside.index_of(kPeerName);
  if (peer == 0) throw Error(Code::kInternal, "the sandbox's end of its veth pair is missing");
  inside.add_address(peer, a.sandbox_address(), 30);
  inside.set_up(peer);
  inside.add_default_route(a.gateway());
  if (limits.egress_mbps) inside.set_rate_limit(peer, std::uint64_t{limits.egress_mbps} * 125000);
  if (limits.connections) {
    // Counted in the sandbox's own namespace (its connection tracking): new connections out of eth0 beyond the
    // limit are refused at once. DNS queries (each a flow of its own) do not count; the resolver has its limits.
    run_nft_in(netns_fd,
               fmt::format("table inet dsec_limits {{\n  chain output {{\n    type filter hook output priority filter; "
                           "policy accept;\n    oifname \"{0}\" udp dport 53 accept\n    oifname \"{0}\" ct state new "
                           "ct count over {1} counter reject\n  }}\n}}\n",
                           kPeerName, limits.connections),
               "limit the sandbox's connections");
  }
  std::vector<std::string> elements = elements_of(a, policy);
  apply_elements({}, elements, "add a sandbox's rules");
  sandboxes_[id] = Sandbox{a, policy, std::move(elements), {}, {}};
  by_address_[a.sandbox_address()] = id;
  undo.armed = false;
  return a;
}

void NodeNetwork::update(const std::string& id, const NetworkPolicy& policy) {
  check(policy);
  std::lock_guard lock(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end())
    throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} has no network link to change", id));
  Sandbox& s = it->second;
  Sandbox before = s;
  // Addresses handed out for a name stay admitted while the new rules still allow the name (under the rule that
  // allows it now).
  s.policy = policy;
  for (auto p = s.pins.begin(); p != s.pins.end();) {
    auto rule = ::dsec::network::name_rule_for(policy, p->first.first);
    if (rule && policy.rules[*rule].allow) {
      p->second.rule = *rule;
      ++p;
    } else {
      p = s.pins.erase(p);
    }
  }
  bool removed = false;
  try {
    removed = commit(s, "change a sandbox's rules");
  } catch (...) {
    s = std::move(before);
    throw;
  }
  // The sandbox's packets are checked one by one, so what the new rules forbid is cut at its next packet; the
  // tracking entries go next, so that replies to it are dropped too.
  if (removed) forget_connections_later(s.link.sandbox_address());
}

void NodeNetwork::forget_connections_later(std::uint32_t address) {
  std::lock_guard lock(forget_mu_);
  if (!forget_thread_.joinable()) forget_thread_ = std::thread([this] { forgetter(); });
  if (std::find(to_forget_.begin(), to_forget_.end(), address) == to_forget_.end()) to_forget_.push_back(address);
  forget_wake_.notify_one();
}

void NodeNetwork::forgetter() {
  std::unique_lock lock(forget_mu_);
  for (;;) {
    forget_wake_.wait(lock, [&] { return forget_stop_ || !to_forget_.empty(); });
    if (to_forget_.empty()) return;  // stopping, nothing left
    std::vector<std::uint32_t> batch;
    batch.swap(to_forget_);
    lock.unlock();
    // What the sandbox's rules allow when the entries are read, not when the change was made: a connection it made
    // under the new rules in between must not lose its entry (its replies would be dropped).
    for (std::uint32_t a : batch) {
      AllowedNow allowed;
      {
        std::lock_guard net(mu_);
        if (Sandbox* s = by_address(a)) {
          if (s->policy.mode == "open") {
            allowed = [](std::uint32_t, std::uint32_t, std::uint32_t) { return true; };
          } else if (s->policy.mode == "egress") {
            auto boxes = ::dsec::network::compile_egress(s->policy);
            auto pinned = pin_boxes(s->policy, s->pins);
            boxes.insert(boxes.end(), pinned.begin(), pinned.end());
            allowed = [boxes = std::move(boxes)](std::uint32_t d, std::uint32_t p, std::uint32_t port) {
              return ::dsec::network::allows(boxes, d, p, port);
            };
          }
        }
      }
      forget_connections(a, allowed ? &allowed : nullptr);
    }
    lock.lock();
  }
}

void NodeNetwork::detach(const std::string& id) {
  std::lock_guard lock(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end()) return;
  Sandbox s = std::move(it->second);
  sandboxes_.erase(it);
  by_address_.erase(s.link.sandbox_address());
  std::vector<std::string> remove = s.elements;
  for (const auto& [port, node_port] : s.exposed) remove.push_back(exposed_element(s, port, node_port));
  try {
    apply_elements(remove, {}, "remove a sandbox's rules and exposed ports");
  } catch (const std::exception& e) {
    log_warn("sandbox {}: {}", id, e.what());
  }
  for (const auto& [port, node_port] : s.exposed) release_node_port(node_port);
  try {
    Netlink().delete_link(s.link.interface);  // its peer goes with it
  } catch (const std::exception& e) {
    log_warn("sandbox {}: remove its link {}: {}", id, s.link.interface, e.what());
  }
  forget_connections(s.link.sandbox_address());
  if (claims_) claims_->release(s.link.block);
  blocks_.give_back(s.link.block);
}

bool NodeNetwork::adopt(const std::string& id, const Attachment& a, const NetworkPolicy& policy,
                        const std::map<std::uint16_t, std::uint16_t>& exposed) {
  std::lock_guard lock(mu_);
  ensure_table();
  if (Netlink().index_of(a.interface) == 0) return false;
  if (!blocks_.claim(a.block)) return false;
  if (!claims_->take_over(a.block)) {
    blocks_.give_back(a.block);
    return false;
  }
  Sandbox sb{a, policy, elements_of(a, policy), {}, {}};
  std::vector<std::string> add = sb.elements;
  for (const auto& [port, node_port] : exposed) {
    if (!node_ports_.claim(node_port) || !port_claims_->take_over(node_port)) {
      log_warn("sandbox {}: its exposed port {} (node port {}) is another's now; not exposed again", id, port,
               node_port);
      continue;
    }
    sb.exposed[port] = node_port;
    add.push_back(exposed_element(sb, port, node_port));
  }
  apply_elements({}, add, "restore a sandbox's rules and exposed ports");
  by_address_[a.sandbox_address()] = id;
  sandboxes_[id] = std::move(sb);
  return true;
}

std::string NodeNetwork::exposed_element(const Sandbox& s, std::uint16_t port, std::uint16_t node_port) const {
  return fmt::format("exposed {{ {} : {} . {} }}", node_port, ipv4_to_string(s.link.sandbox_address()), port);
}

void NodeNetwork::release_node_port(std::uint16_t node_port) {
  if (port_claims_) port_claims_->release(node_port);
  node_ports_.give_back(node_port);
}

std::string NodeNetwork::address_of(std::uint16_t node_port) const {
  return fmt::format("{}:{}", options_.expose_host, node_port);
}

std::uint16_t NodeNetwork::claim_agent_port() {
  std::lock_guard lock(mu_);
  if (!port_claims_) port_claims_.emplace(options_.ports_claims_dir, options_.run_dir);
  return static_cast<std::uint16_t>(node_ports_.take([this](std::uint32_t n) { return port_claims_->claim(n); }));
}

void NodeNetwork::release_agent_port(std::uint16_t node_port) {
  std::lock_guard lock(mu_);
  release_node_port(node_port);
}

std::string NodeNetwork::expose(const std::string& id, std::uint32_t port) {
  if (port < 1 || port > 65535)
    throw Error(Code::kInvalidArgument, fmt::format("port: {} is not a TCP port (1-65535)", port));
  std::lock_guard lock(mu_);
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end())
    throw Error(Code::kFailedPrecondition, fmt::format("sandbox {} has no network link to expose a port on", id));
  Sandbox& sb = it->second;
  const auto p = static_cast<std::uint16_t>(port);
  if (auto e = sb.exposed.find(p); e != sb.exposed.end())
    throw Error(Code::kInvalidArgument, fmt::format("port: {} is exposed already, at {}", port, address_of(e->second)));
  const auto node_port =
      static_cast<std::uint16_t>(node_ports_.take([this](std::uint32_t n) { return port_claims_->claim(n); }));
  try {
    apply_elements({}, {exposed_element(sb, p, node_port)}, "expose a sandbox's port");
  } catch (...) {
    release_node_port(node_port);
    throw;
  }
  sb.exposed[p] = node_port;
  return address_of(node_port);
}

void NodeNetwork::unexpose(const std::string& id, std::uint32_t port) {
  std::lock_guard lock(mu_);
  auto not_exposed = [&] {
    return Error(Code::kNotFound, fmt::format("port: {} of sandbox {} is not exposed", port, id));
  };
  auto it = sandboxes_.find(id);
  if (it == sandboxes_.end() || port < 1 || port > 65535) throw not_exposed();
  Sandbox& sb = it->second;
  auto e = sb.exposed.find(static_cast<std::uint16_t>(port));
  if (e == sb.exposed.end()) throw not_exposed();
  apply_elements({exposed_element(sb, e->first, e->second)}, {}, "unexpose a sandbox's port");
  release_node_port(e->second);
  sb.exposed.erase(e);
  // Connections through it go with the sandbox's other tracking entries.
  forget_connections_later(sb.link.sandbox_address());
}

std::map<std::uint16_t, std::uint16_t> NodeNetwork::exposed(const std::string& id) const {
  std::lock_guard lock(mu_);
  auto it = sandboxes_.find(id);
  return it == sandboxes_.end() ? std::map<std::uint16_t, std::uint16_t>{} : it->second.exposed;
}

std::size_t NodeNetwork::attached() const {
  std::lock_guard lock(mu_);
  return sandboxes_.size();
}

std::string NodeNetwork::describe() const {
  std::lock_guard lock(mu_);
  return fmt::format("routed ({}, {} sandboxes with a network, nftables table inet {})",
                     ::dsec::network::to_string(range_), sandboxes_.size(), options_.table);
}

}  // namespace dsec::agent::network
