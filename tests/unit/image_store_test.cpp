// The image store's names, lookups and removal.
#include <fcntl.h>
#include <sys/file.h>

#include <string>

#include <gtest/gtest.h>

#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "image/store.hpp"
#include "image_test_util.hpp"

namespace dsec::image {
namespace {

namespace fs = std::filesystem;
using testing::entries_with_prefix;
using testing::TempDir;
using testing::write_text;

Code code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return Code::kOk;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

TEST(ImageName, AddsLatestTag) {
  EXPECT_EQ(normalize_name("busybox"), "busybox:latest");
  EXPECT_EQ(normalize_name("busybox:latest"), "busybox:latest");
  EXPECT_EQ(normalize_name("busybox:1.35"), "busybox:1.35");
}

TEST(ImageName, AcceptsRepositoryPathsAndTagCharacters) {
  EXPECT_EQ(normalize_name("swe/django-1234"), "swe/django-1234:latest");
  EXPECT_EQ(normalize_name("a.b_c-d/E9:_x.Y-1"), "a.b_c-d/E9:_x.Y-1");
  EXPECT_EQ(normalize_name("python:bookworm"), "python:bookworm");
  EXPECT_EQ(normalize_name("0/1/2:3"), "0/1/2:3");
}

TEST(ImageName, RejectsMalformedNames) {
  for (const std::string bad :
       {"", ":", "a:", ":tag", "a::b", "a:b:c", "with space", "/abs", "a//b", "a/", ".hidden", "-x", "a/../b",
        "a/./b", "a:-tag", "a:.tag", "a:ta/g", "tab\there", "new\nline", "a%20b", "a@sha256", "ü"}) {
    EXPECT_EQ(code_of([&] { normalize_name(bad); }), Code::kInvalidArgument) << "'" << bad << "'";
  }
}

TEST(ImageName, ErrorNamesTheImageAndTheProblem) {
  std::string msg = message_of([] { normalize_name("bad name"); });
  EXPECT_NE(msg.find("'bad name'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("a space"), std::string::npos) << msg;
}

TEST(ImageName, RejectsNamesTooLongForOneDirectory) {
  EXPECT_EQ(code_of([] { normalize_name(std::string(250, 'a')); }), Code::kInvalidArgument);
  EXPECT_EQ(code_of([] { normalize_name("a:" + std::string(129, 't')); }), Code::kInvalidArgument);
  EXPECT_EQ(normalize_name("a:" + std::string(128, 't')), "a:" + std::string(128, 't'));
  // Each '/' grows to three characters on disk; the limit is on the escaped form.
  std::string slashes;
  for (int i = 0; i < 70; ++i) slashes += "a/";
  slashes += "a";
  EXPECT_EQ(code_of([&] { normalize_name(slashes); }), Code::kInvalidArgument);
}

TEST(ImageName, EscapedNameIsOneSafePathComponent) {
  EXPECT_EQ(escape_name("busybox:latest"), "busybox%3Alatest");
  EXPECT_EQ(escape_name("swe/django:1"), "swe%2Fdjango%3A1");
  for (const std::string n : {"busybox:latest", "swe/django-1234:v1.2", "a/b/c:_"}) {
    std::string e = escape_name(n);
    EXPECT_EQ(e.find('/'), std::string::npos);
    EXPECT_EQ(e.find(':'), std::string::npos);
    EXPECT_EQ(unescape_name(e), n);
  }
}

class ImageStoreTest : public ::testing::Test {
 protected:
  TempDir tmp_;
  ImageStore store_{tmp_ / "images"};

  void make_source(const std::string& marker) {
    write_text(tmp_ / "src/etc/marker", marker);
    write_text(tmp_ / "src/bin/tool", "#!/bin/sh\necho hi\n", 0755);
  }
};

TEST_F(ImageStoreTest, EmptyOrMissingStoreListsNothing) {
  EXPECT_TRUE(store_.list().empty());
  EXPECT_FALSE(store_.find("busybox").has_value());
}

TEST_F(ImageStoreTest, CacheDirIsBesideTheStore) {
  EXPECT_EQ(store_.cache_dir(), tmp_ / "cache");
  ImageStore trailing(tmp_.path().string() + "/images/");
  EXPECT_EQ(trailing.root(), tmp_ / "images");
  EXPECT_EQ(trailing.cache_dir(), tmp_ / "cache");
}

TEST_F(ImageStoreTest, ResolveMissingImageInEmptyStoreSaysHowToBuildOne) {
  try {
    store_.resolve("python:3.11");
    FAIL() << "resolve of a missing image succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
    std::string msg = e.what();
    EXPECT_NE(msg.find("'python:3.11'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("no images"), std::string::npos) << msg;
    EXPECT_NE(msg.find("dsec image build"), std::string::npos) << msg;
  }
}

TEST_F(ImageStoreTest, ResolveMissingImageListsWhatTheStoreHas) {
  make_source("one");
  store_.build_from_directory("alpha", tmp_ / "src");
  store_.build_from_directory("team/beta:v2", tmp_ / "src");
  try {
    store_.resolve("gamma");
    FAIL() << "resolve of a missing image succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kNotFound);
    std::string msg = e.what();
    EXPECT_NE(msg.find("'gamma:latest'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("alpha:latest, team/beta:v2"), std::string::npos) << msg;
  }
  EXPECT_EQ(code_of([&] { store_.resolve("bad name"); }), Code::kInvalidArgument);
}

TEST_F(ImageStoreTest, FindAndResolveAcceptEitherSpelling) {
  make_source("one");
  ImageRecord built = store_.build_from_directory("alpha", tmp_ / "src");
  EXPECT_EQ(built.name, "alpha:latest");
  ASSERT_TRUE(store_.find("alpha:latest"));
  EXPECT_EQ(store_.resolve("alpha").dir, tmp_ / "images" / "alpha%3Alatest");
  ASSERT_EQ(store_.resolve("alpha").layers.size(), 1u);
  EXPECT_EQ(store_.resolve("alpha").layers[0], tmp_ / "images" / "alpha%3Alatest" / "rootfs");
  EXPECT_FALSE(store_.find("alpha:other"));
}

TEST_F(ImageStoreTest, ListSkipsForeignAndDamagedDirectories) {
  make_source("one");
  store_.build_from_directory("alpha", tmp_ / "src");
  std::filesystem::create_directories(tmp_ / "images/not-an-image");
  write_text(tmp_ / "images/broken%3Alatest/manifest.json", "{ not json");
  // A manifest whose name does not match its directory is not trusted either.
  write_text(tmp_ / "images/liar%3Alatest/manifest.json", R"({"name": "alpha:latest", "layers": ["rootfs"]})");
  auto images = store_.list();
  ASSERT_EQ(images.size(), 1u);
  EXPECT_EQ(images[0].name, "alpha:latest");
  EXPECT_FALSE(store_.find("liar"));
}

TEST_F(ImageStoreTest, RemoveDeletesTheImageAndMissingIsNotFound) {
  make_source("one");
  store_.build_from_directory("alpha", tmp_ / "src");
  store_.remove("alpha:latest");
  EXPECT_FALSE(store_.find("alpha"));
  EXPECT_FALSE(std::filesystem::exists(tmp_ / "images/alpha%3Alatest"));
  EXPECT_TRUE(entries_with_prefix(tmp_ / "images", ".").empty());
  std::string msg = message_of([&] { store_.remove("alpha"); });
  EXPECT_EQ(code_of([&] { store_.remove("alpha"); }), Code::kNotFound);
  EXPECT_NE(msg.find("alpha:latest"), std::string::npos) << msg;
}

TEST_F(ImageStoreTest, LeasedImageKeepsItsFilesUntilTheLeaseEnds) {
  make_source("one");
  store_.build_from_directory("alpha", tmp_ / "src");
  EXPECT_EQ(code_of([&] { store_.lease("missing"); }), Code::kNotFound);
  {
    ImageLease lease = store_.lease("alpha");
    ASSERT_TRUE(lease);
    fs::path marker = lease.record().layers[0] / "etc/marker";
    store_.remove("alpha");
    EXPECT_FALSE(store_.find("alpha")) << "the name outlived remove";
    EXPECT_EQ(testing::read_text(marker), "") << "files under a removed image's old path";
    // The files moved with the directory to a removal name, and are still whole there.
    auto pending = entries_with_prefix(tmp_ / "images", ".rm-");
    ASSERT_EQ(pending.size(), 1u);
    EXPECT_EQ(testing::read_text(tmp_ / "images" / pending[0] / "rootfs/etc/marker"), "one");
    store_.prune_stale();
    EXPECT_EQ(entries_with_prefix(tmp_ / "images", ".rm-").size(), 1u) << "prune removed a leased image";
  }
  store_.prune_stale();
  EXPECT_TRUE(entries_with_prefix(tmp_ / "images", ".").empty());
}

TEST_F(ImageStoreTest, ReplacingALeasedImageLeavesTheOldFilesToTheLease) {
  make_source("one");
  store_.build_from_directory("alpha", tmp_ / "src");
  ImageLease lease = store_.lease("alpha");
  make_source("two");
  ImageRecord fresh = store_.build_from_directory("alpha", tmp_ / "src");
  EXPECT_EQ(testing::read_text(fresh.layers[0] / "etc/marker"), "two");
  auto pending = entries_with_prefix(tmp_ / "images", ".rm-");
  ASSERT_EQ(pending.size(), 1u);
  EXPECT_EQ(testing::read_text(tmp_ / "images" / pending[0] / "rootfs/etc/marker"), "one");
  lease = ImageLease();
  store_.prune_stale();
  EXPECT_TRUE(entries_with_prefix(tmp_ / "images", ".").empty());
  EXPECT_EQ(store_.lease("alpha").record().name, "alpha:latest");
}

TEST_F(ImageStoreTest, PruneRemovesOnlyAbandonedBuilds) {
  std::filesystem::create_directories(tmp_ / "images/.tmp-dead-abc/rootfs/x");
  write_text(tmp_ / "images/.tmp-dead-abc/.lock", "");
  std::filesystem::create_directories(tmp_ / "images/.tmp-live-abc/rootfs");
  write_text(tmp_ / "images/.tmp-live-abc/.lock", "");
  std::filesystem::create_directories(tmp_ / "images/.rm-0123/rootfs");
  UniqueFd held(::open((tmp_ / "images/.tmp-live-abc/.lock").c_str(), O_RDWR | O_CLOEXEC));
  ASSERT_TRUE(held);
  ASSERT_EQ(::flock(held.get(), LOCK_EX), 0);

  store_.prune_stale();
  EXPECT_FALSE(std::filesystem::exists(tmp_ / "images/.tmp-dead-abc"));
  EXPECT_FALSE(std::filesystem::exists(tmp_ / "images/.rm-0123"));
  EXPECT_TRUE(std::filesystem::exists(tmp_ / "images/.tmp-live-abc/rootfs"));
}

}  // namespace
}  // namespace dsec::image
