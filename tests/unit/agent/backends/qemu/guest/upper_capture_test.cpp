// The agent's side of a VM snapshot (agent/guest/upper_capture): a stream of entries from inside a VM written as a
// layer's tree, in upper_tree.hpp's form, never outside the tree whatever the guest sends.
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "agent/backends/qemu/guest/upper_capture.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::guest {
namespace {

namespace fs = std::filesystem;
using files::EntryKind;
using files::TreeEntry;

class UpperCaptureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    base_ = fs::temp_directory_path() / ("dsec-upper-capture-" + std::to_string(::getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(base_);
    fs::create_directories(base_);
    dest_ = base_ / "tree";
  }
  void TearDown() override { fs::remove_all(base_); }
  static TreeEntry entry(EntryKind kind, std::string path, std::uint32_t mode = 0644, std::string link = {},
                         std::uint64_t size = 0) {
    TreeEntry e;
    e.kind = kind;
    e.path = std::move(path);
    e.mode = mode;
    e.link = std::move(link);
    e.size = size;
    e.mtime_ns = 1700000000ll * 1000000000ll;
    e.atime_ns = e.mtime_ns;
    return e;
  }
  fs::path base_, dest_;
};

TEST_F(UpperCaptureTest, WritesEveryKindAsAnUpperTree) {
  UpperTreeWriter w(dest_, {});
  TreeEntry dir = entry(EntryKind::kDirectory, "etc", 0755);
  dir.opaque = true;
  w.entry(dir);
  w.entry(entry(EntryKind::kRegular, "etc/only", 0640, {}, 6));
  w.data("fre");
  w.data("sh\n");
  w.entry(entry(EntryKind::kHardlink, "etc/again", 0640, "etc/only"));
  w.entry(entry(EntryKind::kSymlink, "etc/link", 0777, "/nowhere"));
  w.entry(entry(EntryKind::kFifo, "etc/pipe", 0600));
  w.entry(entry(EntryKind::kWhiteout, "gone", 0));
  image::UpperTreeStats st = w.finish();
  EXPECT_EQ(st.directories, 1u);
  EXPECT_EQ(st.files, 1u);
  EXPECT_EQ(st.hard_links, 1u);
  EXPECT_EQ(st.symlinks, 1u);
  EXPECT_EQ(st.fifos, 1u);
  EXPECT_EQ(st.whiteouts, 1u);
  EXPECT_EQ(st.opaque_directories, 1u);
  EXPECT_EQ(st.file_bytes, 6u);
  std::ifstream in(dest_ / "etc/only");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(text, "fresh\n");
  struct stat s {};
  ASSERT_EQ(::lstat((dest_ / "etc/only").c_str(), &s), 0);
  EXPECT_EQ(s.st_mode & 07777, 0640u);
  EXPECT_EQ(s.st_nlink, 2u);
  EXPECT_EQ(s.st_mtim.tv_sec, 1700000000);
  ASSERT_EQ(::lstat((dest_ / "gone").c_str(), &s), 0);
  EXPECT_TRUE(S_ISCHR(s.st_mode));
  EXPECT_EQ(s.st_rdev, makedev(0, 0));
  ASSERT_EQ(::lstat((dest_ / "etc/pipe").c_str(), &s), 0);
  EXPECT_TRUE(S_ISFIFO(s.st_mode));
  EXPECT_EQ(fs::read_symlink(dest_ / "etc/link"), "/nowhere");
  char v[4] = {};
  EXPECT_EQ(::lgetxattr((dest_ / "etc").c_str(), "trusted.overlay.opaque", v, sizeof v), 1);
  EXPECT_EQ(v[0], 'y');
  ASSERT_EQ(::lstat((dest_ / "etc").c_str(), &s), 0);
  EXPECT_EQ(s.st_mtim.tv_sec, 1700000000);  // set after its children were written
}

TEST_F(UpperCaptureTest, AHostileStreamCannotLeaveTheTree) {
  fs::create_directories(base_ / "outside");
  auto code = [&](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.code();
    }
    return Code::kOk;
  };
  {
    UpperTreeWriter w(dest_, {});
    // A symlink to outside, then an entry through it: the parent is opened without following symlinks.
    w.entry(entry(EntryKind::kSymlink, "esc", 0777, (base_ / "outside").string()));
    EXPECT_EQ(code([&] { w.entry(entry(EntryKind::kRegular, "esc/planted", 0644, {}, 1)); }), Code::kUnavailable);
    EXPECT_EQ(code([&] { w.entry(entry(EntryKind::kRegular, "../outside/planted", 0644, {}, 1)); }),
              Code::kUnavailable);
    EXPECT_EQ(code([&] { w.entry(entry(EntryKind::kRegular, "/abs", 0644, {}, 1)); }), Code::kUnavailable);
    EXPECT_EQ(code([&] { w.entry(entry(EntryKind::kRegular, "a/./b", 0644, {}, 1)); }), Code::kUnavailable);
    // A hard link to a file outside through the symlink: refused the same way.
    EXPECT_EQ(code([&] { w.entry(entry(EntryKind::kHardlink, "h", 0644, "esc/secret")); }), Code::kUnavailable);
  }
  EXPECT_TRUE(fs::is_empty(base_ / "outside"));
  {
    fs::remove_all(dest_);
    UpperTreeWriter w(dest_, {});
    w.entry(entry(EntryKind::kRegular, "f", 0644, {}, 2));
    EXPECT_EQ(code([&] { w.data("toolong"); }), Code::kUnavailable);  // more bytes than the entry's size
  }
  {
    fs::remove_all(dest_);
    image::UpperTreeLimits limits;
    limits.max_file_bytes = 10;
    UpperTreeWriter w(dest_, limits);
    EXPECT_EQ(code([&] { w.entry(entry(EntryKind::kRegular, "big", 0644, {}, 11)); }), Code::kResourceExhausted);
  }
  {
    fs::remove_all(dest_);
    UpperTreeWriter w(dest_, {});
    w.entry(entry(EntryKind::kRegular, "short", 0644, {}, 5));
    w.data("ab");
    EXPECT_EQ(code([&] { w.finish(); }), Code::kUnavailable);  // ended before its size
  }
}

}  // namespace
}  // namespace dsec::agent::guest
