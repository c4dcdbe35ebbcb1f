// The microVM backend's guest kernel and the QEMU tiers' initramfs helpers it uses (qemu/initramfs): reading a
// module's depends= from its ELF .modinfo section, ordering modules dependencies first, the initramfs as a
// reproducible cpio, the host's TSC rate, and finding the kernel.
// Module files here are tiny hand-made ELF64 relocatables; the real Debian modules are read too when
// scripts/guest-kernel.sh has unpacked them.
#include <elf.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <archive.h>
#include <archive_entry.h>
#include <gtest/gtest.h>

#include "agent/backends/qemu/initramfs.hpp"
#include "agent/backends/qemu/microvm/guest_kernel.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::microvm {
namespace {

namespace fs = std::filesystem;
using qemu::host_tsc_khz;
using qemu::module_load_order;
using qemu::ModuleInfo;
using qemu::read_module_info;
using qemu::write_initramfs;

const fs::path kInstalledModules = "/var/cache/dsec/guest-kernel/current/modules";

// A minimal ELF64 relocatable: header, .modinfo, .shstrtab, then the section headers (null, .modinfo, .shstrtab).
std::string make_elf(std::string_view modinfo, std::uint16_t type = ET_REL, std::string_view section = ".modinfo") {
  std::string shstrtab;
  shstrtab += '\0';
  std::uint32_t section_name = static_cast<std::uint32_t>(shstrtab.size());
  shstrtab += section;
  shstrtab += '\0';
  std::uint32_t shstrtab_name = static_cast<std::uint32_t>(shstrtab.size());
  shstrtab += ".shstrtab";
  shstrtab += '\0';

  const std::size_t modinfo_off = sizeof(Elf64_Ehdr);
  const std::size_t shstrtab_off = modinfo_off + modinfo.size();
  const std::size_t shoff = (shstrtab_off + shstrtab.size() + 7) & ~std::size_t{7};

  Elf64_Ehdr eh{};
  std::memcpy(eh.e_ident, ELFMAG, SELFMAG);
  eh.e_ident[EI_CLASS] = ELFCLASS64;
  eh.e_ident[EI_DATA] = ELFDATA2LSB;
  eh.e_ident[EI_VERSION] = EV_CURRENT;
  eh.e_type = type;
  eh.e_machine = EM_X86_64;
  eh.e_version = EV_CURRENT;
  eh.e_shoff = shoff;
  eh.e_ehsize = sizeof(Elf64_Ehdr);
  eh.e_shentsize = sizeof(Elf64_Shdr);
  eh.e_shnum = 3;
  eh.e_shstrndx = 2;

  std::array<Elf64_Shdr, 3> sh{};
  sh[1].sh_name = section_name;
  sh[1].sh_type = SHT_PROGBITS;
  sh[1].sh_flags = SHF_ALLOC;
  sh[1].sh_offset = modinfo_off;
  sh[1].sh_size = modinfo.size();
  sh[1].sh_addralign = 1;
  sh[2].sh_name = shstrtab_name;
  sh[2].sh_type = SHT_STRTAB;
  sh[2].sh_offset = shstrtab_off;
  sh[2].sh_size = shstrtab.size();
  sh[2].sh_addralign = 1;

  std::string out(reinterpret_cast<const char*>(&eh), sizeof eh);
  out += modinfo;
  out += shstrtab;
  out.resize(shoff, '\0');
  out.append(reinterpret_cast<const char*>(sh.data()), sizeof(Elf64_Shdr) * sh.size());
  return out;
}

// The .modinfo of a module as the kernel's build writes it: NUL-terminated key=value strings.
std::string modinfo_for(std::string_view name, std::string_view depends) {
  std::string m;
  for (std::string kv : {std::string("license=GPL"), "depends=" + std::string(depends), std::string("retpoline=Y"),
                         std::string("intree=Y")}) {
    m += kv;
    m += '\0';
  }
  if (!name.empty()) {
    m += "name=" + std::string(name);
    m += '\0';
  }
  m += "vermagic=6.1.0-57-cloud-amd64 SMP preempt mod_unload modversions ";
  m += '\0';
  m += std::string(3, '\0');  // padding between entries, as the real section has
  return m;
}

void write_bytes(const fs::path& p, std::string_view data) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  ASSERT_TRUE(out.good()) << p;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::vector<std::string> stems(const std::vector<fs::path>& files) {
  std::vector<std::string> out;
  for (const auto& f : files) out.push_back(f.stem().string());
  return out;
}

class MicrovmGuestKernelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("dsec-guest-kernel-" + std::to_string(::getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(base_);
    mods_ = base_ / "modules";
    fs::create_directories(mods_);
  }
  void TearDown() override { fs::remove_all(base_); }

  // <mods_>/<file>.ko with name= `name` (none when empty) and depends= `depends`.
  fs::path add_module(const std::string& file, const std::string& name, const std::string& depends) {
    fs::path p = mods_ / (file + ".ko");
    write_bytes(p, make_elf(modinfo_for(name, depends)));
    return p;
  }

  fs::path base_, mods_;
};

TEST_F(MicrovmGuestKernelTest, ReadsNameAndDependsFromModinfo) {
  auto p = add_module("virtio_blk", "virtio_blk", "virtio,virtio_ring");
  ModuleInfo info = read_module_info(p);
  EXPECT_EQ(info.name, "virtio_blk");
  EXPECT_EQ(info.depends, (std::vector<std::string>{"virtio", "virtio_ring"}));

  auto none = add_module("overlay", "overlay", "");
  EXPECT_EQ(read_module_info(none).depends, std::vector<std::string>{});
}

TEST_F(MicrovmGuestKernelTest, NameFallsBackToTheFileStem) {
  auto p = add_module("nameless", "", "dep");
  ModuleInfo info = read_module_info(p);
  EXPECT_EQ(info.name, "nameless");
  EXPECT_EQ(info.depends, std::vector<std::string>{"dep"});
}

TEST_F(MicrovmGuestKernelTest, RejectsWhatIsNotAModule) {
  auto expect_invalid = [](const fs::path& p, const std::string& needle) {
    try {
      read_module_info(p);
      ADD_FAILURE() << p << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  write_bytes(base_ / "text.ko", "just some text, long enough to hold an ELF header if it were one..............");
  expect_invalid(base_ / "text.ko", "not an ELF");
  write_bytes(base_ / "exec.ko", make_elf(modinfo_for("x", ""), ET_EXEC));
  expect_invalid(base_ / "exec.ko", "relocatable");
  write_bytes(base_ / "nomodinfo.ko", make_elf(modinfo_for("x", ""), ET_REL, ".data"));
  expect_invalid(base_ / "nomodinfo.ko", ".modinfo");
  write_bytes(base_ / "xz.ko.xz", std::string("\xfd"
                                              "7zXZ\0\0",
                                              6) +
                                      std::string(100, 'x'));
  expect_invalid(base_ / "xz.ko.xz", "compressed");
  std::string truncated = make_elf(modinfo_for("x", ""));
  truncated.resize(truncated.size() - 10);
  write_bytes(base_ / "truncated.ko", truncated);
  expect_invalid(base_ / "truncated.ko", "past the end");
  try {
    read_module_info(base_ / "absent.ko");
    ADD_FAILURE() << "absent file accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound) << e.what();
  }
}

TEST_F(MicrovmGuestKernelTest, LoadOrderPutsDependenciesFirst) {
  add_module("top", "top", "mid,base");
  add_module("mid", "mid", "base");
  add_module("base", "base", "");
  add_module("unrelated", "unrelated", "");
  EXPECT_EQ(stems(module_load_order(mods_, {"top"})), (std::vector<std::string>{"base", "mid", "top"}));
  // Each module once, whatever order and repetition they are asked for in.
  EXPECT_EQ(stems(module_load_order(mods_, {"base", "top", "mid", "top"})),
            (std::vector<std::string>{"base", "mid", "top"}));
  EXPECT_TRUE(module_load_order(mods_, {}).empty());
  for (const auto& p : module_load_order(mods_, {"top"})) EXPECT_EQ(p.parent_path(), mods_);
}

TEST_F(MicrovmGuestKernelTest, DashAndUnderscoreAreTheSameName) {
  add_module("virtio-rng", "virtio_rng", "virtio-ring");
  add_module("virtio_ring", "virtio_ring", "");
  EXPECT_EQ(stems(module_load_order(mods_, {"virtio_rng"})), (std::vector<std::string>{"virtio_ring", "virtio-rng"}));
  EXPECT_EQ(stems(module_load_order(mods_, {"virtio-rng"})), (std::vector<std::string>{"virtio_ring", "virtio-rng"}));
}

TEST_F(MicrovmGuestKernelTest, MissingModuleIsNamed) {
  add_module("erofs", "erofs", "libcrc32c");
  try {
    module_load_order(mods_, {"erofs"}, {}, "install the modules");
    ADD_FAILURE() << "missing dependency accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    std::string msg = e.what();
    EXPECT_NE(msg.find("libcrc32c"), std::string::npos) << msg;
    EXPECT_NE(msg.find("needed by erofs"), std::string::npos) << msg;
    EXPECT_TRUE(msg.ends_with("; install the modules")) << msg;
  }
  try {
    module_load_order(mods_, {"no_such_module"});
    ADD_FAILURE() << "missing module accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("no_such_module"), std::string::npos) << e.what();
  }
}

TEST_F(MicrovmGuestKernelTest, OptionalModulesLoadWhenPresentAndAreSkippedOtherwise) {
  add_module("virtio_ring", "virtio_ring", "");
  add_module("virtio_blk", "virtio_blk", "virtio_ring,maybe_dep");
  add_module("virtio-rng", "virtio_rng", "virtio_ring");
  add_module("needs_absent", "needs_absent", "absent_dep");
  auto order = stems(module_load_order(mods_, {"virtio_blk"}, {"virtio-rng", "maybe_dep", "gone", "needs_absent"}));
  // maybe_dep and gone are absent: skipped; needs_absent lacks a required dependency: skipped; virtio_rng loads last.
  EXPECT_EQ(order, (std::vector<std::string>{"virtio_ring", "virtio_blk", "virtio-rng"}));
  // Optional and also wanted: absent is still fine.
  EXPECT_EQ(stems(module_load_order(mods_, {"gone", "virtio_ring"}, {"gone"})),
            (std::vector<std::string>{"virtio_ring"}));
}

TEST_F(MicrovmGuestKernelTest, CycleIsInvalid) {
  add_module("p", "p", "q");
  add_module("q", "q", "r");
  add_module("r", "r", "p");
  try {
    module_load_order(mods_, {"p"});
    ADD_FAILURE() << "cycle accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("p -> q -> r -> p"), std::string::npos) << e.what();
  }
  add_module("self", "self", "self");
  EXPECT_THROW(module_load_order(mods_, {"self"}), Error);
  // An optional module in a cycle is still an error, not a silent skip.
  EXPECT_THROW(module_load_order(mods_, {}, {"p"}), Error);
}

TEST_F(MicrovmGuestKernelTest, BuiltinModulesNeedNoFile) {
  add_module("erofs", "erofs", "libcrc32c");
  write_bytes(mods_ / "modules.builtin", "kernel/lib/libcrc32c.ko\nkernel/drivers/char/hw_random/rng-core.ko\n");
  EXPECT_EQ(stems(module_load_order(mods_, {"erofs", "rng_core"})), std::vector<std::string>{"erofs"});
}

TEST_F(MicrovmGuestKernelTest, MissingModulesDirectory) {
  try {
    module_load_order(base_ / "nowhere", {"erofs"});
    ADD_FAILURE() << "missing directory accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("nowhere"), std::string::npos) << e.what();
  }
}

// The microvm tier's modules: none for a kernel without a modules directory; a missing one says how to get them.
TEST_F(MicrovmGuestKernelTest, GuestModuleFilesSayHowToGetThem) {
  EXPECT_TRUE(guest_module_files(GuestKernel{base_ / "vmlinux", {}, ""}).empty());
  add_module("virtio_mmio", "virtio_mmio", "");
  try {
    guest_module_files(GuestKernel{base_ / "vmlinux", mods_, ""});
    ADD_FAILURE() << "missing guest modules accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_NE(std::string(e.what()).find("virtio_blk"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("scripts/guest-kernel.sh"), std::string::npos) << e.what();
  }
}

TEST(MicrovmGuestKernelInstalled, RealModulesAndTheirOrder) {
  if (!fs::is_directory(kInstalledModules))
    GTEST_SKIP() << kInstalledModules
                 << " does not exist: run scripts/guest-kernel.sh as root to unpack the guest kernel";
  ModuleInfo blk = read_module_info(kInstalledModules / "virtio_blk.ko");
  EXPECT_EQ(blk.name, "virtio_blk");
  std::sort(blk.depends.begin(), blk.depends.end());
  EXPECT_EQ(blk.depends, (std::vector<std::string>{"virtio", "virtio_ring"}));

  auto order = module_load_order(kInstalledModules, guest_modules(), optional_guest_modules());
  std::map<std::string, std::size_t> position;
  std::string listing;
  for (std::size_t i = 0; i < order.size(); ++i) {
    ModuleInfo info = read_module_info(order[i]);
    position[info.name] = i;
    listing += " " + info.name;
  }
  std::cout << "[ guest modules in load order:" << listing << " ]\n";
  for (const auto& m : guest_modules()) EXPECT_TRUE(position.contains(m)) << m << " not loaded:" << listing;
  for (const auto& p : order) {
    ModuleInfo info = read_module_info(p);
    for (const auto& dep : info.depends) {
      ASSERT_TRUE(position.contains(dep)) << info.name << " needs " << dep << ":" << listing;
      EXPECT_LT(position[dep], position[info.name]) << info.name << " before its dependency " << dep;
    }
  }
}

struct CpioEntry {
  std::string name;
  mode_t type;
  mode_t perm;
  std::int64_t uid, gid, mtime, size;
  unsigned rdev_major, rdev_minor;
  std::string data;
};

std::vector<CpioEntry> read_cpio(const fs::path& p) {
  std::vector<CpioEntry> out;
  archive* a = archive_read_new();
  archive_read_support_format_cpio(a);
  archive_read_support_filter_none(a);
  EXPECT_EQ(archive_read_open_filename(a, p.c_str(), 10240), ARCHIVE_OK) << archive_error_string(a);
  archive_entry* e = nullptr;
  while (archive_read_next_header(a, &e) == ARCHIVE_OK) {
    CpioEntry c{archive_entry_pathname(e),
                archive_entry_filetype(e),
                archive_entry_perm(e),
                archive_entry_uid(e),
                archive_entry_gid(e),
                archive_entry_mtime(e),
                archive_entry_size(e),
                static_cast<unsigned>(archive_entry_rdevmajor(e)),
                static_cast<unsigned>(archive_entry_rdevminor(e)),
                {}};
    char buf[4096];
    la_ssize_t n;
    while ((n = archive_read_data(a, buf, sizeof buf)) > 0) c.data.append(buf, static_cast<std::size_t>(n));
    out.push_back(std::move(c));
  }
  EXPECT_STREQ(archive_format_name(a), "ASCII cpio (SVR4 with no CRC)");
  EXPECT_EQ(archive_filter_code(a, 0), ARCHIVE_FILTER_NONE);
  archive_read_free(a);
  return out;
}

TEST_F(MicrovmGuestKernelTest, InitramfsHoldsInitDevicesAndModulesInOrder) {
  fs::path init = base_ / "dsec-guest-init";
  write_bytes(init, std::string("\x7f"
                                "ELF pretend init binary\n") +
                        std::string(100000, 'i'));
  ::chmod(init.c_str(), 0700);
  auto ring = add_module("virtio_ring", "virtio_ring", "");
  auto rng = add_module("virtio-rng", "virtio_rng", "virtio_ring");
  fs::path out = base_ / "initramfs.cpio";
  write_initramfs(out, init, {ring, rng});
  EXPECT_FALSE(fs::exists(base_ / "initramfs.cpio.tmp"));

  auto entries = read_cpio(out);
  std::vector<std::string> names;
  for (const auto& c : entries) names.push_back(c.name);
  EXPECT_EQ(names,
            (std::vector<std::string>{"dev", "proc", "sys", "tmp", "run", "mnt", "newroot", "lib", "lib/dsec",
                                      "lib/dsec/modules", "dev/console", "dev/null", "init",
                                      "lib/dsec/modules/00-virtio_ring.ko", "lib/dsec/modules/01-virtio_rng.ko"}));
  std::map<std::string, CpioEntry> by_name;
  for (const auto& c : entries) {
    EXPECT_EQ(c.uid, 0) << c.name;
    EXPECT_EQ(c.gid, 0) << c.name;
    EXPECT_EQ(c.mtime, 0) << c.name;
    by_name.emplace(c.name, c);
  }
  EXPECT_EQ(by_name["newroot"].type, static_cast<mode_t>(AE_IFDIR));
  EXPECT_EQ(by_name["newroot"].perm, 0755u);
  EXPECT_EQ(by_name["dev/console"].type, static_cast<mode_t>(AE_IFCHR));
  EXPECT_EQ(by_name["dev/console"].rdev_major, 5u);
  EXPECT_EQ(by_name["dev/console"].rdev_minor, 1u);
  EXPECT_EQ(by_name["dev/null"].type, static_cast<mode_t>(AE_IFCHR));
  EXPECT_EQ(by_name["dev/null"].rdev_major, 1u);
  EXPECT_EQ(by_name["dev/null"].rdev_minor, 3u);
  EXPECT_EQ(by_name["init"].type, static_cast<mode_t>(AE_IFREG));
  EXPECT_EQ(by_name["init"].perm, 0755u);
  EXPECT_EQ(by_name["init"].data, slurp(init));
  EXPECT_EQ(by_name["lib/dsec/modules/01-virtio_rng.ko"].perm, 0644u);
  EXPECT_EQ(by_name["lib/dsec/modules/01-virtio_rng.ko"].data, slurp(rng));
  EXPECT_EQ(by_name["lib/dsec/modules/00-virtio_ring.ko"].data, slurp(ring));

  // Uncompressed newc, and the same bytes again for the same inputs (a different mtime on the inputs included).
  std::string bytes = slurp(out);
  EXPECT_EQ(bytes.substr(0, 6), "070701");
  struct timespec times[2] = {{12345, 0}, {12345, 0}};
  ::utimensat(AT_FDCWD, init.c_str(), times, 0);
  fs::path again = base_ / "again.cpio";
  write_initramfs(again, init, {ring, rng});
  EXPECT_TRUE(slurp(again) == bytes) << "a second write gave different bytes";
  // Rewriting in place replaces the file.
  write_initramfs(out, init, {ring});
  EXPECT_EQ(read_cpio(out).size(), entries.size() - 1);
}

TEST_F(MicrovmGuestKernelTest, InitramfsNumbersManyModulesSortably) {
  fs::path init = base_ / "init";
  write_bytes(init, "init");
  std::vector<fs::path> modules;
  for (int i = 0; i < 101; ++i) modules.push_back(add_module("m" + std::to_string(i), "", ""));
  fs::path out = base_ / "initramfs.cpio";
  write_initramfs(out, init, modules);
  std::vector<std::string> module_names;
  for (const auto& c : read_cpio(out))
    if (c.name.starts_with("lib/dsec/modules/")) module_names.push_back(c.name);
  ASSERT_EQ(module_names.size(), 101u);
  EXPECT_EQ(module_names.front(), "lib/dsec/modules/000-m0.ko");
  EXPECT_EQ(module_names.back(), "lib/dsec/modules/100-m100.ko");
  EXPECT_TRUE(std::is_sorted(module_names.begin(), module_names.end()));
}

TEST_F(MicrovmGuestKernelTest, InitramfsMissingInitFails) {
  try {
    write_initramfs(base_ / "initramfs.cpio", base_ / "no-init", {});
    ADD_FAILURE() << "missing init accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no-init"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(base_ / "initramfs.cpio"));
  EXPECT_FALSE(fs::exists(base_ / "initramfs.cpio.tmp"));
}

TEST(MicrovmGuestKernelModuleLists, AreTheGuestsNeeds) {
  EXPECT_EQ(guest_modules(), (std::vector<std::string>{"virtio_mmio", "virtio_blk", "virtio_console", "virtio_balloon",
                                                       "erofs", "overlay"}));
  EXPECT_EQ(optional_guest_modules(), std::vector<std::string>{"virtio_rng"});
}

TEST(MicrovmGuestKernelTsc, HostRateIsPlausibleAndCached) {
#if !defined(__x86_64__)
  GTEST_SKIP() << "the TSC is x86-64's";
#else
  std::uint64_t khz = host_tsc_khz();
  std::cout << "[ host TSC: " << khz << " kHz ]\n";
  EXPECT_GE(khz, 100'000u);
  EXPECT_LE(khz, 10'000'000u);
  EXPECT_EQ(host_tsc_khz(), khz);
#endif
}

class MicrovmGuestKernelFindTest : public MicrovmGuestKernelTest {
 protected:
  void SetUp() override {
    MicrovmGuestKernelTest::SetUp();
    if (const char* old = std::getenv("DSEC_GUEST_KERNEL_DIR")) saved_env_ = old;
  }
  void TearDown() override {
    if (saved_env_) {
      ::setenv("DSEC_GUEST_KERNEL_DIR", saved_env_->c_str(), 1);
    } else {
      ::unsetenv("DSEC_GUEST_KERNEL_DIR");
    }
    MicrovmGuestKernelTest::TearDown();
  }

  static void expect_precondition(const fs::path& configured, const std::vector<std::string>& needles) {
    try {
      find_guest_kernel(configured);
      ADD_FAILURE() << configured << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kFailedPrecondition) << e.what();
      for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
  }

  std::optional<std::string> saved_env_;
};

TEST_F(MicrovmGuestKernelFindTest, NothingThereSaysHowToGetIt) {
  expect_precondition(base_ / "no-kernel", {(base_ / "no-kernel").string(), "scripts/guest-kernel.sh"});
  ::setenv("DSEC_GUEST_KERNEL_DIR", (base_ / "cache").c_str(), 1);
  EXPECT_EQ(default_guest_kernel_dir(), base_ / "cache");
  expect_precondition({}, {(base_ / "cache" / "current").string(), "scripts/guest-kernel.sh"});
  fs::create_directories(base_ / "empty");
  expect_precondition(base_ / "empty", {"neither vmlinux nor vmlinuz", "scripts/guest-kernel.sh"});
  write_bytes(base_ / "garbage", "not a kernel");
  expect_precondition(base_ / "garbage", {"neither an ELF vmlinux nor a bzImage"});
  ::unsetenv("DSEC_GUEST_KERNEL_DIR");
  EXPECT_EQ(default_guest_kernel_dir(), fs::path("/var/cache/dsec/guest-kernel"));
}

TEST_F(MicrovmGuestKernelFindTest, ScriptLayoutAndLoneFile) {
  fs::path rel = base_ / "cache" / "6.1.0-57-cloud-amd64";
  fs::create_directories(rel / "modules");
  write_bytes(rel / "vmlinux", std::string("\x7f"
                                           "ELF\x02\x01\x01") +
                                   std::string(100, '\0'));
  write_bytes(rel / "release", "6.1.0-57-cloud-amd64\n");
  fs::create_directory_symlink("6.1.0-57-cloud-amd64", base_ / "cache" / "current");

  ::setenv("DSEC_GUEST_KERNEL_DIR", (base_ / "cache").c_str(), 1);
  GuestKernel k = find_guest_kernel({});
  EXPECT_EQ(k.kernel, base_ / "cache" / "current" / "vmlinux");
  EXPECT_EQ(k.modules_dir, base_ / "cache" / "current" / "modules");
  EXPECT_EQ(k.release, "6.1.0-57-cloud-amd64");

  k = find_guest_kernel(rel);
  EXPECT_EQ(k.kernel, rel / "vmlinux");
  EXPECT_EQ(k.release, "6.1.0-57-cloud-amd64");

  // A kernel file alone: modules beside it when there are, none otherwise.
  k = find_guest_kernel(rel / "vmlinux");
  EXPECT_EQ(k.kernel, rel / "vmlinux");
  EXPECT_EQ(k.modules_dir, rel / "modules");
  fs::create_directories(base_ / "lone");
  fs::copy_file(rel / "vmlinux", base_ / "lone" / "kernel.elf");
  k = find_guest_kernel(base_ / "lone" / "kernel.elf");
  EXPECT_TRUE(k.modules_dir.empty());
  EXPECT_EQ(k.release, "");
}

TEST_F(MicrovmGuestKernelFindTest, BzImageReleaseFromItsHeader) {
  // The boot protocol's header: "HdrS" at 0x202, kernel_version at 0x20e pointing 0x200 before the string.
  std::string image(0x1000, '\0');
  std::memcpy(image.data() + 0x202, "HdrS", 4);
  std::uint16_t version_offset = 0x600;
  std::memcpy(image.data() + 0x20e, &version_offset, 2);
  std::string version = "6.1.0-99-cloud-amd64 (debian-kernel@lists.debian.org) #1 SMP";
  std::memcpy(image.data() + 0x800, version.data(), version.size());
  write_bytes(base_ / "vmlinuz", image);
  GuestKernel k = find_guest_kernel(base_ / "vmlinuz");
  EXPECT_EQ(k.kernel, base_ / "vmlinuz");
  EXPECT_EQ(k.modules_dir, base_ / "modules");  // the fixture's modules directory sits beside it
  EXPECT_EQ(k.release, "6.1.0-99-cloud-amd64");
}

TEST_F(MicrovmGuestKernelFindTest, InstalledKernel) {
  ::unsetenv("DSEC_GUEST_KERNEL_DIR");
  if (!fs::exists("/var/cache/dsec/guest-kernel/current"))
    GTEST_SKIP() << "no /var/cache/dsec/guest-kernel/current: run scripts/guest-kernel.sh as root";
  GuestKernel k = find_guest_kernel({});
  EXPECT_EQ(k.kernel.filename(), "vmlinux");
  EXPECT_FALSE(k.modules_dir.empty());
  EXPECT_NE(k.release, "");
  std::ifstream in(k.kernel, std::ios::binary);
  char magic[4] = {};
  in.read(magic, 4);
  EXPECT_EQ(std::string(magic, 4),
            "\x7f"
            "ELF");
  std::cout << "[ installed guest kernel " << k.release << " at " << k.kernel << " ]\n";
}

}  // namespace
}  // namespace dsec::agent::microvm
