// The request table both client engines send (client/requests.hpp): methods, targets and bodies as the agent's
// routes expect them, arguments refused before a round trip, and exec's checks the same as the agent's decoder.
#include <gtest/gtest.h>

#include <string>

#include "client/requests.hpp"
#include "common/protocol.hpp"
#include "error_test_util.hpp"

namespace dsec::detail {
namespace {

using protocol::json;

ExecRequest shell(std::string command) {
  ExecRequest r;
  r.shell = std::move(command);
  return r;
}

// What the client refuses and what the agent's decoder refuses are the same execs.
bool agent_refuses(const ExecRequest& r) {
  try {
    protocol::decode_exec_request(protocol::encode(r));
    return false;
  } catch (const Error&) {
    return true;
  }
}

bool client_refuses(const ExecRequest& r) {
  try {
    protocol::validate(r);
    return false;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInvalidArgument);
    return true;
  }
}

TEST(ClientRequests, ExecValidationMatchesTheAgentsDecoder) {
  std::vector<ExecRequest> cases;
  cases.push_back(shell("true"));
  cases.push_back(ExecRequest{});  // neither argv nor shell
  ExecRequest argv;
  argv.argv = {"/bin/echo", "hi"};
  cases.push_back(argv);
  ExecRequest both = argv;  // a shell wins: argv is not sent
  both.shell = "true";
  cases.push_back(both);
  ExecRequest empty_argv0;
  empty_argv0.argv = {""};
  cases.push_back(empty_argv0);
  ExecRequest nul_arg;
  nul_arg.argv = {"/bin/echo", std::string("a\0b", 3)};
  cases.push_back(nul_arg);
  cases.push_back(shell(std::string("a\0b", 3)));
  ExecRequest bad_env = shell("true");
  bad_env.env["A=B"] = "x";
  cases.push_back(bad_env);
  ExecRequest relative_cwd = shell("true");
  relative_cwd.cwd = "tmp";
  cases.push_back(relative_cwd);
  for (double timeout : {0.0, -1.0, 604800.0, 604801.0}) {
    ExecRequest t = shell("true");
    t.timeout_seconds = timeout;
    cases.push_back(t);
  }
  ExecRequest big_output = shell("true");
  big_output.max_output_bytes = (1ull << 30) + 1;
  cases.push_back(big_output);
  for (std::string user : {"root", "1000:1000", "-bad", "70000"}) {
    ExecRequest u = shell("true");
    u.user = user;
    cases.push_back(u);
  }
  ExecRequest long_id = shell("true");
  long_id.request_id = std::string(129, 'x');
  cases.push_back(long_id);
  for (std::size_t i = 0; i < cases.size(); ++i)
    EXPECT_EQ(client_refuses(cases[i]), agent_refuses(cases[i])) << "case " << i;
}

TEST(ClientRequests, ExecCarriesItsRequestIdAndTimeout) {
  ExecRequest r = shell("echo hi");
  r.timeout_seconds = 2.5;
  SandboxRequest sent = requests::exec("sb-1", r, false);
  EXPECT_EQ(sent.method, "POST");
  EXPECT_EQ(sent.target, "/v1/sandboxes/sb-1/exec");
  EXPECT_EQ(sent.content_type, kJson);
  EXPECT_EQ(sent.how.extra.count(), 2500);
  EXPECT_FALSE(sent.how.request_id.empty());
  json body = json::parse(sent.body);
  EXPECT_EQ(body.at("request_id"), sent.how.request_id);
  EXPECT_FALSE(body.contains("stream"));
  EXPECT_EQ(protocol::decode_exec_request(body).shell, "echo hi");

  r.request_id = "mine";
  SandboxRequest streamed = requests::exec("sb-1", r, true);
  EXPECT_EQ(streamed.how.request_id, "mine");
  EXPECT_EQ(json::parse(streamed.body).at("stream"), true);
  // The agent reads the flag with the same codec.
  EXPECT_TRUE(protocol::exec_streams(json::parse(streamed.body)));
  EXPECT_FALSE(protocol::exec_streams(body));
  EXPECT_FALSE(protocol::exec_streams(json{{"stream", nullptr}}));
  EXPECT_CODE_MSG(protocol::exec_streams(json{{"stream", "yes"}}), Code::kInvalidArgument,
                  "stream: must be true or false");
  EXPECT_CODE(requests::exec("sb-1", ExecRequest{}, false), Code::kInvalidArgument);
}

TEST(ClientRequests, TargetsAreEscaped) {
  EXPECT_EQ(requests::read_file("sb-1", "/tmp/x y").target, "/v1/sandboxes/sb-1/files?path=%2Ftmp%2Fx%20y");
  EXPECT_EQ(requests::session_info("sb-1", "a b").target, "/v1/sandboxes/sb-1/sessions/a%20b");
  EXPECT_EQ(requests::write_file("sb-1", "/x", "data", 0755).target, "/v1/sandboxes/sb-1/files?path=%2Fx&mode=0755");
  EXPECT_EQ(requests::write_file("sb-1", "/x", "data", 0755).payload(), "data");
  EXPECT_EQ(requests::process_output("sb-1", 7, 0, std::nullopt, 1.5, 100).target,
            "/v1/sandboxes/sb-1/processes/7/output?stdout=0&wait=1.5&max=100");
  EXPECT_EQ(requests::unexpose("sb-1", 8080).target, "/v1/sandboxes/sb-1/ports?port=8080");
}

TEST(ClientRequests, HowEachCallMayBeRepeated) {
  EXPECT_TRUE(requests::info("sb-1").how.repeatable);
  EXPECT_FALSE(requests::open_session("sb-1", SessionOptions{}).how.repeatable);
  EXPECT_FALSE(requests::expose("sb-1", 80).how.repeatable);
  EXPECT_FALSE(requests::spawn("sb-1",
                               [] {
                                 ProcessRequest p;
                                 p.shell = "sleep 1";
                                 return p;
                               }())
                   .how.request_id.empty());
  SandboxRequest sleep = requests::sleep_or_wake("sb-1", true);
  EXPECT_TRUE(sleep.how.retry_timeouts);
  EXPECT_EQ(sleep.target, "/v1/sandboxes/sb-1/sleep");
  EXPECT_FALSE(json::parse(sleep.body).at("request_id").get<std::string>().empty());
}

TEST(ClientRequests, ArgumentsRefusedBeforeARoundTrip) {
  EXPECT_CODE(requests::set_ttl("sb-1", std::chrono::seconds(-1)), Code::kInvalidArgument);
  EXPECT_CODE(requests::expose("sb-1", 0), Code::kInvalidArgument);
  EXPECT_CODE(requests::write_file("sb-1", "/x", "", 010000), Code::kInvalidArgument);
  EXPECT_CODE(requests::process_output("sb-1", 1, 0, 0, 301, 10), Code::kInvalidArgument);
  EXPECT_CODE(requests::process_output("sb-1", 1, 0, 0, 0, 0), Code::kInvalidArgument);
  EXPECT_CODE(requests::signal("sb-1", 1, -1, false), Code::kInvalidArgument);
  EXPECT_CODE(requests::resize("sb-1", 1, 0, 80), Code::kInvalidArgument);
}

}  // namespace
}  // namespace dsec::detail
