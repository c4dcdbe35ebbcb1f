// Fuzz target: the JSON codecs of the v1 wire (common/protocol.hpp). The input is a request or answer body; it is
// parsed as the agent and the client parse bodies (protocol::parse_body), then given to every decoder, as is and
// each of its members (batches and lists carry decoded values one level down).
//
// Properties:
//  - The decoders of requests the agent takes from the network (decode_spec, decode_exec_request,
//    decode_fncall_request, decode_network) refuse bad input with dsec::Error INVALID_ARGUMENT and nothing else: the
//    agent answers 400 naming the field.
//  - The decoders of answers the client takes from an agent (exec and call results, sandbox and node info, errors)
//    throw nothing but dsec::Error or nlohmann's own exceptions (the client reports both as a bad answer).
//  - Whatever decodes, encodes to JSON text that decodes again to the same thing (encode(decode(encode(x))) ==
//    encode(x)), so what one side sends the other reads back unchanged.
//  - base64: decode(encode(bytes)) == bytes; malformed base64 is INVALID_ARGUMENT.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/protocol.hpp"
#include "common/protocol/screen.hpp"
#include "dsec/error.hpp"
#include "fuzz_util.hpp"

namespace {

using dsec::Code;
using dsec::Error;
using nlohmann::json;
namespace protocol = dsec::protocol;

json reparse(const json& j, std::string_view what) {
  try {
    return json::parse(j.dump());
  } catch (const json::exception& e) {
    fuzz::fail(std::string(what) + ": its own encoding does not parse: " + e.what());
  }
}

// A request decoder: INVALID_ARGUMENT or a value that survives encode and decode.
template <typename Decode>
void request_round_trip(const json& j, Decode decode, std::string_view what) {
  json first;
  try {
    first = protocol::encode(decode(j));
  } catch (const Error& e) {
    fuzz::expect_code(e, Code::kInvalidArgument, what);
    return;
  } catch (const std::exception& e) {
    fuzz::fail(std::string(what) + ": threw something other than dsec::Error: " + e.what());
  }
  json again;
  try {
    again = protocol::encode(decode(reparse(first, what)));
  } catch (const std::exception& e) {
    fuzz::fail(std::string(what) + ": refused its own encoding " + first.dump() + ": " + e.what());
  }
  if (again != first) fuzz::fail(std::string(what) + ": encode/decode changed " + first.dump() + " to " + again.dump());
}

// An answer decoder: dsec::Error, nlohmann's exceptions, or a value that survives encode and decode.
template <typename Decode>
void answer_round_trip(const json& j, Decode decode, std::string_view what) {
  json first;
  try {
    first = protocol::encode(decode(j));
  } catch (const Error&) {
    return;
  } catch (const json::exception&) {
    return;
  } catch (const std::exception& e) {
    fuzz::fail(std::string(what) + ": threw something other than dsec::Error or a JSON error: " + e.what());
  }
  json again;
  try {
    again = protocol::encode(decode(reparse(first, what)));
  } catch (const std::exception& e) {
    fuzz::fail(std::string(what) + ": refused its own encoding " + first.dump() + ": " + e.what());
  }
  if (again != first) fuzz::fail(std::string(what) + ": encode/decode changed " + first.dump() + " to " + again.dump());
}

void decode_all(const json& j) {
  request_round_trip(j, protocol::decode_spec, "decode_spec");
  request_round_trip(j, protocol::decode_exec_request, "decode_exec_request");
  request_round_trip(j, protocol::decode_fncall_request, "decode_fncall_request");
  request_round_trip(j, protocol::decode_network, "decode_network");
  // A full VM's screen input (POST /v1/sandboxes/{id}/screen/input): INVALID_ARGUMENT, or actions that survive
  // encode and decode.
  {
    json first;
    try {
      first = protocol::encode_input(protocol::decode_input(j));
    } catch (const Error& e) {
      fuzz::expect_code(e, Code::kInvalidArgument, "decode_input");
    } catch (const std::exception& e) {
      fuzz::fail(std::string("decode_input: threw something other than dsec::Error: ") + e.what());
    }
    if (!first.is_null()) {
      json again;
      try {
        again = protocol::encode_input(protocol::decode_input(reparse(first, "decode_input")));
      } catch (const std::exception& e) {
        fuzz::fail("decode_input: refused its own encoding " + first.dump() + ": " + e.what());
      }
      if (again != first) fuzz::fail("decode_input: encode/decode changed " + first.dump() + " to " + again.dump());
    }
  }
  answer_round_trip(j, protocol::decode_exec_result, "decode_exec_result");
  answer_round_trip(j, protocol::decode_fncall_result, "decode_fncall_result");
  answer_round_trip(j, protocol::decode_sandbox_info, "decode_sandbox_info");
  answer_round_trip(j, protocol::decode_node_info, "decode_node_info");
  for (int status : {400, 404, 500, 503}) {
    try {
      Error e = protocol::decode_error(j, status);
      Error again = protocol::decode_error(reparse(protocol::encode_error(e), "decode_error"), status);
      if (again.code() != e.code() || std::string_view(again.what()) != e.what() || again.retryable() != e.retryable())
        fuzz::fail("decode_error: encode/decode changed the error");
    } catch (const json::exception&) {
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);

  std::string bytes(text);
  if (protocol::base64_decode(protocol::base64_encode(bytes)) != bytes) fuzz::fail("base64: decode(encode(x)) != x");
  try {
    std::string decoded = protocol::base64_decode(text);
    if (decoded.size() > text.size()) fuzz::fail("base64_decode: more bytes out than in");
  } catch (const Error& e) {
    fuzz::expect_code(e, Code::kInvalidArgument, "base64_decode");
  }

  json j;
  try {
    j = protocol::parse_body(text);
  } catch (const Error& e) {
    fuzz::expect_code(e, Code::kInvalidArgument, "parse_body");
    return 0;
  }
  decode_all(j);
  if (j.is_structured()) {
    int members = 0;
    for (const auto& member : j) {
      if (++members > 32) break;
      decode_all(member);
    }
  }
  return 0;
}
