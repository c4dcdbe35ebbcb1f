// dsec-bench network: what sandbox networks cost (docs/networking.md). Create-to-ready with network "egress" (a
// link, a /30, rules in the agent's nftables sets) against "none", the two alternating every iteration; the latency
// of a rule change (Sandbox::set_network) on a live sandbox; and both again with K sandboxes holding rules on the
// node, so that what one more sandbox or one change costs is seen at scale. No traffic is sent: the rules name
// documentation networks (RFC 5737) that nothing on this machine answers.
#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "bench.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"

// ldns last: its headers define C's bool words, which <optional> must not see.
#include <ldns/ldns.h>

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

// The upstream name server the agent's resolver asks: n<I>.bench.test is 198.18.<I / 256>.<I % 256> (TTL 300),
// everything else NXDOMAIN. On 127.0.0.1, so that nothing leaves the machine.
class NameServer {
 public:
  NameServer() {
    fd_ = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0)
      throw Error(Code::kInternal, "dsec-bench: cannot bind the name server's UDP port on 127.0.0.1");
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~NameServer() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
  }
  std::uint16_t port() const { return port_; }

 private:
  void serve() {
    std::uint8_t buf[1500];
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 100) <= 0) continue;
      sockaddr_in from{};
      socklen_t len = sizeof from;
      ssize_t n = ::recvfrom(fd_, buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &len);
      ldns_pkt* q = nullptr;
      if (n <= 0 || ldns_wire2pkt(&q, buf, static_cast<std::size_t>(n)) != LDNS_STATUS_OK) continue;
      ldns_pkt* r = ldns_pkt_new();
      ldns_pkt_set_id(r, ldns_pkt_id(q));
      ldns_pkt_set_qr(r, true);
      const ldns_rr_list* questions = ldns_pkt_question(q);
      unsigned index = 0;
      bool found = false;
      if (ldns_rr_list_rr_count(questions) == 1) {
        const ldns_rr* question = ldns_rr_list_rr(questions, 0);
        ldns_pkt_push_rr(r, LDNS_SECTION_QUESTION, ldns_rr_clone(question));
        char* name = ldns_rdf2str(ldns_rr_owner(question));
        found = name && std::sscanf(name, "n%u.bench.test.", &index) == 1 && index < 65536;
        if (found) {
          ldns_rr* a = nullptr;
          const std::string rr = fmt::format("{} 300 IN A 198.18.{}.{}", name, index / 256, index % 256);
          if (ldns_rr_new_frm_str(&a, rr.c_str(), 0, nullptr, nullptr) == LDNS_STATUS_OK)
            ldns_pkt_push_rr(r, LDNS_SECTION_ANSWER, a);
        }
        std::free(name);
      }
      if (!found) ldns_pkt_set_rcode(r, LDNS_RCODE_NXDOMAIN);
      std::uint8_t* wire = nullptr;
      std::size_t size = 0;
      if (ldns_pkt2wire(&wire, r, &size) == LDNS_STATUS_OK)
        ::sendto(fd_, wire, size, 0, reinterpret_cast<sockaddr*>(&from), len);
      std::free(wire);
      ldns_pkt_free(r);
      ldns_pkt_free(q);
    }
  }

  int fd_ = -1;
  std::uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

NameServer& name_server() {
  static NameServer server;
  return server;
}

void print_latency(const char* what, const Latency& l) {
  fmt::print("  {:<52} {:>8.2f} ms {:>8.2f} ms {:>8.2f} ms {:>8.2f} ms  (n={})\n", what, l.percentile(50),
             l.percentile(90), l.percentile(99), l.max(), l.count());
}

}  // namespace

std::vector<std::string> network_agent_args() {
  return {"--dns-upstream", fmt::format("127.0.0.1:{}", name_server().port())};
}

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

  // Names: a sandbox whose only rule is *.bench.test resolves a new name (the agent forwards it and pins its
  // address in one nftables transaction before it answers), the same name again (the pin is only extended), and
  // runs `true`: each an exec from the client, so the differences are the resolver's.
  std::uint32_t next_name = 0;
  auto measure_names = [&](std::size_t n, Latency& first, Latency& again, Latency& plain) {
    SandboxSpec spec = none;
    spec.network.mode = "egress";
    NetworkRule names;
    names.host = "*.bench.test";
    spec.network.rules = {names};
    Sandbox sb = client.create(spec);
    auto timed = [&](const std::string& command, Latency* into) {
      auto t0 = Clock::now();
      ExecResult r = sb.exec(command, 10);
      double ms = ms_since(t0);
      if (r.exit_code != 0)
        throw Error(Code::kInternal,
                    fmt::format("dsec-bench: `{}` in the sandbox failed: {}", command, r.stdout_data + r.stderr_data));
      if (into) into->add(ms);
    };
    for (std::size_t i = 0; i < options.warmup + n; ++i) {
      const bool keep = i >= options.warmup;
      const std::string name = fmt::format("n{}.bench.test", next_name++ % 65536);
      timed("nslookup -type=a " + name + " >/dev/null", keep ? &first : nullptr);
      timed("nslookup -type=a " + name + " >/dev/null", keep ? &again : nullptr);
      timed("true", keep ? &plain : nullptr);
    }
    sb.destroy();
  };
  Latency resolve_first, resolve_again, exec_true;
  measure_names(options.n, resolve_first, resolve_again, exec_true);
  print_latency("exec: nslookup of a new allowed name", resolve_first);
  print_latency("exec: nslookup of the same name again", resolve_again);
  print_latency("exec: true", exec_true);
  fmt::print(
      "  a new name costs {:+.2f} ms at p50 over `true` (forward, pin, answer, and nslookup itself), the "
      "same name {:+.2f} ms\n",
      resolve_first.percentile(50) - exec_true.percentile(50), resolve_again.percentile(50) - exec_true.percentile(50));

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
  fmt::print(
      "  with {} sandboxes holding rules on the node (made in {:.1f} s; MemAvailable {:.1f} MiB lower, {:.0f} KiB "
      "a sandbox, its processes and link included):\n",
      k, fill_s, static_cast<double>(available_before - std::min(available_before, available_after)) / (1 << 20),
      k ? static_cast<double>(available_before - std::min(available_before, available_after)) / 1024 /
              static_cast<double>(k)
        : 0.0);
  print_latency("create, network none", at_none);
  print_latency("create, network egress with 3 rules", at_egress);
  print_latency("set_network on a live sandbox", at_update);
  Latency at_first, at_again, at_true;
  measure_names(n, at_first, at_again, at_true);
  print_latency("exec: nslookup of a new allowed name", at_first);
  print_latency("exec: nslookup of the same name again", at_again);
  print_latency("exec: true", at_true);
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
  fmt::print(
      "  reading {} MiB sent by busybox nc: through an exposed port ({}:{}) {:.0f} MiB/s; the same sender on "
      "the host over loopback {:.0f} MiB/s\n",
      kBytes >> 20, host, node_port, exposed, loopback);
}

}  // namespace dsec::bench
