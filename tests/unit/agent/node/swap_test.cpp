// The node's swap for sleeping sandboxes (agent/node/swap.hpp): /proc parsers, the swap header against mkswap's, the
// filesystems a swap file may not live on, and a swap file's life on this host (made, turned on, reused, turned
// off; an area found on is left alone unless it carries dsecd's label). The life test needs root and a kernel that
// lets it swapon; it skips itself and says why otherwise.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/swap.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "abandon.hpp"
#include "agent/node/swap.hpp"
#include "dsec/error.hpp"

namespace dsec::agent {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

TEST(SwapParsers, MeminfoSwapLines) {
  auto t = parse_meminfo_swap(
      "MemTotal:       24684084 kB\nSwapCached:            0 kB\nSwapTotal:       2097148 kB\n"
      "SwapFree:        2000000 kB\nZswap:  0 kB\n");
  EXPECT_EQ(t.total_bytes, 2097148ull << 10);
  EXPECT_EQ(t.free_bytes, 2000000ull << 10);
  auto none = parse_meminfo_swap("MemTotal: 1 kB\n");
  EXPECT_EQ(none.total_bytes, 0u);
}

TEST(SwapParsers, ProcSwapsWithEscapedPaths) {
  auto swaps = parse_proc_swaps(
      "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
      "/var/lib/dsec/swap\\040file                   file\t\t2097148\t\t1024\t\t-2\n"
      "/dev/zram1                              partition\t262140\t\t0\t\t100\n");
  ASSERT_EQ(swaps.size(), 2u);
  EXPECT_EQ(swaps[0].path, "/var/lib/dsec/swap file");
  EXPECT_EQ(swaps[0].type, "file");
  EXPECT_EQ(swaps[0].size_bytes, 2097148ull << 10);
  EXPECT_EQ(swaps[0].used_bytes, 1024ull << 10);
  EXPECT_EQ(swaps[0].priority, -2);
  EXPECT_EQ(swaps[1].path, "/dev/zram1");
  EXPECT_EQ(swaps[1].priority, 100);
  EXPECT_TRUE(parse_proc_swaps("Filename\tType\tSize\tUsed\tPriority\n").empty());
}

TEST(SwapHeader, RoundTripAndRefusals) {
  const unsigned char uuid[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  std::string page = make_swap_header(64ull << 20, 4096, "dsecd", uuid);
  ASSERT_EQ(page.size(), 4096u);
  EXPECT_EQ(page.substr(4086), "SWAPSPACE2");
  SwapHeader h = parse_swap_header(page);
  EXPECT_TRUE(h.valid);
  EXPECT_EQ(h.pages, (64ull << 20) / 4096);
  EXPECT_EQ(h.label, "dsecd");
  // A label longer than the field is cut at 16 bytes.
  EXPECT_EQ(parse_swap_header(make_swap_header(1 << 20, 4096, "a-label-of-twenty-bytes", uuid)).label,
            "a-label-of-twent");
  EXPECT_THROW(make_swap_header(4096 * 5, 4096, "x", uuid), Error);  // under ten pages
  EXPECT_FALSE(parse_swap_header(std::string(4096, '\0')).valid);
  EXPECT_FALSE(parse_swap_header("short").valid);
}

TEST(SwapHeader, ReadsWhatMkswapWrites) {
  if (::access("/usr/sbin/mkswap", X_OK) != 0 && ::access("/sbin/mkswap", X_OK) != 0)
    GTEST_SKIP() << "mkswap (util-linux) is not installed: nothing to compare the header with";
  const fs::path file = fs::temp_directory_path() / ("dsec-unit-mkswap-" + std::to_string(::getpid()));
  {
    std::ofstream out(file, std::ios::binary);
    out.seekp((8 << 20) - 1);
    out.put('\0');
  }
  std::string cmd = "PATH=/usr/sbin:/sbin:$PATH mkswap -L mklabel " + file.string() + " >/dev/null 2>&1";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  std::ifstream in(file, std::ios::binary);
  std::string theirs(static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)), '\0');
  in.read(theirs.data(), static_cast<std::streamsize>(theirs.size()));
  fs::remove(file);
  SwapHeader h = parse_swap_header(theirs);
  EXPECT_TRUE(h.valid);
  EXPECT_EQ(h.label, "mklabel");
  EXPECT_EQ(h.pages, (8ull << 20) / theirs.size());
  // Ours puts the same fields in the same places (the uuid and the label aside).
  const unsigned char uuid[16] = {};
  std::string ours = make_swap_header(8ull << 20, theirs.size(), "mklabel", uuid);
  EXPECT_EQ(ours.substr(1024, 12), theirs.substr(1024, 12)) << "version, last page, bad pages";
  EXPECT_EQ(ours.substr(1024 + 28, 16), theirs.substr(1024 + 28, 16)) << "label";
  EXPECT_EQ(ours.substr(ours.size() - 10), theirs.substr(theirs.size() - 10));
}

TEST(SwapFilesystem, TmpfsCannotHoldSwap) {
  if (fs::exists("/dev/shm")) {
    SwapFilesystem shm = swap_filesystem("/dev/shm");
    EXPECT_EQ(shm.name, "tmpfs");
    EXPECT_FALSE(shm.can_hold_swap);
    SwapOptions o;
    o.file = "/dev/shm/dsec-unit-swap-" + std::to_string(::getpid());
    o.file_bytes = 16 << 20;
    try {
      NodeSwap swap(o);
      FAIL() << "a swap file on tmpfs was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kFailedPrecondition);
      EXPECT_THAT(e.what(), HasSubstr("tmpfs, which cannot hold swap"));
    }
    EXPECT_FALSE(fs::exists(o.file)) << "the refused swap file was created";
  }
  EXPECT_FALSE(swap_filesystem("/proc").can_hold_swap);
}

TEST(NodeSwapOptions, BadOptionsAreRefused) {
  SwapOptions relative;
  relative.file = "swapfile";
  relative.file_bytes = 16 << 20;
  try {
    NodeSwap swap(relative);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    EXPECT_THAT(e.what(), HasSubstr("not an absolute path"));
  }
  SwapOptions tiny;
  tiny.file = fs::temp_directory_path() / "dsec-unit-tiny-swap";
  tiny.file_bytes = 4096;
  EXPECT_THROW(NodeSwap{tiny}, Error);
}

TEST(NodeSwapOptions, AnExistingFileThatIsNotSwapIsLeftAlone) {
  const fs::path file = fs::temp_directory_path() / ("dsec-unit-notswap-" + std::to_string(::getpid()));
  {
    std::ofstream out(file);
    out << "precious data\n";
  }
  SwapOptions o;
  o.file = file;
  o.file_bytes = 16 << 20;
  try {
    NodeSwap swap(o);
    FAIL() << "an ordinary file was taken for swap";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kFailedPrecondition);
    EXPECT_THAT(e.what(), HasSubstr("is not a swap area"));
  }
  std::ifstream in(file);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "precious data\n");
  fs::remove(file);
}

bool active(const fs::path& file) {
  for (const auto& s : read_proc_swaps())
    if (s.path == file.string()) return true;
  return false;
}

// A swap file under /var/tmp (a disk filesystem on any sane host), turned off and removed whatever happens.
class SwapFileLife : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "swapon needs root";
    file_ = fs::path("/var/tmp") / ("dsec-unit-swap-" + std::to_string(::getpid()));
    if (!swap_filesystem("/var/tmp").can_hold_swap)
      GTEST_SKIP() << "/var/tmp is on " << swap_filesystem("/var/tmp").name << ", which cannot hold a swap file";
  }
  void TearDown() override {
    if (file_.empty()) return;
    if (active(file_)) ::swapoff(file_.c_str());
    std::error_code ec;
    fs::remove(file_, ec);
  }
  fs::path file_;
};

TEST_F(SwapFileLife, MadeReusedAndTurnedOff) {
  SwapOptions o;
  o.file = file_;
  o.file_bytes = 16 << 20;
  std::unique_ptr<NodeSwap> swap;
  try {
    swap = std::make_unique<NodeSwap>(o);
  } catch (const Error& e) {
    if (e.code() == Code::kPermissionDenied) GTEST_SKIP() << "this host does not let root turn swap on: " << e.what();
    throw;
  }
  EXPECT_TRUE(active(file_));
  struct stat st {};
  ASSERT_EQ(::stat(file_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(static_cast<std::uint64_t>(st.st_size), 16ull << 20);
  EXPECT_GE(read_swap_totals().total_bytes, 15ull << 20);
  ASSERT_EQ(swap->summary().size(), 1u);
  EXPECT_THAT(swap->summary()[0], HasSubstr("made"));

  swap->turn_off();
  EXPECT_FALSE(active(file_));
  EXPECT_TRUE(fs::exists(file_)) << "the swap file is kept for the next start";

  // The next start reuses the file as it is.
  swap = std::make_unique<NodeSwap>(o);
  EXPECT_TRUE(active(file_));
  EXPECT_THAT(swap->summary()[0], HasSubstr("reused"));
  swap.reset();  // the destructor turns it off too
  EXPECT_FALSE(active(file_));

  // Another size: made again.
  o.file_bytes = 24 << 20;
  swap = std::make_unique<NodeSwap>(o);
  ASSERT_EQ(::stat(file_.c_str(), &st), 0);
  EXPECT_EQ(static_cast<std::uint64_t>(st.st_size), 24ull << 20);
  EXPECT_THAT(swap->summary()[0], HasSubstr("made"));

  // Found on with dsecd's label (an agent that crashed left it): taken over, and turned off at the end.
  auto crashed = std::move(swap);
  swap = std::make_unique<NodeSwap>(o);
  EXPECT_THAT(swap->summary()[0], HasSubstr("already on; made by dsecd"));
  test::abandon(std::move(crashed));  // as if that agent had died without turning it off
  swap.reset();
  EXPECT_FALSE(active(file_));

  // Found on without it (someone else's swap): used and left on.
  o.label = "someone";
  swap = std::make_unique<NodeSwap>(o);
  o.label = "dsecd";
  auto second = std::make_unique<NodeSwap>(o);
  EXPECT_THAT(second->summary()[0], HasSubstr("not made by dsecd: left on"));
  second.reset();
  EXPECT_TRUE(active(file_)) << "swap dsecd did not make was turned off";
  swap.reset();
  EXPECT_FALSE(active(file_));
}

}  // namespace
}  // namespace dsec::agent
