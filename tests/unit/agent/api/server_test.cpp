// A real agent in-process: the HTTP server on a temporary unix socket with the null backend, driven with raw HTTP.
#include <gtest/gtest.h>

#include <archive.h>
#include <archive_entry.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>

#include "agent/agent.hpp"
#include "agent/agent_test_util.hpp"
#include "common/protocol.hpp"
#include "http/http.hpp"

namespace dsec::agent {
namespace {

namespace http = boost::beast::http;
using protocol::json;
using testing::FakeImages;
using testing::ScratchDir;

// One client connection, speaking raw HTTP/1.1 bytes and reading answers with Beast's parser.
class Conn {
 public:
  explicit Conn(const std::filesystem::path& socket_path) {
    fd_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket_path.c_str(), sizeof addr.sun_path - 1);
    if (::connect(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
      throw std::runtime_error(std::string("connect: ") + std::strerror(errno));
    timeval tv{10, 0};
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  }

  void send(std::string_view raw) {
    while (!raw.empty()) {
      ssize_t n = ::send(fd_.get(), raw.data(), raw.size(), MSG_NOSIGNAL);
      if (n < 0) throw std::runtime_error(std::string("send: ") + std::strerror(errno));
      raw.remove_prefix(static_cast<std::size_t>(n));
    }
  }

  HttpResponse read() {
    FdStream stream(fd_.get());
    http::response_parser<http::string_body> parser;
    parser.body_limit(1ull << 30);
    boost::system::error_code ec;
    http::read(stream, buffer_, parser, ec);
    if (ec) throw std::runtime_error("reading the answer: " + ec.message());
    return parser.release();
  }

  HttpResponse call(std::string_view method, std::string_view target, std::string_view body = {},
                    std::string_view extra_headers = {}) {
    send(fmt::format("{} {} HTTP/1.1\r\nHost: dsecd\r\nContent-Length: {}\r\n{}\r\n", method, target, body.size(),
                     extra_headers));
    send(body);
    return read();
  }

  // True when the server closed the connection (end of stream) within `wait`.
  bool closed_within(std::chrono::milliseconds wait) {
    pollfd p{fd_.get(), POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return false;
    char c;
    return ::recv(fd_.get(), &c, 1, 0) == 0;
  }

 private:
  UniqueFd fd_;
  boost::beast::flat_buffer buffer_;
};

json body_of(const HttpResponse& res) { return json::parse(res.body()); }

// Every error answer has the dsec error shape.
void expect_error(const HttpResponse& res, int status, std::string_view code, std::string_view in_message = {}) {
  EXPECT_EQ(res.result_int(), status) << res.body();
  EXPECT_EQ(std_view(res[http::field::content_type]), "application/json");
  json j = body_of(res);
  EXPECT_EQ(j.at("code"), code) << res.body();
  EXPECT_TRUE(j.at("message").is_string());
  EXPECT_TRUE(j.at("retryable").is_boolean());
  if (!in_message.empty()) {
    EXPECT_NE(j.at("message").get<std::string>().find(in_message), std::string::npos) << res.body();
  }
}

class ThrowingBackend final : public Backend {
 public:
  std::string_view kind() const override { return "broken"; }
  std::unique_ptr<BackendSandbox> create(const CreateParams&) override {
    throw std::runtime_error("the backend fell over");
  }
};

class ServerTest : public ::testing::Test {
 protected:
  void start(std::function<void(AgentConfig&)> tweak = {}) {
    AgentConfig config;
    config.node_id = "t1";
    config.unix_socket = dir_.path() / "run" / "dsecd.sock";
    config.home = dir_.path() / "home";
    config.run_dir = dir_.path() / "run";
    config.max_header_bytes = 2048;
    config.max_body_bytes = 1 << 20;
    config.reaper_interval = std::chrono::milliseconds{50};
    if (tweak) tweak(config);
    AgentParts parts;
    parts.images = std::make_unique<FakeImages>(std::set<std::string>{"busybox:latest"});
    parts.backends.emplace("null", make_null_backend());
    parts.backends.emplace("broken", std::make_unique<ThrowingBackend>());
    parts.capacity = HostCapacity{2, 8ull << 30};
    agent_ = std::make_unique<Agent>(config, std::move(parts));
    agent_->start();
  }

  Conn connect() { return Conn(agent_->config().unix_socket); }

  std::string create_sandbox(Conn& c, std::string_view spec = R"({"kind": "null"})") {
    auto res = c.call("POST", "/v1/sandboxes", spec);
    EXPECT_EQ(res.result_int(), 201) << res.body();
    return body_of(res).at("id").get<std::string>();
  }

  ScratchDir dir_;
  std::unique_ptr<Agent> agent_;
};

TEST_F(ServerTest, OneKeepAliveConnectionServesASandboxLifecycle) {
  start();
  Conn c = connect();
  auto res = c.call("GET", "/healthz");
  EXPECT_EQ(res.result_int(), 200);
  EXPECT_EQ(res.body(), "ok\n");
  EXPECT_TRUE(res.keep_alive());

  res = c.call("GET", "/v1/node");
  ASSERT_EQ(res.result_int(), 200);
  json node = body_of(res);
  EXPECT_EQ(node["id"], "t1");
  EXPECT_EQ(node["protocol"], "v1");
  EXPECT_EQ(node["backends"], json::array({"broken", "null"}));
  EXPECT_EQ(node["capacity"]["cores"], 2);
  EXPECT_EQ(node["capacity"]["memory"], 8ull << 30);
  EXPECT_GT(node["capacity"]["disk"].get<std::uint64_t>(), 0u);
  EXPECT_EQ(node["images"], json::array({"busybox:latest"}));
  EXPECT_EQ(node["cgroup_version"], "none");
  EXPECT_EQ(node["load"]["sandboxes"], 0);

  res = c.call("POST", "/v1/sandboxes",
               R"({"kind": "null", "labels": {"team": "rl"}, "resources": {"cpu": 0.5, "memory": "64Mi"}})");
  ASSERT_EQ(res.result_int(), 201) << res.body();
  json info = body_of(res);
  std::string id = info["id"];
  EXPECT_EQ(id.rfind("t1-", 0), 0u);
  EXPECT_EQ(info["state"], "running");
  EXPECT_EQ(info["image"], "busybox:latest");
  EXPECT_EQ(info["resources"]["memory"], 64ull << 20);

  res = c.call("GET", "/v1/sandboxes/" + id);
  EXPECT_EQ(res.result_int(), 200);
  EXPECT_EQ(body_of(res)["state"], "running");
  res = c.call("GET", "/v1/node");
  EXPECT_EQ(body_of(res)["load"]["sandboxes"], 1);
  EXPECT_DOUBLE_EQ(body_of(res)["load"]["cpu_requested"].get<double>(), 0.5);

  res = c.call("DELETE", "/v1/sandboxes/" + id);
  EXPECT_EQ(res.result_int(), 200);
  EXPECT_EQ(body_of(res), (json{{"id", id}, {"state", "destroyed"}}));
  res = c.call("DELETE", "/v1/sandboxes/" + id);  // idempotent
  EXPECT_EQ(res.result_int(), 200);
  res = c.call("GET", "/v1/sandboxes/" + id);
  EXPECT_EQ(body_of(res)["state"], "destroyed");
  expect_error(c.call("POST", "/v1/sandboxes/" + id + "/exec", R"({"argv": ["true"]})"), 404, "NOT_FOUND",
               "was destroyed");
}

TEST_F(ServerTest, HttpLimitsAnswerWithTheErrorShape) {
  start();
  {
    Conn c = connect();
    std::string big(4000, 'x');
    auto res = c.call("GET", "/healthz", {}, "X-Padding: " + big + "\r\n");
    expect_error(res, 431, "RESOURCE_EXHAUSTED", "header");
    EXPECT_FALSE(res.keep_alive());
    EXPECT_TRUE(c.closed_within(std::chrono::seconds{5}));
  }
  {
    Conn c = connect();
    std::string id = create_sandbox(c);
    // Only the header is sent: the agent refuses on the announced length without waiting for the body.
    c.send(fmt::format("PUT /v1/sandboxes/{}/files?path=/big HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n", id,
                       (1 << 20) + 1));
    auto res = c.read();
    expect_error(res, 413, "RESOURCE_EXHAUSTED", "body larger than 1048576 bytes");
    EXPECT_FALSE(body_of(res)["retryable"].get<bool>());
  }
  {
    Conn c = connect();
    std::string id = create_sandbox(c);
    std::string almost(1 << 20, 'z');  // exactly the limit is fine
    EXPECT_EQ(c.call("PUT", fmt::format("/v1/sandboxes/{}/files?path=/big", id), almost).result_int(), 200);
    EXPECT_EQ(c.call("GET", fmt::format("/v1/sandboxes/{}/files?path=/big", id)).body(), almost);
  }
}

TEST_F(ServerTest, MalformedRequestsGet400AndTheAgentGoesOn) {
  start();
  {
    Conn c = connect();
    c.send("THIS IS NOT HTTP\r\n\r\n");
    expect_error(c.read(), 400, "INVALID_ARGUMENT", "malformed HTTP request");
  }
  {
    Conn c = connect();
    c.send("GET /healthz HTTP/1.1\r\nContent-Length: banana\r\n\r\n");
    expect_error(c.read(), 400, "INVALID_ARGUMENT");
  }
  Conn c = connect();
  EXPECT_EQ(c.call("GET", "/healthz").result_int(), 200);
}

TEST_F(ServerTest, BadSpecsAreNamedInTheError) {
  start();
  Conn c = connect();
  expect_error(c.call("POST", "/v1/sandboxes", R"({"kind": "null", "resources": )"), 400, "INVALID_ARGUMENT",
               "not valid JSON");
  expect_error(c.call("POST", "/v1/sandboxes", R"({"kind": "null", "resources": {"memory": "lots"}})"), 400,
               "INVALID_ARGUMENT", "resources.memory: 'lots' is not a size");
  expect_error(c.call("POST", "/v1/sandboxes", R"({"kind": "null", "ttl": "soon"})"), 400, "INVALID_ARGUMENT",
               "ttl: must be a number");
  expect_error(c.call("POST", "/v1/sandboxes", R"({"kind": "firecracker"})"), 400, "INVALID_ARGUMENT",
               "kind: 'firecracker' is not served");
  expect_error(c.call("POST", "/v1/sandboxes", R"({"kind": "null", "image": "swe/django-1234"})"), 404, "NOT_FOUND",
               "swe/django-1234");
  expect_error(c.call("POST", "/v1/sandboxes", R"({"kind": "null", "count": 0})"), 400, "INVALID_ARGUMENT", "count:");
  expect_error(c.call("POST", "/v1/sandboxes", R"({"kind": "null", "count": 1025})"), 400, "INVALID_ARGUMENT",
               "count:");
  expect_error(c.call("POST", "/v1/sandboxes", R"([1, 2])"), 400, "INVALID_ARGUMENT", "spec");
  // The connection survived all of it.
  EXPECT_EQ(c.call("GET", "/healthz").result_int(), 200);
}

TEST_F(ServerTest, UnknownRoutesSandboxesAndMethods) {
  start();
  Conn c = connect();
  expect_error(c.call("GET", "/v2/sandboxes"), 404, "NOT_FOUND", "no route GET /v2/sandboxes");
  expect_error(c.call("GET", "/v1/sandboxes/t1-000000000000"), 404, "NOT_FOUND", "t1-000000000000");
  expect_error(c.call("DELETE", "/v1/sandboxes/t1-000000000000"), 404, "NOT_FOUND");
  expect_error(c.call("POST", "/v1/sandboxes/t1-000000000000/exec", R"({"argv": ["true"]})"), 404, "NOT_FOUND");
  expect_error(c.call("GET", "/v1/sandboxes/t1-000000000000/files?path=/etc/hosts"), 404, "NOT_FOUND");
  expect_error(c.call("POST", "/v1/node"), 501, "UNIMPLEMENTED", "use GET");
  expect_error(c.call("GET", "/v1/sandboxes?lable=team=rl"), 400, "INVALID_ARGUMENT", "lable");
  expect_error(c.call("GET", "/v1/sandboxes?label=team"), 400, "INVALID_ARGUMENT", "label");
  expect_error(c.call("GET", "/v1/sandboxes?label=%zz"), 400, "INVALID_ARGUMENT", "percent");
}

TEST_F(ServerTest, AnExceptionInAHandlerBecomesInternal) {
  start();
  Conn c = connect();
  expect_error(c.call("POST", "/v1/sandboxes", R"({"kind": "broken"})"), 500, "INTERNAL", "the backend fell over");
  EXPECT_EQ(c.call("GET", "/healthz").result_int(), 200);
}

std::map<std::string, std::string> tar_files(const std::string& tar) {
  std::map<std::string, std::string> out;
  archive* a = archive_read_new();
  archive_read_support_format_tar(a);
  archive_read_open_memory(a, tar.data(), tar.size());
  archive_entry* entry;
  while (archive_read_next_header(a, &entry) == ARCHIVE_OK) {
    std::string data;
    char buf[4096];
    for (la_ssize_t n; (n = archive_read_data(a, buf, sizeof buf)) > 0;) data.append(buf, static_cast<size_t>(n));
    out[archive_entry_pathname(entry)] = data;
  }
  archive_read_free(a);
  return out;
}

TEST_F(ServerTest, FilesTravelAsRawBytesAndTarStreams) {
  start();
  Conn c = connect();
  std::string id = create_sandbox(c);
  std::string files = "/v1/sandboxes/" + id + "/files";
  std::string binary("\0\x01\x02\xff\xfe\r\n\0", 8);
  auto res = c.call("PUT", files + "?path=%2Fdata%2Fx.bin&mode=0600", binary);
  ASSERT_EQ(res.result_int(), 200) << res.body();
  EXPECT_EQ(body_of(res)["bytes"], 8);

  res = c.call("GET", files + "?path=/data/x.bin");
  EXPECT_EQ(res.result_int(), 200);
  EXPECT_EQ(std_view(res[http::field::content_type]), "application/octet-stream");
  EXPECT_EQ(res.body(), binary);

  res = c.call("GET", files + "?path=/data");  // a directory comes as a tar stream
  EXPECT_EQ(std_view(res[http::field::content_type]), "application/x-tar");
  std::string tar = res.body();
  EXPECT_EQ(tar_files(tar).at("x.bin"), binary);
  EXPECT_EQ(c.call("GET", files + "?path=/data&format=tar").body(), tar);

  res = c.call("PUT", files + "?path=/copy", tar, "Content-Type: application/x-tar\r\n");
  ASSERT_EQ(res.result_int(), 200) << res.body();
  EXPECT_EQ(c.call("GET", files + "?path=/copy/x.bin").body(), binary);

  expect_error(c.call("GET", files + "?path=data/x.bin"), 400, "INVALID_ARGUMENT", "path:");
  expect_error(c.call("GET", files + "?path=/data%00x"), 400, "INVALID_ARGUMENT", "NUL");
  expect_error(c.call("GET", files), 400, "INVALID_ARGUMENT", "path: missing");
  expect_error(c.call("GET", files + "?path=/nope"), 404, "NOT_FOUND");
  expect_error(c.call("PUT", files + "?path=/f&mode=999", "x"), 400, "INVALID_ARGUMENT", "mode:");
  expect_error(c.call("GET", files + "?path=/data&format=zip"), 400, "INVALID_ARGUMENT", "format:");
}

TEST_F(ServerTest, ExecOnTheNullBackendSaysItRunsNothing) {
  start();
  Conn c = connect();
  std::string id = create_sandbox(c);
  expect_error(c.call("POST", "/v1/sandboxes/" + id + "/exec", R"({"argv": ["true"]})"), 501, "UNIMPLEMENTED",
               "the null backend runs nothing");
  expect_error(c.call("POST", "/v1/sandboxes/" + id + "/exec", R"({"argv": "true"})"), 400, "INVALID_ARGUMENT", "argv");
  // A streaming exec that fails before any output is the same plain error, and the connection goes on serving.
  expect_error(c.call("POST", "/v1/sandboxes/" + id + "/exec", R"({"argv": ["true"], "stream": true})"), 501,
               "UNIMPLEMENTED", "the null backend runs nothing");
  expect_error(c.call("POST", "/v1/sandboxes/" + id + "/exec", R"({"argv": ["true"], "stream": 1})"), 400,
               "INVALID_ARGUMENT", "stream");
  EXPECT_EQ(c.call("GET", "/healthz").result_int(), 200);
}

TEST_F(ServerTest, BatchesAndRequestIdsAreIdempotent) {
  start();
  Conn c = connect();
  auto res = c.call("POST", "/v1/sandboxes", R"({"kind": "null", "request_id": "step-1"})");
  EXPECT_EQ(res.result_int(), 201);
  std::string id = body_of(res)["id"];
  res = c.call("POST", "/v1/sandboxes", R"({"kind": "null", "request_id": "step-1"})");
  EXPECT_EQ(res.result_int(), 200);
  EXPECT_EQ(body_of(res)["id"], id);

  res = c.call("POST", "/v1/sandboxes", R"({"kind": "null", "count": 3, "request_id": "batch-9"})");
  ASSERT_EQ(res.result_int(), 201) << res.body();
  json first = body_of(res)["sandboxes"];
  ASSERT_EQ(first.size(), 3u);
  res = c.call("POST", "/v1/sandboxes", R"({"kind": "null", "count": 3, "request_id": "batch-9"})");
  EXPECT_EQ(res.result_int(), 200);
  json second = body_of(res)["sandboxes"];
  for (int i = 0; i < 3; ++i) EXPECT_EQ(first[i]["id"], second[i]["id"]);
  EXPECT_EQ(body_of(c.call("GET", "/v1/sandboxes"))["sandboxes"].size(), 4u);
}

TEST_F(ServerTest, ListFiltersOnLabelsAndTenant) {
  start();
  Conn c = connect();
  std::string a = create_sandbox(c, R"({"kind": "null", "labels": {"team": "rl", "note": "a=b"}, "tenant": "alice"})");
  std::string b = create_sandbox(c, R"({"kind": "null", "labels": {"team": "rl"}, "tenant": "bob"})");
  auto ids = [&](std::string_view target) {
    std::vector<std::string> out;
    json listed = body_of(c.call("GET", target));
    for (const auto& s : listed["sandboxes"]) out.push_back(s["id"]);
    std::sort(out.begin(), out.end());
    return out;
  };
  std::vector<std::string> both{a, b};
  std::sort(both.begin(), both.end());
  EXPECT_EQ(ids("/v1/sandboxes?label=team=rl"), both);
  EXPECT_EQ(ids("/v1/sandboxes?label=team%3Drl&tenant=alice"), std::vector<std::string>{a});
  EXPECT_EQ(ids("/v1/sandboxes?label=team=rl&label=note=a%3Db"), std::vector<std::string>{a});
  EXPECT_EQ(ids("/v1/sandboxes?tenant=carol"), std::vector<std::string>{});
}

TEST_F(ServerTest, MetricsCountRequestsAndSandboxes) {
  start();
  Conn c = connect();
  std::string id = create_sandbox(c);
  c.call("DELETE", "/v1/sandboxes/" + id);
  c.call("GET", "/nowhere");
  auto res = c.call("GET", "/metrics");
  ASSERT_EQ(res.result_int(), 200);
  EXPECT_EQ(std_view(res[http::field::content_type]).substr(0, 10), "text/plain");
  const std::string& text = res.body();
  for (const char* line :
       {"dsec_requests_total{route=\"/v1/sandboxes\",method=\"POST\",code=\"201\"} 1",
        "dsec_requests_total{route=\"/v1/sandboxes/{id}\",method=\"DELETE\",code=\"200\"} 1",
        "dsec_requests_total{route=\"unknown\",method=\"GET\",code=\"404\"} 1",
        "dsec_sandboxes_created_total{kind=\"null\"} 1", "dsec_sandboxes_destroyed_total{kind=\"null\"} 1",
        "dsec_sandboxes_live{kind=\"null\"} 0", "dsec_sandbox_create_seconds_count 1",
        "dsec_sandbox_create_seconds_bucket{le=\"+Inf\"} 1", "# TYPE dsec_exec_seconds histogram"}) {
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
  }
}

TEST_F(ServerTest, ConnectionsBeyondTheCapAreRefused) {
  start([](AgentConfig& c) { c.max_connections = 2; });
  Conn a = connect();
  Conn b = connect();
  EXPECT_EQ(a.call("GET", "/healthz").result_int(), 200);
  EXPECT_EQ(b.call("GET", "/healthz").result_int(), 200);
  Conn c = connect();
  expect_error(c.read(), 503, "UNAVAILABLE", "maximum of 2 connections");
}

TEST_F(ServerTest, IdleConnectionsAreClosed) {
  start([](AgentConfig& c) { c.idle_timeout = std::chrono::seconds{1}; });
  Conn c = connect();
  EXPECT_EQ(c.call("GET", "/healthz").result_int(), 200);
  EXPECT_TRUE(c.closed_within(std::chrono::seconds{5}));
  Conn slow = connect();
  slow.send("GET /healthz HTTP/1.1\r\n");  // and never finishes its header
  EXPECT_TRUE(slow.closed_within(std::chrono::seconds{5}));
}

TEST_F(ServerTest, ExpectContinueIsAnswered) {
  start();
  Conn c = connect();
  std::string id = create_sandbox(c);
  c.send(
      fmt::format("PUT /v1/sandboxes/{}/files?path=/e HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                  "Expect: 100-continue\r\n\r\n",
                  id));
  EXPECT_EQ(c.read().result_int(), 100);
  c.send("hello");
  EXPECT_EQ(c.read().result_int(), 200);
  EXPECT_EQ(c.call("GET", fmt::format("/v1/sandboxes/{}/files?path=/e", id)).body(), "hello");
}

TEST_F(ServerTest, StopDestroysEverySandboxAndRemovesTheSocket) {
  start();
  Conn idle = connect();
  std::string id;
  {
    Conn c = connect();
    c.call("POST", "/v1/sandboxes", R"({"kind": "null", "count": 2})");
    id = create_sandbox(c);
  }
  auto state = dir_.path() / "home" / "state" / "sandboxes";
  EXPECT_TRUE(std::filesystem::exists(state / (id + ".json")));
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(state), {}), 3);
  agent_->stop();
  EXPECT_TRUE(std::filesystem::is_empty(state));
  EXPECT_FALSE(std::filesystem::exists(agent_->config().unix_socket));
  EXPECT_EQ(agent_->metrics().destroyed("null"), 3u);
  EXPECT_TRUE(idle.closed_within(std::chrono::seconds{1}));
}

TEST_F(ServerTest, ASecondAgentCannotTakeALiveSocket) {
  start();
  AgentConfig config = agent_->config();
  config.home = dir_.path() / "home2";
  AgentParts parts;
  parts.images = std::make_unique<FakeImages>(std::set<std::string>{});
  parts.backends.emplace("null", make_null_backend());
  Agent second(config, std::move(parts));
  try {
    second.start();
    FAIL() << "two agents listen on one socket";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kAlreadyExists);
  }
  Conn c = connect();
  EXPECT_EQ(c.call("GET", "/healthz").result_int(), 200);
}

TEST_F(ServerTest, SnapshotRequestsAreCheckedAndTheNullBackendCannotSnapshot) {
  start();
  Conn c = connect();
  std::string id = create_sandbox(c);
  const std::string target = "/v1/sandboxes/" + id + "/snapshot";
  // Bad input first: each a 400 naming what is wrong, whatever the backend.
  expect_error(c.call("POST", target, "[1]"), 400, "INVALID_ARGUMENT", "JSON object");
  expect_error(c.call("POST", target, "{}"), 400, "INVALID_ARGUMENT", "name: missing");
  expect_error(c.call("POST", target, R"({"name": 7})"), 400, "INVALID_ARGUMENT", "name: must be a string");
  expect_error(c.call("POST", target, R"({"name": "a", "tag": "b"})"), 400, "INVALID_ARGUMENT", "unknown field 'tag'");
  expect_error(c.call("POST", target, R"({"name": "Bad Name!"})"), 400, "INVALID_ARGUMENT", "invalid image name");
  expect_error(c.call("POST", target, R"({"name": "snap/x:-tag"})"), 400, "INVALID_ARGUMENT", "tag");
  expect_error(c.call("POST", target, R"({"name": "snap/x:1@sha256:)" + std::string(64, 'a') + R"("})"), 400,
               "INVALID_ARGUMENT", "pins a digest");
  expect_error(c.call("POST", target, R"({"name": "snap/x", "request_id": ")" + std::string(200, 'r') + R"("})"), 400,
               "INVALID_ARGUMENT", "request_id");
  expect_error(c.call("GET", target), 501, "UNIMPLEMENTED", "POST");
  expect_error(c.call("POST", target + "?x=1", R"({"name": "snap/x"})"), 400, "INVALID_ARGUMENT", "'x'");
  // The null backend has no file system to capture: 501, and nothing is tagged in the store.
  expect_error(c.call("POST", target, R"({"name": "snap/x"})"), 501, "UNIMPLEMENTED", "null backend");
  EXPECT_FALSE(std::filesystem::exists(dir_.path() / "home" / "store" / "refs"));
  EXPECT_TRUE(!std::filesystem::exists(dir_.path() / "run" / ".snapshots") ||
              std::filesystem::is_empty(dir_.path() / "run" / ".snapshots"))
      << "no staging left";
  // Unknown and destroyed sandboxes: 404.
  expect_error(c.call("POST", "/v1/sandboxes/t1-000000000000/snapshot", R"({"name": "snap/x"})"), 404, "NOT_FOUND");
  EXPECT_EQ(c.call("DELETE", "/v1/sandboxes/" + id).result_int(), 200);
  expect_error(c.call("POST", target, R"({"name": "snap/x"})"), 404, "NOT_FOUND", "destroyed");
}

}  // namespace
}  // namespace dsec::agent
