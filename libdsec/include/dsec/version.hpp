#pragma once

namespace dsec {
inline constexpr const char* kVersion = "0.1.0";
inline constexpr const char* kProtocolVersion = "v1";
}  // namespace dsec
