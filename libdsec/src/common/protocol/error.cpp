#include "common/protocol/error.hpp"

#include <fmt/format.h>

#include "common/protocol/fields_internal.hpp"

namespace dsec::protocol {

using namespace fields;

json encode_error(const Error& e) {
  json j{{"code", std::string(e.code_name())},
         {"message", e.what()},
         {"retryable", e.retryable()},
         {"fault", std::string(fault_name(e.fault()))}};
  if (e.outcome_unknown()) j["outcome_unknown"] = true;
  return j;
}

Error decode_error(const json& j, int status) {
  if (j.is_object() && j.contains("code") && j["code"].is_string()) {
    // Never throws: an error body with members of the wrong type still becomes an error, with what it holds.
    Code code = code_from_name(j["code"].get<std::string>());
    std::string message;
    if (auto m = j.find("message"); m != j.end() && !m->is_null())
      message = m->is_string() ? m->get<std::string>() : m->dump();
    bool retryable = is_retryable(code);
    if (auto r = j.find("retryable"); r != j.end() && r->is_boolean()) retryable = r->get<bool>();
    Fault fault = fault_of(code);
    if (auto f = j.find("fault"); f != j.end() && f->is_string())
      fault = f->get<std::string>() == "infrastructure" ? Fault::kInfrastructure : Fault::kRequest;
    // An agent older than the field says it only in its message.
    bool outcome_unknown = code == Code::kDataLoss && message.find(kOutcomeUnknownPrefix) != std::string::npos;
    if (auto u = j.find("outcome_unknown"); u != j.end() && u->is_boolean()) outcome_unknown = u->get<bool>();
    return Error(code, message, retryable, fault, outcome_unknown);
  }
  Code code = status == 404   ? Code::kNotFound
              : status == 400 ? Code::kInvalidArgument
              : status == 503 ? Code::kUnavailable
              : status == 504 ? Code::kDeadlineExceeded
                              : Code::kUnknown;
  return Error(code, fmt::format("agent answered HTTP {} without a dsec error body", status));
}

}  // namespace dsec::protocol
