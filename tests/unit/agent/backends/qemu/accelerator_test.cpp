// The accelerator choice the QEMU tiers share (agent/backends/qemu/accelerator): who may open /dev/kvm, what is
// chosen and why; and the microvm backend's probe on this host when KVM is required.
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include "agent/backends/qemu/accelerator.hpp"
#include "agent/backends/qemu/qemu_backend.hpp"

namespace dsec::agent::microvm {
namespace {

using qemu::AcceleratorChoice;
using qemu::choose_accelerator;
using qemu::host_kvm_access;
using qemu::kvm_access;
using qemu::KvmAccess;

struct stat device(mode_t perm, gid_t gid) {
  struct stat st {};
  st.st_mode = S_IFCHR | perm;
  st.st_uid = 0;
  st.st_gid = gid;
  st.st_rdev = makedev(10, 232);
  return st;
}

TEST(MicrovmAccelerator, KvmAccessByTheDevicesMode) {
  EXPECT_TRUE(kvm_access(device(0666, 0)).usable);
  EXPECT_FALSE(kvm_access(device(0666, 0)).group.has_value());
  KvmAccess grouped = kvm_access(device(0660, 108));
  EXPECT_TRUE(grouped.usable);
  ASSERT_TRUE(grouped.group.has_value());
  EXPECT_EQ(*grouped.group, 108u);
  // Root's group would be a privilege to hand out: refused.
  EXPECT_FALSE(kvm_access(device(0660, 0)).usable);
  KvmAccess closed = kvm_access(device(0600, 0));
  EXPECT_FALSE(closed.usable);
  EXPECT_NE(closed.reason.find("mode 0600"), std::string::npos) << closed.reason;
  struct stat file = device(0666, 0);
  file.st_mode = S_IFREG | 0666;
  EXPECT_FALSE(kvm_access(file).usable);
}

TEST(MicrovmAccelerator, ChoosesKvmOnlyWhenItsProbeAnswered) {
  KvmAccess open{true, std::nullopt, {}};
  KvmAccess closed{false, std::nullopt, "closed"};
  constexpr std::string_view kFlag = "--microvm-accelerator";
  EXPECT_TRUE(choose_accelerator(kFlag, "auto", open, "", true, false).kvm);
  AcceleratorChoice failed =
      choose_accelerator(kFlag, "auto", open, "KVM internal error: emulation failure", true, true);
  EXPECT_FALSE(failed.kvm);
  EXPECT_TRUE(failed.unavailable.empty());
  EXPECT_NE(failed.reason.find("emulation failure"), std::string::npos) << failed.reason;
  EXPECT_NE(failed.reason.find("kvm_pvm"), std::string::npos) << failed.reason;
  AcceleratorChoice no_access = choose_accelerator(kFlag, "auto", closed, "", false, false);
  EXPECT_FALSE(no_access.kvm);
  EXPECT_EQ(no_access.reason, "closed");
  AcceleratorChoice required = choose_accelerator(kFlag, "kvm", closed, "", false, false);
  EXPECT_FALSE(required.kvm);
  EXPECT_EQ(required.unavailable, "--microvm-accelerator kvm: closed");
  AcceleratorChoice tcg = choose_accelerator(kFlag, "tcg", open, "", false, false);
  EXPECT_FALSE(tcg.kvm);
  EXPECT_EQ(tcg.reason, "configured (--microvm-accelerator tcg)");
  // Each tier quotes its own option.
  EXPECT_EQ(choose_accelerator("--vm-accelerator", "kvm", closed, "", false, false).unavailable,
            "--vm-accelerator kvm: closed");
}

// The real probe on this host: with KVM required, a host where QEMU cannot run the guest with KVM (this one:
// kvm_pvm, closed to unprivileged uids) leaves the backend unavailable, saying why, and refuses creates.
TEST(MicrovmAccelerator, RequiredKvmThatCannotRunTheGuestMakesTheBackendUnavailable) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root";
  if (!microvm_unavailable_reason(AgentConfig{}).empty())
    GTEST_SKIP() << "no QEMU or guest kernel: " << microvm_unavailable_reason(AgentConfig{});
  KvmAccess access = host_kvm_access();
  if (access.usable) GTEST_SKIP() << "QEMU's uid can open /dev/kvm here: whether KVM runs the guest decides";
  AgentConfig config;
  config.run_dir = std::filesystem::temp_directory_path() / ("dsec-mvm-accel-" + std::to_string(::getpid()));
  config.cgroup_name = "dsec-mvm-accel-" + std::to_string(::getpid());
  config.microvm.accelerator = "kvm";
  std::filesystem::create_directories(config.run_dir);
  {
    auto backend = make_microvm_backend(config);
    MicroVmStatus status;
    for (int i = 0; i < 200 && !(status = backend->status()).ready; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(status.ready);
    EXPECT_EQ(status.accelerator, "tcg");
    EXPECT_NE(status.unavailable.find("--microvm-accelerator kvm"), std::string::npos) << status.unavailable;
    EXPECT_NE(status.unavailable.find(access.reason), std::string::npos) << status.unavailable;
    CreateParams params;
    params.id = "accel-test";
    params.spec.kind = "microvm";
    try {
      backend->create(params);
      ADD_FAILURE() << "a create without the required KVM succeeded";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kFailedPrecondition) << e.what();
    }
    backend->shutdown();
  }
  std::error_code ec;
  EXPECT_FALSE(std::filesystem::exists(config.run_dir / ".microvm"));
  std::filesystem::remove_all(config.run_dir, ec);
}

}  // namespace
}  // namespace dsec::agent::microvm
