// Fuzz target: what dsec-e2b decodes from E2B's SDKs (libdsec/src/e2b): Connect envelopes (a server stream's one
// request, a client stream's many), a unary call's JSON, the Connect-Timeout-Ms header, and multipart uploads. Bad
// input is an RpcError of invalid_argument or unimplemented (Connect) or INVALID_ARGUMENT (multipart); a stream's
// messages are objects, and an upload's parts lie within the body.
//
// Input: byte 0 picks the decoder (0 client stream, 1 server stream, 2 unary, 3 timeout header, 4 multipart whose
// Content-Type is the input up to the first newline); the rest is the body (or header value).
#include <cstddef>
#include <cstdint>
#include <string>

#include <boost/beast/http/field.hpp>

#include "dsec/error.hpp"
#include "fuzz_util.hpp"
#include "gateway/e2b/connect_rpc.hpp"
#include "gateway/e2b/multipart.hpp"
#include "http/http.hpp"

namespace {

namespace http = boost::beast::http;

dsec::agent::HttpRequest post(const char* content_type, std::string body) {
  dsec::agent::HttpRequest r{http::verb::post, "/process.Process/Start", 11};
  r.set(http::field::content_type, content_type);
  r.body() = std::move(body);
  return r;
}

void expect_connect_code(const dsec::e2b::RpcError& e, std::string_view what) {
  if (e.code() != "invalid_argument" && e.code() != "unimplemented")
    fuzz::fail(std::string(what) + ": refused with " + e.code() + ": " + e.what());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Input in(data, size);
  const std::uint8_t which = in.byte() % 5;
  try {
    switch (which) {
      case 0: {
        std::string body(in.rest());
        for (const auto& m : dsec::e2b::stream_messages(post("application/connect+json", body)))
          if (!m.is_object()) fuzz::fail("a client stream's message is not an object");
        break;
      }
      case 1:
        if (!dsec::e2b::stream_request(post("application/connect+json", std::string(in.rest()))).is_object())
          fuzz::fail("a stream's request is not an object");
        break;
      case 2:
        if (!dsec::e2b::unary_request(post("application/json", std::string(in.rest()))).is_object())
          fuzz::fail("a unary request is not an object");
        break;
      case 3: {
        auto r = post("application/connect+json", "");
        r.set("Connect-Timeout-Ms", std::string(in.rest()));
        if (auto t = dsec::e2b::connect_timeout(r); t && t->count() < 0) fuzz::fail("a negative timeout");
        break;
      }
      case 4: {
        const std::string type(in.until('\n'));
        const std::string body(in.rest());
        for (const auto& u : dsec::e2b::parse_multipart(type, body))
          if (u.data.size() > body.size() || u.path.size() > body.size()) fuzz::fail("a part larger than its body");
        break;
      }
    }
  } catch (const dsec::e2b::RpcError& e) {
    expect_connect_code(e, "Connect decoding");
  } catch (const dsec::Error& e) {
    fuzz::expect_code(e, dsec::Code::kInvalidArgument, "multipart");
  }
  return 0;
}
