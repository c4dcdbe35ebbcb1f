// Syscall failures as dsec::Error with errno and context ("mkdir /sys/fs/cgroup/pids/dsec/x: Permission denied").
#pragma once

#include <sys/types.h>

#include <cerrno>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec {

// The dsec code that fits an errno: ENOENT -> NOT_FOUND, EACCES/EPERM -> PERMISSION_DENIED, ENOSPC/EDQUOT/EMFILE/
// ENOMEM/EAGAIN -> RESOURCE_EXHAUSTED, EINVAL/ENAMETOOLONG/ELOOP/EISDIR/ENOTDIR/EXDEV -> INVALID_ARGUMENT, else
// INTERNAL.
Code code_for_errno(int err) noexcept;

[[noreturn]] inline void throw_errno(int err, std::string_view context) {
  throw Error(code_for_errno(err), fmt::format("{}: {}", context, std::strerror(err)));
}

template <typename... Args>
[[noreturn]] void throw_errno_fmt(int err, fmt::format_string<Args...> f, Args&&... args) {
  throw_errno(err, fmt::format(f, std::forward<Args>(args)...));
}

// Retries a syscall interrupted by a signal.
template <typename F>
auto retry_eintr(F&& f) {
  decltype(f()) r;
  do {
    r = f();
  } while (r == -1 && errno == EINTR);
  return r;
}

// One sendmsg(2) of `data` with `fds` attached (SCM_RIGHTS; at most kMaxFdsPerMessage), retried on EINTR, without
// SIGPIPE. Returns what sendmsg returns: the bytes sent (perhaps fewer than data.size(); send the rest plainly), or
// -1 with errno set.
inline constexpr std::size_t kMaxFdsPerMessage = 64;
ssize_t send_with_fds(int sock, std::string_view data, std::span<const int> fds);

}  // namespace dsec
