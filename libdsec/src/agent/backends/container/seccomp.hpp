// The seccomp filter every container sandbox runs under, compiled once with libseccomp and loaded by the sandbox's
// first process with one syscall (it cannot allocate or call libseccomp at that point).
//
// Denied (EPERM unless noted): mount and the new mount API, pivot_root, umount, swapon/off, reboot, kexec, module
// loading, keyctl/add_key/request_key, bpf, perf_event_open, userfaultfd, io_uring, setns, new user namespaces (clone
// and unshare with CLONE_NEWUSER; clone3 answers ENOSYS so libc falls back to clone, whose flags can be checked),
// open_by_handle_at, syslog, acct, quotactl, clock/time setting, iopl/ioperm, ptrace and process_vm_* (unless the spec
// allows ptrace). Calls from another ABI (x32, i386) kill the process.
#pragma once

#include <linux/filter.h>

#include <vector>

namespace dsec::agent::container {

struct SeccompProgram {
  std::vector<sock_filter> instructions;
  sock_fprog fprog() const {
    return sock_fprog{static_cast<unsigned short>(instructions.size()), const_cast<sock_filter*>(instructions.data())};
  }
};

// `allow_mount` lets mount and umount through (the fncall backend's fork servers mount each call's /tmp and /proc
// before the call's child loads the strict filter on top of this one).
SeccompProgram build_seccomp_program(bool allow_ptrace, bool allow_mount = false);

}  // namespace dsec::agent::container
