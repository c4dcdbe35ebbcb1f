// The host-side logs of a VM: bound_log keeps a log that a guest can grow (its console, written by QEMU through an
// O_APPEND descriptor) within its limit, keeping whole last lines, while the writer goes on appending.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "agent/backends/qemu/vm_process.hpp"
#include "common/unique_fd.hpp"

namespace dsec::agent::qemu {
namespace {

namespace fs = std::filesystem;

class BoundLog : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/dsec-boundlog-XXXXXX";
    ASSERT_NE(::mkdtemp(dir), nullptr);
    dir_ = dir;
    path_ = dir_ / "console.log";
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string read_all(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

  fs::path dir_, path_;
};

TEST_F(BoundLog, UnderTheLimitNothingChanges) {
  std::ofstream(path_) << "boot\nok\n";
  EXPECT_EQ(bound_log(path_, 1024, 64), 0u);
  EXPECT_EQ(read_all(path_), "boot\nok\n");
  EXPECT_EQ(bound_log(dir_ / "absent.log", 1, 1), 0u);
}

TEST_F(BoundLog, OverTheLimitTheLastWholeLinesStayAndTheWriterGoesOn) {
  // The writer, as QEMU holds its console: O_APPEND, kept open across the cut.
  UniqueFd writer(::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
  ASSERT_TRUE(writer);
  std::string all;
  for (int i = 0; i < 20000; ++i) all += "line " + std::to_string(i) + "\n";
  ASSERT_EQ(::write(writer.get(), all.data(), all.size()), static_cast<ssize_t>(all.size()));
  ASSERT_GT(all.size(), 100'000u);

  const std::uint64_t dropped = bound_log(path_, 100'000, 1000);
  std::string after = read_all(path_);
  EXPECT_GT(dropped, all.size() - 1000);
  EXPECT_LT(after.size(), 1200u);
  EXPECT_EQ(after.rfind("[dsec: ", 0), 0u) << after.substr(0, 100);  // says what went
  std::string kept = after.substr(after.find('\n') + 1);
  EXPECT_EQ(kept.rfind("line ", 0), 0u) << "the kept part starts at a line's start: " << kept.substr(0, 40);
  EXPECT_TRUE(all.ends_with(kept));
  EXPECT_EQ(dropped, all.size() - kept.size());

  // The writer's next line lands after what stayed, not at its old offset.
  const std::string next = "after the cut\n";
  ASSERT_EQ(::write(writer.get(), next.data(), next.size()), static_cast<ssize_t>(next.size()));
  EXPECT_EQ(read_all(path_), after + next);
  EXPECT_EQ(fs::file_size(path_), after.size() + next.size());
}

}  // namespace
}  // namespace dsec::agent::qemu
