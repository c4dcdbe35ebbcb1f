// dsec-bench network: what sandbox networks cost (docs/networking.md). Create-to-ready with network "egress" (a
// link, a /30, rules in the agent's nftables sets) against "none", the two alternating every iteration; the latency
// of a rule change (Sandbox::set_network) on a live sandbox; and both again with K sandboxes holding rules on the
// node, so that what one more sandbox or one change costs is seen at scale. No traffic is sent: the rules name
// documentation networks (RFC 5737) that nothing on this machine answers.
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <optional>
#include <thread>

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

// An IPv4 address of this machine other than loopback (the node's own: what a grader on another machine would
// dial), or empty.
std::string node_address() {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return {};
  std::string out;
  for (ifaddrs* i = list; i && out.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    std::string name = i->ifa_name;
    if (name == "lo" || name.starts_with("dsh-")) continue;
    char text[INET_ADDRSTRLEN] = {};
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, text, sizeof text);
    out = text;
  }
  ::freeifaddrs(list);
  return out;
}

// Reads `bytes` from host:port and answers MiB/s (0 when the connection fails).
double read_rate(const std::string& host, int port, std::size_t bytes) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  ::inet_pton(AF_INET, host.c_str(), &a.sin_addr);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return 0;
  }
  std::vector<char> buf(1 << 20);
  std::size_t got = 0;
  auto t = Clock::now();
  while (got < bytes) {
    ssize_t n = ::recv(fd, buf.data(), buf.size(), 0);
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  double s = ms_since(t) / 1000;
  ::close(fd);
  return got < bytes || s <= 0 ? 0 : static_cast<double>(got) / (1 << 20) / s;
}

// The same sender as in the sandbox (busybox nc, from the host's busybox) on the host, read over loopback: what
// the exposed port is compared with. 0 when the host has no busybox.
double loopback_rate(std::size_t bytes, int port) {
  const char* busybox = ::access("/bin/busybox", X_OK) == 0 ? "/bin/busybox" : nullptr;
  if (!busybox) return 0;
  pid_t pid = ::fork();
  if (pid == 0) {
    int zero = ::open("/dev/zero", O_RDONLY);
    int null = ::open("/dev/null", O_WRONLY);
    ::dup2(zero, 0);
    ::dup2(null, 1);
    ::dup2(null, 2);
    const std::string p = std::to_string(port);
    ::execl(busybox, "nc", "-l", "-p", p.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  double rate = 0;
  for (int attempt = 0; attempt < 20 && rate == 0; ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    rate = read_rate("127.0.0.1", port, bytes);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return rate;
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
  const std::uint64_t available_before = mem_available_settled();
  auto t = Clock::now();
  for (std::size_t i = 0; i < k; ++i) held.push_back(client.create(small));
  double fill_s = ms_since(t) / 1000;
  const std::uint64_t available_after = mem_available_settled();
  const std::size_t n = std::max<std::size_t>(10, options.n / 4);
  Latency at_none, at_egress, at_update;
  measure(n, at_none, at_egress, at_update);
  fmt::print("  with {} sandboxes holding rules on the node (made in {:.1f} s; MemAvailable {:.1f} MiB lower, {:.0f} KiB "
             "a sandbox, its processes and link included):\n",
             k, fill_s, static_cast<double>(available_before - std::min(available_before, available_after)) / (1 << 20),
             k ? static_cast<double>(available_before - std::min(available_before, available_after)) / 1024 /
                     static_cast<double>(k)
               : 0.0);
  print_latency("create, network none", at_none);
  print_latency("create, network egress with 3 rules", at_egress);
  print_latency("set_network on a live sandbox", at_update);
  t = Clock::now();
  for (auto& sb : held) sb.destroy();
  fmt::print("  destroying them took {:.1f} s\n", ms_since(t) / 1000);

  // Throughput through an exposed port: a sandbox sends zeros (busybox nc) to a reader on the host that dials the
  // node's own address, next to the same reading over loopback from a server on the host.
  const std::string host = node_address();
  if (host.empty()) {
    fmt::print("  exposed port throughput: skipped (this machine has no IPv4 address but loopback)\n");
    return;
  }
  constexpr std::size_t kBytes = 512ull << 20;
  // As much cpu as the host's sender has (the sender writes 1 KiB at a time: at 0.5 cores it is the cpu quota
  // that is measured).
  SandboxSpec server_spec = none;
  server_spec.resources.cpu = static_cast<double>(std::max(1u, std::thread::hardware_concurrency()));
  Sandbox server = client.create(server_spec);
  server.exec(std::string("(while true; do nc -l -p 8000 < /dev/zero; done) >/dev/null 2>&1 &"), 10);
  const std::string address = server.expose(8000);
  const int node_port = std::stoi(address.substr(address.rfind(':') + 1));
  double exposed = 0;
  for (int attempt = 0; attempt < 20 && exposed == 0; ++attempt) {
    exposed = read_rate(host, node_port, kBytes);
    if (exposed == 0) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const double loopback = loopback_rate(kBytes, 29999);
  server.destroy();
  fmt::print("  reading {} MiB sent by busybox nc: through an exposed port ({}:{}) {:.0f} MiB/s; the same sender on "
             "the host over loopback {:.0f} MiB/s\n",
             kBytes >> 20, host, node_port, exposed, loopback);
}

}  // namespace dsec::bench
