#include "agent/backends/qemu/vnc_listener.hpp"

#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include "common/log.hpp"
#include "common/syscall.hpp"

namespace dsec::agent::qemu {
namespace {

// 8 characters of 62 (about 47.6 bits): the most VNC authentication uses, made fresh for each endpoint.
std::string new_password() {
  constexpr std::string_view kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string out;
  while (out.size() < 8) {
    unsigned char bytes[16];
    if (::getrandom(bytes, sizeof bytes, 0) != static_cast<ssize_t>(sizeof bytes)) {
      if (errno == EINTR) continue;
      throw_errno(errno, "VNC: getrandom");
    }
    for (unsigned char b : bytes)
      if (b < 248 && out.size() < 8) out += kAlphabet[b % kAlphabet.size()];  // 248 = 4 x 62: no bias
  }
  return out;
}

}  // namespace

VncListener::VncListener(std::string sandbox_id, std::uint16_t port, RunningVm vm)
    : id_(std::move(sandbox_id)), port_(port), password_(new_password()), vm_(std::move(vm)) {
  listener_ = UniqueFd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!listener_) throw_errno(errno, "VNC: socket");
  int one = 1;
  ::setsockopt(listener_.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(port);
  if (::bind(listener_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(listener_.get(), 16) != 0)
    throw Error(Code::kUnavailable, fmt::format("sandbox {}: the VNC screen cannot listen on port {}: {}", id_, port,
                                                std::strerror(errno)));
  stop_ = UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!stop_) throw_errno(errno, "VNC: eventfd");
  thread_ = std::thread([this] { run(); });
}

VncListener::~VncListener() {
  std::uint64_t one = 1;
  (void)!::write(stop_.get(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

void VncListener::run() {
  for (;;) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {stop_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      log_warn("sandbox {}: VNC listener: poll: {}", id_, std::strerror(errno));
      return;
    }
    if (fds[1].revents) return;
    UniqueFd connection(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!connection) continue;  // gone before it was accepted, or EAGAIN
    hand_over(std::move(connection));
  }
}

void VncListener::hand_over(UniqueFd connection) {
  const std::string name = fmt::format("vnc-{}", connections_.load() + 1);
  try {
    std::shared_ptr<VmInstance> vm = vm_();
    vm->with_qmp([&](QmpClient& qmp) {
      // Set on every hand-over: a VM woken or restored runs in a QEMU that never had it.
      qmp.execute("set_password", {{"protocol", "vnc"}, {"password", password_}});
      qmp.execute_with_fds("getfd", {{"fdname", name}}, {connection.get()});
      try {
        qmp.execute("add_client", {{"protocol", "vnc"}, {"fdname", name}, {"skipauth", false}});
      } catch (...) {
        try {
          qmp.execute("closefd", {{"fdname", name}});
        } catch (...) {
        }
        throw;
      }
    });
    ++connections_;
  } catch (const std::exception& e) {
    // Asleep, stopped, or QEMU refused it: the viewer sees its connection closed.
    log_info("sandbox {}: a VNC connection was closed: {}", id_, e.what());
  }
}

}  // namespace dsec::agent::qemu
