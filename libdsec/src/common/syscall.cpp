#include "common/syscall.hpp"

namespace dsec {

Code code_for_errno(int err) noexcept {
  switch (err) {
    case ENOENT: return Code::kNotFound;
    case EACCES:
    case EPERM:
    case EROFS: return Code::kPermissionDenied;
    case ENOSPC:
    case EDQUOT:
    case EMFILE:
    case ENFILE:
    case ENOMEM:
    case EAGAIN:
    case EFBIG: return Code::kResourceExhausted;
    case EINVAL:
    case ENAMETOOLONG:
    case ELOOP:
    case EISDIR:
    case ENOTDIR:
    case EXDEV: return Code::kInvalidArgument;
    case EEXIST: return Code::kAlreadyExists;
    case ESRCH: return Code::kNotFound;
    case ETIMEDOUT: return Code::kDeadlineExceeded;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE: return Code::kUnavailable;
    default: return Code::kInternal;
  }
}

}  // namespace dsec
