// The sandbox registry: idempotent creates, tombstones, admission, batches, TTL, liveness and on-disk records.
#include <gtest/gtest.h>

#include <fstream>
#include <set>
#include <thread>

#include "agent/agent_test_util.hpp"
#include "agent/registry/registry.hpp"
#include "common/protocol.hpp"
#include "error_test_util.hpp"

namespace dsec::agent {
namespace {

using testing::FakeImages;
using testing::ProbeBackend;
using testing::ScratchDir;

class RegistryTest : public ::testing::Test {
 protected:
  void make(RegistryOptions options = {}) {
    options.node_id = "n1";
    if (!options.clock) options.clock = [this] { return clock_.load(); };
    registry_ =
        std::make_unique<Registry>(std::move(options), Registry::Backends{{"null", &backend_}}, images_, metrics_);
  }

  SandboxSpec spec(std::string request_id = {}) {
    SandboxSpec s;
    s.kind = "null";
    s.resources.cpu = 0.5;
    s.resources.memory_bytes = 64ull << 20;
    s.request_id = std::move(request_id);
    return s;
  }

  std::atomic<double> clock_{1'700'000'000.0};
  std::shared_ptr<ProbeBackend::State> state_ = std::make_shared<ProbeBackend::State>();
  ProbeBackend backend_{state_};
  FakeImages images_{{"busybox:latest"}};
  Metrics metrics_;
  std::unique_ptr<Registry> registry_;
};

TEST_F(RegistryTest, CreateGivesANodePrefixedIdAndRunningInfo) {
  make();
  auto out = registry_->create(spec());
  EXPECT_TRUE(out.created);
  EXPECT_EQ(out.info.state, "running");
  EXPECT_EQ(out.info.node, "n1");
  EXPECT_EQ(out.info.image, "busybox:latest");
  EXPECT_EQ(out.info.kind, "null");
  ASSERT_EQ(out.info.id.size(), 3u + 12u);
  EXPECT_EQ(out.info.id.substr(0, 3), "n1-");
  EXPECT_EQ(out.info.id.find_first_not_of("0123456789abcdef", 3), std::string::npos) << out.info.id;
  EXPECT_DOUBLE_EQ(out.info.expires_at, out.info.created_at + 3600);
  EXPECT_EQ(registry_->get(out.info.id).state, "running");
  EXPECT_EQ(metrics_.created("null"), 1u);
}

TEST_F(RegistryTest, ConcurrentCreatesWithOneRequestIdMakeOneSandbox) {
  make();
  state_->create_delay_ms = 150;  // every duplicate arrives while the first is still being made
  constexpr int kThreads = 8;
  std::vector<CreateOutcome> outcomes(kThreads);
  std::vector<std::thread> threads;
  for (int i = 0; i < kThreads; ++i)
    threads.emplace_back([&, i] { outcomes[i] = registry_->create(spec("train-step-7")); });
  for (auto& t : threads) t.join();
  EXPECT_EQ(state_->creates.load(), 1);
  int created = 0;
  for (const auto& o : outcomes) {
    EXPECT_EQ(o.info.id, outcomes[0].info.id);
    created += o.created ? 1 : 0;
  }
  EXPECT_EQ(created, 1);
  EXPECT_EQ(registry_->load().sandboxes, 1u);

  // Later repeats also answer with it, without a second create.
  auto again = registry_->create(spec("train-step-7"));
  EXPECT_FALSE(again.created);
  EXPECT_EQ(again.info.id, outcomes[0].info.id);
  EXPECT_EQ(state_->creates.load(), 1);
}

TEST_F(RegistryTest, ARequestIdReusedForAnotherSpecIsRefused) {
  make();
  registry_->create(spec("r1"));
  SandboxSpec other = spec("r1");
  other.resources.cpu = 2;
  std::optional<Error> e = dsec::test::thrown([&] { registry_->create(other); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), Code::kInvalidArgument);
  EXPECT_EQ(std::string(e->what()).rfind("request_id: ", 0), 0u) << e->what();
}

TEST_F(RegistryTest, AFailedCreateIsNotRememberedUnderItsRequestId) {
  make();
  state_->fail_at = 1;
  EXPECT_CODE(registry_->create(spec("r1")), Code::kInternal);
  auto out = registry_->create(spec("r1"));
  EXPECT_TRUE(out.created);
  EXPECT_EQ(state_->creates.load(), 2);
}

TEST_F(RegistryTest, WaitersOnAFailingCreateGetItsError) {
  make();
  state_->fail_at = 1;
  state_->create_delay_ms = 150;
  std::atomic<int> internal{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i)
    threads.emplace_back([&] {
      if (dsec::test::code_of([&] { registry_->create(spec("r1")); }) == Code::kInternal) ++internal;
    });
  for (auto& t : threads) t.join();
  // The first create failed and every duplicate that waited for it got its error (all four, unless a thread was
  // so late that it started after the failure: then it made the one sandbox, and any later one replayed it).
  EXPECT_GE(internal.load(), 1);
  const bool all_waited = internal.load() == 4;
  EXPECT_EQ(registry_->load().sandboxes, all_waited ? 0u : 1u);
  EXPECT_EQ(state_->creates.load(), all_waited ? 1 : 2);
}

TEST_F(RegistryTest, DestroyIsIdempotentThroughTombstones) {
  make();
  std::string id = registry_->create(spec()).info.id;
  auto first = registry_->destroy(id);
  EXPECT_EQ(first.state, "destroyed");
  EXPECT_EQ(registry_->destroy(id).state, "destroyed");
  EXPECT_EQ(registry_->get(id).state, "destroyed");
  EXPECT_CODE_MSG(registry_->acquire(id), Code::kNotFound, "was destroyed");
  EXPECT_CODE(registry_->destroy("n1-000000000000"), Code::kNotFound);
  EXPECT_CODE(registry_->get("n1-000000000000"), Code::kNotFound);
  EXPECT_EQ(metrics_.destroyed("null"), 1u);
  EXPECT_EQ(registry_->load().sandboxes, 0u);
}

TEST_F(RegistryTest, TombstonesAreBoundedInCountAndTime) {
  RegistryOptions options;
  options.max_tombstones = 2;
  options.tombstone_retention = std::chrono::seconds{60};
  make(std::move(options));
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(registry_->create(spec()).info.id);
  for (const auto& id : ids) registry_->destroy(id);
  EXPECT_CODE(registry_->destroy(ids[0]), Code::kNotFound);  // the oldest went beyond 2
  EXPECT_EQ(registry_->destroy(ids[1]).state, "destroyed");
  EXPECT_EQ(registry_->destroy(ids[2]).state, "destroyed");
  clock_ = clock_.load() + 61;
  registry_->reap();
  EXPECT_CODE(registry_->destroy(ids[2]), Code::kNotFound);
}

TEST_F(RegistryTest, RequestIdsAreForgottenAfterTheirRetention) {
  RegistryOptions options;
  options.request_id_retention = std::chrono::seconds{3600};
  make(std::move(options));
  auto first = registry_->create(spec("r1"));
  clock_ = clock_.load() + 1800;
  EXPECT_EQ(registry_->create(spec("r1")).info.id, first.info.id);
  clock_ = clock_.load() + 1801;
  registry_->reap();
  auto later = registry_->create(spec("r1"));
  EXPECT_TRUE(later.created);
  EXPECT_NE(later.info.id, first.info.id);
}

TEST_F(RegistryTest, AReplayOfADestroyedSandboxSaysDestroyed) {
  make();
  auto first = registry_->create(spec("r1"));
  registry_->destroy(first.info.id);
  auto again = registry_->create(spec("r1"));
  EXPECT_FALSE(again.created);
  EXPECT_EQ(again.info.id, first.info.id);
  EXPECT_EQ(again.info.state, "destroyed");
}

TEST_F(RegistryTest, AdmissionRefusesBeyondCpuAndMemoryWithOvercommit) {
  RegistryOptions options;
  options.cores = 2;
  options.cpu_overcommit = 1.5;  // 3 cores
  options.memory_bytes = 1ull << 30;
  options.memory_overcommit = 1.0;  // 1 GiB
  make(std::move(options));
  SandboxSpec s = spec();
  s.resources.cpu = 1;
  s.resources.memory_bytes = 200ull << 20;
  std::vector<std::string> ids;
  for (int i = 0; i < 3; ++i) ids.push_back(registry_->create(s).info.id);
  try {
    registry_->create(s);
    FAIL() << "a fourth core was admitted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kResourceExhausted);
    EXPECT_TRUE(e.retryable());
    EXPECT_NE(std::string(e.what()).find("cpu"), std::string::npos) << e.what();
  }
  registry_->destroy(ids[0]);
  ids.push_back(registry_->create(s).info.id);  // room again
  registry_->destroy(ids[1]);                   // 2 cores and 400Mi live

  SandboxSpec big = spec();
  big.resources.cpu = 0.1;
  big.resources.memory_bytes = 700ull << 20;  // 400Mi + 700Mi > 1Gi
  EXPECT_CODE_MSG(registry_->create(big), Code::kResourceExhausted, "memory");
  big.resources.memory_bytes = 624ull << 20;  // exactly 1Gi fits
  EXPECT_TRUE(registry_->create(big).created);
  EXPECT_EQ(state_->creates.load(), 5);  // refusals never reached the backend
  auto load = registry_->load();
  EXPECT_EQ(load.sandboxes, 3u);
  EXPECT_NEAR(load.cpu_requested, 2.1, 1e-9);
  EXPECT_EQ(load.memory_requested, 1ull << 30);
}

TEST_F(RegistryTest, ARequestNoEmptyNodeCouldGrantIsNotRetryable) {
  RegistryOptions options;
  options.cores = 2;
  options.cpu_overcommit = 1.5;
  options.memory_bytes = 1ull << 30;
  options.memory_overcommit = 1.0;
  make(std::move(options));
  for (auto [cpu, memory] : {std::pair{4.0, 64ull << 20}, std::pair{0.5, 2ull << 30}, std::pair{0.1, 16ull << 40}}) {
    SandboxSpec s = spec();
    s.resources.cpu = cpu;
    s.resources.memory_bytes = memory;
    try {
      registry_->create(s);
      FAIL() << "admitted " << cpu << " cpu, " << memory << " bytes";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Code::kResourceExhausted);
      EXPECT_FALSE(e.retryable()) << e.what();
      EXPECT_NE(std::string(e.what()).find("could never fit"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(state_->creates.load(), 0);
}

TEST_F(RegistryTest, AdmissionCountsCreatesInFlight) {
  RegistryOptions options;
  options.cores = 1;
  options.cpu_overcommit = 1;
  make(std::move(options));
  state_->create_delay_ms = 200;
  SandboxSpec s = spec();
  s.resources.cpu = 1;
  std::atomic<int> ok{0}, exhausted{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 3; ++i)
    threads.emplace_back([&] {
      Code c = dsec::test::code_of([&] { registry_->create(s); });
      if (c == Code::kOk) ++ok;
      if (c == Code::kResourceExhausted) ++exhausted;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 1);
  EXPECT_EQ(exhausted.load(), 2);
}

TEST_F(RegistryTest, UnknownKindAndMissingImageAreNamed) {
  make();
  SandboxSpec s = spec();
  s.kind = "microvm";
  std::optional<Error> e = dsec::test::thrown([&] { registry_->create(s); });
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code(), Code::kInvalidArgument);
  EXPECT_EQ(std::string(e->what()).rfind("kind: 'microvm'", 0), 0u) << e->what();
  EXPECT_NE(std::string(e->what()).find("null"), std::string::npos) << e->what();  // says what the node serves

  s = spec();
  s.image = "swe/django-1234";
  EXPECT_CODE_MSG(registry_->create(s), Code::kNotFound, "swe/django-1234");
  EXPECT_EQ(state_->creates.load(), 0);
  // A failed create gives its reservation back.
  RegistryOptions tight;
  tight.cores = 1;
  tight.cpu_overcommit = 1;
  make(std::move(tight));
  s.resources.cpu = 1;
  for (int i = 0; i < 3; ++i) EXPECT_CODE(registry_->create(s), Code::kNotFound);
  s.image = "busybox";
  EXPECT_TRUE(registry_->create(s).created);
}

TEST_F(RegistryTest, BatchesUseIndexedRequestIds) {
  make();
  auto batch = registry_->create_batch(spec("job"), 5);
  ASSERT_EQ(batch.size(), 5u);
  std::set<std::string> ids;
  for (const auto& o : batch) {
    EXPECT_TRUE(o.created);
    ids.insert(o.info.id);
  }
  EXPECT_EQ(ids.size(), 5u);
  EXPECT_EQ(registry_->create(spec("job/3")).info.id, batch[3].info.id);
  auto again = registry_->create_batch(spec("job"), 5);
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_FALSE(again[i].created);
    EXPECT_EQ(again[i].info.id, batch[i].info.id);
  }
  EXPECT_EQ(state_->creates.load(), 5);
}

TEST_F(RegistryTest, ABatchIsAllOrNothing) {
  make();
  state_->fail_at = 4;
  EXPECT_CODE(registry_->create_batch(spec("job"), 6), Code::kInternal);
  EXPECT_EQ(registry_->load().sandboxes, 0u);
  EXPECT_TRUE(registry_->list({}, {}).empty());
  // The request ids of the rolled-back elements are forgotten: a retry makes fresh sandboxes.
  state_->fail_at = 0;
  auto batch = registry_->create_batch(spec("job"), 6);
  for (const auto& o : batch) {
    EXPECT_TRUE(o.created);
    EXPECT_EQ(o.info.state, "running");
  }
  EXPECT_EQ(registry_->load().sandboxes, 6u);
}

TEST_F(RegistryTest, ABatchThatCannotFitIsRefusedBeforeAnyCreate) {
  RegistryOptions options;
  options.cores = 2;
  options.cpu_overcommit = 1;
  make(std::move(options));
  SandboxSpec s = spec();
  s.resources.cpu = 1;
  EXPECT_CODE(registry_->create_batch(s, 3), Code::kResourceExhausted);
  EXPECT_EQ(state_->creates.load(), 0);
  EXPECT_EQ(registry_->create_batch(s, 2).size(), 2u);
}

TEST_F(RegistryTest, ListFiltersOnEveryLabelAndTenant) {
  make();
  SandboxSpec a = spec();
  a.labels = {{"team", "rl"}, {"size", "big"}};
  a.tenant = "alice";
  SandboxSpec b = spec();
  b.labels = {{"team", "rl"}};
  b.tenant = "bob";
  std::string ida = registry_->create(a).info.id;
  std::string idb = registry_->create(b).info.id;
  EXPECT_EQ(registry_->list({}, {}).size(), 2u);
  EXPECT_EQ(registry_->list({{"team", "rl"}}, {}).size(), 2u);
  auto big = registry_->list({{"team", "rl"}, {"size", "big"}}, {});
  ASSERT_EQ(big.size(), 1u);
  EXPECT_EQ(big[0].id, ida);
  auto bobs = registry_->list({}, "bob");
  ASSERT_EQ(bobs.size(), 1u);
  EXPECT_EQ(bobs[0].id, idb);
  EXPECT_TRUE(registry_->list({{"team", "sft"}}, {}).empty());
}

TEST_F(RegistryTest, TheReaperDestroysExpiredSandboxes) {
  make();
  SandboxSpec s = spec();
  s.ttl = std::chrono::seconds{10};
  std::string id = registry_->create(s).info.id;
  SandboxSpec forever = spec();
  forever.ttl = std::chrono::seconds{0};
  std::string keep = registry_->create(forever).info.id;
  EXPECT_EQ(registry_->get(keep).expires_at, 0);
  clock_ = clock_.load() + 5;
  registry_->reap();
  EXPECT_EQ(registry_->get(id).state, "running");
  clock_ = clock_.load() + 6;
  registry_->reap();
  auto info = registry_->get(id);
  EXPECT_EQ(info.state, "destroyed");
  EXPECT_EQ(info.message, "ttl expired");
  clock_ = clock_.load() + 86400 * 30;
  registry_->reap();
  EXPECT_EQ(registry_->get(keep).state, "running");
}

TEST_F(RegistryTest, ADeadSandboxTurnsFailed) {
  make();
  std::string id = registry_->create(spec()).info.id;
  state_->alive = false;
  auto info = registry_->get(id);
  EXPECT_EQ(info.state, "failed");
  EXPECT_FALSE(info.message.empty());
  EXPECT_EQ(registry_->load().sandboxes, 1u);  // still holds its resources until destroyed
  EXPECT_EQ(registry_->destroy(id).state, "destroyed");

  state_->alive = true;
  std::string id2 = registry_->create(spec()).info.id;
  state_->alive = false;
  registry_->reap();
  EXPECT_EQ(registry_->list({}, {}).at(0).state, "failed");
  EXPECT_EQ(registry_->list({}, {}).at(0).id, id2);
}

TEST_F(RegistryTest, AHandleOutlivesADestroy) {
  make();
  std::string id = registry_->create(spec()).info.id;
  SandboxHandle handle = registry_->acquire(id);
  handle.sandbox->write_file("/a", "x", 0644);
  registry_->destroy(id);
  // The object is still there; it answers as a destroyed sandbox does.
  EXPECT_CODE(handle.sandbox->read_file("/a"), Code::kNotFound);
}

TEST_F(RegistryTest, RecordsAreWrittenAtCreateAndRemovedAtDestroy) {
  ScratchDir dir;
  RegistryOptions options;
  options.state_dir = dir.path() / "state" / "sandboxes";
  make(std::move(options));
  SandboxSpec s = spec("r9");
  s.labels = {{"k", "v"}};
  std::string id = registry_->create(s).info.id;
  auto file = dir.path() / "state" / "sandboxes" / (id + ".json");
  ASSERT_TRUE(std::filesystem::exists(file));
  std::ifstream in(file);
  auto j = protocol::json::parse(in);
  EXPECT_EQ(j["info"]["id"], id);
  EXPECT_EQ(j["info"]["state"], "running");
  EXPECT_EQ(j["spec"]["labels"]["k"], "v");
  EXPECT_EQ(j["spec"]["request_id"], "r9");
  EXPECT_EQ(j["layers"].size(), 1u);
  registry_->destroy(id);
  EXPECT_FALSE(std::filesystem::exists(file));
  // What stays is the request log, which remembers r9 for a restart (recovery_test.cpp).
  std::vector<std::string> left;
  for (const auto& e : std::filesystem::directory_iterator(dir.path() / "state" / "sandboxes"))
    left.push_back(e.path().filename().string());
  EXPECT_EQ(left, std::vector<std::string>{"requests.log"});
}

TEST_F(RegistryTest, TheRecordIsOnDiskBeforeTheBackendStartsAnything) {
  ScratchDir dir;
  RegistryOptions options;
  options.state_dir = dir.path();
  make(options);
  state_->create_delay_ms = 300;
  std::thread creator([&] { registry_->create(spec()); });
  // While the backend is still creating, an agent that died now would leave this record for the next start.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  std::vector<std::filesystem::path> records;
  while (records.empty() && std::chrono::steady_clock::now() < until) {
    for (const auto& e : std::filesystem::directory_iterator(dir.path()))
      if (e.path().extension() == ".json") records.push_back(e.path());
    if (records.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(records.size(), 1u);
  std::ifstream in(records[0]);
  auto j = protocol::json::parse(in);
  EXPECT_EQ(j["info"]["state"], "creating");
  EXPECT_EQ(j["info"]["kind"], "null");
  creator.join();
  EXPECT_EQ(state_->creates.load(), 1);

  // A create the backend refuses leaves no record behind.
  state_->create_delay_ms = 0;
  state_->fail_at = 2;
  EXPECT_CODE(registry_->create(spec()), Code::kInternal);
  std::size_t count = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) count += e.path().extension() == ".json";
  EXPECT_EQ(count, 1u);
}

TEST_F(RegistryTest, LeftoversOfAnEarlierRunAreRemovedAtStartup) {
  ScratchDir dir;
  RegistryOptions options;
  options.state_dir = dir.path();
  make(options);
  std::string first = registry_->create(spec()).info.id;
  std::string second = registry_->create(spec()).info.id;
  EXPECT_EQ(registry_->remove_leftovers_of_earlier_run(), 0u);  // its own live sandboxes are not leftovers
  EXPECT_TRUE(state_->leftovers_removed.empty());
  std::ofstream(dir.path() / "n1-half.json.tmp") << "{";
  std::ofstream(dir.path() / "notes.txt") << "not a record";

  make(options);  // a new agent on the same home, after a crash
  state_->fail_leftovers = true;
  EXPECT_EQ(registry_->remove_leftovers_of_earlier_run(), 0u);
  EXPECT_TRUE(std::filesystem::exists(dir.path() / (first + ".json")));  // kept for a later try
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "n1-half.json.tmp"));

  state_->fail_leftovers = false;
  EXPECT_EQ(registry_->remove_leftovers_of_earlier_run(), 2u);
  std::vector<std::string> removed = state_->leftovers_removed;
  std::sort(removed.begin(), removed.end());
  std::vector<std::string> expected{first, second};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removed, expected);
  EXPECT_FALSE(std::filesystem::exists(dir.path() / (first + ".json")));
  EXPECT_FALSE(std::filesystem::exists(dir.path() / (second + ".json")));
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "notes.txt"));
}

TEST_F(RegistryTest, DestroyAllEmptiesTheNode) {
  RegistryOptions options;
  options.cores = 16;
  options.memory_bytes = 16ull << 30;
  make(std::move(options));
  registry_->create_batch(spec(), 20);
  EXPECT_EQ(registry_->destroy_all("agent shutdown"), 20u);
  EXPECT_EQ(registry_->load().sandboxes, 0u);
  EXPECT_EQ(registry_->load().cpu_requested, 0);
  EXPECT_EQ(metrics_.destroyed("null"), 20u);
}

// A backend without sleep answers UNIMPLEMENTED, and nothing about the sandbox changes; wake of an awake sandbox and
// sleep of an unknown one are refused before the backend is asked.
TEST_F(RegistryTest, SleepOfABackendWithoutItChangesNothing) {
  make();
  std::string id = registry_->create(spec()).info.id;
  EXPECT_CODE(registry_->sleep(id), Code::kUnimplemented);
  EXPECT_EQ(registry_->get(id).state, "running");
  EXPECT_DOUBLE_EQ(registry_->load().cpu_requested, 0.5);
  EXPECT_CODE_MSG(registry_->wake(id), Code::kFailedPrecondition, "is running, not sleeping");
  EXPECT_CODE(registry_->sleep("n1-nope"), Code::kNotFound);
  registry_->destroy(id);
  EXPECT_CODE(registry_->sleep(id), Code::kNotFound);
  EXPECT_DOUBLE_EQ(registry_->load().cpu_requested, 0.0);
}

// A sleep or wake that repeats the request id of the sandbox's last one is answered again without asking the
// backend (a client retrying after a lost answer); a new id, or none, is a new call and fails for the state; the id
// of a sleep on a wake is a mistake.
TEST_F(RegistryTest, RetriedSleepAndWakeAreAnsweredAgain) {
  make();
  state_->can_sleep = true;
  std::string id = registry_->create(spec()).info.id;
  auto first = registry_->sleep(id, "t1-sleep");
  EXPECT_EQ(first.info.state, "sleeping");
  EXPECT_EQ(first.report.memory_after_bytes, 1u);
  auto again = registry_->sleep(id, "t1-sleep");
  EXPECT_EQ(again.info.state, "sleeping");
  EXPECT_EQ(again.report.memory_after_bytes, 1u) << "the retry was not answered with the first call's report";
  EXPECT_EQ(state_->sleeps.load(), 1) << "the retry reached the backend";
  EXPECT_DOUBLE_EQ(registry_->load().cpu_requested, 0.0);
  EXPECT_CODE_MSG(registry_->sleep(id, "t1-sleep-2"), Code::kFailedPrecondition, "already sleeping");
  EXPECT_CODE(registry_->sleep(id), Code::kFailedPrecondition);
  EXPECT_CODE_MSG(registry_->wake(id, "t1-sleep"), Code::kInvalidArgument, "was a sleep");
  EXPECT_EQ(registry_->get(id).state, "sleeping");

  EXPECT_EQ(registry_->wake(id, "t1-wake").report.memory_after_bytes, 1u);
  EXPECT_EQ(registry_->wake(id, "t1-wake").info.state, "running");
  EXPECT_EQ(state_->wakes.load(), 1);
  EXPECT_DOUBLE_EQ(registry_->load().cpu_requested, 0.5);
  // The sleep's id is no longer the last one: sleeping with it again is a new sleep.
  EXPECT_EQ(registry_->sleep(id, "t1-sleep").report.memory_after_bytes, 2u);
  EXPECT_EQ(state_->sleeps.load(), 2);
  registry_->destroy(id);
  EXPECT_CODE(registry_->sleep(id, "t1-sleep"), Code::kNotFound);
}

}  // namespace
}  // namespace dsec::agent
