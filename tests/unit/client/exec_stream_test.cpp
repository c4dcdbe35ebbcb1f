// The client's decoding of a streaming exec's NDJSON body: lines split across any pieces, chunks decoded in order,
// the final line, and every way the body can be wrong.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "client/exec_stream.hpp"
#include "common/protocol.hpp"
#include "error_test_util.hpp"

namespace dsec::detail {
namespace {

std::vector<std::string> split(const std::vector<std::string>& pieces, std::size_t max_line = 1 << 20) {
  LineSplitter splitter(max_line);
  std::vector<std::string> lines;
  for (const auto& p : pieces) splitter.feed(p, [&](std::string_view line) { lines.emplace_back(line); });
  return lines;
}

TEST(LineSplitter, LinesComeWholeWhateverThePieces) {
  using V = std::vector<std::string>;
  EXPECT_EQ(split({"a\nbb\n"}), (V{"a", "bb"}));
  EXPECT_EQ(split({"a", "b", "\nc", "d\n"}), (V{"ab", "cd"}));
  EXPECT_EQ(split({"one\r\n", "\n", "two\r", "\n"}), (V{"one", "two"}));
  EXPECT_EQ(split({"x\n", "tail without newline"}), (V{"x"}));

  const std::string text = "{\"stdout\":\"aGk=\"}\n{\"result\":{}}\nlast\n";
  std::vector<std::string> bytes;
  for (char c : text) bytes.emplace_back(1, c);
  EXPECT_EQ(split(bytes), (V{"{\"stdout\":\"aGk=\"}", "{\"result\":{}}", "last"}));
}

TEST(LineSplitter, KeepsAnUnfinishedLineAndRefusesOversizedOnes) {
  LineSplitter splitter(8);
  std::vector<std::string> lines;
  auto add = [&](std::string_view l) { lines.emplace_back(l); };
  splitter.feed("12345", add);
  EXPECT_EQ(splitter.pending(), 5u);
  EXPECT_TRUE(lines.empty());
  splitter.feed("678\n", add);
  EXPECT_EQ(lines, std::vector<std::string>{"12345678"});
  EXPECT_EQ(splitter.pending(), 0u);
  try {
    splitter.feed("1234", add);
    splitter.feed("56789", add);
    FAIL() << "a 9-byte line passed an 8-byte limit";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kInternal);
  }
}

TEST(LineSplitter, ALineIsNotDeliveredTwiceWhenTheCallbackThrows) {
  LineSplitter splitter(64);
  int calls = 0;
  auto boom = [&](std::string_view) {
    ++calls;
    throw std::runtime_error("callback failed");
  };
  splitter.feed("par", boom);
  EXPECT_THROW(splitter.feed("tial\nrest", boom), std::runtime_error);
  EXPECT_EQ(calls, 1);
  std::vector<std::string> lines;
  splitter.feed("\n", [&](std::string_view l) { lines.emplace_back(l); });
  // What followed the failed line in the same piece is dropped with it; the splitter itself stays usable.
  EXPECT_EQ(splitter.pending(), 0u);
}

std::string b64(std::string_view s) { return protocol::base64_encode(s); }

TEST(ExecStreamDecoder, OutputChunksInOrderThenTheResult) {
  std::vector<std::pair<int, std::string>> got;
  ExecStreamDecoder decoder([&](int fd, std::string_view data) { got.emplace_back(fd, std::string(data)); });
  std::string binary("\x00\xff\n\r\x01", 5);
  std::string body = "{\"stdout\":\"" + b64("first\n") + "\"}\n" + "{\"stderr\":\"" + b64("oops") + "\"}\n" +
                     "{\"stdout\":\"" + b64(binary) + "\"}\n" +
                     R"({"result":{"exit_code":3,"signal":0,"stdout":"","stderr":"","stdout_truncated":true,)"
                     R"("stderr_truncated":false,"timed_out":false,"duration":1.5}})"
                     "\n";
  // Fed in uneven pieces, as libcurl hands them over.
  for (std::size_t i = 0; i < body.size(); i += 7) decoder.feed(std::string_view(body).substr(i, 7));
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0], (std::pair<int, std::string>{1, "first\n"}));
  EXPECT_EQ(got[1], (std::pair<int, std::string>{2, "oops"}));
  EXPECT_EQ(got[2], (std::pair<int, std::string>{1, binary}));
  EXPECT_TRUE(decoder.done());
  ExecResult r = decoder.finish();
  EXPECT_EQ(r.exit_code, 3);
  EXPECT_TRUE(r.stdout_truncated);
  EXPECT_FALSE(r.stderr_truncated);
  EXPECT_DOUBLE_EQ(r.duration_seconds, 1.5);
  EXPECT_TRUE(r.stdout_data.empty());
}

TEST(ExecStreamDecoder, AnErrorLineIsTheAgentsErrorNeverRetried) {
  ExecStreamDecoder decoder(nullptr);
  decoder.feed("{\"stdout\":\"" + b64("x") + "\"}\n");
  decoder.feed(R"({"error":{"code":"UNAVAILABLE","message":"sandbox s1: lost its init during exec","retryable":true}})"
               "\n");
  try {
    decoder.finish();
    FAIL() << "an error line must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kUnavailable);
    EXPECT_FALSE(e.retryable());
    EXPECT_NE(std::string(e.what()).find("lost its init"), std::string::npos);
  }
}

TEST(ExecStreamDecoder, AnErrorLineKeepsTheAgentsFaultAndOutcomeUnknown) {
  ExecStreamDecoder decoder(nullptr);
  decoder.feed(R"({"error":{"code":"DATA_LOSS","message":"exec r1: the agent restarted","retryable":false,)"
               R"("fault":"request","outcome_unknown":true}})"
               "\n");
  try {
    decoder.finish();
    FAIL() << "an error line must throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), Code::kDataLoss);
    EXPECT_EQ(e.fault(), Fault::kRequest);  // DATA_LOSS alone would say the infrastructure's
    EXPECT_TRUE(e.outcome_unknown());
  }
}

using test::code_of;

TEST(ExecStreamDecoder, MalformedBodiesAreErrors) {
  auto fed = [](std::string body) {
    return [body] {
      ExecStreamDecoder d(nullptr);
      d.feed(body);
      d.finish();
    };
  };
  EXPECT_EQ(code_of(fed("")), Code::kUnavailable);                                // no final line
  EXPECT_EQ(code_of(fed("{\"stdout\":\"eA==\"}\n")), Code::kUnavailable);         // cut after a chunk
  EXPECT_EQ(code_of(fed("{\"stdout\":\"eA==\"}\n{\"resu")), Code::kUnavailable);  // cut mid-line
  EXPECT_EQ(code_of(fed("not json\n")), Code::kInternal);
  EXPECT_EQ(code_of(fed("[1,2]\n")), Code::kInternal);
  EXPECT_EQ(code_of(fed("{\"stdout\":\"eA==\",\"stderr\":\"eA==\"}\n")), Code::kInternal);  // two keys
  EXPECT_EQ(code_of(fed("{\"stdout\":42}\n")), Code::kInternal);
  EXPECT_EQ(code_of(fed("{\"stdout\":\"!!!\"}\n")), Code::kInternal);  // not base64
  EXPECT_EQ(code_of(fed("{\"bogus\":1}\n")), Code::kInternal);
  EXPECT_EQ(code_of(fed("{\"result\":{}}\n{\"stdout\":\"eA==\"}\n")), Code::kInternal);  // past the final line
  EXPECT_EQ(code_of(fed("{\"result\":{}}\n")), Code::kOk);
}

TEST(ExecStreamDecoder, WhatTheCallbackThrowsPropagates) {
  ExecStreamDecoder decoder([](int, std::string_view) { throw std::runtime_error("trainer says stop"); });
  EXPECT_THROW(decoder.feed("{\"stderr\":\"" + b64("x") + "\"}\n"), std::runtime_error);
  EXPECT_FALSE(decoder.done());
}

}  // namespace
}  // namespace dsec::detail
