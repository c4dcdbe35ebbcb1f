// An agent that restarts after a crash: the sandbox records it finds on disk, and what the registry decides for each
// (take over, mark failed, roll back a half-done create, finish a half-done destroy), with request ids, groups, TTLs
// and load carried over; the record format; the request log. The registry runs on a fake clock over the probe
// backend (the null backend, with adoption that can be told a sandbox died). "A crash" is a registry dropped without
// destroying anything, and a new one on the same state directory.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "agent/agent_test_util.hpp"
#include "agent/registry/create_ids.hpp"
#include "agent/registry/registry.hpp"
#include "common/protocol.hpp"
#include "error_test_util.hpp"

namespace dsec::agent {
namespace {

namespace fs = std::filesystem;
using protocol::json;
using testing::FakeImages;
using testing::ProbeBackend;
using testing::ScratchDir;

constexpr double kT0 = 1'700'000'000.0;

json read_json(const fs::path& path) {
  std::ifstream in(path);
  return json::parse(in);
}

void write_json(const fs::path& path, const json& j) { std::ofstream(path) << j.dump(2) << "\n"; }

class RecoveryTest : public ::testing::Test {
 protected:
  void SetUp() override { make(); }

  // A new registry on the same state directory; the old one goes without destroying anything, as in a crash.
  void make() {
    RegistryOptions options;
    options.node_id = "n1";
    options.state_dir = state_dir();
    options.cores = 4;
    options.memory_bytes = 4ull << 30;
    options.clock = [this] { return clock_.load(); };
    registry_.reset();
    registry_ =
        std::make_unique<Registry>(std::move(options), Registry::Backends{{"null", &backend_}}, images_, metrics_);
  }

  RecoveryReport restart() {
    make();
    return registry_->recover_earlier_run();
  }

  fs::path state_dir() const { return dir_.path() / "state"; }
  fs::path record_of(const std::string& id) const { return state_dir() / (id + ".json"); }

  SandboxSpec spec(std::string request_id = {}) {
    SandboxSpec s;
    s.kind = "null";
    s.resources.cpu = 0.5;
    s.resources.memory_bytes = 64ull << 20;
    s.request_id = std::move(request_id);
    return s;
  }

  std::vector<std::string> leftovers_removed() {
    std::lock_guard lock(state_->mutex);
    return state_->leftovers_removed;
  }
  bool leftovers_removed_of(const std::string& id) {
    auto v = leftovers_removed();
    return std::find(v.begin(), v.end(), id) != v.end();
  }

  // The record of `id` as an agent killed at this moment would leave it, with the state changed to `state`.
  void rewrite_state(const std::string& id, const std::string& state, const std::string& message = {}) {
    json j = read_json(record_of(id));
    j["info"]["state"] = state;
    j["info"]["message"] = message;
    write_json(record_of(id), j);
  }

  ScratchDir dir_;
  std::atomic<double> clock_{kT0};
  std::shared_ptr<ProbeBackend::State> state_ = std::make_shared<ProbeBackend::State>();
  ProbeBackend backend_{state_};
  FakeImages images_{{"busybox:latest"}};
  Metrics metrics_;
  std::unique_ptr<Registry> registry_;
};

TEST_F(RecoveryTest, TheRecordSaysWhatTheSandboxIsAndHowToTakeItOver) {
  SandboxSpec s = spec("r1");
  s.labels = {{"task", "t1"}};
  s.group = "g";
  s.group_ttl = std::chrono::seconds(30);
  std::string id = registry_->create(s, R"({"layers": []})").info.id;
  json j = read_json(record_of(id));
  EXPECT_EQ(j["version"], 2);
  EXPECT_EQ(j["info"]["state"], "running");
  EXPECT_EQ(j["info"]["group"], "g");
  EXPECT_EQ(j["info"]["labels"]["task"], "t1");
  EXPECT_EQ(j["spec"]["request_id"], "r1");
  EXPECT_EQ(j["spec"]["group_ttl"], 30);
  EXPECT_EQ(j["layers"].size(), 1u);
  EXPECT_EQ(j["image_manifest"], R"({"layers": []})");
  EXPECT_EQ(j["request_fingerprint"].get<std::string>().rfind("sha256:", 0), 0u) << j.dump();
  EXPECT_EQ(j["backend"], json({{"made_by", "probe"}}));

  // Sleeping is on disk too; a sandbox found dead says so there as well.
  state_->can_sleep = true;
  registry_->sleep(id);
  EXPECT_EQ(read_json(record_of(id))["info"]["state"], "sleeping");
  registry_->wake(id);
  state_->alive = false;
  EXPECT_EQ(registry_->get(id).state, "failed");
  EXPECT_EQ(read_json(record_of(id))["info"]["state"], "failed");
}

TEST_F(RecoveryTest, LiveSandboxesAreTakenOverAsTheyWere) {
  state_->can_sleep = true;
  SandboxSpec first = spec("r1");
  first.labels = {{"task", "t1"}};
  first.tenant = "team-a";
  first.ttl = std::chrono::seconds(600);
  SandboxInfo a = registry_->create(first).info;
  SandboxSpec grouped = spec();
  grouped.group = "g";
  grouped.group_ttl = std::chrono::seconds(30);
  SandboxInfo b = registry_->create(grouped).info;
  SandboxInfo c = registry_->create(spec()).info;
  registry_->sleep(c.id);
  const int creates = state_->creates.load();

  clock_ = kT0 + 5;
  RecoveryReport report = restart();
  EXPECT_EQ(report.adopted, 3u);
  EXPECT_EQ(report.failed + report.rolled_back + report.destroyed + report.kept + report.unreadable, 0u);
  EXPECT_TRUE(leftovers_removed().empty());

  SandboxInfo got = registry_->get(a.id);
  EXPECT_EQ(got.state, "running");
  EXPECT_EQ(got.labels, a.labels);
  EXPECT_EQ(got.tenant, "team-a");
  EXPECT_DOUBLE_EQ(got.created_at, a.created_at);
  EXPECT_DOUBLE_EQ(got.expires_at, a.expires_at);
  EXPECT_EQ(registry_->get(b.id).group, "g");
  EXPECT_EQ(registry_->get(c.id).state, "sleeping");
  EXPECT_EQ(registry_->list({{"task", "t1"}}, "").size(), 1u);

  // The backend was asked with what the records kept.
  {
    std::lock_guard lock(state_->mutex);
    ASSERT_EQ(state_->adopted.size(), 3u);
    for (const auto& p : state_->adopted) {
      EXPECT_EQ(p.state, (BackendState{{"made_by", "probe"}})) << p.id;
      EXPECT_EQ(p.sleeping, p.id == c.id) << p.id;
      EXPECT_EQ(p.image_layers.size(), 1u);
    }
  }

  // They count toward the node's load (the sleeping one's cpu does not), and work.
  NodeLoad load = registry_->load();
  EXPECT_EQ(load.sandboxes, 3u);
  EXPECT_DOUBLE_EQ(load.cpu_requested, 1.0);
  EXPECT_EQ(load.memory_requested, 3 * (64ull << 20));
  registry_->acquire(a.id).sandbox->write_file("/after", "x", 0644);
  EXPECT_EQ(registry_->acquire(a.id).sandbox->read_file("/after"), "x");
  registry_->wake(c.id);
  EXPECT_DOUBLE_EQ(registry_->load().cpu_requested, 1.5);

  // The group's lease is the one on disk: renewable, and it holds its member.
  GroupInfo group = registry_->get_group("g");
  EXPECT_DOUBLE_EQ(group.expires_at, kT0 + 30);
  ASSERT_EQ(group.sandboxes.size(), 1u);
  EXPECT_EQ(group.sandboxes[0].id, b.id);
  EXPECT_DOUBLE_EQ(registry_->renew_group("g", 60).expires_at, kT0 + 65);

  // A retried create finds the first one's sandbox.
  CreateOutcome again = registry_->create(first);
  EXPECT_FALSE(again.created);
  EXPECT_EQ(again.info.id, a.id);
  EXPECT_EQ(state_->creates.load(), creates);
  SandboxSpec other = first;
  other.resources.cpu = 2;
  EXPECT_CODE(registry_->create(other), Code::kInvalidArgument);

  // Destroying them works as for any sandbox.
  EXPECT_EQ(registry_->destroy_all("agent shutdown"), 3u);
  EXPECT_FALSE(fs::exists(record_of(a.id)));
  EXPECT_EQ(metrics_.recovered("null", "adopted"), 3u);
}

TEST_F(RecoveryTest, ASandboxThatDiedWhileTheAgentWasDownTurnsFailed) {
  std::string dead = registry_->create(spec("r-dead")).info.id;
  std::string live = registry_->create(spec()).info.id;
  {
    std::lock_guard lock(state_->mutex);
    state_->dead.insert(dead);
  }
  RecoveryReport report = restart();
  EXPECT_EQ(report.adopted, 1u);
  EXPECT_EQ(report.failed, 1u);

  SandboxInfo info = registry_->get(dead);
  EXPECT_EQ(info.state, "failed");
  EXPECT_NE(info.message.find("died while the agent was down"), std::string::npos) << info.message;
  EXPECT_NE(info.message.find("its processes are gone"), std::string::npos) << info.message;
  EXPECT_TRUE(leftovers_removed_of(dead));
  EXPECT_FALSE(leftovers_removed_of(live));
  EXPECT_EQ(read_json(record_of(dead))["info"]["state"], "failed");
  EXPECT_CODE_MSG(registry_->acquire(dead).sandbox->read_file("/x"), Code::kFailedPrecondition, "is not running");
  // It holds its resources until destroyed, like any failed sandbox; a retried create answers with it.
  EXPECT_EQ(registry_->load().sandboxes, 2u);
  EXPECT_EQ(registry_->create(spec("r-dead")).info.id, dead);
  EXPECT_EQ(metrics_.recovered("null", "failed"), 1u);

  // Another restart keeps it failed without asking the backend to adopt it again.
  std::size_t adopts_before;
  {
    std::lock_guard lock(state_->mutex);
    adopts_before = state_->adopted.size();
  }
  report = restart();
  EXPECT_EQ(report.failed, 1u);
  EXPECT_EQ(registry_->get(dead).message, info.message);
  {
    std::lock_guard lock(state_->mutex);
    EXPECT_EQ(state_->adopted.size(), adopts_before + 1);  // only the live one
  }
  registry_->destroy(dead);
  EXPECT_FALSE(fs::exists(record_of(dead)));
  EXPECT_EQ(registry_->get(dead).state, "destroyed");
}

// The record of a create the agent was killed in: written before the backend started anything, never updated.
TEST_F(RecoveryTest, ACreateCutShortIsRolledBackAndItsRequestIdForgotten) {
  state_->create_delay_ms = 300;
  std::thread creator([&] { registry_->create(spec("r-half")); });
  fs::path snapshot = dir_.path() / "at-the-kill";
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::string half;
  while (half.empty() && std::chrono::steady_clock::now() < until) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(state_dir(), ec))
      if (e.path().extension() == ".json") half = e.path().stem().string();
    if (half.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_FALSE(half.empty());
  fs::copy_file(record_of(half), snapshot);
  creator.join();
  state_->create_delay_ms = 0;
  // The disk as the kill left it: that record, no request log line.
  registry_.reset();
  fs::remove_all(state_dir());
  fs::create_directories(state_dir());
  fs::copy_file(snapshot, record_of(half));
  EXPECT_EQ(read_json(record_of(half))["info"]["state"], "creating");

  RecoveryReport report = restart();
  EXPECT_EQ(report.rolled_back, 1u);
  EXPECT_EQ(report.adopted, 0u);
  EXPECT_TRUE(leftovers_removed_of(half));
  EXPECT_FALSE(fs::exists(record_of(half)));
  EXPECT_CODE(registry_->get(half), Code::kNotFound);
  EXPECT_EQ(registry_->load().sandboxes, 0u);
  // The create never answered: repeating it makes a sandbox.
  CreateOutcome retried = registry_->create(spec("r-half"));
  EXPECT_TRUE(retried.created);
  EXPECT_NE(retried.info.id, half);
}

// A destroy renames the record to <id>.destroying before the backend starts on it; the agent killed then leaves it.
TEST_F(RecoveryTest, ADestroyCutShortIsFinished) {
  std::string id = registry_->create(spec("r-gone")).info.id;
  fs::rename(record_of(id), state_dir() / (id + ".destroying"));
  RecoveryReport report = restart();
  EXPECT_EQ(report.destroyed, 1u);
  EXPECT_TRUE(leftovers_removed_of(id));
  EXPECT_FALSE(fs::exists(record_of(id)));
  EXPECT_FALSE(fs::exists(state_dir() / (id + ".destroying")));
  SandboxInfo info = registry_->get(id);
  EXPECT_EQ(info.state, "destroyed");
  EXPECT_NE(info.message.find("cut short"), std::string::npos) << info.message;
  EXPECT_EQ(registry_->load().sandboxes, 0u);
  CreateOutcome again = registry_->create(spec("r-gone"));
  EXPECT_FALSE(again.created);
  EXPECT_EQ(again.info.id, id);
  EXPECT_EQ(again.info.state, "destroyed");
}

TEST_F(RecoveryTest, RequestIdsOfFinishedCreatesSurviveRestarts) {
  std::string destroyed = registry_->create(spec("r-destroyed")).info.id;
  registry_->destroy(destroyed);
  std::string live = registry_->create(spec("r-live")).info.id;
  // A batch that failed is not remembered, also after a restart.
  state_->fail_at = state_->creates.load() + 2;
  SandboxSpec batch = spec("job");
  EXPECT_CODE(registry_->create_batch(batch, 3), Code::kInternal);
  state_->fail_at = 0;
  clock_ = kT0 + 10;

  RecoveryReport report = restart();
  const int creates = state_->creates.load();
  EXPECT_GE(report.request_ids, 2u);
  CreateOutcome a = registry_->create(spec("r-destroyed"));
  EXPECT_FALSE(a.created);
  EXPECT_EQ(a.info.id, destroyed);
  EXPECT_EQ(a.info.state, "destroyed");
  CreateOutcome b = registry_->create(spec("r-live"));
  EXPECT_FALSE(b.created);
  EXPECT_EQ(b.info.id, live);
  EXPECT_EQ(state_->creates.load(), creates);
  SandboxSpec other = spec("r-destroyed");
  other.resources.memory_bytes = 128ull << 20;
  EXPECT_CODE(registry_->create(other), Code::kInvalidArgument);
  auto retried = registry_->create_batch(batch, 3);
  for (const auto& r : retried) EXPECT_TRUE(r.created);

  // A second restart still knows them; one past the retention (an hour) does not.
  restart();
  EXPECT_FALSE(registry_->create(spec("r-destroyed")).created);
  clock_ = kT0 + 3600 + 20;
  restart();
  EXPECT_TRUE(registry_->create(spec("r-destroyed")).created);
}

TEST_F(RecoveryTest, LeasesAndTtlsThatRanOutWhileTheAgentWasDownApplyAtOnce) {
  SandboxSpec grouped = spec();
  grouped.group = "g";
  grouped.group_ttl = std::chrono::seconds(30);
  std::string in_group = registry_->create(grouped).info.id;
  SandboxSpec short_lived = spec();
  short_lived.ttl = std::chrono::seconds(20);
  std::string expiring = registry_->create(short_lived).info.id;
  std::string keeper = registry_->create(spec()).info.id;

  clock_ = kT0 + 60;
  EXPECT_EQ(restart().adopted, 3u);
  registry_->reap();
  EXPECT_EQ(registry_->get(in_group).state, "destroyed");
  EXPECT_EQ(registry_->get(in_group).message, "group 'g' lease expired");
  EXPECT_EQ(registry_->get(expiring).message, "ttl expired");
  EXPECT_EQ(registry_->get(keeper).state, "running");
  EXPECT_CODE(registry_->renew_group("g", 30), Code::kNotFound);
  EXPECT_FALSE(fs::exists(state_dir() / "groups" / "g.json"));
}

TEST_F(RecoveryTest, AGroupWhoseSandboxesAreAllGoneLosesItsLease) {
  SandboxSpec grouped = spec();
  grouped.group = "g";
  grouped.group_ttl = std::chrono::seconds(30);
  std::string id = registry_->create(grouped).info.id;
  rewrite_state(id, "creating");  // as if its create had been cut short
  EXPECT_EQ(restart().rolled_back, 1u);
  EXPECT_FALSE(fs::exists(state_dir() / "groups" / "g.json"));
  EXPECT_CODE(registry_->get_group("g"), Code::kNotFound);
}

TEST_F(RecoveryTest, RecordsOfOtherKindsAreKeptAndUnreadableOnesCleanedUp) {
  std::string id = registry_->create(spec()).info.id;
  json j = read_json(record_of(id));
  j["info"]["id"] = "n1-0000000000aa";
  j["info"]["kind"] = "microvm";
  write_json(record_of("n1-0000000000aa"), j);
  std::ofstream(record_of("n1-0000000000bb")) << "{\"info\": ";
  std::ofstream(state_dir() / "notes.txt") << "not a record";

  RecoveryReport report = restart();
  EXPECT_EQ(report.adopted, 1u);
  EXPECT_EQ(report.kept, 1u);
  EXPECT_EQ(report.unreadable, 1u);
  EXPECT_TRUE(fs::exists(record_of("n1-0000000000aa")));
  EXPECT_FALSE(fs::exists(record_of("n1-0000000000bb")));
  EXPECT_TRUE(leftovers_removed_of("n1-0000000000bb"));
  EXPECT_FALSE(leftovers_removed_of("n1-0000000000aa"));
  EXPECT_TRUE(fs::exists(state_dir() / "notes.txt"));
  EXPECT_CODE(registry_->get("n1-0000000000aa"), Code::kNotFound);
}

TEST_F(RecoveryTest, RemoveModeDestroysEverythingAnEarlierRunLeft) {
  std::string a = registry_->create(spec("r-a")).info.id;
  std::string b = registry_->create(spec()).info.id;
  make();
  EXPECT_EQ(registry_->remove_leftovers_of_earlier_run(), 2u);
  EXPECT_TRUE(leftovers_removed_of(a));
  EXPECT_TRUE(leftovers_removed_of(b));
  EXPECT_EQ(registry_->get(a).state, "destroyed");
  EXPECT_EQ(registry_->load().sandboxes, 0u);
  EXPECT_EQ(registry_->create(spec("r-a")).info.id, a);  // still not made twice
}

TEST_F(RecoveryTest, ACleanShutdownLeavesAnEmptyStateDirectory) {
  registry_->create(spec("r1"));
  registry_->create(spec());
  EXPECT_TRUE(fs::exists(state_dir() / "requests.log"));
  registry_->destroy_all("agent shutdown");
  registry_->forget_requests();
  EXPECT_TRUE(fs::is_empty(state_dir()));
  EXPECT_EQ(restart().request_ids, 0u);
  EXPECT_TRUE(registry_->create(spec("r1")).created);
}

TEST(CreateIdsTest, AppendsForgetsAndRewrites) {
  ScratchDir dir;
  const fs::path path = dir.path() / "requests.log";
  {
    CreateIds log(path);
    EXPECT_TRUE(log.load().empty());
    log.append({"a", "n1-1", "sha256:1", 1.0});
    log.append({"b", "n1-2", "sha256:2", 2.0});
    log.append({"c", "n1-3", "sha256:3", 3.0});
    log.forget("b", "n1-2");
    log.forget("c", "n1-other");                 // another sandbox's: no effect
    log.append({"a", "n1-4", "sha256:4", 4.0});  // reused since: the later one counts
    EXPECT_EQ(log.appended(), 6u);
  }
  // A line cut short (a full disk) is skipped.
  std::ofstream(path, std::ios::app) << "{\"request_id\": \"d\", \"sand";
  CreateIds log(path);
  auto entries = log.load();
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].request_id, "c");
  EXPECT_EQ(entries[1].request_id, "a");
  EXPECT_EQ(entries[1].sandbox_id, "n1-4");
  EXPECT_EQ(entries[1].fingerprint, "sha256:4");
  EXPECT_DOUBLE_EQ(entries[1].at, 4.0);

  log.rewrite([&] { return std::vector<CreateIds::Entry>{entries[1]}; });
  EXPECT_EQ(log.appended(), 0u);
  log.append({"e", "n1-5", "sha256:5", 5.0});
  entries = log.load();
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].request_id, "a");
  EXPECT_EQ(entries[1].request_id, "e");
  EXPECT_FALSE(fs::exists(dir.path() / "requests.log.tmp"));
  log.rewrite([] { return std::vector<CreateIds::Entry>{}; });  // nothing to remember: no file
  EXPECT_FALSE(fs::exists(path));
  log.append({"f", "n1-6", "sha256:6", 6.0});
  ASSERT_EQ(log.load().size(), 1u);
  log.remove();
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(log.load().empty());
}

}  // namespace
}  // namespace dsec::agent
