// The JSON field helpers the v1 codecs share (common/protocol/*.cpp). Private to the codecs: request decoders throw
// INVALID_ARGUMENT naming the field ("resources.memory: ..."), answer decoders INTERNAL ("malformed answer: ...").
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/protocol/body.hpp"
#include "common/protocol/limits.hpp"
#include "dsec/error.hpp"
#include "dsec/spec.hpp"

namespace dsec::protocol::fields {

using nlohmann::json;

// A request's field that is not what it should be: INVALID_ARGUMENT, "field: what".
[[noreturn]] void bad(std::string_view field, std::string_view what);

// j[key], or nullptr when it is missing or null.
const json* find(const json& j, const char* key);

// Members of a request, `fallback` when missing or null; INVALID_ARGUMENT naming `field` when of another type.
std::string get_string(const json& j, const char* key, std::string_view field, std::string fallback = {});
bool get_bool(const json& j, const char* key, std::string_view field, bool fallback);
double get_number(const json& j, const char* key, std::string_view field, double fallback);
std::uint64_t get_unsigned(const json& j, const char* key, std::string_view field, std::uint64_t fallback);
// Sizes are bytes as an integer, or a string such as "512Mi".
std::uint64_t get_size(const json& j, const char* key, std::string_view field, std::uint64_t fallback);
std::map<std::string, std::string> get_string_map(const json& j, const char* key, std::string_view field);
std::vector<std::string> get_string_list(const json& j, const char* key, std::string_view field);

bool has_nul(std::string_view s);

// An answer (what an agent sends back, or a record an agent wrote) that does not hold what it should: INTERNAL, as
// for an answer that is not JSON at all, naming the field.
[[noreturn]] void bad_answer(std::string_view field, std::string_view what);

// A member of an answer: missing or null is `fallback`; anything else must have the member's type, and a number must
// fit it. (Left to nlohmann's conversions, a number that does not fit its type is undefined behaviour, and a wrong
// type an exception that names no field.)
template <typename T>
T member(const json& j, const char* key, T fallback, std::string_view field = {}) {
  if (field.empty()) field = key;
  const json* v = find(j, key);
  if (!v) return fallback;
  if constexpr (std::is_same_v<T, bool>) {
    if (!v->is_boolean()) bad_answer(field, "must be true or false");
    return v->get<bool>();
  } else if constexpr (std::is_integral_v<T>) {
    using limits = std::numeric_limits<T>;
    if (v->is_number_unsigned()) {
      auto u = v->get<std::uint64_t>();
      if (u > static_cast<std::uint64_t>(limits::max())) bad_answer(field, fmt::format("{} is out of range", u));
      return static_cast<T>(u);
    }
    if (v->is_number_integer()) {
      auto i = v->get<std::int64_t>();
      if (i < static_cast<std::int64_t>(limits::min()) ||
          (i > 0 && static_cast<std::uint64_t>(i) > static_cast<std::uint64_t>(limits::max())))
        bad_answer(field, fmt::format("{} is out of range", i));
      return static_cast<T>(i);
    }
    if (v->is_number_float()) {
      // An integer written as 1e3, or one too large for JSON's integers: whole and within T's range only.
      double d = v->get<double>();
      if (!(d >= static_cast<double>(limits::min()) && d < std::ldexp(1.0, limits::digits)) || d != std::floor(d))
        bad_answer(field, fmt::format("{} is not an integer in range", d));
      return static_cast<T>(d);
    }
    bad_answer(field, "must be an integer");
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!v->is_number()) bad_answer(field, "must be a number");
    return v->get<double>();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!v->is_string()) bad_answer(field, "must be a string");
    return v->get<std::string>();
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    if (!v->is_array()) bad_answer(field, "must be a list of strings");
    T out;
    for (const auto& x : *v) {
      if (!x.is_string()) bad_answer(field, "must be a list of strings");
      out.push_back(x.get<std::string>());
    }
    return out;
  } else {
    static_assert(std::is_same_v<T, Labels>);
    if (!v->is_object()) bad_answer(field, "must be an object of strings");
    T out;
    for (auto it = v->begin(); it != v->end(); ++it) {
      if (!it->is_string()) bad_answer(fmt::format("{}.{}", field, it.key()), "must be a string");
      out.emplace(it.key(), it->get_ref<const std::string&>());
    }
    return out;
  }
}

// The same for a string member, which is more often given as a literal.
std::string member(const json& j, const char* key, const char* fallback, std::string_view field = {});

void expect_object(const json& j, std::string_view what);

// A request id (exec, function call, sandbox create): INVALID_ARGUMENT "request_id: at most 128 bytes" when longer
// or holding a NUL.
void validate_request_id(std::string_view id);

// How a command ended, as exec and function call results both carry it (ExecResult, FnCallResult): exit_code,
// signal, stdout and stderr (base64), their truncation flags and timed_out. Each result's codec adds its own fields.
template <typename Result>
json encode_run_outcome(const Result& r) {
  return json{{"exit_code", r.exit_code},
              {"signal", r.signal},
              {"stdout", base64_encode(r.stdout_data)},
              {"stderr", base64_encode(r.stderr_data)},
              {"stdout_truncated", r.stdout_truncated},
              {"stderr_truncated", r.stderr_truncated},
              {"timed_out", r.timed_out}};
}
template <typename Result>
void decode_run_outcome(const json& j, Result& r) {
  r.exit_code = member(j, "exit_code", -1);
  r.signal = member(j, "signal", 0);
  r.stdout_data = base64_decode(member(j, "stdout", ""));
  r.stderr_data = base64_decode(member(j, "stderr", ""));
  r.stdout_truncated = member(j, "stdout_truncated", false);
  r.stderr_truncated = member(j, "stderr_truncated", false);
  r.timed_out = member(j, "timed_out", false);
}

void validate_labels(const Labels& labels, std::string_view field);
void validate_env(const Env& env, std::string_view field);
// "name[:tag]" or, pinned to one manifest, "name[:tag]@sha256:<64 hex>".
void validate_image_ref(std::string_view image, std::string_view field);

}  // namespace dsec::protocol::fields
