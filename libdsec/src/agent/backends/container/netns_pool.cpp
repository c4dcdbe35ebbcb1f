#include "agent/backends/container/netns_pool.hpp"

#include <fcntl.h>
#include <net/if.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>

#include "common/syscall.hpp"

namespace dsec::agent::container {

NetnsPool::NetnsPool(std::size_t target) : target_(target) {
  if (target_ > 0) refiller_ = std::thread([this] { refill_loop(); });
}

NetnsPool::~NetnsPool() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  if (refiller_.joinable()) refiller_.join();
}

UniqueFd NetnsPool::make_namespace() {
  // Network namespaces are per thread: this moves only the calling thread.
  if (::unshare(CLONE_NEWNET) != 0) throw_errno(errno, "unshare(CLONE_NEWNET)");
  UniqueFd ns(::open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC));
  if (!ns) throw_errno(errno, "open /proc/thread-self/ns/net");
  UniqueFd sock(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!sock) throw_errno(errno, "socket in new network namespace");
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
  if (::ioctl(sock.get(), SIOCGIFFLAGS, &ifr) != 0) throw_errno(errno, "SIOCGIFFLAGS lo");
  ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
  if (::ioctl(sock.get(), SIOCSIFFLAGS, &ifr) != 0) throw_errno(errno, "SIOCSIFFLAGS lo up");
  return ns;
}

UniqueFd NetnsPool::take() {
  {
    std::lock_guard lock(mu_);
    if (!ready_.empty()) {
      UniqueFd fd = std::move(ready_.front());
      ready_.pop_front();
      wake_.notify_all();
      return fd;
    }
  }
  wake_.notify_all();
  // Empty pool: make one on a short-lived thread so this (request) thread stays in the host namespace.
  UniqueFd fd;
  std::exception_ptr error;
  std::thread([&] {
    try {
      fd = make_namespace();
    } catch (...) {
      error = std::current_exception();
    }
  }).join();
  if (error) std::rethrow_exception(error);
  return fd;
}

std::size_t NetnsPool::available() {
  std::lock_guard lock(mu_);
  return ready_.size();
}

void NetnsPool::refill_loop() {
  std::unique_lock lock(mu_);
  while (!stop_) {
    if (ready_.size() >= target_) {
      wake_.wait(lock, [&] { return stop_ || ready_.size() < target_; });
      continue;
    }
    lock.unlock();
    UniqueFd fd;
    try {
      fd = make_namespace();
    } catch (const std::exception&) {
      // Out of namespaces or memory: back off; take() reports the error when it must make one itself.
      lock.lock();
      wake_.wait_for(lock, std::chrono::seconds(1), [&] { return stop_; });
      continue;
    }
    lock.lock();
    ready_.push_back(std::move(fd));
  }
}

}  // namespace dsec::agent::container
