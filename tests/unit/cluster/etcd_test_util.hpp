// Helpers for the tests that talk to etcd: a real etcd (Debian's /usr/bin/etcd) on free loopback ports with a
// scratch data directory, and a TCP proxy in front of it that can drop its connections and refuse new ones, so a
// test can break a client's stream while the store goes on changing.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cluster/etcd_client.hpp"

namespace dsec::testing {

inline constexpr const char* kEtcdBinary = "/usr/bin/etcd";

// Why etcd tests cannot run here, or "" when they can.
inline std::string etcd_skip_reason() {
  if (::access(kEtcdBinary, X_OK) != 0)
    return "no etcd at /usr/bin/etcd (apt-get install etcd-server; scripts/install-deps.sh installs it)";
  return {};
}

// A loopback port nobody listens on right now.
inline int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    throw std::runtime_error("bind 127.0.0.1:0 failed");
  }
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

template <typename P>
bool wait_until(P predicate, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!predicate()) {
    if (std::chrono::steady_clock::now() >= deadline) return predicate();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// One etcd member on 127.0.0.1, killed with the test process (PR_SET_PDEATHSIG) if the test dies.
class EtcdServer {
 public:
  EtcdServer() : client_port_(free_port()), peer_port_(free_port()) {
    char tmpl[] = "/tmp/dsec-etcd-test-XXXXXX";
    if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
    dir_ = tmpl;
  }
  ~EtcdServer() {
    kill();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  EtcdServer(const EtcdServer&) = delete;
  EtcdServer& operator=(const EtcdServer&) = delete;

  std::string url() const { return fmt::format("http://127.0.0.1:{}", client_port_); }
  int client_port() const { return client_port_; }
  bool running() const { return pid_ > 0; }

  // Starts etcd (on the same ports and data as before, unless `wipe`) and waits until it answers.
  void start(bool wipe = false) {
    if (pid_ > 0) return;
    std::error_code ec;
    if (wipe) std::filesystem::remove_all(dir_ / "data", ec);
    std::string peer = fmt::format("http://127.0.0.1:{}", peer_port_);
    std::vector<std::string> args = {kEtcdBinary,
                                     "--name",
                                     "dsec-test",
                                     "--data-dir",
                                     (dir_ / "data").string(),
                                     "--listen-client-urls",
                                     url(),
                                     "--advertise-client-urls",
                                     url(),
                                     "--listen-peer-urls",
                                     peer,
                                     "--initial-advertise-peer-urls",
                                     peer,
                                     "--initial-cluster",
                                     "dsec-test=" + peer};
    std::string log = (dir_ / "etcd.log").string();
    std::vector<char*> argv;  // made before fork: the child of a threaded process must not allocate
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
      }
      ::execv(kEtcdBinary, argv.data());
      ::_exit(127);
    }
    cluster::EtcdOptions o;
    o.endpoints = {url()};
    o.request_timeout = std::chrono::milliseconds(500);
    cluster::EtcdClient probe(o);
    bool up = wait_until(
        [&] {
          int status = 0;
          if (::waitpid(pid_, &status, WNOHANG) == pid_)
            throw std::runtime_error("etcd exited at start:\n" + log_tail());
          try {
            probe.get("/health-probe");
            return true;
          } catch (const std::exception&) {
            return false;
          }
        },
        std::chrono::seconds(30));
    if (!up) {
      kill();
      throw std::runtime_error("etcd did not answer within 30 s:\n" + log_tail());
    }
  }

  // SIGKILL, as a crash.
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

  std::string log_tail() const {
    std::ifstream f(dir_ / "etcd.log");
    std::stringstream s;
    s << f.rdbuf();
    std::string all = s.str();
    return all.size() > 3000 ? all.substr(all.size() - 3000) : all;
  }

 private:
  int client_port_;
  int peer_port_;
  std::filesystem::path dir_;
  pid_t pid_ = -1;
};

// Forwards 127.0.0.1:port() to 127.0.0.1:target. break_connections() drops every open connection; refuse(true)
// makes it close new ones at once (the member looks down) until refuse(false).
class TcpProxy {
 public:
  explicit TcpProxy(int target) : target_(target) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    ::setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(listen_fd_, 64) != 0)
      throw std::runtime_error("proxy: cannot listen");
    socklen_t len = sizeof a;
    ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { loop(); });
  }
  ~TcpProxy() {
    stop_ = true;
    thread_.join();
    for (auto& p : pairs_) {
      ::close(p.first);
      ::close(p.second);
    }
    ::close(listen_fd_);
  }

  std::string url() const { return fmt::format("http://127.0.0.1:{}", port_); }
  void break_connections() {
    break_ = true;
    wait_until([&] { return !break_.load(); }, std::chrono::seconds(5));
  }
  void refuse(bool on) { refuse_ = on; }
  int accepted() const { return accepted_.load(); }

 private:
  void loop() {
    while (!stop_) {
      if (break_) {
        for (auto& p : pairs_) {
          ::close(p.first);
          ::close(p.second);
        }
        pairs_.clear();
        break_ = false;
      }
      std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
      for (auto& p : pairs_) {
        fds.push_back({p.first, POLLIN, 0});
        fds.push_back({p.second, POLLIN, 0});
      }
      const std::size_t polled = pairs_.size();  // a pair accepted below waits for the next poll
      if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
      if (fds[0].revents & POLLIN) {
        int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c >= 0) {
          if (refuse_) {
            ::close(c);
          } else {
            int u = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
            sockaddr_in a{};
            a.sin_family = AF_INET;
            a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
            a.sin_port = htons(static_cast<uint16_t>(target_));
            if (::connect(u, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
              pairs_.emplace_back(c, u);
              ++accepted_;
            } else {
              ::close(u);
              ::close(c);
            }
          }
        }
      }
      std::vector<std::size_t> dead;
      for (std::size_t i = 0; i < polled; ++i) {
        for (int side = 0; side < 2; ++side) {
          const pollfd& f = fds[1 + 2 * i + side];
          if (!(f.revents & (POLLIN | POLLHUP | POLLERR))) continue;
          int from = side == 0 ? pairs_[i].first : pairs_[i].second;
          int to = side == 0 ? pairs_[i].second : pairs_[i].first;
          char buf[16384];
          ssize_t n = ::read(from, buf, sizeof buf);
          if (n <= 0 || ::send(to, buf, static_cast<size_t>(n), MSG_NOSIGNAL) != n) {
            dead.push_back(i);
            break;
          }
        }
      }
      for (auto it = dead.rbegin(); it != dead.rend(); ++it) {
        ::close(pairs_[*it].first);
        ::close(pairs_[*it].second);
        pairs_.erase(pairs_.begin() + static_cast<std::ptrdiff_t>(*it));
      }
    }
  }

  int target_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<bool> break_{false};
  std::atomic<bool> refuse_{false};
  std::atomic<int> accepted_{0};
  std::vector<std::pair<int, int>> pairs_;
  std::thread thread_;
};

}  // namespace dsec::testing
