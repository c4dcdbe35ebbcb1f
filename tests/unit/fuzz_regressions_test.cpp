// Inputs the fuzz targets (tests/fuzz, docs/security.md "Fuzzing") found that dsec's decoders mishandled, each now
// refused with a dsec::Error naming what is wrong (or, where the decoder is lenient, read without harm):
//  - request bodies with a number too large for a double were nlohmann's out_of_range, so a 500 instead of a 400;
//  - numbers that do not fit their field (5e49 bytes of memory, an exit code of 1e300) in answers, records, chunk
//    indexes and manifests were converted with undefined behaviour;
//  - a chunk index of a layer near 2^64 bytes needed no chunks (the count wrapped around);
//  - a fork server's message with a member of the wrong type threw nlohmann's type_error out of the call;
//  - a fork server's frame claiming a 256 MiB blob made the agent allocate it before a byte of it arrived;
//  - an OCI layout whose JSON has members of the wrong type (a number for a mediaType or digest, a string for a
//    platform) threw nlohmann's type_error out of an image build;
//  - a StartRequest count was checked against the payload's bytes rather than what they can hold.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "agent/fncall/wire.hpp"
#include "common/protocol.hpp"
#include "common/unique_fd.hpp"
#include "common/wire/init_protocol.hpp"
#include "dsec/error.hpp"
#include "error_test_util.hpp"
#include "image/layer_tar.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/manifest.hpp"

namespace dsec {
namespace {

using nlohmann::json;

using test::code_of;

template <typename F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

TEST(FuzzRegressions, BodyWithANumberTooLargeForADoubleIsInvalidArgument) {
  EXPECT_CODE(protocol::parse_body(R"({"ttl": 1e999})"), Code::kInvalidArgument);
  EXPECT_CODE(protocol::parse_body(R"({"gpu_mode":44e531})"), Code::kInvalidArgument);
  EXPECT_CODE(protocol::parse_body(R"({"ttl": 1e300})"), Code::kOk);
}

TEST(FuzzRegressions, AnswerNumbersThatDoNotFitTheirFieldAreErrors) {
  json info = {{"id", "sb-1"}, {"resources", {{"memory", 1}}}};
  info["resources"]["memory"] = json::parse("53687999999999999999999999999999999999999999990912");
  EXPECT_CODE(protocol::decode_sandbox_info(info), Code::kInternal);
  EXPECT_NE(message_of([&] { protocol::decode_sandbox_info(info); }).find("resources.memory"), std::string::npos);
  info["resources"]["memory"] = -1;
  EXPECT_CODE(protocol::decode_sandbox_info(info), Code::kInternal);
  info["resources"]["memory"] = "1Gi";
  EXPECT_CODE(protocol::decode_sandbox_info(info), Code::kInternal);
  info["resources"]["memory"] = 1e3;  // a whole number written as a float still reads
  EXPECT_EQ(protocol::decode_sandbox_info(info).resources.memory_bytes, 1000u);

  EXPECT_CODE(protocol::decode_exec_result(json{{"exit_code", 1e300}}), Code::kInternal);
  EXPECT_CODE(protocol::decode_exec_result(json{{"exit_code", 2.5}}), Code::kInternal);
  EXPECT_CODE(protocol::decode_exec_result(json{{"signal", std::int64_t{1} << 40}}), Code::kInternal);
  EXPECT_CODE(protocol::decode_exec_result(json{{"timed_out", 1}}), Code::kInternal);
  EXPECT_CODE(protocol::decode_exec_result(json::array()), Code::kInternal);
  EXPECT_EQ(protocol::decode_exec_result(json{{"exit_code", -3}}).exit_code, -3);
  EXPECT_CODE(protocol::decode_fncall_result(json{{"peak_memory", -1.5}}), Code::kInternal);
  EXPECT_CODE(protocol::decode_fncall_result(json{{"error", {{"code", 7}}}}), Code::kInternal);
  EXPECT_CODE(protocol::decode_node_info(json{{"capacity", {{"cores", 4294967296}}}}), Code::kInternal);
  EXPECT_CODE(protocol::decode_node_info(json{{"load", {{"load1", "high"}}}}), Code::kInternal);
  EXPECT_EQ(protocol::decode_node_info(json{{"capacity", {{"cores", 4294967295u}}}}).cores, 4294967295u);
}

TEST(FuzzRegressions, AnErrorBodyWithMembersOfTheWrongTypeStillDecodes) {
  Error e = protocol::decode_error(json{{"code", "NOT_FOUND"}, {"message", 42}, {"retryable", "yes"}}, 404);
  EXPECT_EQ(e.code(), Code::kNotFound);
  EXPECT_STREQ(e.what(), "42");
  EXPECT_FALSE(e.retryable());
}

std::string chunk_index(std::uint64_t size, const std::string& chunks, const std::string& extra = {}) {
  const std::string d = "sha256:" + std::string(64, 'a');
  return R"({"schema":1,"layer":")" + d + R"(","size":)" + std::to_string(size) + R"(,"chunk_size":4096,"data":")" + d +
         R"(","data_size":100,"chunks":)" + chunks + extra + "}";
}

TEST(FuzzRegressions, ChunkIndexNumbersMustFitAndCoverTheLayer) {
  const std::string one = R"([[0,10,")" + std::string(64, 'b') + R"("]])";
  EXPECT_CODE(image::chunk_index_from_json(chunk_index(4096, one)), Code::kOk);
  // A layer of 2^64 - 1 bytes with no chunks at all: the chunk count used to wrap around to 0.
  EXPECT_CODE(image::chunk_index_from_json(chunk_index(UINT64_MAX, "[]")), Code::kInvalidArgument);
  auto with = [&](std::string text, const std::string& from, const std::string& to) {
    text.replace(text.find(from), from.size(), to);
    return text;
  };
  std::string good = chunk_index(4096, one);
  for (const auto& [from, to] : std::initializer_list<std::pair<std::string, std::string>>{
           {R"("data_size":100)", R"("data_size":2700000000000000000000005)"},
           {R"("data_size":100)", R"("data_size":-100)"},
           {R"("chunk_size":4096)", R"("chunk_size":4096.5)"},
           {R"("chunk_size":4096)", R"("chunk_size":1e30)"},
           {R"("schema":1)", R"("schema":1e300)"},
           {"[[0,10,", "[[-1.5,10,"},
           {"[[0,10,", "[[0,1e20,"}}) {
    std::string text = with(good, from, to);
    EXPECT_CODE(image::chunk_index_from_json(text), Code::kInvalidArgument) << text;
  }
  EXPECT_EQ(code_of([&] { image::chunk_index_from_json(chunk_index(4096, one, R"(,"prefetch":[1e40])")); }),
            Code::kInvalidArgument);
  EXPECT_EQ(code_of([&] { image::chunk_index_from_json(chunk_index(4096, one, R"(,"meta_size":-4096)")); }),
            Code::kInvalidArgument);
}

TEST(FuzzRegressions, ManifestSchemaMustBeAnInteger) {
  image::Manifest m;
  m.name = "busybox";
  m.tag = "latest";
  image::LayerDescriptor l;
  l.digest = l.index = l.data = "sha256:" + std::string(64, 'c');
  l.size = 4096;
  m.layers.push_back(l);
  std::string text = image::manifest_to_json(m);
  EXPECT_EQ(image::manifest_from_json(text).name, "busybox");
  std::string big = text;
  big.replace(big.find(R"("schema":1)"), 10, R"("schema":1e300)");
  EXPECT_CODE(image::manifest_from_json(big), Code::kInvalidArgument);
  EXPECT_NE(message_of([&] { image::manifest_from_json(big); }).find("schema"), std::string::npos);
}

TEST(FuzzRegressions, ForkServerHeadersOfAnyShapeAreReadWithoutThrowing) {
  agent::fncall::Frame f;
  f.header = json::parse(R"({"type": 5, "exit_code": 1e300, "status": 4294967296, "message": 3, "seconds": "x"})");
  EXPECT_EQ(f.type(), "");
  EXPECT_FALSE(f.integer("exit_code"));
  EXPECT_FALSE(f.integer("status"));
  EXPECT_EQ(f.text("message", "failed"), "failed");
  EXPECT_EQ(f.number("seconds", 0.5), 0.5);
  f.header = json::parse(R"({"type": "status", "status": -9, "seconds": 2})");
  EXPECT_EQ(f.type(), "status");
  EXPECT_EQ(f.integer("status"), -9);
  EXPECT_EQ(f.number("seconds", 0), 2.0);
  f.header = json::array({1, 2});
  EXPECT_EQ(f.type(), "");
  EXPECT_FALSE(f.integer("status"));
}

TEST(FuzzRegressions, ForkServerFrameClaimingAHugeBlobCostsNoMoreThanItsBytes) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd agent_end(sv[0]), peer_end(sv[1]);
  std::string head = R"({"type":"compiled"})";
  std::string frame(8, '\0');
  std::uint32_t head_len = static_cast<std::uint32_t>(head.size()), blob_len = 200u << 20;
  std::memcpy(frame.data(), &head_len, 4);
  std::memcpy(frame.data() + 4, &blob_len, 4);
  frame += head + "only a few bytes";
  ASSERT_EQ(::send(peer_end.get(), frame.data(), frame.size(), 0), static_cast<ssize_t>(frame.size()));
  peer_end.reset();
  agent::fncall::Frame f;
  // The peer went away mid-blob: UNAVAILABLE, after at most one step of the blob was allocated.
  EXPECT_EQ(code_of([&] { agent::fncall::recv_frame(agent_end.get(), f, std::chrono::steady_clock::now()); }),
            Code::kUnavailable);
  EXPECT_LE(f.blob.capacity(), 2u << 20);
}

TEST(FuzzRegressions, OciLayoutJsonOfTheWrongShapeIsInvalidArgument) {
  namespace fs = std::filesystem;
  char tmpl[] = "/tmp/dsec-fuzz-regressions-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  fs::path dir = tmpl;
  const std::string digest = "sha256:" + std::string(64, '0');
  const std::vector<std::string> indexes = {R"({"manifests": [{"mediaType": 5, "digest": ")" + digest + R"("}]})",
                                            R"({"manifests": [3]})", R"({"manifests": [{"digest": 5}]})",
                                            R"({"manifests": [{"digest": ")" + digest + R"(", "platform": "linux"}]})",
                                            R"([1, 2])"};
  for (const std::string& index : indexes) {
    fs::remove_all(dir / "layout");
    fs::create_directories(dir / "layout" / "blobs" / "sha256");
    std::ofstream(dir / "layout" / "index.json") << index;
    image::TarLimits limits;
    std::vector<std::string> notes;
    EXPECT_EQ(code_of([&] {
                image::apply_oci_image(dir / "layout", dir / "root", image::WhiteoutMode::kApply, limits, notes);
              }),
              Code::kInvalidArgument)
        << index;
  }
  fs::remove_all(dir / "layout");
  fs::create_directories(dir / "layout");
  std::ofstream(dir / "layout" / "manifest.json") << R"([{"Layers": [5]}])";
  image::TarLimits limits;
  std::vector<std::string> notes;
  EXPECT_EQ(code_of([&] {
              image::apply_oci_image(dir / "layout", dir / "root", image::WhiteoutMode::kApply, limits, notes);
            }),
            Code::kInvalidArgument);
  fs::remove_all(dir);
}

std::string start_payload(std::uint32_t argc, const std::string& rest) {
  std::string p(4, '\0');
  std::memcpy(p.data(), &argc, 4);
  return p + rest;
}

std::string str(const std::string& s) {
  std::string p(4, '\0');
  std::uint32_t n = static_cast<std::uint32_t>(s.size());
  std::memcpy(p.data(), &n, 4);
  return p + s;
}

TEST(FuzzRegressions, StartPayloadCountsMustFitThePayload) {
  init_protocol::StartPayload p;
  std::string good = start_payload(2, str("/bin/echo") + str("hi")) + start_payload(1, str("A=1")) + str("/");
  ASSERT_TRUE(init_protocol::decode_start_payload(good, p));
  EXPECT_EQ(p.argv, (std::vector<std::string>{"/bin/echo", "hi"}));
  EXPECT_EQ(p.env, (std::vector<std::string>{"A=1"}));
  EXPECT_EQ(p.cwd, "/");
  init_protocol::StartPayload q;
  // 16 bytes cannot hold 12 strings (each costs 4 bytes of length at least): refused before anything is allocated.
  EXPECT_FALSE(init_protocol::decode_start_payload(start_payload(12, std::string(12, 'x')), q));
  EXPECT_TRUE(q.argv.empty());
  EXPECT_FALSE(init_protocol::decode_start_payload(start_payload(0, start_payload(0, "") + str("/")), q));  // no argv
  EXPECT_FALSE(init_protocol::decode_start_payload(good + "x", q));                                         // trailing
  EXPECT_FALSE(init_protocol::decode_start_payload(
      start_payload(1, str(std::string("a\0b", 3))) + start_payload(0, "") + str("/"), q));  // NUL
}

}  // namespace
}  // namespace dsec
