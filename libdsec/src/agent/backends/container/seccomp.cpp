#include "agent/backends/container/seccomp.hpp"

#include <sched.h>
#include <seccomp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <memory>
#include <string_view>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::container {
namespace {

struct CtxDeleter {
  void operator()(scmp_filter_ctx ctx) const { seccomp_release(ctx); }
};

constexpr const char* kDenied[] = {
    "mount",
    "umount",
    "umount2",
    "pivot_root",
    "swapon",
    "swapoff",
    "reboot",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "setns",
    "open_by_handle_at",
    "name_to_handle_at",
    "syslog",
    "acct",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "move_mount",
    "open_tree",
    "mount_setattr",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "iopl",
    "ioperm",
    "vhangup",
    "nfsservctl",
    "uselib",
    "fanotify_init",
    "kcmp",
    "pidfd_getfd",
    "process_madvise",
    "mbind",
    "migrate_pages",
    "move_pages",
    "set_mempolicy",
};

constexpr const char* kPtrace[] = {"ptrace", "process_vm_readv", "process_vm_writev"};

void add_rule(scmp_filter_ctx ctx, std::uint32_t action, const char* name, unsigned arg_count = 0,
              scmp_arg_cmp arg = {}) {
  int nr = seccomp_syscall_resolve_name(name);
  if (nr == __NR_SCMP_ERROR) return;  // not a syscall on this architecture
  int rc = arg_count ? seccomp_rule_add(ctx, action, nr, 1, arg) : seccomp_rule_add(ctx, action, nr, 0);
  if (rc != 0) throw_errno_fmt(-rc, "seccomp rule for {}", name);
}

}  // namespace

SeccompProgram build_seccomp_program(bool allow_ptrace, bool allow_mount) {
  std::unique_ptr<void, CtxDeleter> ctx(seccomp_init(SCMP_ACT_ALLOW));
  if (!ctx) throw Error(Code::kInternal, "seccomp_init failed");
  // Any other ABI (x32 on x86_64, i386 via int 0x80) kills the process.
  seccomp_attr_set(ctx.get(), SCMP_FLTATR_ACT_BADARCH, SCMP_ACT_KILL_PROCESS);
  // The filter is loaded with no_new_privs set; do not ask libseccomp to set it itself.
  seccomp_attr_set(ctx.get(), SCMP_FLTATR_CTL_NNP, 0);
  const auto eperm = SCMP_ACT_ERRNO(EPERM);
  for (const char* name : kDenied) {
    std::string_view n = name;
    if (allow_mount && (n == "mount" || n == "umount" || n == "umount2")) continue;
    add_rule(ctx.get(), eperm, name);
  }
  if (!allow_ptrace)
    for (const char* name : kPtrace) add_rule(ctx.get(), eperm, name);
  add_rule(ctx.get(), eperm, "unshare", 1, SCMP_A0(SCMP_CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER));
  add_rule(ctx.get(), eperm, "clone", 1, SCMP_A0(SCMP_CMP_MASKED_EQ, CLONE_NEWUSER, CLONE_NEWUSER));
  add_rule(ctx.get(), SCMP_ACT_ERRNO(ENOSYS), "clone3");

  UniqueFd mem(::memfd_create("dsec-seccomp", MFD_CLOEXEC));
  if (!mem) throw_errno(errno, "memfd_create for seccomp export");
  if (int rc = seccomp_export_bpf(ctx.get(), mem.get()); rc != 0) throw_errno(-rc, "seccomp_export_bpf");
  off_t size = ::lseek(mem.get(), 0, SEEK_END);
  if (size <= 0 || size % sizeof(sock_filter) != 0) throw Error(Code::kInternal, "seccomp export has a bad size");
  SeccompProgram program;
  program.instructions.resize(static_cast<std::size_t>(size) / sizeof(sock_filter));
  if (::pread(mem.get(), program.instructions.data(), static_cast<std::size_t>(size), 0) != size)
    throw_errno(errno, "read seccomp export");
  return program;
}

}  // namespace dsec::agent::container
