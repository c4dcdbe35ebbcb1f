// Function calls on the v1 wire (POST /v1/fncall, docs/protocol.md): requests, results and GPU modes.
#pragma once

#include <cstddef>
#include <string_view>

#include "common/protocol/body.hpp"
#include "common/protocol/limits.hpp"
#include "dsec/fncall.hpp"

namespace dsec::protocol {

// The request decoder validates every field; a request body may also carry "image_manifest" (a pinned image's
// manifest, as create sends it), which the route reads itself.
json encode(const FnCallRequest& request);
FnCallRequest decode_fncall_request(const json& j);

// The answer of one call. decode_fncall_result also reads a batch element that is {"error": {"code", "message"}}:
// the result then carries error_code and error and nothing else.
json encode(const FnCallResult& result);
FnCallResult decode_fncall_result(const json& j);

// "none", "exclusive", "shared"; parse_gpu_mode throws INVALID_ARGUMENT naming `field` for anything else.
std::string_view gpu_mode_name(GpuMode mode) noexcept;
GpuMode parse_gpu_mode(std::string_view name, std::string_view field = "gpu_mode");

}  // namespace dsec::protocol
