// The fncall backend's service without fork servers: its configuration checks, the errors of calls that cannot
// run (no image, a language the node does not serve, GPUs it does not have), what it reports for GET /v1/node, its
// routes, and its life cycle (a service that never ran a call starts and stops without making anything).
#include <gtest/gtest.h>

#include <filesystem>

#include "agent/agent_test_util.hpp"
#include "agent/api/routes.hpp"
#include "agent/fncall/fncall_service.hpp"
#include "error_test_util.hpp"

namespace dsec::agent::fncall {
namespace {

using dsec::agent::testing::FakeImages;
using dsec::agent::testing::ScratchDir;

class FnCallServiceTest : public ::testing::Test {
 protected:
  FnCallServiceOptions options(std::function<void(FnCallConfig&)> tweak = {}) {
    FnCallServiceOptions o;
    o.node_id = "n1";
    o.cgroup_name = "dsec-unit-fncall-" + std::to_string(::getpid());
    o.run_dir = dir_.path() / "run";
    o.cores = 2;
    if (tweak) tweak(o.config);
    return o;
  }
  ScratchDir dir_;
  FakeImages images_{{"judge:latest"}};
};

TEST_F(FnCallServiceTest, BadConfigurationsAreInvalidArguments) {
  auto make = [&](std::function<void(FnCallConfig&)> tweak) { FnCallService service(options(tweak), images_); };
  EXPECT_CODE_MSG(make([](FnCallConfig& c) { c.pools["cobol"] = {1, 2}; }), Code::kInvalidArgument, "cobol");
  EXPECT_CODE(make([](FnCallConfig& c) { c.pools["python"] = {3, 2}; }), Code::kInvalidArgument);
  EXPECT_CODE_MSG(make([](FnCallConfig& c) { c.warm = {"python"}; }), Code::kInvalidArgument,
                  "--fncall-image");  // no default image
  EXPECT_CODE(make([](FnCallConfig& c) {
                c.default_image = "judge";
                c.warm = {"c"};
                c.pools["c"] = {0, 0};
              }),
              Code::kInvalidArgument);
  EXPECT_CODE(make([](FnCallConfig& c) { c.uid = 0; }), Code::kInvalidArgument);
  EXPECT_CODE(make([](FnCallConfig& c) { c.default_image = "../x"; }), Code::kInvalidArgument);
  EXPECT_CODE(make([](FnCallConfig& c) { c.gpus = {"0", "0"}; }), Code::kInvalidArgument);
  EXPECT_CODE(make([](FnCallConfig& c) { c.default_image = "judge:py@sha256:" + std::string(64, 'a'); }), Code::kOk);
}

TEST_F(FnCallServiceTest, CallsThatCannotRunSayWhy) {
  FnCallService service(options([](FnCallConfig& c) {
                          c.pools["cpp"] = {0, 0};
                          c.gpus = {"0"};
                        }),
                        images_);
  service.start();
  FnCallRequest r;
  r.code = "print(1)";
  // No image, and no default one.
  EXPECT_CODE_MSG(service.run(r), Code::kFailedPrecondition, "--fncall-image");
  // An image no store has.
  r.image = "nothere:1";
  EXPECT_CODE(service.run(r), Code::kNotFound);
  // A language the node turned off.
  r.language = "cpp";
  EXPECT_CODE_MSG(service.run(r), Code::kFailedPrecondition, "'cpp'");
  // More GPUs than the node has: refused before anything else.
  r.language = "python";
  r.gpu_mode = GpuMode::kExclusive;
  r.gpus = 2;
  EXPECT_CODE(service.run(r), Code::kFailedPrecondition);
  // A failed call is not remembered: the same request id fails the same way again, it does not hang or succeed.
  r.gpus = 0;
  r.gpu_mode = GpuMode::kNone;
  r.request_id = "rid-1";
  EXPECT_CODE(service.run(r), Code::kNotFound);
  EXPECT_CODE(service.run(r), Code::kNotFound);
  // A batch: each element's own answer, in order.
  std::vector<BatchCall> batch(3);
  batch[0].request = r;
  batch[1].error = Error(Code::kInvalidArgument, "calls[1]: bad");
  batch[2].request = r;
  batch[2].request->language = "cpp";
  batch[2].request->request_id.clear();
  auto out = service.run_batch(std::move(batch));
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0].error->code(), Code::kNotFound);
  EXPECT_EQ(out[1].error->code(), Code::kInvalidArgument);
  EXPECT_EQ(out[2].error->code(), Code::kFailedPrecondition);
  service.shutdown();
  // Nothing was started, so nothing was made on the host.
  EXPECT_FALSE(std::filesystem::exists(dir_.path() / "run" / "fncall"));
  // After shutdown, calls are refused as unavailable.
  r.image = "judge";
  r.request_id.clear();
  EXPECT_CODE(service.run(r), Code::kUnavailable);
}

TEST_F(FnCallServiceTest, StatusListsLanguagesAndGpus) {
  FnCallService service(options([](FnCallConfig& c) {
                          c.default_image = "judge";
                          c.pools["shell"] = {0, 0};
                          c.gpus = {"0", "1"};
                          c.gpu_shares = 3;
                        }),
                        images_);
  FnCallStatus st = service.status();
  EXPECT_EQ(st.languages, (std::vector<std::string>{"c", "cpp", "python"}));
  EXPECT_EQ(st.default_image, "judge");
  EXPECT_TRUE(st.pools.empty());
  ASSERT_EQ(st.gpus.size(), 2u);
  EXPECT_EQ(st.gpus[1].device, "1");
  EXPECT_EQ(st.gpu_shares, 3u);
  EXPECT_EQ(st.gpus_free, 2u);
}

TEST(FnCallRoutes, TargetsOfFunctionCalls) {
  EXPECT_EQ(parse_target("/v1/fncall").route, Route::kFnCall);
  EXPECT_EQ(parse_target("/v1/fncall/").route, Route::kFnCall);
  EXPECT_EQ(parse_target("/v1/fncall/batch").route, Route::kFnCallBatch);
  EXPECT_EQ(parse_target("/v1/fncall/other").route, Route::kUnknown);
  EXPECT_EQ(route_template(Route::kFnCall), "/v1/fncall");
  EXPECT_EQ(route_template(Route::kFnCallBatch), "/v1/fncall/batch");
}

}  // namespace
}  // namespace dsec::agent::fncall
