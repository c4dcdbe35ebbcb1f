// The fixture of the client tests against a real dsecd (build/bin/dsecd): an embedded agent with a home of its own
// and a busybox image in it. Skips with the reason when dsecd has not been built or the host lacks busybox.
#pragma once

#include <gtest/gtest.h>

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "dsec/client.hpp"
#include "dsec/spec.hpp"
#include "image/build.hpp"
#include "image/store/blob_store.hpp"

namespace dsec::detail {

namespace fs = std::filesystem;

inline std::string find_dsecd() {
  if (const char* env = std::getenv("DSEC_AGENT"); env && *env) return env;
  // The test binary and dsecd share build/bin.
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return {};
  fs::path candidate = self.parent_path() / "dsecd";
  return fs::exists(candidate) ? candidate.string() : std::string();
}

class AgentTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dsecd_ = find_dsecd();
    if (dsecd_.empty()) return;
    char dir[] = "/tmp/dsec-cxx-XXXXXX";
    if (!::mkdtemp(dir)) return;
    home_ = dir;
  }
  static void TearDownTestSuite() {
    if (!home_.empty()) fs::remove_all(home_);
  }

  void SetUp() override {
    if (dsecd_.empty()) GTEST_SKIP() << "build/bin/dsecd is absent (build the dsecd target, or set $DSEC_AGENT)";
    if (home_.empty()) GTEST_SKIP() << "cannot create a temporary home under /tmp";
    if (!fs::exists("/bin/busybox"))
      GTEST_SKIP() << "/bin/busybox (Debian's busybox-static) is needed for the test image";
  }

  // An embedded agent with its own home (and a busybox image in it).
  static ClientOptions embedded(const std::string& node_id, const std::string& backends = "null") {
    ClientOptions o;
    o.agent_binary = dsecd_;
    o.home = home_ + "/" + node_id;
    auto store = image::open_directory_store(fs::path(o.home) / "store");
    image::BuildOptions build;
    build.reference = "busybox";
    build.source = image::LayerSource::parse("busybox-static");
    build.work_dir = fs::path(o.home) / "build";
    fs::create_directories(build.work_dir);
    image::build_image(*store, build);
    o.agent_args = {"--backends", backends, "--node-id", node_id};
    return o;
  }

  static SandboxSpec null_spec() {
    SandboxSpec s;
    s.kind = "null";
    s.resources.cpu = 0.05;
    return s;
  }

  static inline std::string dsecd_;
  static inline std::string home_;
};

}  // namespace dsec::detail
