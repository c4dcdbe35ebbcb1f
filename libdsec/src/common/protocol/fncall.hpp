// Function calls on the v1 wire (POST /v1/fncall, docs/protocol.md): requests, results and GPU modes.
#pragma once

#include <cstddef>
#include <string_view>

#include "common/protocol/body.hpp"
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

// The languages a call may name (a node serves those it has pools for; GET /v1/node lists them).
inline constexpr const char* kFnCallLanguages[] = {"python", "shell", "c", "cpp"};
// Bounds of one call's request: the code, stdin, and all files together; one batch's number of calls.
inline constexpr std::size_t kMaxFnCallCodeBytes = 4u << 20;
inline constexpr std::size_t kMaxFnCallInputBytes = 64u << 20;
inline constexpr std::size_t kMaxFnCallFiles = 1024;
inline constexpr std::size_t kMaxFnCallArgs = 4096;
inline constexpr std::size_t kMaxFnCallBatch = 1024;
inline constexpr double kMaxFnCallTimeoutSeconds = 3600;

}  // namespace dsec::protocol
