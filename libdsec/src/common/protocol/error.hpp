// An error on the v1 wire: every failed call's body.
#pragma once

#include <string_view>

#include "common/protocol/body.hpp"
#include "dsec/error.hpp"

namespace dsec::protocol {

// {"code": "NOT_FOUND", "message": "...", "retryable": false, "fault": "request"}, and "outcome_unknown": true for
// an exactly-once request whose outcome cannot be known (Error::outcome_unknown). Decoding never throws: an error
// body with members missing or of the wrong type still becomes an Error, with what it holds; unknown members are
// ignored.
json encode_error(const Error& error);
Error decode_error(const json& j, int http_status);

// What the message of an outcome-unknown error says (docs/errors.md); agents before the field said it only so.
inline constexpr std::string_view kOutcomeUnknownPrefix = "outcome unknown:";

}  // namespace dsec::protocol
