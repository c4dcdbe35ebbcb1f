#include "common/syscall.hpp"

#include <sys/socket.h>

namespace dsec {

Code code_for_errno(int err) noexcept {
  switch (err) {
    case ENOENT:
      return Code::kNotFound;
    case EACCES:
    case EPERM:
    case EROFS:
      return Code::kPermissionDenied;
    case ENOSPC:
    case EDQUOT:
    case EMFILE:
    case ENFILE:
    case ENOMEM:
    case EAGAIN:
    case EFBIG:
      return Code::kResourceExhausted;
    case EINVAL:
    case ENAMETOOLONG:
    case ELOOP:
    case EISDIR:
    case ENOTDIR:
    case EXDEV:
      return Code::kInvalidArgument;
    case EEXIST:
      return Code::kAlreadyExists;
    case ESRCH:
      return Code::kNotFound;
    case ETIMEDOUT:
      return Code::kDeadlineExceeded;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
      return Code::kUnavailable;
    default:
      return Code::kInternal;
  }
}

ssize_t send_with_fds(int sock, std::string_view data, std::span<const int> fds) {
  if (fds.size() > kMaxFdsPerMessage) {
    errno = EINVAL;
    return -1;
  }
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)]{};
  iovec iov{const_cast<char*>(data.data()), data.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (!fds.empty()) {
    msg.msg_control = control;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  return retry_eintr([&] { return ::sendmsg(sock, &msg, MSG_NOSIGNAL); });
}

}  // namespace dsec
