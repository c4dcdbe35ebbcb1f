#include "agent/network/netlink.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_link.h>
#include <linux/netlink.h>
#include <linux/pkt_sched.h>
#include <linux/rtnetlink.h>
#include <linux/veth.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>

#include <fmt/format.h>

#include "common/syscall.hpp"

namespace dsec::agent::network {
namespace {

// A request under construction: the header, then attributes appended (nested ones opened and closed).
struct Message {
  alignas(nlmsghdr) char buf[1024]{};
  nlmsghdr* hdr() { return reinterpret_cast<nlmsghdr*>(buf); }
  Message(std::uint16_t type, std::uint16_t flags) {
    hdr()->nlmsg_len = NLMSG_LENGTH(0);
    hdr()->nlmsg_type = type;
    hdr()->nlmsg_flags = static_cast<std::uint16_t>(NLM_F_REQUEST | NLM_F_ACK | flags);
  }
  void* append(const void* data, std::size_t n) {
    std::size_t at = NLMSG_ALIGN(hdr()->nlmsg_len);
    if (at + n > sizeof buf) throw Error(Code::kInternal, "netlink request too large");
    std::memcpy(buf + at, data, n);
    hdr()->nlmsg_len = static_cast<std::uint32_t>(at + n);
    return buf + at;
  }
  rtattr* attr(std::uint16_t type, const void* data, std::size_t n) {
    std::size_t at = NLMSG_ALIGN(hdr()->nlmsg_len);
    if (at + RTA_LENGTH(n) > sizeof buf) throw Error(Code::kInternal, "netlink request too large");
    auto* a = reinterpret_cast<rtattr*>(buf + at);
    a->rta_type = type;
    a->rta_len = static_cast<std::uint16_t>(RTA_LENGTH(n));
    if (n) std::memcpy(RTA_DATA(a), data, n);
    hdr()->nlmsg_len = static_cast<std::uint32_t>(at + RTA_ALIGN(a->rta_len));
    return a;
  }
  rtattr* nest(std::uint16_t type) { return attr(type, nullptr, 0); }
  void end(rtattr* a) { a->rta_len = static_cast<std::uint16_t>(buf + hdr()->nlmsg_len - reinterpret_cast<char*>(a)); }
  void attr_string(std::uint16_t type, const std::string& s) { attr(type, s.c_str(), s.size() + 1); }
};

UniqueFd open_socket() {
  UniqueFd fd(::socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, NETLINK_ROUTE));
  if (!fd) throw_errno(errno, "netlink socket");
  sockaddr_nl local{};
  local.nl_family = AF_NETLINK;
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&local), sizeof local) != 0) throw_errno(errno, "bind netlink");
  return fd;
}

}  // namespace

Netlink::Netlink() : fd_(open_socket()) {}

Netlink::Netlink(int netns_fd) {
  UniqueFd own(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
  if (!own) throw_errno(errno, "open this thread's network namespace");
  if (::setns(netns_fd, CLONE_NEWNET) != 0) throw_errno(errno, "enter a sandbox's network namespace");
  int err = 0;
  try {
    fd_ = open_socket();
  } catch (const Error&) {
    err = errno ? errno : EIO;
  }
  if (::setns(own.get(), CLONE_NEWNET) != 0) throw_errno(errno, "return to the agent's network namespace");
  if (err) throw_errno(err, "netlink socket in a sandbox's network namespace");
}

int Netlink::exchange(void* message, std::size_t size, const char* what,
                      const std::function<bool(const nlmsghdr&)>& on_answer) {
  auto* hdr = static_cast<nlmsghdr*>(message);
  hdr->nlmsg_seq = ++seq_;
  sockaddr_nl kernel{};
  kernel.nl_family = AF_NETLINK;
  if (::sendto(fd_.get(), message, size, 0, reinterpret_cast<sockaddr*>(&kernel), sizeof kernel) < 0)
    throw_errno(errno, fmt::format("netlink {}", what));
  alignas(nlmsghdr) char answer[8192];
  for (;;) {
    ssize_t n = ::recv(fd_.get(), answer, sizeof answer, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw_errno(errno, fmt::format("netlink {}: receive", what));
    for (auto* h = reinterpret_cast<nlmsghdr*>(answer); NLMSG_OK(h, static_cast<unsigned>(n)); h = NLMSG_NEXT(h, n)) {
      if (h->nlmsg_seq != seq_) continue;
      if (h->nlmsg_type == NLMSG_ERROR) return -static_cast<nlmsgerr*>(NLMSG_DATA(h))->error;
      if (on_answer && on_answer(*h)) return 0;
    }
  }
}

void Netlink::request(void* message, std::size_t size, const char* what, bool missing_ok) {
  int err = exchange(message, size, what, {});
  if (err == 0 || (missing_ok && (err == ENODEV || err == ENOENT))) return;
  throw_errno(err, fmt::format("netlink {}", what));
}

void Netlink::create_veth(const std::string& name, const std::string& peer, int peer_netns_fd) {
  Message m(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL);
  ifinfomsg info{};
  info.ifi_family = AF_UNSPEC;
  m.append(&info, sizeof info);
  m.attr_string(IFLA_IFNAME, name);
  rtattr* linkinfo = m.nest(IFLA_LINKINFO);
  m.attr_string(IFLA_INFO_KIND, "veth");
  rtattr* data = m.nest(IFLA_INFO_DATA);
  rtattr* peer_attr = m.nest(VETH_INFO_PEER);
  ifinfomsg peer_info{};
  peer_info.ifi_family = AF_UNSPEC;
  m.append(&peer_info, sizeof peer_info);
  m.attr_string(IFLA_IFNAME, peer);
  std::uint32_t ns = static_cast<std::uint32_t>(peer_netns_fd);
  m.attr(IFLA_NET_NS_FD, &ns, sizeof ns);
  m.end(peer_attr);
  m.end(data);
  m.end(linkinfo);
  request(m.buf, m.hdr()->nlmsg_len, "create veth");
}

void Netlink::delete_link(const std::string& name) {
  Message m(RTM_DELLINK, 0);
  ifinfomsg info{};
  info.ifi_family = AF_UNSPEC;
  m.append(&info, sizeof info);
  m.attr_string(IFLA_IFNAME, name);
  request(m.buf, m.hdr()->nlmsg_len, "delete link", true);
}

int Netlink::index_of(const std::string& name) {
  // if_nametoindex answers for the calling thread's namespace, which is the agent's: ask the kernel over this socket.
  Message m(RTM_GETLINK, 0);
  m.hdr()->nlmsg_flags = NLM_F_REQUEST;
  ifinfomsg info{};
  info.ifi_family = AF_UNSPEC;
  m.append(&info, sizeof info);
  m.attr_string(IFLA_IFNAME, name);
  int index = 0;
  int err = exchange(m.buf, m.hdr()->nlmsg_len, "get link", [&](const nlmsghdr& h) {
    if (h.nlmsg_type != RTM_NEWLINK) return false;
    index = static_cast<const ifinfomsg*>(NLMSG_DATA(&h))->ifi_index;
    return true;
  });
  if (err != 0 && err != ENODEV) throw_errno(err, "netlink get link");
  return index;
}

void Netlink::set_up(int index) {
  Message m(RTM_NEWLINK, 0);
  ifinfomsg info{};
  info.ifi_family = AF_UNSPEC;
  info.ifi_index = index;
  info.ifi_flags = IFF_UP;
  info.ifi_change = IFF_UP;
  m.append(&info, sizeof info);
  request(m.buf, m.hdr()->nlmsg_len, "set link up");
}

void Netlink::add_address(int index, std::uint32_t address, int prefix) {
  Message m(RTM_NEWADDR, NLM_F_CREATE | NLM_F_REPLACE);
  ifaddrmsg a{};
  a.ifa_family = AF_INET;
  a.ifa_prefixlen = static_cast<unsigned char>(prefix);
  a.ifa_index = static_cast<unsigned>(index);
  m.append(&a, sizeof a);
  std::uint32_t be = htonl(address);
  m.attr(IFA_LOCAL, &be, sizeof be);
  m.attr(IFA_ADDRESS, &be, sizeof be);
  request(m.buf, m.hdr()->nlmsg_len, "add address");
}

void Netlink::add_default_route(std::uint32_t gateway) {
  Message m(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_REPLACE);
  rtmsg r{};
  r.rtm_family = AF_INET;
  r.rtm_table = RT_TABLE_MAIN;
  r.rtm_protocol = RTPROT_BOOT;
  r.rtm_scope = RT_SCOPE_UNIVERSE;
  r.rtm_type = RTN_UNICAST;
  m.append(&r, sizeof r);
  std::uint32_t be = htonl(gateway);
  m.attr(RTA_GATEWAY, &be, sizeof be);
  request(m.buf, m.hdr()->nlmsg_len, "add default route");
}

void Netlink::set_rate_limit(int index, std::uint64_t bytes_per_second) {
  Message m(RTM_NEWQDISC, NLM_F_CREATE | NLM_F_REPLACE);
  tcmsg t{};
  t.tcm_family = AF_UNSPEC;
  t.tcm_ifindex = index;
  t.tcm_handle = 1u << 16;  // 1:
  t.tcm_parent = TC_H_ROOT;
  m.append(&t, sizeof t);
  m.attr_string(TCA_KIND, "tbf");
  rtattr* options = m.nest(TCA_OPTIONS);
  // A burst of 20 ms at the rate (at least 64 KiB, what one segmentation-offloaded packet may be) and a queue of
  // 50 ms more: TCP then sees the rate, not losses.
  const std::uint64_t burst = std::max<std::uint64_t>(bytes_per_second / 50, 64 << 10);
  tc_tbf_qopt q{};
  q.rate.rate = static_cast<std::uint32_t>(std::min<std::uint64_t>(bytes_per_second, 0xFFFFFFFFu));
  q.rate.linklayer = TC_LINKLAYER_ETHERNET;
  q.limit = static_cast<std::uint32_t>(std::min<std::uint64_t>(burst + bytes_per_second / 20, 0xFFFFFFFFu));
  m.attr(TCA_TBF_PARMS, &q, sizeof q);
  if (bytes_per_second >= 0xFFFFFFFFu) m.attr(TCA_TBF_RATE64, &bytes_per_second, sizeof bytes_per_second);
  const auto burst32 = static_cast<std::uint32_t>(std::min<std::uint64_t>(burst, 0xFFFFFFFFu));
  m.attr(TCA_TBF_BURST, &burst32, sizeof burst32);
  m.end(options);
  request(m.buf, m.hdr()->nlmsg_len, "set a rate limit (tbf)");
}

}  // namespace dsec::agent::network
