// The E2B gateway's wire pieces: Connect envelopes and errors, envd's Basic user, paths under a home.
#include <gtest/gtest.h>

#include <boost/beast/http/field.hpp>

#include "common/protocol.hpp"
#include "error_test_util.hpp"
#include "gateway/e2b/connect_rpc.hpp"
#include "gateway/e2b/gateway.hpp"

namespace dsec::e2b {
namespace {

namespace http = boost::beast::http;

agent::HttpRequest post(std::string content_type, std::string body) {
  agent::HttpRequest r{http::verb::post, "/process.Process/Start", 11};
  r.set(http::field::content_type, content_type);
  r.body() = std::move(body);
  return r;
}

TEST(ConnectRpc, EnvelopeIsFlagsLengthPayload) {
  const std::string e = envelope(0x02, "{}");
  ASSERT_EQ(e.size(), 7u);
  EXPECT_EQ(e[0], '\x02');
  EXPECT_EQ(e.substr(1, 4), std::string("\0\0\0\x02", 4));
  EXPECT_EQ(e.substr(5), "{}");
  EXPECT_EQ(envelope(0, std::string(300, 'x')).substr(1, 4), std::string("\0\0\x01\x2c", 4));
}

TEST(ConnectRpc, StreamRequestReadsItsOneEnvelope) {
  const std::string msg = R"({"process":{"cmd":"/bin/bash"}})";
  json m = stream_request(post("application/connect+json", envelope(0, msg)));
  EXPECT_EQ(m["process"]["cmd"], "/bin/bash");
}

TEST(ConnectRpc, MalformedStreamRequestsAreInvalidArgument) {
  auto code_of = [](agent::HttpRequest r) {
    std::optional<RpcError> e = dsec::test::thrown<RpcError>([&] { stream_request(r); });
    return e ? e->code() : std::string("none");
  };
  EXPECT_EQ(code_of(post("application/connect+json", "abc")), "invalid_argument");                    // short
  EXPECT_EQ(code_of(post("application/connect+json", envelope(0, "{}") + "x")), "invalid_argument");  // two
  EXPECT_EQ(code_of(post("application/connect+json", envelope(0, "[1]"))), "invalid_argument");       // not an object
  EXPECT_EQ(code_of(post("application/json", envelope(0, "{}"))), "invalid_argument");                // wrong type
  EXPECT_EQ(code_of(post("application/connect+json", envelope(1, "{}"))), "unimplemented");           // compressed
}

TEST(ConnectRpc, UnaryErrorsCarryTheCodeAsAStringAndItsStatus) {
  agent::HttpResponse r = unary_error(RpcError("not_found", "path '/x' does not exist"));
  EXPECT_EQ(r.result_int(), 404u);
  json body = json::parse(r.body());
  EXPECT_EQ(body["code"], "not_found");
  EXPECT_EQ(body["message"], "path '/x' does not exist");
  EXPECT_EQ(unary_error(RpcError("already_exists", "")).result_int(), 409u);
  EXPECT_EQ(unary_error(RpcError("unauthenticated", "")).result_int(), 401u);
  EXPECT_EQ(rpc_error(Error(Code::kResourceExhausted, "full")).code(), "resource_exhausted");
  EXPECT_EQ(rpc_error(Error(Code::kCancelled, "gone")).code(), "canceled");
}

TEST(ConnectRpc, TimeoutHeaderIsDigitsOnly) {
  agent::HttpRequest r = post("application/connect+json", "");
  EXPECT_FALSE(connect_timeout(r).has_value());
  r.set("Connect-Timeout-Ms", "60000");
  EXPECT_EQ(connect_timeout(r)->count(), 60000);
  r.set("Connect-Timeout-Ms", "-5");
  EXPECT_THROW(connect_timeout(r), RpcError);
  r.set("Keepalive-Ping-Interval", "50");
  EXPECT_EQ(keepalive_interval(r).count(), 50000);
}

TEST(Envd, BasicAuthNamesTheUser) {
  agent::HttpRequest r = post("application/json", "");
  EXPECT_EQ(basic_auth_user(r), "");
  r.set(http::field::authorization, "Basic " + protocol::base64_encode("root:"));
  EXPECT_EQ(basic_auth_user(r), "root");
  r.set(http::field::authorization, "Bearer x");
  EXPECT_THROW(basic_auth_user(r), RpcError);
}

TEST(Envd, HostNamesNameTheirSandbox) {
  EXPECT_EQ(sandbox_of_host("49983-node1-abc123.sb.example.com", "sb.example.com"), "node1-abc123");
  EXPECT_EQ(sandbox_of_host("49983-node1-abc123.sb.example.com:8443", "sb.example.com"), "node1-abc123");
  EXPECT_EQ(sandbox_of_host("api.sb.example.com", "sb.example.com"), "");         // no port
  EXPECT_EQ(sandbox_of_host("49983-x.other.example.com", "sb.example.com"), "");  // another domain
  EXPECT_EQ(sandbox_of_host("49983-x.sb.example.com", ""), "");                   // no --domain
  EXPECT_EQ(sandbox_of_host("127.0.0.1:3000", "sb.example.com"), "");
}

TEST(Envd, PathsResolveUnderTheHome) {
  EXPECT_EQ(resolve_path("/etc/hosts", "/home/user"), "/etc/hosts");
  EXPECT_EQ(resolve_path("a/b.txt", "/home/user"), "/home/user/a/b.txt");
  EXPECT_EQ(resolve_path("~", "/root"), "/root");
  EXPECT_EQ(resolve_path("~/x", "/root"), "/root/x");
  EXPECT_EQ(resolve_path("x", "/"), "/x");
}

}  // namespace
}  // namespace dsec::e2b
