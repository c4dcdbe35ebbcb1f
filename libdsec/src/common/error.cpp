#include "dsec/error.hpp"

#include <array>
#include <utility>

namespace dsec {
namespace {

struct CodeEntry {
  Code code;
  std::string_view name;
  int http;
};

constexpr std::array<CodeEntry, 17> kCodes{{
    {Code::kOk, "OK", 200},
    {Code::kCancelled, "CANCELLED", 499},
    {Code::kUnknown, "UNKNOWN", 500},
    {Code::kInvalidArgument, "INVALID_ARGUMENT", 400},
    {Code::kDeadlineExceeded, "DEADLINE_EXCEEDED", 504},
    {Code::kNotFound, "NOT_FOUND", 404},
    {Code::kAlreadyExists, "ALREADY_EXISTS", 409},
    {Code::kPermissionDenied, "PERMISSION_DENIED", 403},
    {Code::kResourceExhausted, "RESOURCE_EXHAUSTED", 429},
    {Code::kFailedPrecondition, "FAILED_PRECONDITION", 412},
    {Code::kAborted, "ABORTED", 409},
    {Code::kOutOfRange, "OUT_OF_RANGE", 400},
    {Code::kUnimplemented, "UNIMPLEMENTED", 501},
    {Code::kInternal, "INTERNAL", 500},
    {Code::kUnavailable, "UNAVAILABLE", 503},
    {Code::kDataLoss, "DATA_LOSS", 500},
    {Code::kUnauthenticated, "UNAUTHENTICATED", 401},
}};

}  // namespace

std::string_view code_name(Code code) noexcept {
  for (const auto& e : kCodes)
    if (e.code == code) return e.name;
  return "UNKNOWN";
}

Code code_from_name(std::string_view name) noexcept {
  for (const auto& e : kCodes)
    if (e.name == name) return e.code;
  return Code::kUnknown;
}

int http_status(Code code) noexcept {
  for (const auto& e : kCodes)
    if (e.code == code) return e.http;
  return 500;
}

bool is_retryable(Code code) noexcept {
  return code == Code::kUnavailable || code == Code::kAborted || code == Code::kResourceExhausted;
}

Fault fault_of(Code code) noexcept {
  switch (code) {
    case Code::kUnknown:
    case Code::kDeadlineExceeded:
    case Code::kAborted:
    case Code::kInternal:
    case Code::kUnavailable:
    case Code::kDataLoss:
      return Fault::kInfrastructure;
    default:
      return Fault::kRequest;  // the caller's arguments, names, rights, quota or timing
  }
}

std::string_view fault_name(Fault fault) noexcept {
  return fault == Fault::kInfrastructure ? "infrastructure" : "request";
}

}  // namespace dsec
