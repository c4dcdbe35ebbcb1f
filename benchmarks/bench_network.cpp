// dsec-bench network: what sandbox networks cost (docs/networking.md). Create-to-ready with network "egress" (a
// link, a /30, rules in the agent's nftables sets) against "none", the two alternating every iteration; the latency
// of a rule change (Sandbox::set_network) on a live sandbox; and both again with K sandboxes holding rules on the
// node, so that what one more sandbox or one change costs is seen at scale. No traffic is sent: the rules name
// documentation networks (RFC 5737) that nothing on this machine answers.
#include <optional>

#include <fmt/format.h>

#include "bench.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"

namespace dsec::bench {
namespace {

NetworkPolicy policy(int variant) {
  NetworkPolicy p;
  p.mode = "egress";
  NetworkRule deny;
  deny.allow = false;
  deny.cidr = "198.51.100.0/28";
  NetworkRule web;
  web.cidr = "198.51.100.0/24";
  web.protocol = "tcp";
  web.port_min = 80;
  web.port_max = static_cast<std::uint16_t>(variant == 0 ? 443 : 8443);
  NetworkRule dns;
  dns.cidr = "192.0.2.53";
  dns.protocol = "udp";
  dns.port_min = dns.port_max = 53;
  p.rules = {deny, web, dns};
  return p;
}

void print_latency(const char* what, const Latency& l) {
  fmt::print("  {:<52} {:>8.2f} ms {:>8.2f} ms {:>8.2f} ms {:>8.2f} ms  (n={})\n", what, l.percentile(50),
             l.percentile(90), l.percentile(99), l.max(), l.count());
}

}  // namespace

void run_network(const Options& options, Client& client) {
  SandboxSpec none = bench_spec(options);
  SandboxSpec egress = none;
  egress.network = policy(0);
  const NodeInfo node = client.nodes().at(0);
  fmt::print("== network: {} ==\n", node.network);

  auto measure = [&](std::size_t n, Latency& create_none, Latency& create_egress, Latency& update) {
    for (std::size_t i = 0; i < options.warmup + n; ++i) {
      const bool keep = i >= options.warmup;
      // The two take turns going first: whatever the kernel still does after the last destroys (a network
      // namespace's teardown runs in a worker) reaches both alike.
      double t_none = 0, t_egress = 0;
      auto timed = [&](const SandboxSpec& spec, double& ms) {
        auto t0 = Clock::now();
        Sandbox sb = client.create(spec);
        ms = ms_since(t0);
        return sb;
      };
      std::optional<Sandbox> a, b;
      if (i % 2 == 0) {
        a.emplace(timed(none, t_none));
        b.emplace(timed(egress, t_egress));
      } else {
        b.emplace(timed(egress, t_egress));
        a.emplace(timed(none, t_none));
      }
      auto t2 = Clock::now();
      b->set_network(policy(1));  // the web rule's ports change: one element out, one in
      double t_update = ms_since(t2);
      a->destroy();
      b->destroy();
      if (!keep) continue;
      create_none.add(t_none);
      create_egress.add(t_egress);
      update.add(t_update);
    }
  };

  Latency create_none, create_egress, update;
  measure(options.n, create_none, create_egress, update);
  fmt::print("                                                          p50         p90         p99         max\n");
  print_latency("create, network none (to ready for exec)", create_none);
  print_latency("create, network egress with 3 rules", create_egress);
  print_latency("set_network on a live sandbox (3 rules replaced)", update);
  fmt::print("  egress costs {:+.2f} ms at p50\n", create_egress.percentile(50) - create_none.percentile(50));

  // At scale: K sandboxes with rules stay on the node while the same measures run again.
  const std::size_t k = options.density_count;
  std::vector<Sandbox> held;
  held.reserve(k);
  SandboxSpec small = egress;
  small.resources.cpu = 0.01;
  small.resources.memory_bytes = 16ull << 20;
  auto t = Clock::now();
  for (std::size_t i = 0; i < k; ++i) held.push_back(client.create(small));
  double fill_s = ms_since(t) / 1000;
  const std::size_t n = std::max<std::size_t>(10, options.n / 4);
  Latency at_none, at_egress, at_update;
  measure(n, at_none, at_egress, at_update);
  fmt::print("  with {} sandboxes holding rules on the node (made in {:.1f} s):\n", k, fill_s);
  print_latency("create, network none", at_none);
  print_latency("create, network egress with 3 rules", at_egress);
  print_latency("set_network on a live sandbox", at_update);
  t = Clock::now();
  for (auto& sb : held) sb.destroy();
  fmt::print("  destroying them took {:.1f} s\n", ms_since(t) / 1000);
}

}  // namespace dsec::bench
