// The JSON of spawned processes and shell sessions: request bodies checked before they leave, answers
// decoded field by field, and every way an answer can be malformed.
#include <gtest/gtest.h>

#include <string>

#include "common/protocol/process.hpp"
#include "error_test_util.hpp"

namespace dsec::protocol {
namespace {

using protocol::json;

using test::code_of;

TEST(ProcessCodec, DecodesAProcessInfo) {
  json j = json::parse(R"({"pid": 42, "argv": ["python3", "-m", "http.server"], "tag": "web", "pty": true,
    "running": false, "exit_code": 127, "signal": 0, "reason": "executable_not_found", "started_at": 1764650000.125,
    "ended_at": 1764650001.5, "stdout_bytes": 6, "stderr_bytes": 5000000000, "stdin_open": false})");
  ProcessInfo p = decode_process_info(j);
  EXPECT_EQ(p.pid, 42);
  EXPECT_EQ(p.argv, (std::vector<std::string>{"python3", "-m", "http.server"}));
  EXPECT_EQ(p.tag, "web");
  EXPECT_TRUE(p.pty);
  EXPECT_FALSE(p.running);
  EXPECT_EQ(p.exit_code, 127);
  EXPECT_EQ(p.reason, "executable_not_found");
  EXPECT_DOUBLE_EQ(p.started_at, 1764650000.125);
  EXPECT_DOUBLE_EQ(p.ended_at, 1764650001.5);
  EXPECT_EQ(p.stdout_bytes, 6u);
  EXPECT_EQ(p.stderr_bytes, 5000000000u);
  EXPECT_FALSE(p.stdin_open);
}

TEST(ProcessCodec, AProcessInfoNeedsOnlyItsPid) {
  ProcessInfo p = decode_process_info(json{{"pid", 7}, {"running", true}, {"stdin_open", true}, {"reason", nullptr}});
  EXPECT_EQ(p.pid, 7);
  EXPECT_TRUE(p.running);
  EXPECT_TRUE(p.stdin_open);
  EXPECT_EQ(p.exit_code, -1);
  EXPECT_TRUE(p.argv.empty());
  EXPECT_EQ(p.reason, "");
}

TEST(ProcessCodec, RefusesMalformedProcessInfo) {
  for (const char* text :
       {R"([])", R"({})", R"({"pid": 0})", R"({"pid": "42"})", R"({"pid": 1, "argv": "sh"})",
        R"({"pid": 1, "argv": [1]})", R"({"pid": 1, "running": 1})", R"({"pid": 1, "exit_code": "0"})",
        R"({"pid": 1, "stdout_bytes": -1})", R"({"pid": 1, "started_at": "now"})"}) {
    EXPECT_CODE(decode_process_info(json::parse(text)), Code::kDataLoss) << text;
  }
}

TEST(ProcessCodec, DecodesListsInOrder) {
  auto list = decode_process_list(json::parse(R"({"processes": [{"pid": 3}, {"pid": 9, "tag": "b"}]})"));
  ASSERT_EQ(list.size(), 2u);
  EXPECT_EQ(list[0].pid, 3);
  EXPECT_EQ(list[1].tag, "b");
  EXPECT_TRUE(decode_process_list(json::parse(R"({"processes": []})")).empty());
  EXPECT_CODE(decode_process_list(json::parse(R"({"sessions": []})")), Code::kDataLoss);
  EXPECT_CODE(decode_process_list(json::parse(R"({"processes": [{"pid": "x"}]})")), Code::kDataLoss);

  auto sessions =
      decode_session_list(json::parse(R"({"sessions": [{"name": "main"}, {"name": "s2", "alive": true}]})"));
  ASSERT_EQ(sessions.size(), 2u);
  EXPECT_EQ(sessions[0].name, "main");
  EXPECT_TRUE(sessions[1].alive);
  EXPECT_CODE(decode_session_list(json::parse(R"({"sessions": {}})")), Code::kDataLoss);
}

TEST(ProcessCodec, DecodesOutputAsBytes) {
  json j{{"stdout", protocol::base64_encode(std::string("hi\0\xff", 4))},
         {"stdout_offset", 10},
         {"stderr", ""},
         {"stderr_offset", 0},
         {"stdout_end", 20},
         {"stderr_end", 0},
         {"running", true},
         {"exit_code", -1},
         {"signal", 0}};
  ProcessOutput out = decode_process_output(j);
  EXPECT_EQ(out.stdout_data, std::string("hi\0\xff", 4));
  EXPECT_EQ(out.stdout_offset, 10u);
  EXPECT_EQ(out.stdout_end, 20u);
  EXPECT_EQ(out.stderr_data, "");
  EXPECT_TRUE(out.running);

  ProcessOutput ended = decode_process_output(json{{"running", false}, {"exit_code", -1}, {"signal", 9}});
  EXPECT_FALSE(ended.running);
  EXPECT_EQ(ended.signal, 9);
  EXPECT_EQ(ended.stdout_end, 0u);
}

TEST(ProcessCodec, RefusesOutputThatDoesNotAddUp) {
  EXPECT_CODE(decode_process_output(json{{"stdout", "not base64!"}}), Code::kDataLoss);
  EXPECT_CODE(decode_process_output(json{{"stdout", 5}}), Code::kDataLoss);
  // Bytes past the end the answer itself names.
  json past{{"stderr", protocol::base64_encode("abcdef")}, {"stderr_offset", 4}, {"stderr_end", 8}};
  EXPECT_CODE(decode_process_output(past), Code::kDataLoss);
  past["stderr_end"] = 10;
  EXPECT_EQ(decode_process_output(past).stderr_data, "abcdef");
}

TEST(ProcessCodec, DecodesASessionInfo) {
  SessionInfo s = decode_session_info(json::parse(
      R"({"name": "main", "shell": "/bin/bash", "pid": 17, "alive": false, "busy": false, "exit_code": 3, "signal": 0})"));
  EXPECT_EQ(s.name, "main");
  EXPECT_EQ(s.shell, "/bin/bash");
  EXPECT_EQ(s.pid, 17);
  EXPECT_FALSE(s.alive);
  EXPECT_FALSE(s.busy);
  EXPECT_EQ(s.exit_code, 3);
  EXPECT_CODE(decode_session_info(json::parse(R"({"shell": "/bin/sh"})")), Code::kDataLoss);
  EXPECT_CODE(decode_session_info(json::parse(R"({"name": "a", "busy": "no"})")), Code::kDataLoss);
}

TEST(ProcessCodec, EncodesASpawnAsExecHasItsCommand) {
  ProcessRequest r;
  r.shell = "echo hi";
  r.env = {{"K", "V"}};
  r.cwd = "/tmp";
  r.user = "1000:1000";
  json j = encode(r);
  EXPECT_EQ(j.at("shell"), "echo hi");
  EXPECT_EQ(j.at("env").at("K"), "V");
  EXPECT_EQ(j.at("cwd"), "/tmp");
  EXPECT_EQ(j.at("user"), "1000:1000");
  EXPECT_FALSE(j.contains("argv"));
  EXPECT_FALSE(j.contains("timeout"));
  EXPECT_FALSE(j.contains("max_output"));
  EXPECT_FALSE(j.contains("pty"));
  EXPECT_FALSE(j.contains("tag"));

  ProcessRequest t;
  t.argv = {"python3", "-i"};
  t.pty = true;
  t.rows = 40;
  t.cols = 120;
  t.tag = "repl";
  j = encode(t);
  EXPECT_EQ(j.at("argv"), (json{"python3", "-i"}));
  EXPECT_EQ(j.at("pty"), true);
  EXPECT_EQ(j.at("rows"), 40);
  EXPECT_EQ(j.at("cols"), 120);
  EXPECT_EQ(j.at("tag"), "repl");
}

TEST(ProcessCodec, RefusesABadSpawnBeforeItLeaves) {
  auto refused = [](auto change) {
    ProcessRequest r;
    r.argv = {"true"};
    change(r);
    return code_of([&] { encode(r); });
  };
  EXPECT_EQ(refused([](ProcessRequest& r) { r.argv.clear(); }), Code::kInvalidArgument);
  EXPECT_EQ(refused([](ProcessRequest& r) { r.shell = "true"; }), Code::kInvalidArgument);  // both
  EXPECT_EQ(refused([](ProcessRequest& r) { r.cwd = "relative"; }), Code::kInvalidArgument);
  EXPECT_EQ(refused([](ProcessRequest& r) { r.user = "-x"; }), Code::kInvalidArgument);
  EXPECT_EQ(refused([](ProcessRequest& r) { r.tag = std::string(129, 't'); }), Code::kInvalidArgument);
  EXPECT_EQ(refused([](ProcessRequest& r) { r.pty = true, r.rows = 0; }), Code::kInvalidArgument);
  EXPECT_EQ(refused([](ProcessRequest& r) { r.pty = true, r.cols = 1001; }), Code::kInvalidArgument);
  EXPECT_EQ(refused([](ProcessRequest& r) { r.rows = 0; }), Code::kOk);  // no pty: the size is not sent
  EXPECT_EQ(refused([](ProcessRequest& r) { r.tag = std::string(128, 't'); }), Code::kOk);
}

TEST(ProcessCodec, EncodesSessionsAndRuns) {
  json j = encode(SessionOptions{});
  EXPECT_FALSE(j.contains("name"));
  EXPECT_FALSE(j.contains("shell"));
  EXPECT_FALSE(j.contains("argv"));

  SessionOptions o;
  o.name = "main.1_x-y";
  o.shell = "/bin/bash";
  o.env = {{"A", "b"}};
  o.cwd = "/repo";
  o.user = "agent";
  j = encode(o);
  EXPECT_EQ(j.at("name"), "main.1_x-y");
  EXPECT_EQ(j.at("shell"), "/bin/bash");
  EXPECT_EQ(j.at("env").at("A"), "b");
  EXPECT_EQ(j.at("cwd"), "/repo");
  EXPECT_EQ(j.at("user"), "agent");

  for (const char* name : {"has space", "a/b", "ü"}) {
    SessionOptions bad;
    bad.name = name;
    EXPECT_CODE(encode(bad), Code::kInvalidArgument) << name;
  }
  SessionOptions long_name;
  long_name.name = std::string(65, 'n');
  EXPECT_CODE(encode(long_name), Code::kInvalidArgument);

  j = encode_session_run("cd /tmp && export X=1", 30, 1024, true);
  EXPECT_EQ(j, (json{{"command", "cd /tmp && export X=1"}, {"timeout", 30.0}, {"max_output", 1024}, {"stream", true}}));
  EXPECT_CODE(encode_session_run(std::string("a\0b", 3), 1, 1, false), Code::kInvalidArgument);
  EXPECT_CODE(encode_session_run("true", 0, 1, false), Code::kInvalidArgument);
  EXPECT_CODE(encode_session_run("true", 1, (1u << 30) + 1, false), Code::kInvalidArgument);
}

TEST(ProcessCodec, SecondsInAQuery) {
  EXPECT_EQ(query_seconds(60), "60");
  EXPECT_EQ(query_seconds(0.25), "0.25");
  EXPECT_EQ(query_seconds(1.5004), "1.5");
  EXPECT_EQ(query_seconds(0.0001), "0");
  EXPECT_EQ(query_seconds(0), "0");
  EXPECT_EQ(query_seconds(-3), "0");
  EXPECT_EQ(query_seconds(299.999), "299.999");
}

TEST(ProcessCodec, RequestsRoundTripThroughTheAgentsDecoders) {
  ProcessRequest r;
  r.argv = {"python3", "-c", "print(1)"};
  r.env = {{"A", "1"}};
  r.cwd = "/tmp";
  r.pty = true;
  r.rows = 40;
  r.cols = 120;
  r.tag = "web";
  ProcessRequest back = decode_process_request(encode(r));
  EXPECT_EQ(back.argv, r.argv);
  EXPECT_EQ(back.env, r.env);
  EXPECT_EQ(back.cwd, "/tmp");
  EXPECT_TRUE(back.pty);
  EXPECT_EQ(back.rows, 40u);
  EXPECT_EQ(back.cols, 120u);
  EXPECT_EQ(back.tag, "web");
  EXPECT_CODE(decode_process_request(json{{"shell", "true"}, {"colour", 1}}), Code::kInvalidArgument);
  EXPECT_CODE(decode_process_request(json::array()), Code::kInvalidArgument);

  SessionOptions o;
  o.name = "main";
  o.shell = "/bin/sh";
  o.user = "1000:1000";
  SessionOptions opened = decode_session_options(encode(o));
  EXPECT_EQ(opened.name, "main");
  EXPECT_EQ(opened.shell, "/bin/sh");
  EXPECT_EQ(opened.user, "1000:1000");
  EXPECT_CODE(decode_session_options(json{{"shell", "sh"}}), Code::kInvalidArgument);

  SessionRunRequest run = decode_session_run(encode_session_run("ls", 30, 1024, true));
  EXPECT_EQ(run.command, "ls");
  EXPECT_EQ(run.timeout_seconds, 30);
  EXPECT_EQ(run.max_output_bytes, 1024u);
  EXPECT_TRUE(run.stream);

  EXPECT_EQ(decode_signal_request(json{{"signal", "SIGTERM"}, {"group", true}}).signal, 15);
  EXPECT_EQ(decode_signal_request(json{{"signal", 9}}).signal, 9);
  EXPECT_CODE(decode_signal_request(json{{"signal", "SIGNOPE"}}), Code::kInvalidArgument);
  EXPECT_EQ(decode_resize_request(json{{"rows", 10}, {"cols", 20}}).cols, 20u);
  EXPECT_CODE(decode_resize_request(json{{"rows", 10}}), Code::kInvalidArgument);
}

TEST(ProcessCodec, AnswersRoundTripThroughTheClientsDecoders) {
  ProcessInfo p;
  p.pid = 42;
  p.argv = {"sleep", "1"};
  p.running = false;
  p.exit_code = 3;
  p.started_at = 1.5;
  p.ended_at = 2.5;
  p.stdout_bytes = 7;
  json j = encode(p, TerminalSize{30, 90});
  EXPECT_EQ(j["rows"], 30);
  ProcessInfo back = decode_process_info(j);
  EXPECT_EQ(back.pid, 42);
  EXPECT_EQ(back.argv, p.argv);
  EXPECT_EQ(back.exit_code, 3);
  EXPECT_EQ(back.stdout_bytes, 7u);
  EXPECT_FALSE(encode(p).contains("rows"));
  EXPECT_EQ(decode_process_list(encode_process_list(json::array({j}))).size(), 1u);

  ProcessInfo never;
  never.argv = {"/nope"};
  never.exit_code = 127;
  never.reason = "executable_not_found";
  never.message = "no such file";
  ProcessInfo failed = decode_process_info(encode(never));
  EXPECT_EQ(failed.pid, 0);
  EXPECT_EQ(failed.reason, "executable_not_found");
  EXPECT_EQ(failed.message, "no such file");

  ProcessOutput out;
  out.stdout_data = std::string("a\0b", 3);
  out.stdout_offset = 2;
  out.stdout_end = 5;
  out.signal = 9;
  ProcessOutput got = decode_process_output(encode(out));
  EXPECT_EQ(got.stdout_data, out.stdout_data);
  EXPECT_EQ(got.stdout_end, 5u);
  EXPECT_EQ(got.signal, 9);

  SessionInfo s{"main", "/bin/sh", 12, false, false, 0, 0};
  EXPECT_EQ(decode_session_list(encode(std::vector<SessionInfo>{s})).at(0).name, "main");
  EXPECT_TRUE(encode(s).contains("exit_code"));
  s.alive = true;
  EXPECT_FALSE(encode(s).contains("exit_code"));
}

}  // namespace
}  // namespace dsec::protocol
