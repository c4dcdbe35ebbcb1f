// Lease groups in the agent: a create starts or extends a group's lease, renewals extend it, the reaper destroys the
// sandboxes of a group whose lease ran out, DELETE destroys a group; the lease is kept on disk. Also the node-side
// checks of placement fields (node_selector, GPUs). The registry runs on a fake clock; the HTTP side goes through
// the router without a socket.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "agent/agent_test_util.hpp"
#include "agent/api/router.hpp"
#include "agent/api/routes.hpp"
#include "agent/registry/registry.hpp"
#include "common/protocol.hpp"
#include "error_test_util.hpp"

namespace dsec::agent {
namespace {

namespace http = boost::beast::http;
using protocol::json;
using testing::FakeImages;
using testing::ProbeBackend;
using testing::ScratchDir;

constexpr double kT0 = 1'700'000'000.0;

class GroupsTest : public ::testing::Test {
 protected:
  void SetUp() override { make(); }

  void make(RegistryOptions options = {}) {
    options.node_id = "n1";
    options.state_dir = dir_.path() / "state";
    options.cores = 64;
    options.memory_bytes = 64ull << 30;
    options.clock = [this] { return clock_.load(); };
    registry_.reset();
    registry_ =
        std::make_unique<Registry>(std::move(options), Registry::Backends{{"null", &backend_}}, images_, metrics_);
    router_ = std::make_unique<Router>(*registry_, metrics_, [] { return NodeInfo{}; });
  }

  SandboxSpec spec(std::string group = {}, int group_ttl = 0) {
    SandboxSpec s;
    s.kind = "null";
    s.resources.cpu = 0.5;
    s.resources.memory_bytes = 64ull << 20;
    s.ttl = std::chrono::seconds{0};
    s.group = std::move(group);
    s.group_ttl = std::chrono::seconds{group_ttl};
    return s;
  }

  std::string create(std::string group = {}, int group_ttl = 0) {
    return registry_->create(spec(std::move(group), group_ttl)).info.id;
  }

  void at(double seconds_after_t0) { clock_ = kT0 + seconds_after_t0; }

  std::string state_of(const std::string& id) { return registry_->get(id).state; }

  struct Answer {
    int status;
    json body;
  };
  Answer call(http::verb verb, const std::string& target, const std::string& body = {}) {
    HttpRequest request{verb, target, 11};
    request.body() = body;
    request.prepare_payload();
    HttpResponse response = router_->handle(request);
    return Answer{static_cast<int>(response.result_int()), json::parse(response.body())};
  }

  std::filesystem::path lease_file(const std::string& group) {
    return dir_.path() / "state" / "groups" / (group + ".json");
  }

  json read_json(const std::filesystem::path& path) {
    std::ifstream in(path);
    return json::parse(in);
  }

  ScratchDir dir_;
  std::atomic<double> clock_{kT0};
  std::shared_ptr<ProbeBackend::State> state_ = std::make_shared<ProbeBackend::State>();
  ProbeBackend backend_{state_};
  FakeImages images_{{"busybox:latest"}};
  Metrics metrics_;
  std::unique_ptr<Registry> registry_;
  std::unique_ptr<Router> router_;
};

TEST_F(GroupsTest, ACreateStartsTheLeaseAndTheSandboxNamesItsGroup) {
  auto a = registry_->create(spec("job-7", 30)).info;
  EXPECT_EQ(a.group, "job-7");
  at(5);
  create("job-7", 30);
  create();  // not in a group
  GroupInfo g = registry_->get_group("job-7");
  EXPECT_EQ(g.node, "n1");
  EXPECT_DOUBLE_EQ(g.ttl, 30);
  EXPECT_DOUBLE_EQ(g.expires_at, kT0 + 35);  // the second create extended it
  ASSERT_EQ(g.sandbox_count, 2u);
  ASSERT_EQ(g.sandboxes.size(), 2u);
  EXPECT_EQ(g.sandboxes[0].id, a.id);  // oldest first
  EXPECT_EQ(registry_->get(a.id).group, "job-7");
  EXPECT_EQ(registry_->list_groups().size(), 1u);
}

TEST_F(GroupsTest, TheReaperDestroysAGroupWhoseLeaseExpired) {
  std::vector<std::string> doomed{create("crashed", 10), create("crashed", 10), create("crashed", 10)};
  std::string alive = create("renewed", 10);
  std::string loose = create();
  at(9.9);
  registry_->reap();
  for (const auto& id : doomed) EXPECT_EQ(state_of(id), "running");
  registry_->renew_group("renewed", 10);
  at(10);
  registry_->reap();
  for (const auto& id : doomed) {
    SandboxInfo info = registry_->get(id);
    EXPECT_EQ(info.state, "destroyed");
    EXPECT_EQ(info.message, "group 'crashed' lease expired");
  }
  EXPECT_EQ(state_of(alive), "running");
  EXPECT_EQ(state_of(loose), "running");
  // The group is forgotten: renewing it, reading it or deleting it says so.
  EXPECT_CODE_MSG(registry_->renew_group("crashed", 10), Code::kNotFound, "group 'crashed' not found on node 'n1'");
  EXPECT_CODE(registry_->get_group("crashed"), Code::kNotFound);
  EXPECT_CODE(registry_->destroy_group("crashed"), Code::kNotFound);
  EXPECT_EQ(registry_->load().sandboxes, 2u);
  at(19.5);
  registry_->reap();
  EXPECT_EQ(state_of(alive), "running");
  at(20);
  registry_->reap();
  EXPECT_EQ(state_of(alive), "destroyed");
}

TEST_F(GroupsTest, RenewalsExtendTheLeaseAndNeverShortenIt) {
  std::string id = create("g", 30);
  at(20);
  GroupInfo g = registry_->renew_group("g", 30);
  EXPECT_DOUBLE_EQ(g.expires_at, kT0 + 50);
  EXPECT_EQ(g.sandbox_count, 1u);
  g = registry_->renew_group("g", 5);  // a shorter ttl does not pull the deadline in
  EXPECT_DOUBLE_EQ(g.expires_at, kT0 + 50);
  EXPECT_DOUBLE_EQ(g.ttl, 5);
  at(48);
  g = registry_->renew_group("g", 0);  // 0: the group's own ttl, now 5
  EXPECT_DOUBLE_EQ(g.expires_at, kT0 + 53);
  at(52);
  registry_->reap();
  EXPECT_EQ(state_of(id), "running");
  EXPECT_CODE(registry_->renew_group("g", 0.5), Code::kInvalidArgument);
  EXPECT_CODE(registry_->renew_group("g", 86401), Code::kInvalidArgument);
  EXPECT_CODE(registry_->renew_group("bad/id", 10), Code::kInvalidArgument);
  EXPECT_CODE(registry_->renew_group("never", 10), Code::kNotFound);
}

TEST_F(GroupsTest, ALeaseThatExpiredCannotBeRenewedEvenBeforeTheReaperRuns) {
  std::string id = create("g", 10);
  at(11);
  EXPECT_CODE_MSG(registry_->renew_group("g", 10), Code::kNotFound, "lease expired 1.0 s ago");
  EXPECT_EQ(state_of(id), "running");  // until the reaper comes
  registry_->reap();
  EXPECT_EQ(state_of(id), "destroyed");
}

TEST_F(GroupsTest, ACreateIntoAnExpiredGroupStartsAFreshLeaseWithoutTheOldSandboxes) {
  std::string old_id = create("g", 10);
  at(15);
  std::string new_id = create("g", 10);
  GroupInfo g = registry_->get_group("g");
  EXPECT_DOUBLE_EQ(g.expires_at, kT0 + 25);
  ASSERT_EQ(g.sandboxes.size(), 1u);
  EXPECT_EQ(g.sandboxes[0].id, new_id);
  registry_->reap();
  EXPECT_EQ(state_of(old_id), "destroyed");
  EXPECT_EQ(state_of(new_id), "running");
}

TEST_F(GroupsTest, DeleteDestroysEveryMemberAndForgetsTheGroup) {
  std::vector<std::string> ids;
  for (int i = 0; i < 5; ++i) ids.push_back(create("g", 60));
  std::string other = create("h", 60);
  GroupInfo g = registry_->destroy_group("g");
  EXPECT_EQ(g.sandbox_count, 5u);
  for (const auto& id : ids) {
    EXPECT_EQ(state_of(id), "destroyed");
    EXPECT_EQ(registry_->get(id).message, "group 'g' deleted");
  }
  EXPECT_EQ(state_of(other), "running");
  EXPECT_CODE(registry_->destroy_group("g"), Code::kNotFound);
  EXPECT_CODE(registry_->renew_group("g", 10), Code::kNotFound);
  EXPECT_EQ(registry_->load().sandboxes, 1u);
}

TEST_F(GroupsTest, AMemberDestroyedAloneLeavesTheGroupAndAnEmptyLeaseLastsUntilItExpires) {
  std::string a = create("g", 10);
  std::string b = create("g", 10);
  registry_->destroy(a);
  EXPECT_EQ(registry_->get_group("g").sandbox_count, 1u);
  registry_->destroy(b);
  EXPECT_EQ(registry_->get_group("g").sandbox_count, 0u);
  EXPECT_EQ(registry_->renew_group("g", 10).sandbox_count, 0u);  // the trainer may keep it for later creates
  at(10);
  registry_->reap();
  EXPECT_TRUE(registry_->list_groups().empty());
}

TEST_F(GroupsTest, ABatchJoinsItsGroup) {
  SandboxSpec s = spec("pulse", 20);
  s.request_id = "batch-1";
  auto outcomes = registry_->create_batch(s, 16);
  EXPECT_EQ(registry_->get_group("pulse").sandbox_count, 16u);
  at(20);
  registry_->reap();
  for (const auto& o : outcomes) EXPECT_EQ(state_of(o.info.id), "destroyed");
  EXPECT_EQ(registry_->load().sandboxes, 0u);
}

TEST_F(GroupsTest, TheLeaseIsKeptOnDiskAndMembershipInTheSandboxRecords) {
  std::string id = create("g", 30);
  ASSERT_TRUE(std::filesystem::exists(lease_file("g")));
  json lease = read_json(lease_file("g"));
  EXPECT_EQ(lease["id"], "g");
  EXPECT_DOUBLE_EQ(lease["expires_at"].get<double>(), kT0 + 30);
  EXPECT_DOUBLE_EQ(lease["ttl"].get<double>(), 30);
  json record = read_json(dir_.path() / "state" / (id + ".json"));
  EXPECT_EQ(record["info"]["group"], "g");
  EXPECT_EQ(record["spec"]["group"], "g");
  EXPECT_EQ(record["spec"]["group_ttl"], 30);

  at(10);
  registry_->renew_group("g", 60);
  EXPECT_DOUBLE_EQ(read_json(lease_file("g"))["expires_at"].get<double>(), kT0 + 70);
  at(70);
  registry_->reap();
  EXPECT_FALSE(std::filesystem::exists(lease_file("g")));
  EXPECT_FALSE(std::filesystem::exists(dir_.path() / "state" / (id + ".json")));

  create("h", 30);
  registry_->destroy_group("h");
  EXPECT_FALSE(std::filesystem::exists(lease_file("h")));
  // No directory stays behind once the node has no group.
  EXPECT_FALSE(std::filesystem::exists(dir_.path() / "state" / "groups"));
}

TEST_F(GroupsTest, ShutdownDestroysEverySandboxAndForgetsEveryGroup) {
  create("a", 30);
  create("a", 30);
  create("b", 30);
  create();
  EXPECT_EQ(registry_->destroy_all("agent shutdown"), 4u);
  EXPECT_TRUE(registry_->list_groups().empty());
  EXPECT_CODE(registry_->renew_group("a", 30), Code::kNotFound);
  EXPECT_FALSE(std::filesystem::exists(dir_.path() / "state" / "groups"));
  EXPECT_TRUE(std::filesystem::is_empty(dir_.path() / "state"));
}

TEST_F(GroupsTest, AStartAfterACrashDropsTheLeasesOfSandboxesItRemoves) {
  create("g", 30);
  ASSERT_TRUE(std::filesystem::exists(lease_file("g")));
  // A crash: the registry goes without destroying anything; the next one finds the records and the lease.
  make();
  EXPECT_EQ(registry_->remove_leftovers_of_earlier_run(), 1u);
  EXPECT_FALSE(std::filesystem::exists(lease_file("g")));
  EXPECT_CODE(registry_->renew_group("g", 10), Code::kNotFound);

  // A record the new run cannot clean up is kept, and so is its group's lease.
  create("k", 30);
  state_->fail_leftovers = true;
  make();
  EXPECT_EQ(registry_->remove_leftovers_of_earlier_run(), 0u);
  EXPECT_TRUE(std::filesystem::exists(lease_file("k")));
}

TEST_F(GroupsTest, NodeSelectorAndGpusAreCheckedOnTheNodeToo) {
  RegistryOptions options;
  options.node_labels = {{"zone", "a"}};
  options.gpus = 2;
  make(options);
  SandboxSpec s = spec();
  s.node_selector = {{"zone", "b"}};
  EXPECT_CODE_MSG(registry_->create(s), Code::kFailedPrecondition,
                  "node_selector: node 'n1' does not match: label zone=a, not zone=b");
  s.node_selector = {{"zone", "a"}};
  s.resources.gpus = 1;
  std::string first = registry_->create(s).info.id;
  registry_->create(s);
  EXPECT_EQ(registry_->load().gpus_requested, 2u);
  EXPECT_CODE_MSG(registry_->create(s), Code::kResourceExhausted, "1 gpus wanted, node 'n1' has 0 free of 2");
  registry_->destroy(first);
  registry_->create(s);
  EXPECT_CODE(registry_->create_batch(s, 2), Code::kResourceExhausted);
}

TEST_F(GroupsTest, RoutesOfGroups) {
  EXPECT_EQ(parse_target("/v1/groups").route, Route::kGroups);
  auto t = parse_target("/v1/groups/job-7");
  EXPECT_EQ(t.route, Route::kGroup);
  EXPECT_EQ(t.group_id, "job-7");
  t = parse_target("/v1/groups/job-7/renew");
  EXPECT_EQ(t.route, Route::kGroupRenew);
  EXPECT_EQ(t.group_id, "job-7");
  EXPECT_TRUE(t.sandbox_id.empty());
  for (const char* target : {"/v1/groups/g/x", "/v1/groups//renew", "/v1/groups/g/renew/x"})
    EXPECT_EQ(parse_target(target).route, Route::kUnknown) << target;
  EXPECT_EQ(route_template(Route::kGroupRenew), "/v1/groups/{id}/renew");
}

TEST_F(GroupsTest, TheHttpProtocolOfGroups) {
  auto created = call(http::verb::post, "/v1/sandboxes",
                      R"({"kind": "null", "resources": {"memory": "64Mi"}, "group": "job-7", "group_ttl": 30,
                          "count": 3})");
  ASSERT_EQ(created.status, 201) << created.body;
  EXPECT_EQ(created.body["sandboxes"][0]["group"], "job-7");

  auto got = call(http::verb::get, "/v1/groups/job-7");
  ASSERT_EQ(got.status, 200) << got.body;
  EXPECT_EQ(got.body["id"], "job-7");
  EXPECT_EQ(got.body["node"], "n1");
  EXPECT_EQ(got.body["ttl"], 30.0);
  EXPECT_EQ(got.body["expires_at"], kT0 + 30);
  EXPECT_EQ(got.body["expires_in"], 30.0);
  EXPECT_EQ(got.body["sandbox_count"], 3);
  EXPECT_EQ(got.body["sandboxes"].size(), 3u);

  at(10);
  auto renewed = call(http::verb::post, "/v1/groups/job-7/renew", R"({"ttl": 60})");
  ASSERT_EQ(renewed.status, 200) << renewed.body;
  EXPECT_EQ(renewed.body["expires_at"], kT0 + 70);
  EXPECT_EQ(renewed.body["expires_in"], 60.0);
  EXPECT_EQ(renewed.body["sandbox_count"], 3);
  EXPECT_EQ(call(http::verb::post, "/v1/groups/job-7/renew", "").status, 200);  // no body: the group's ttl

  auto listed = call(http::verb::get, "/v1/groups");
  ASSERT_EQ(listed.status, 200);
  ASSERT_EQ(listed.body["groups"].size(), 1u);
  EXPECT_FALSE(listed.body["groups"][0].contains("sandboxes"));

  auto bad = call(http::verb::post, "/v1/groups/job-7/renew", R"({"ttl": 0})");
  EXPECT_EQ(bad.status, 400);
  EXPECT_EQ(bad.body["code"], "INVALID_ARGUMENT");
  EXPECT_EQ(call(http::verb::post, "/v1/groups/job-7/renew", R"({"ttl": "30"})").status, 400);
  EXPECT_EQ(call(http::verb::post, "/v1/groups/job-7/renew", R"({"tll": 30})").status, 400);
  EXPECT_EQ(call(http::verb::post, "/v1/groups/job-7/renew", R"([30])").status, 400);
  EXPECT_EQ(call(http::verb::post, "/v1/groups/job-7/renew", "{").status, 400);
  EXPECT_EQ(call(http::verb::get, "/v1/groups/bad%20id").status, 400);
  EXPECT_EQ(call(http::verb::get, "/v1/groups/" + std::string(129, 'g')).status, 400);
  EXPECT_EQ(call(http::verb::put, "/v1/groups/job-7").status, 501);
  EXPECT_EQ(call(http::verb::get, "/v1/groups/job-7/renew").status, 501);
  EXPECT_EQ(call(http::verb::get, "/v1/groups/job-7?x=1").status, 400);
  auto missing = call(http::verb::post, "/v1/groups/nope/renew", R"({"ttl": 30})");
  EXPECT_EQ(missing.status, 404);
  EXPECT_EQ(missing.body["code"], "NOT_FOUND");
  EXPECT_EQ(call(http::verb::post, "/v1/sandboxes", R"({"kind": "null", "group": "g"})").status, 400);

  auto deleted = call(http::verb::delete_, "/v1/groups/job-7");
  ASSERT_EQ(deleted.status, 200) << deleted.body;
  EXPECT_EQ(deleted.body["destroyed"], 3);
  EXPECT_EQ(call(http::verb::delete_, "/v1/groups/job-7").status, 404);
  EXPECT_EQ(call(http::verb::get, "/v1/groups/job-7").status, 404);
  EXPECT_EQ(registry_->load().sandboxes, 0u);
}

}  // namespace
}  // namespace dsec::agent
