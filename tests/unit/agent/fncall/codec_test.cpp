// The wire format of function calls: POST /v1/fncall bodies and answers (docs/protocol.md).
#include <gtest/gtest.h>

#include <string>

#include "common/protocol.hpp"
#include "error_test_util.hpp"

namespace dsec::protocol {
namespace {

TEST(FnCallCodec, RequestRoundTripsEveryField) {
  FnCallRequest r;
  r.language = "cpp";
  r.code = "int main() { return 3; }";
  r.stdin_data = std::string("in\0put", 6);
  r.args = {"a", "b c"};
  r.files = {{"data/x.bin", std::string("\x00\xff\x01", 3)}, {"y.txt", "hello"}};
  r.env = {{"K", "v"}};
  r.image = "judge:1@sha256:" + std::string(64, 'a');
  r.timeout_seconds = 2.5;
  r.cpu_seconds = 1.5;
  r.memory_bytes = 64ull << 20;
  r.pids = 7;
  r.max_output_bytes = 1000;
  r.gpu_mode = GpuMode::kShared;
  r.gpus = 2;
  r.request_id = "req-1";
  FnCallRequest d = decode_fncall_request(json::parse(encode(r).dump()));
  EXPECT_EQ(d.language, r.language);
  EXPECT_EQ(d.code, r.code);
  EXPECT_EQ(d.stdin_data, r.stdin_data);
  EXPECT_EQ(d.args, r.args);
  EXPECT_EQ(d.files, r.files);
  EXPECT_EQ(d.env, r.env);
  EXPECT_EQ(d.image, r.image);
  EXPECT_DOUBLE_EQ(d.timeout_seconds, 2.5);
  EXPECT_DOUBLE_EQ(d.cpu_seconds, 1.5);
  EXPECT_EQ(d.memory_bytes, 64ull << 20);
  EXPECT_EQ(d.pids, 7u);
  EXPECT_EQ(d.max_output_bytes, 1000u);
  EXPECT_EQ(d.gpu_mode, GpuMode::kShared);
  EXPECT_EQ(d.gpus, 2u);
  EXPECT_EQ(d.request_id, "req-1");
}

TEST(FnCallCodec, DefaultsOfAMinimalRequest) {
  FnCallRequest d = decode_fncall_request(json{{"code", "print(1)"}});
  FnCallRequest defaults;
  EXPECT_EQ(d.language, "python");
  EXPECT_EQ(d.image, "");
  EXPECT_EQ(d.timeout_seconds, defaults.timeout_seconds);
  EXPECT_EQ(d.memory_bytes, defaults.memory_bytes);
  EXPECT_EQ(d.pids, defaults.pids);
  EXPECT_EQ(d.max_output_bytes, defaults.max_output_bytes);
  EXPECT_EQ(d.gpu_mode, GpuMode::kNone);
  EXPECT_EQ(d.gpus, 0u);
  // Sizes may be strings, as in a spec.
  EXPECT_EQ(decode_fncall_request(json{{"code", ""}, {"memory", "32Mi"}}).memory_bytes, 32ull << 20);
  // A GPU mode without a count asks for one.
  EXPECT_EQ(decode_fncall_request(json{{"code", ""}, {"gpu_mode", "exclusive"}}).gpus, 1u);
}

TEST(FnCallCodec, BadFieldsAreInvalidArgumentsNamingTheField) {
  struct Case {
    json body;
    std::string field;
  };
  const Case cases[] = {
      {json::array(), "fncall"},
      {json{{"language", "python"}}, "code"},
      {json{{"code", 5}}, "code"},
      {json{{"code", ""}, {"language", "cobol"}}, "language"},
      {json{{"code", ""}, {"stdin", "%%%"}}, "base64"},
      {json{{"code", ""}, {"args", "x"}}, "args"},
      {json{{"code", ""}, {"args", {1}}}, "args"},
      {json{{"code", ""}, {"files", {{"/etc/passwd", "eA=="}}}}, "files./etc/passwd"},
      {json{{"code", ""}, {"files", {{"a/../../b", "eA=="}}}}, "files.a/../../b"},
      {json{{"code", ""}, {"files", {{"a//b", "eA=="}}}}, "files.a//b"},
      {json{{"code", ""}, {"files", {{"x", 3}}}}, "files.x"},
      {json{{"code", ""}, {"env", {{"A=B", "c"}}}}, "env.A=B"},
      {json{{"code", ""}, {"image", "../etc"}}, "image"},
      {json{{"code", ""}, {"image", "x@sha256:12"}}, "image"},
      {json{{"code", ""}, {"timeout", 0}}, "timeout"},
      {json{{"code", ""}, {"timeout", 1e9}}, "timeout"},
      {json{{"code", ""}, {"cpu_time", -1}}, "cpu_time"},
      {json{{"code", ""}, {"memory", 1024}}, "memory"},
      {json{{"code", ""}, {"memory", "lots"}}, "memory"},
      {json{{"code", ""}, {"pids", 0}}, "pids"},
      {json{{"code", ""}, {"max_output_bytes", 1ull << 40}}, "max_output_bytes"},
      {json{{"code", ""}, {"gpu_mode", "half"}}, "gpu_mode"},
      {json{{"code", ""}, {"gpus", 1}}, "gpus"},
      {json{{"code", ""}, {"gpu_mode", "shared"}, {"gpus", 100000}}, "gpus"},
      {json{{"code", ""}, {"request_id", std::string(200, 'r')}}, "request_id"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.body.dump());
    EXPECT_CODE_MSG(decode_fncall_request(c.body), Code::kInvalidArgument, c.field);
  }
}

TEST(FnCallCodec, HugeInputsAreRefused) {
  EXPECT_CODE(decode_fncall_request(json{{"code", std::string(kMaxFnCallCodeBytes + 1, 'x')}}), Code::kInvalidArgument);
  EXPECT_CODE(decode_fncall_request(json{{"code", std::string(kMaxFnCallCodeBytes, 'x')}}), Code::kOk);
  // Files together past the input bound.
  std::string chunk = base64_encode(std::string(kMaxFnCallInputBytes / 2, 'a'));
  EXPECT_CODE(decode_fncall_request(json{{"code", ""}, {"files", {{"a", chunk}, {"b", chunk}, {"c", "eA=="}}}}),
              Code::kInvalidArgument);
}

TEST(FnCallCodec, ResultRoundTripsAndBatchErrorsDecode) {
  FnCallResult r;
  r.exit_code = -1;
  r.signal = 9;
  r.stdout_data = std::string("o\0ut", 4);
  r.stderr_data = "err";
  r.stdout_truncated = true;
  r.timed_out = true;
  r.oom_killed = true;
  r.duration_seconds = 0.25;
  r.cpu_seconds = 0.125;
  r.peak_memory_bytes = 12345;
  r.compile_exit_code = 1;
  r.compile_output = "x.c:1: error";
  r.compile_seconds = 0.5;
  r.gpus = {"0", "1"};
  r.node = "n1";
  FnCallResult d = decode_fncall_result(json::parse(encode(r).dump()));
  EXPECT_EQ(d.exit_code, -1);
  EXPECT_EQ(d.signal, 9);
  EXPECT_EQ(d.stdout_data, r.stdout_data);
  EXPECT_EQ(d.stderr_data, "err");
  EXPECT_TRUE(d.stdout_truncated);
  EXPECT_FALSE(d.stderr_truncated);
  EXPECT_TRUE(d.timed_out);
  EXPECT_TRUE(d.oom_killed);
  EXPECT_DOUBLE_EQ(d.duration_seconds, 0.25);
  EXPECT_DOUBLE_EQ(d.cpu_seconds, 0.125);
  EXPECT_EQ(d.peak_memory_bytes, 12345u);
  EXPECT_EQ(d.compile_exit_code, 1);
  EXPECT_EQ(d.compile_output, r.compile_output);
  EXPECT_DOUBLE_EQ(d.compile_seconds, 0.5);
  EXPECT_EQ(d.gpus, r.gpus);
  EXPECT_EQ(d.node, "n1");
  EXPECT_TRUE(d.error.empty());

  FnCallResult e = decode_fncall_result(json{{"error", {{"code", "NOT_FOUND"}, {"message", "no image x"}}}});
  EXPECT_EQ(e.error_code, "NOT_FOUND");
  EXPECT_EQ(e.error, "no image x");
}

TEST(FnCallCodec, GpuModeNames) {
  for (GpuMode m : {GpuMode::kNone, GpuMode::kExclusive, GpuMode::kShared})
    EXPECT_EQ(parse_gpu_mode(gpu_mode_name(m)), m);
  EXPECT_THROW(parse_gpu_mode("all"), Error);
}

}  // namespace
}  // namespace dsec::protocol
