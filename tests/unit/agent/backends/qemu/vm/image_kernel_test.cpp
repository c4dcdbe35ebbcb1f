// What a full VM boots (agent/backends/vm/image_kernel): the image's /vmlinuz and the modules its boot needs, read
// inside the image's root and copied into the cache with an initramfs of dsec-init and those modules in load order.
// The image is a tree made here from the microVM tier's guest kernel (a real bzImage and real modules; those that
// kernel builds in are listed in the tree's modules.builtin); skips where that kernel is not installed
// (scripts/guest-kernel.sh).
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "agent/backends/qemu/vm/image_kernel.hpp"
#include "dsec/error.hpp"

namespace dsec {
namespace {

namespace fs = std::filesystem;
using agent::vm::prepare_image_boot;

const fs::path kGuestKernel = "/var/cache/dsec/guest-kernel/current";

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

class ImageKernel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kGuestKernel / "vmlinuz") || !fs::exists(kGuestKernel / "modules"))
      GTEST_SKIP() << "no guest kernel in " << kGuestKernel << " (scripts/guest-kernel.sh installs it)";
    base_ = fs::temp_directory_path() / ("dsec-image-kernel-" + std::to_string(::getpid()));
    fs::remove_all(base_);
    root_ = base_ / "root";
    cache_ = base_ / "cache";
    fs::create_directories(cache_);
    release_ = slurp(kGuestKernel / "release");
    while (!release_.empty() && release_.back() == '\n') release_.pop_back();
    // An image as Debian lays it out: /vmlinuz -> boot/vmlinuz-<release>, modules below /lib/modules/<release>.
    fs::create_directories(root_ / "boot");
    fs::copy_file(kGuestKernel / "vmlinuz", root_ / "boot" / ("vmlinuz-" + release_));
    fs::create_symlink("boot/vmlinuz-" + release_, root_ / "vmlinuz");
    mods_ = root_ / "lib/modules" / release_;
    fs::create_directories(mods_ / "kernel/drivers");
    std::ostringstream dep;
    for (const auto& e : fs::directory_iterator(kGuestKernel / "modules")) {
      if (e.path().extension() != ".ko") continue;
      fs::copy_file(e.path(), mods_ / "kernel/drivers" / e.path().filename());
      dep << "kernel/drivers/" << e.path().filename().string() << ":";
      std::string name = e.path().stem().string();
      if (name == "virtio_blk" || name == "virtio_console" || name == "virtio_balloon")
        dep << " kernel/drivers/virtio_ring.ko kernel/drivers/virtio.ko";
      if (name == "virtio_ring") dep << " kernel/drivers/virtio.ko";
      if (name == "erofs") dep << " kernel/drivers/libcrc32c.ko";
      dep << "\n";
    }
    write(mods_ / "modules.dep", dep.str());
    // What that kernel builds in, plus virtio_pci, which it has as a module that the microVM tier does not install.
    write(mods_ / "modules.builtin",
          slurp(kGuestKernel / "modules/modules.builtin") + "kernel/drivers/virtio/virtio_pci.ko\n");
    init_ = base_ / "dsec-init";
    write(init_, "#!/bin/false\n");
  }
  void TearDown() override {
    if (!base_.empty()) fs::remove_all(base_);
  }
  static void write(const fs::path& p, const std::string& text) {
    std::ofstream out(p, std::ios::binary);
    out << text;
  }

  fs::path base_, root_, cache_, mods_, init_;
  std::string release_;
};

TEST_F(ImageKernel, TakesTheImagesKernelAndTheModulesItsBootNeeds) {
  auto boot = prepare_image_boot(root_, init_, cache_);
  EXPECT_EQ(boot.release, release_);
  EXPECT_EQ(slurp(boot.kernel), slurp(kGuestKernel / "vmlinuz"));
  std::string cpio = slurp(boot.initramfs);
  // The modules the boot loads, dependencies first (as each module's .modinfo says), numbered in load order:
  // virtio and virtio_ring before virtio_blk, libcrc32c before erofs; nothing it does not need (virtio_balloon,
  // virtio_mmio).
  auto at = [&](const std::string& name) { return cpio.find(name + ".ko"); };
  for (const char* m : {"virtio", "virtio_ring", "virtio_blk", "virtio_console", "libcrc32c", "erofs", "overlay"})
    EXPECT_NE(at(std::string("-") + m), std::string::npos) << m;
  EXPECT_LT(at("-virtio"), at("-virtio_blk"));
  EXPECT_LT(at("-virtio_ring"), at("-virtio_blk"));
  EXPECT_LT(at("-libcrc32c"), at("-erofs"));
  EXPECT_EQ(at("-virtio_balloon"), std::string::npos);
  EXPECT_EQ(at("-virtio_mmio"), std::string::npos);
  EXPECT_NE(cpio.find("#!/bin/false"), std::string::npos);  // dsec-init as /init
  // Made once: the same image and init give the same key and files.
  auto again = prepare_image_boot(root_, init_, cache_);
  EXPECT_EQ(again.key, boot.key);
  EXPECT_EQ(again.initramfs, boot.initramfs);
  // Another dsec-init makes another initramfs.
  write(init_, "#!/bin/true\n");
  EXPECT_NE(prepare_image_boot(root_, init_, cache_).key, boot.key);
}

TEST_F(ImageKernel, AnImageWithoutAKernelOrAModuleSaysWhatIsMissing) {
  fs::remove(root_ / "vmlinuz");
  try {
    prepare_image_boot(root_, init_, cache_);
    FAIL() << "an image without /vmlinuz booted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("/vmlinuz"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("linux-image-amd64"), std::string::npos) << e.what();
  }
  // A link that leaves the image resolves inside it, where nothing is.
  fs::create_symlink("/" + (kGuestKernel / "vmlinuz").relative_path().string(), root_ / "vmlinuz");
  EXPECT_THROW(prepare_image_boot(root_, init_, cache_), Error);
  fs::remove(root_ / "vmlinuz");
  fs::create_symlink("boot/vmlinuz-" + release_, root_ / "vmlinuz");
  fs::remove(mods_ / "kernel/drivers/erofs.ko");
  std::string dep = slurp(mods_ / "modules.dep");
  write(mods_ / "modules.dep", dep.substr(0, dep.find("kernel/drivers/erofs.ko")) +
                                   dep.substr(dep.find('\n', dep.find("kernel/drivers/erofs.ko")) + 1));
  try {
    prepare_image_boot(root_, init_, cache_);
    FAIL() << "an image without erofs booted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("erofs"), std::string::npos) << e.what();
  }
  for (const auto& e : fs::directory_iterator(cache_))  // nothing half made is left behind
    EXPECT_NE(e.path().filename().string().rfind(".new-", 0), 0u) << e.path();
}

TEST(ImageKernelRelease, ComesFromTheBzImageHeaderAndGarbageIsRefused) {
  std::string image(0x400, '\0');
  image.replace(0x202, 4, "HdrS");
  image[0x20e] = 0x00;
  image[0x20f] = 0x01;  // version at 0x200 + 0x100
  std::string v = "6.1.0-50-amd64 (debian-kernel@lists.debian.org) #1 SMP";
  image.replace(0x300, v.size(), v);
  EXPECT_EQ(agent::vm::bzimage_release(image), "6.1.0-50-amd64");
  EXPECT_THROW(agent::vm::bzimage_release("not a kernel"), Error);
  image.replace(0x300, 8, "../../x ");
  EXPECT_THROW(agent::vm::bzimage_release(image), Error);
}

}  // namespace
}  // namespace dsec
