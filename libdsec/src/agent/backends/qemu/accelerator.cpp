#include "agent/backends/qemu/accelerator.hpp"

#include <fmt/format.h>

namespace dsec::agent::qemu {

KvmAccess kvm_access(const struct stat& st) {
  KvmAccess out;
  if (!S_ISCHR(st.st_mode)) {
    out.reason = "/dev/kvm is not a character device";
    return out;
  }
  if ((st.st_mode & 0006) == 0006) {
    out.usable = true;
    return out;
  }
  if ((st.st_mode & 0060) == 0060 && st.st_gid != 0) {
    out.usable = true;
    out.group = st.st_gid;
    return out;
  }
  out.reason = fmt::format(
      "/dev/kvm (mode {:04o}, owner uid {} gid {}) is closed to QEMU's unprivileged uid; a mode "
      "of 0660 with a group of its own lets it in",
      st.st_mode & 07777, st.st_uid, st.st_gid);
  return out;
}

KvmAccess host_kvm_access() {
  struct stat st {};
  if (::stat("/dev/kvm", &st) != 0) return KvmAccess{false, std::nullopt, "no /dev/kvm"};
  return kvm_access(st);
}

AcceleratorChoice choose_accelerator(std::string_view flag, const std::string& wanted, const KvmAccess& access,
                                     const std::string& probe_failure, bool probe_ran, bool host_is_pvm) {
  AcceleratorChoice c;
  if (wanted == "tcg") {
    c.reason = fmt::format("configured ({} tcg)", flag);
    return c;
  }
  if (access.usable && probe_ran && probe_failure.empty()) {
    c.kvm = true;
    c.reason = "KVM runs the guest";
    return c;
  }
  c.reason = !access.usable ? access.reason
             : probe_ran    ? "KVM did not run the guest: " + probe_failure
                            : "KVM was not probed";
  if (host_is_pvm) c.reason += " (this host's KVM is kvm_pvm, which runs only guest kernels built for PVM)";
  if (wanted == "kvm") c.unavailable = fmt::format("{} kvm: {}", flag, c.reason);
  return c;
}

}  // namespace dsec::agent::qemu
