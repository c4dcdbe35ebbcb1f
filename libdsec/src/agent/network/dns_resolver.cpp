#include "agent/network/dns_resolver.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ldns/ldns.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <charconv>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/network_rules.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::network {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kUpstreamTimeout = std::chrono::seconds(3);
constexpr auto kExpireEvery = std::chrono::seconds(2);
constexpr std::size_t kPlainDnsSize = 512;  // a reply's size limit without EDNS

struct PacketFree {
  void operator()(ldns_pkt* p) const { ldns_pkt_free(p); }
};
using Packet = std::unique_ptr<ldns_pkt, PacketFree>;

Packet parse(const std::uint8_t* data, std::size_t size) {
  ldns_pkt* p = nullptr;
  if (ldns_wire2pkt(&p, data, size) != LDNS_STATUS_OK) return nullptr;
  return Packet(p);
}

std::string name_of(const ldns_rdf* rdf) {
  char* text = ldns_rdf2str(rdf);
  if (!text) return "";
  std::string out = ::dsec::network::normalize_name(text);
  std::free(text);
  return out;
}

// A reply to `query` carrying its id, flags and question.
Packet reply_to(const ldns_pkt* query, ldns_pkt_rcode rcode) {
  Packet r(ldns_pkt_new());
  if (!r) return nullptr;
  ldns_pkt_set_id(r.get(), ldns_pkt_id(query));
  ldns_pkt_set_qr(r.get(), true);
  ldns_pkt_set_opcode(r.get(), ldns_pkt_get_opcode(query));
  ldns_pkt_set_rd(r.get(), ldns_pkt_rd(query));
  ldns_pkt_set_ra(r.get(), true);
  ldns_pkt_set_rcode(r.get(), static_cast<std::uint8_t>(rcode));
  const ldns_rr_list* q = ldns_pkt_question(query);
  for (std::size_t i = 0; q && i < ldns_rr_list_rr_count(q); ++i)
    ldns_pkt_push_rr(r.get(), LDNS_SECTION_QUESTION, ldns_rr_clone(ldns_rr_list_rr(q, i)));
  return r;
}

}  // namespace

DnsUpstream parse_dns_upstream(const std::string& text) {
  auto bad = [&] {
    return Error(Code::kInvalidArgument,
                 fmt::format("--dns-upstream: '{}' is not an IPv4 address with an optional port, such as "
                             "192.0.2.53 or 192.0.2.53:5353",
                             text));
  };
  std::string host = text;
  DnsUpstream u;
  if (auto colon = text.find(':'); colon != std::string::npos) {
    host = text.substr(0, colon);
    const std::string p = text.substr(colon + 1);
    unsigned port = 0;
    auto [ptr, ec] = std::from_chars(p.data(), p.data() + p.size(), port);
    if (p.empty() || ec != std::errc() || ptr != p.data() + p.size() || port < 1 || port > 65535) throw bad();
    u.port = static_cast<std::uint16_t>(port);
  }
  auto c = ::dsec::network::parse_cidr(host);
  if (!c || c->prefix != 32 || host.find('/') != std::string::npos || c->address == 0) throw bad();
  u.address = c->address;
  return u;
}

std::optional<DnsUpstream> upstream_from_resolv_conf(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  while (std::getline(f, line)) {
    std::istringstream words(line);
    std::string key, value;
    if (!(words >> key >> value) || key != "nameserver") continue;
    auto c = ::dsec::network::parse_cidr(value);
    if (c && c->prefix == 32 && value.find('/') == std::string::npos && c->address != 0)
      return DnsUpstream{c->address, 53};
  }
  return std::nullopt;
}

struct DnsResolver::Impl {
  DnsUpstream upstream;
  DnsDecisions decisions;
  UniqueFd listen;   // queries from sandboxes (redirected here)
  UniqueFd outward;  // to and from the upstream resolver (connected: nothing else is read)
  UniqueFd wake;     // eventfd: stop
  std::uint16_t port = 0;
  std::thread thread;

  struct Pending {
    Packet query;  // the sandbox's, for its id, flags and question
    sockaddr_in client{};
    std::uint32_t source = 0;
    std::string name;
    Clock::time_point deadline;
  };
  std::map<std::uint16_t, Pending> pending;         // by the id of the query sent upstream
  std::map<std::uint32_t, std::size_t> pending_of;  // per sandbox address
  std::mt19937 random{std::random_device{}()};
  bool warned_no_upstream = false;

  void send(const ldns_pkt* reply, const sockaddr_in& to, std::size_t limit) {
    std::uint8_t* wire = nullptr;
    std::size_t size = 0;
    if (ldns_pkt2wire(&wire, reply, &size) != LDNS_STATUS_OK || !wire) return;
    if (size <= limit)
      (void)::sendto(listen.get(), wire, size, MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(&to), sizeof to);
    std::free(wire);
  }

  void answer(const ldns_pkt* query, ldns_pkt_rcode rcode, const sockaddr_in& to) {
    if (Packet r = reply_to(query, rcode)) send(r.get(), to, kPlainDnsSize);
  }

  void on_query(const std::uint8_t* data, std::size_t size, const sockaddr_in& from) {
    const std::uint32_t source = ntohl(from.sin_addr.s_addr);
    Packet q = parse(data, size);
    if (!q || ldns_pkt_qr(q.get())) return;  // not a query: dropped
    if (!decisions.may_resolve) return;
    const ldns_rr_list* questions = ldns_pkt_question(q.get());
    if (ldns_pkt_get_opcode(q.get()) != LDNS_PACKET_QUERY || !questions || ldns_rr_list_rr_count(questions) != 1) {
      // Whether the source is a sandbox at all decides whether anything is sent back.
      if (decisions.may_resolve(source, "").has_value()) answer(q.get(), LDNS_RCODE_NOTIMPL, from);
      return;
    }
    const ldns_rr* question = ldns_rr_list_rr(questions, 0);
    const std::string name = name_of(ldns_rr_owner(question));
    std::optional<bool> allowed = decisions.may_resolve(source, name);
    if (!allowed) return;  // no sandbox's address
    if (!*allowed || name.empty() || ldns_rr_get_class(question) != LDNS_RR_CLASS_IN) {
      answer(q.get(), LDNS_RCODE_NXDOMAIN, from);
      return;
    }
    if (ldns_rr_get_type(question) != LDNS_RR_TYPE_A) {
      answer(q.get(), LDNS_RCODE_NOERROR, from);  // IPv4 only: no data of other types
      return;
    }
    if (upstream.address == 0) {
      if (!warned_no_upstream) log_warn("sandbox DNS: no upstream resolver (dsecd --dns-upstream); answering SERVFAIL");
      warned_no_upstream = true;
      answer(q.get(), LDNS_RCODE_SERVFAIL, from);
      return;
    }
    if (pending.size() >= kPendingInAll || pending_of[source] >= kPendingPerSource) {
      answer(q.get(), LDNS_RCODE_REFUSED, from);
      return;
    }
    // A query of the agent's own, not the sandbox's bytes: a fresh id, the one question, recursion wanted.
    std::uint16_t id = 0;
    do id = static_cast<std::uint16_t>(random());
    while (pending.count(id));
    Packet out(ldns_pkt_query_new(ldns_rdf_clone(ldns_rr_owner(question)), LDNS_RR_TYPE_A, LDNS_RR_CLASS_IN, LDNS_RD));
    if (!out) return;
    ldns_pkt_set_id(out.get(), id);
    std::uint8_t* wire = nullptr;
    std::size_t wire_size = 0;
    if (ldns_pkt2wire(&wire, out.get(), &wire_size) != LDNS_STATUS_OK || !wire) return;
    const ssize_t sent = ::send(outward.get(), wire, wire_size, MSG_DONTWAIT);
    std::free(wire);
    if (sent < 0) {
      answer(q.get(), LDNS_RCODE_SERVFAIL, from);
      return;
    }
    ++pending_of[source];
    pending[id] = Pending{std::move(q), from, source, name, Clock::now() + kUpstreamTimeout};
  }

  void finish(std::map<std::uint16_t, Pending>::iterator it) {
    if (auto p = pending_of.find(it->second.source); p != pending_of.end() && --p->second == 0) pending_of.erase(p);
    pending.erase(it);
  }

  void on_upstream(const std::uint8_t* data, std::size_t size) {
    Packet a = parse(data, size);
    if (!a || !ldns_pkt_qr(a.get())) return;
    auto it = pending.find(ldns_pkt_id(a.get()));
    if (it == pending.end()) return;
    Pending& p = it->second;
    const ldns_rr_list* questions = ldns_pkt_question(a.get());
    if (!questions || ldns_rr_list_rr_count(questions) != 1 ||
        name_of(ldns_rr_owner(ldns_rr_list_rr(questions, 0))) != p.name)
      return;  // not the answer to this query: the real one may still come
    const auto rcode = ldns_pkt_get_rcode(a.get());
    if (rcode != LDNS_RCODE_NOERROR) {
      answer(p.query.get(), rcode == LDNS_RCODE_NXDOMAIN ? LDNS_RCODE_NXDOMAIN : LDNS_RCODE_SERVFAIL, p.client);
      finish(it);
      return;
    }
    Packet reply = reply_to(p.query.get(), LDNS_RCODE_NOERROR);
    std::vector<ResolvedAddress> addresses;
    const ldns_rr_list* records = ldns_pkt_answer(a.get());
    for (std::size_t i = 0; reply && records && i < ldns_rr_list_rr_count(records); ++i) {
      const ldns_rr* rr = ldns_rr_list_rr(records, i);
      if (ldns_rr_get_class(rr) != LDNS_RR_CLASS_IN) continue;
      const auto type = ldns_rr_get_type(rr);
      if (type != LDNS_RR_TYPE_A && type != LDNS_RR_TYPE_CNAME) continue;  // what an A answer holds
      ldns_rr* copy = ldns_rr_clone(rr);
      ldns_rr_set_ttl(copy, std::min(ldns_rr_ttl(rr), kMaxAnswerTtl));
      if (type == LDNS_RR_TYPE_A) {
        const ldns_rdf* rd = ldns_rr_rdf(rr, 0);
        if (!rd || ldns_rdf_size(rd) != 4) {
          ldns_rr_free(copy);
          continue;
        }
        std::uint32_t be = 0;
        std::memcpy(&be, ldns_rdf_data(rd), 4);
        addresses.push_back({ntohl(be), ldns_rr_ttl(copy)});
      }
      ldns_pkt_push_rr(reply.get(), LDNS_SECTION_ANSWER, copy);
    }
    if (!reply) return;
    if (!addresses.empty() && !decisions.pin(p.source, p.name, addresses)) {
      answer(p.query.get(), LDNS_RCODE_NXDOMAIN, p.client);
    } else {
      // A client that announced no larger size gets what fits in 512 bytes: whole records, the last ones dropped.
      const std::size_t limit = std::max<std::size_t>(kPlainDnsSize, ldns_pkt_edns_udp_size(p.query.get()));
      std::uint8_t* wire = nullptr;
      std::size_t wire_size = 0;
      while (ldns_pkt2wire(&wire, reply.get(), &wire_size) == LDNS_STATUS_OK && wire && wire_size > limit &&
             ldns_pkt_ancount(reply.get()) > 0) {
        std::free(wire);
        wire = nullptr;
        ldns_rr_free(ldns_rr_list_pop_rr(ldns_pkt_answer(reply.get())));
        ldns_pkt_set_ancount(reply.get(), static_cast<std::uint16_t>(ldns_pkt_ancount(reply.get()) - 1));
      }
      std::free(wire);
      send(reply.get(), p.client, limit);
    }
    finish(it);
  }

  void expire_pending() {
    const auto now = Clock::now();
    for (auto it = pending.begin(); it != pending.end();) {
      auto next = std::next(it);
      if (it->second.deadline <= now) {
        answer(it->second.query.get(), LDNS_RCODE_SERVFAIL, it->second.client);
        finish(it);
      }
      it = next;
    }
  }

  void loop() {
    std::array<std::uint8_t, 4096> buf;
    auto last_expire = Clock::now();
    for (;;) {
      pollfd fds[3] = {{listen.get(), POLLIN, 0}, {outward.get(), POLLIN, 0}, {wake.get(), POLLIN, 0}};
      (void)::poll(fds, 3, 500);
      if (fds[2].revents) return;
      for (int n = 0; n < 64 && (fds[0].revents & POLLIN); ++n) {
        sockaddr_in from{};
        socklen_t len = sizeof from;
        ssize_t got =
            ::recvfrom(listen.get(), buf.data(), buf.size(), MSG_DONTWAIT, reinterpret_cast<sockaddr*>(&from), &len);
        if (got < 0) break;
        if (from.sin_family == AF_INET) on_query(buf.data(), static_cast<std::size_t>(got), from);
      }
      for (int n = 0; n < 64 && (fds[1].revents & POLLIN); ++n) {
        ssize_t got = ::recv(outward.get(), buf.data(), buf.size(), MSG_DONTWAIT);
        if (got < 0) break;
        on_upstream(buf.data(), static_cast<std::size_t>(got));
      }
      expire_pending();
      if (Clock::now() - last_expire >= kExpireEvery) {
        last_expire = Clock::now();
        if (decisions.expire) {
          try {
            decisions.expire();
          } catch (const std::exception& e) {
            log_warn("sandbox DNS: expiring pins: {}", e.what());
          }
        }
      }
    }
  }
};

DnsResolver::DnsResolver(DnsUpstream upstream, DnsDecisions decisions) : impl_(std::make_unique<Impl>()) {
  Impl& d = *impl_;
  d.upstream = upstream;
  d.decisions = std::move(decisions);
  d.listen = UniqueFd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!d.listen) throw_errno(errno, "sandbox DNS: socket");
  sockaddr_in any{};
  any.sin_family = AF_INET;
  if (::bind(d.listen.get(), reinterpret_cast<sockaddr*>(&any), sizeof any) != 0)
    throw_errno(errno, "sandbox DNS: bind a UDP port");
  socklen_t len = sizeof any;
  ::getsockname(d.listen.get(), reinterpret_cast<sockaddr*>(&any), &len);
  d.port = ntohs(any.sin_port);
  d.outward = UniqueFd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!d.outward) throw_errno(errno, "sandbox DNS: socket");
  if (upstream.address != 0) {
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(upstream.port);
    to.sin_addr.s_addr = htonl(upstream.address);
    if (::connect(d.outward.get(), reinterpret_cast<sockaddr*>(&to), sizeof to) != 0)
      throw_errno(errno, fmt::format("sandbox DNS: the upstream resolver {}:{}",
                                     ::dsec::network::ipv4_to_string(upstream.address), upstream.port));
  }
  d.wake = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!d.wake) throw_errno(errno, "sandbox DNS: eventfd");
  d.thread = std::thread([&d] { d.loop(); });
}

DnsResolver::~DnsResolver() {
  std::uint64_t one = 1;
  (void)::write(impl_->wake.get(), &one, sizeof one);
  if (impl_->thread.joinable()) impl_->thread.join();
}

std::uint16_t DnsResolver::port() const { return impl_->port; }

}  // namespace dsec::agent::network
