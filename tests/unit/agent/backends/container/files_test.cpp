// The container backend's files API resolves every path inside the sandbox root. These tests use a plain directory
// as the root and plant what a hostile sandbox would: absolute and relative symlinks pointing out, FIFOs, tar entries
// with "..". Nothing may land outside the root, and nothing may block.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include <archive.h>
#include <archive_entry.h>
#include <gtest/gtest.h>

#include "agent/backends/container/rootfs_files.hpp"
#include "agent/backends/container/seccomp.hpp"
#include "agent/backends/container/spawn.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::container {
namespace {

namespace fs = std::filesystem;

class RootfsFilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("dsec-files-" + std::to_string(::getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(base_);
    root_ = base_ / "root";
    outside_ = base_ / "outside";
    fs::create_directories(root_ / "etc");
    fs::create_directories(outside_);
  }
  void TearDown() override { fs::remove_all(base_); }

  RootfsFiles files() {
    UniqueFd fd(::open(root_.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC));
    EXPECT_TRUE(fd);
    return RootfsFiles(std::move(fd));
  }

  static std::string slurp(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  fs::path base_, root_, outside_;
};

TEST(NormalizeSandboxPath, CollapsesDotsAndSlashes) {
  EXPECT_EQ(normalize_sandbox_path("/"), "/");
  EXPECT_EQ(normalize_sandbox_path("//a///b/./c/"), "/a/b/c");
  EXPECT_EQ(normalize_sandbox_path("/a/b/../c"), "/a/c");
  EXPECT_EQ(normalize_sandbox_path("/../../etc/passwd"), "/etc/passwd");
}

TEST(NormalizeSandboxPath, RejectsRelativeAndNul) {
  EXPECT_THROW(normalize_sandbox_path("etc/passwd"), Error);
  EXPECT_THROW(normalize_sandbox_path(""), Error);
  EXPECT_THROW(normalize_sandbox_path(std::string_view("/a\0b", 4)), Error);
}

TEST_F(RootfsFilesTest, WriteCreatesParentsAndReadsBack) {
  auto f = files();
  f.write_file("/work/deep/dir/file.bin", std::string("a\0b\xff", 4), 0600);
  EXPECT_EQ(slurp(root_ / "work/deep/dir/file.bin"), std::string("a\0b\xff", 4));
  EXPECT_EQ(fs::status(root_ / "work/deep/dir/file.bin").permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(f.read_file("/work/deep/dir/file.bin", 1 << 20), std::string("a\0b\xff", 4));
}

TEST_F(RootfsFilesTest, AbsoluteSymlinkOutIsResolvedInsideTheRoot) {
  // The sandbox plants /evil -> <host path of outside>; following it must stay inside the root.
  fs::create_symlink(outside_, root_ / "evil");
  auto f = files();
  // The link's target does not exist inside the root: the write fails, and nothing reaches the host.
  EXPECT_THROW(f.write_file("/evil/planted.txt", "x", 0644), Error);
  EXPECT_FALSE(fs::exists(outside_ / "planted.txt"));
  // Once the same path exists inside the root, the write lands there.
  fs::create_directories(root_ / outside_.relative_path());
  f.write_file("/evil/planted.txt", "x", 0644);
  EXPECT_FALSE(fs::exists(outside_ / "planted.txt"));
  EXPECT_TRUE(fs::exists(root_ / outside_.relative_path() / "planted.txt"));
}

TEST_F(RootfsFilesTest, RelativeSymlinkClimbingOutIsClamped) {
  std::ofstream(outside_ / "secret") << "host secret";
  fs::create_symlink("../../../../../../../" + (outside_ / "secret").relative_path().string(), root_ / "etc/link");
  auto f = files();
  EXPECT_THROW(f.read_file("/etc/link", 1 << 20), Error);  // resolves to <root>/<outside>/secret: absent
  std::ofstream(root_ / "etc/passwd") << "sandbox passwd";
  fs::create_symlink("/../../etc/passwd", root_ / "pw");
  EXPECT_EQ(f.read_file("/pw", 1 << 20), "sandbox passwd");
}

TEST_F(RootfsFilesTest, FifoNeverBlocks) {
  ASSERT_EQ(::mkfifo((root_ / "fifo").c_str(), 0644), 0);
  auto f = files();
  auto start = std::chrono::steady_clock::now();
  try {
    f.write_file("/fifo", "x", 0644);
    FAIL() << "writing a FIFO must fail";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.what();
  }
  try {
    f.read_file("/fifo", 1 << 20);
    FAIL() << "reading a FIFO must fail";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
}

TEST_F(RootfsFilesTest, MissingFileIsNotFound) {
  auto f = files();
  try {
    f.read_file("/nope", 100);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
  }
}

TEST_F(RootfsFilesTest, TarRoundTripKeepsFilesLinksAndModes) {
  fs::create_directories(root_ / "src/sub");
  std::ofstream(root_ / "src/a.txt") << "alpha";
  std::ofstream(root_ / "src/sub/b.sh") << "#!/bin/sh\necho b\n";
  fs::permissions(root_ / "src/sub/b.sh", fs::perms::owner_all);
  fs::create_symlink("a.txt", root_ / "src/link");
  auto f = files();
  std::string tar = f.get_archive("/src", 1 << 20);
  f.put_archive("/dst", tar);
  EXPECT_EQ(slurp(root_ / "dst/a.txt"), "alpha");
  EXPECT_EQ(slurp(root_ / "dst/sub/b.sh"), "#!/bin/sh\necho b\n");
  EXPECT_TRUE(fs::is_symlink(root_ / "dst/link"));
  EXPECT_EQ(fs::read_symlink(root_ / "dst/link"), "a.txt");
  EXPECT_NE(fs::status(root_ / "dst/sub/b.sh").permissions() & fs::perms::owner_exec, fs::perms::none);
}

TEST_F(RootfsFilesTest, TarEntriesCannotEscapeThroughDotDotOrPlantedLinks) {
  // The destination holds symlinks the sandbox planted where the archive's entries will land.
  fs::create_directories(root_ / "build");
  std::ofstream(root_ / "build/x") << "payload";
  auto f = files();
  std::string tar = f.get_archive("/build", 1 << 20);
  fs::create_directories(root_ / "dst");
  fs::create_symlink(outside_, root_ / "dst/x-dir");
  fs::create_symlink(outside_ / "x", root_ / "dst/x");
  f.put_archive("/dst", tar);
  EXPECT_FALSE(fs::exists(outside_ / "x")) << "a planted symlink redirected an extraction to the host";
  EXPECT_EQ(slurp(root_ / "dst/x"), "payload");
}

// A tar made by hand with names that climb out of the destination or are absolute.
std::string hostile_tar(const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string out;
  archive* a = archive_write_new();
  archive_write_set_format_pax_restricted(a);
  archive_write_open2(
      a, &out, nullptr,
      [](archive*, void* client, const void* buf, size_t len) -> la_ssize_t {
        static_cast<std::string*>(client)->append(static_cast<const char*>(buf), len);
        return static_cast<la_ssize_t>(len);
      },
      nullptr, nullptr);
  for (const auto& [name, content] : entries) {
    archive_entry* e = archive_entry_new();
    archive_entry_set_pathname(e, name.c_str());
    archive_entry_set_filetype(e, AE_IFREG);
    archive_entry_set_perm(e, 0644);
    archive_entry_set_size(e, static_cast<la_int64_t>(content.size()));
    archive_write_header(a, e);
    archive_write_data(a, content.data(), content.size());
    archive_entry_free(e);
  }
  archive_write_close(a);
  archive_write_free(a);
  return out;
}

TEST_F(RootfsFilesTest, TarNamesWithDotDotOrAbsolutePathsStayUnderTheTarget) {
  auto f = files();
  std::string escape = "../../../../../../../.." + outside_.string() + "/escaped";
  f.put_archive("/dst", hostile_tar({{escape, "1"}, {outside_.string() + "/abs", "2"}}));
  EXPECT_FALSE(fs::exists(outside_ / "escaped"));
  EXPECT_FALSE(fs::exists(outside_ / "abs"));
  EXPECT_EQ(slurp(root_ / "dst" / outside_.relative_path() / "escaped"), "1");
  EXPECT_EQ(slurp(root_ / "dst" / outside_.relative_path() / "abs"), "2");
}

TEST_F(RootfsFilesTest, GarbageTarIsInvalidArgument) {
  auto f = files();
  try {
    f.put_archive("/dst", std::string(1024, 'z'));
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument) << e.what();
  }
}

TEST(Seccomp, BuildsBothPrograms) {
  auto strict = build_seccomp_program(false);
  auto ptrace = build_seccomp_program(true);
  EXPECT_GT(strict.instructions.size(), 20u);
  EXPECT_LT(ptrace.instructions.size(), strict.instructions.size());
}

TEST(RootfsPlan, OverlayStacksLayersTopFirstOverATmpfsUpper) {
  Resources r;
  r.disk_bytes = 64 << 20;
  RootfsPlan plan = plan_rootfs("/run/dsec/sb", {"/img/top", "/img/base"}, r);
  ASSERT_GE(plan.steps.size(), 4u);
  EXPECT_STREQ(plan.steps[0].fstype, "tmpfs");
  EXPECT_NE(std::string(plan.steps[0].data).find("size=67108864"), std::string::npos);
  bool found = false;
  for (const auto& s : plan.steps)
    if (s.fstype && std::string(s.fstype) == "overlay") {
      found = true;
      EXPECT_NE(std::string(s.data).find("lowerdir=/img/top:/img/base,"), std::string::npos) << s.data;
      EXPECT_STREQ(s.target, "/run/dsec/sb/root");
    }
  EXPECT_TRUE(found);
}

}  // namespace
}  // namespace dsec::agent::container
