// An error on the v1 wire: every failed call's body.
#pragma once

#include "common/protocol/body.hpp"
#include "dsec/error.hpp"

namespace dsec::protocol {

// {"code": "NOT_FOUND", "message": "...", "retryable": false}
json encode_error(const Error& error);
Error decode_error(const json& j, int http_status);

}  // namespace dsec::protocol
