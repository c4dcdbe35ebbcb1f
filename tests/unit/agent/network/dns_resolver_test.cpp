// The sandboxes' DNS resolver, live on loopback: a query comes in, only allowed names go upstream (a stand-in
// zone the test serves itself), the answer's addresses are pinned before the answer is sent, and malformed packets
// of every kind are dropped without harm.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <ldns/ldns.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "agent/network/dns_resolver.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::network {
namespace {

constexpr std::uint32_t kLoopback = 0x7F000001;

UniqueFd udp_socket(std::uint16_t* port = nullptr) {
  UniqueFd fd(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(kLoopback);
  EXPECT_EQ(::bind(fd.get(), reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  socklen_t len = sizeof a;
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&a), &len);
  if (port) *port = ntohs(a.sin_port);
  return fd;
}

std::vector<std::uint8_t> wire_of(ldns_pkt* p) {
  std::uint8_t* data = nullptr;
  std::size_t size = 0;
  EXPECT_EQ(ldns_pkt2wire(&data, p, &size), LDNS_STATUS_OK);
  std::vector<std::uint8_t> out(data, data + size);
  std::free(data);
  ldns_pkt_free(p);
  return out;
}

std::vector<std::uint8_t> query(const char* name, ldns_rr_type type = LDNS_RR_TYPE_A, std::uint16_t id = 4242) {
  ldns_pkt* p = nullptr;
  EXPECT_EQ(ldns_pkt_query_new_frm_str(&p, name, type, LDNS_RR_CLASS_IN, LDNS_RD), LDNS_STATUS_OK);
  ldns_pkt_set_id(p, id);
  return wire_of(p);
}

// The upstream stand-in: a.test A 192.0.2.1 (TTL 5000), c.test CNAME a.test, nx.test NXDOMAIN, slow.test never
// answered. It records every name it is asked.
class Zone {
 public:
  Zone() : fd_(udp_socket(&port_)), thread_([this] { serve(); }) {}
  ~Zone() {
    stop_ = true;
    thread_.join();
  }
  std::uint16_t port() const { return port_; }
  std::vector<std::string> asked() {
    std::lock_guard lock(mu_);
    return asked_;
  }

 private:
  void serve() {
    std::uint8_t buf[4096];
    while (!stop_) {
      pollfd p{fd_.get(), POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      sockaddr_in from{};
      socklen_t len = sizeof from;
      ssize_t n = ::recvfrom(fd_.get(), buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &len);
      ldns_pkt* q = nullptr;
      if (n <= 0 || ldns_wire2pkt(&q, buf, static_cast<std::size_t>(n)) != LDNS_STATUS_OK) continue;
      char* text = ldns_rdf2str(ldns_rr_owner(ldns_rr_list_rr(ldns_pkt_question(q), 0)));
      std::string name = text;
      std::free(text);
      for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      {
        std::lock_guard lock(mu_);
        asked_.push_back(name);
      }
      if (name == "slow.test.") {
        ldns_pkt_free(q);
        continue;
      }
      ldns_pkt* r = ldns_pkt_new();
      ldns_pkt_set_id(r, ldns_pkt_id(q));
      ldns_pkt_set_qr(r, true);
      ldns_pkt_push_rr(r, LDNS_SECTION_QUESTION, ldns_rr_clone(ldns_rr_list_rr(ldns_pkt_question(q), 0)));
      auto add = [&](const char* rr) {
        ldns_rr* record = nullptr;
        ASSERT_EQ(ldns_rr_new_frm_str(&record, rr, 0, nullptr, nullptr), LDNS_STATUS_OK) << rr;
        ldns_pkt_push_rr(r, LDNS_SECTION_ANSWER, record);
      };
      if (name == "a.test.") {
        add("a.test. 5000 IN A 192.0.2.1");
      } else if (name == "c.test.") {
        add("c.test. 60 IN CNAME a.test.");
        add("a.test. 60 IN A 192.0.2.1");
        add("a.test. 60 IN A 192.0.2.2");
      } else {
        ldns_pkt_set_rcode(r, LDNS_RCODE_NXDOMAIN);
      }
      ldns_pkt_free(q);
      auto wire = wire_of(r);
      ::sendto(fd_.get(), wire.data(), wire.size(), 0, reinterpret_cast<sockaddr*>(&from), len);
    }
  }

  std::uint16_t port_ = 0;
  UniqueFd fd_;
  std::mutex mu_;
  std::vector<std::string> asked_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class DnsResolverTest : public ::testing::Test {
 protected:
  DnsResolverTest() {
    DnsDecisions d;
    d.may_resolve = [this](std::uint32_t source, const std::string& name) -> std::optional<bool> {
      if (source != kLoopback || name == "stranger.test") return std::nullopt;  // no sandbox's address
      return allowed_.count(name) > 0;
    };
    d.pin = [this](std::uint32_t, const std::string& name, const std::vector<ResolvedAddress>& answers) {
      std::lock_guard lock(mu_);
      if (name == "revoked.test") return false;
      for (const auto& a : answers) pins_[name].push_back(a);
      return true;
    };
    resolver_.emplace(DnsUpstream{kLoopback, zone_.port()}, std::move(d));
    client_ = udp_socket();
  }

  // Sends a packet to the resolver; the answer, if one comes within `wait`.
  std::optional<ldns_pkt*> ask(const std::vector<std::uint8_t>& packet,
                               std::chrono::milliseconds wait = std::chrono::milliseconds(2000)) {
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(resolver_->port());
    to.sin_addr.s_addr = htonl(kLoopback);
    ::sendto(client_.get(), packet.data(), packet.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to);
    pollfd p{client_.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return std::nullopt;
    std::uint8_t buf[4096];
    ssize_t n = ::recv(client_.get(), buf, sizeof buf, 0);
    // What was pinned when the answer arrived (the pin must come first).
    {
      std::lock_guard lock(mu_);
      pins_at_answer_ = pins_;
    }
    ldns_pkt* r = nullptr;
    if (n <= 0 || ldns_wire2pkt(&r, buf, static_cast<std::size_t>(n)) != LDNS_STATUS_OK) return nullptr;
    return r;
  }

  std::set<std::string> allowed_{"a.test", "c.test", "nx.test", "slow.test", "revoked.test"};
  Zone zone_;
  std::optional<DnsResolver> resolver_;
  UniqueFd client_;
  std::mutex mu_;
  std::map<std::string, std::vector<ResolvedAddress>> pins_, pins_at_answer_;
};

std::vector<std::string> a_records(ldns_pkt* r) {
  std::vector<std::string> out;
  const ldns_rr_list* answers = ldns_pkt_answer(r);
  for (std::size_t i = 0; i < ldns_rr_list_rr_count(answers); ++i) {
    ldns_rr* rr = ldns_rr_list_rr(answers, i);
    if (ldns_rr_get_type(rr) != LDNS_RR_TYPE_A) continue;
    char* text = ldns_rdf2str(ldns_rr_rdf(rr, 0));
    out.push_back(text);
    std::free(text);
  }
  return out;
}

TEST_F(DnsResolverTest, AnAllowedNameIsAskedUpstreamAndPinnedBeforeTheAnswer) {
  auto r = ask(query("A.Test."));
  ASSERT_TRUE(r && *r);
  EXPECT_EQ(ldns_pkt_id(*r), 4242);
  EXPECT_EQ(ldns_pkt_get_rcode(*r), LDNS_RCODE_NOERROR);
  EXPECT_EQ(a_records(*r), std::vector<std::string>{"192.0.2.1"});
  EXPECT_EQ(ldns_rr_ttl(ldns_rr_list_rr(ldns_pkt_answer(*r), 0)), DnsResolver::kMaxAnswerTtl);  // clamped
  ldns_pkt_free(*r);
  ASSERT_EQ(pins_at_answer_["a.test"].size(), 1u);
  EXPECT_EQ(pins_at_answer_["a.test"][0].address, 0xC0000201u);
  EXPECT_EQ(pins_at_answer_["a.test"][0].ttl, DnsResolver::kMaxAnswerTtl);

  // A CNAME chain: every address at its end is pinned under the name asked.
  r = ask(query("c.test."));
  ASSERT_TRUE(r && *r);
  EXPECT_EQ(a_records(*r), (std::vector<std::string>{"192.0.2.1", "192.0.2.2"}));
  ldns_pkt_free(*r);
  EXPECT_EQ(pins_at_answer_["c.test"].size(), 2u);
}

TEST_F(DnsResolverTest, OtherNamesAndTypesNeverLeaveTheNode) {
  for (const char* name : {"denied.test.", "x.a.test."}) {
    auto r = ask(query(name));
    ASSERT_TRUE(r && *r) << name;
    EXPECT_EQ(ldns_pkt_get_rcode(*r), LDNS_RCODE_NXDOMAIN) << name;
    ldns_pkt_free(*r);
  }
  auto r = ask(query("a.test.", LDNS_RR_TYPE_AAAA));  // IPv4 only: an empty answer, nothing asked
  ASSERT_TRUE(r && *r);
  EXPECT_EQ(ldns_pkt_get_rcode(*r), LDNS_RCODE_NOERROR);
  EXPECT_EQ(ldns_pkt_ancount(*r), 0);
  ldns_pkt_free(*r);
  r = ask(query("nx.test."));  // upstream's NXDOMAIN passes
  ASSERT_TRUE(r && *r);
  EXPECT_EQ(ldns_pkt_get_rcode(*r), LDNS_RCODE_NXDOMAIN);
  ldns_pkt_free(*r);
  r = ask(query("revoked.test."));  // allowed when asked, refused at pinning: no address handed out
  ASSERT_TRUE(r && *r);
  EXPECT_EQ(ldns_pkt_get_rcode(*r), LDNS_RCODE_NXDOMAIN);
  EXPECT_EQ(ldns_pkt_ancount(*r), 0);
  ldns_pkt_free(*r);
  EXPECT_FALSE(ask(query("stranger.test."), std::chrono::milliseconds(300)));  // not a sandbox: no answer
  for (const std::string& asked : zone_.asked()) EXPECT_TRUE(asked == "nx.test." || asked == "revoked.test.") << asked;
}

TEST_F(DnsResolverTest, MalformedPacketsAreDroppedAndTheResolverGoesOn) {
  std::vector<std::vector<std::uint8_t>> bad = {
      {},
      {0x12},
      {0x12, 0x34, 0x01, 0x00, 0x00, 0x01},  // a header cut short
      std::vector<std::uint8_t>(512, 0xFF),
  };
  // A question whose name is a compression pointer to itself.
  bad.push_back(
      {0x00, 0x01, 0x01, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xC0, 0x0C, 0x00, 0x01, 0x00, 0x01});
  // Two questions; and an answer (QR set) sent as if a query.
  {
    auto q = query("a.test.");
    q[5] = 2;
    bad.push_back(q);
    auto a = query("a.test.");
    a[2] |= 0x80;
    bad.push_back(a);
  }
  // A name of odd bytes that is no host name.
  {
    std::vector<std::uint8_t> q = {0x00, 0x02, 0x01, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x03,
                                   'a',  0x00, '\n', 0x04, 't',  'e',  's',  't',  0x00, 0x00, 0x01, 0x00, 0x01};
    bad.push_back(q);
  }
  for (const auto& packet : bad) {
    auto r = ask(packet, std::chrono::milliseconds(200));
    if (r && *r) {
      EXPECT_NE(ldns_pkt_get_rcode(*r), LDNS_RCODE_NOERROR);  // an error answer, never data
      ldns_pkt_free(*r);
    }
  }
  auto r = ask(query("a.test."));
  ASSERT_TRUE(r && *r);
  EXPECT_EQ(a_records(*r), std::vector<std::string>{"192.0.2.1"});
  ldns_pkt_free(*r);
}

TEST_F(DnsResolverTest, OneSandboxCannotHoldMoreThanItsShareOfQueries) {
  // Queries upstream never answers pile up to the per-sandbox limit; the rest are REFUSED at once.
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(resolver_->port());
  to.sin_addr.s_addr = htonl(kLoopback);
  const std::size_t sent = DnsResolver::kPendingPerSource + 8;
  for (std::size_t i = 0; i < sent; ++i) {
    auto q = query("slow.test.", LDNS_RR_TYPE_A, static_cast<std::uint16_t>(i));
    ::sendto(client_.get(), q.data(), q.size(), 0, reinterpret_cast<sockaddr*>(&to), sizeof to);
  }
  std::size_t refused = 0;
  for (;;) {
    pollfd p{client_.get(), POLLIN, 0};
    if (::poll(&p, 1, 500) <= 0) break;
    std::uint8_t buf[512];
    ssize_t n = ::recv(client_.get(), buf, sizeof buf, 0);
    ldns_pkt* r = nullptr;
    if (n > 0 && ldns_wire2pkt(&r, buf, static_cast<std::size_t>(n)) == LDNS_STATUS_OK) {
      if (ldns_pkt_get_rcode(r) == LDNS_RCODE_REFUSED) ++refused;
      ldns_pkt_free(r);
    }
  }
  EXPECT_EQ(refused, sent - DnsResolver::kPendingPerSource);
}

TEST(DnsUpstream, ParsedStrictly) {
  EXPECT_EQ(parse_dns_upstream("192.0.2.53").address, 0xC0000235u);
  EXPECT_EQ(parse_dns_upstream("192.0.2.53:5353").port, 5353);
  for (const char* bad : {"", "dns.example", "192.0.2.0/24", "192.0.2.53:0", "192.0.2.53:70000", "0.0.0.0", ":53"})
    EXPECT_THROW(parse_dns_upstream(bad), Error) << bad;
}

}  // namespace
}  // namespace dsec::agent::network
