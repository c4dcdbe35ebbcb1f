#include "common/protocol/fields_internal.hpp"

#include <cctype>

#include "dsec/spec.hpp"

namespace dsec::protocol::fields {

[[noreturn]] void bad(std::string_view field, std::string_view what) {
  throw Error(Code::kInvalidArgument, fmt::format("{}: {}", field, what));
}

const json* find(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string get_string(const json& j, const char* key, std::string_view field, std::string fallback) {
  const json* v = find(j, key);
  if (!v) return fallback;
  if (!v->is_string()) bad(field, "must be a string");
  return v->get<std::string>();
}

bool get_bool(const json& j, const char* key, std::string_view field, bool fallback) {
  const json* v = find(j, key);
  if (!v) return fallback;
  if (!v->is_boolean()) bad(field, "must be true or false");
  return v->get<bool>();
}

double get_number(const json& j, const char* key, std::string_view field, double fallback) {
  const json* v = find(j, key);
  if (!v) return fallback;
  if (!v->is_number()) bad(field, "must be a number");
  double d = v->get<double>();
  if (!std::isfinite(d)) bad(field, "must be finite");
  return d;
}

std::uint64_t get_unsigned(const json& j, const char* key, std::string_view field, std::uint64_t fallback) {
  const json* v = find(j, key);
  if (!v) return fallback;
  if (v->is_number_unsigned()) return v->get<std::uint64_t>();
  if (v->is_number_integer()) {
    if (v->get<std::int64_t>() < 0) bad(field, "must not be negative");
    return static_cast<std::uint64_t>(v->get<std::int64_t>());
  }
  bad(field, "must be a non-negative integer");
}

std::uint64_t get_size(const json& j, const char* key, std::string_view field, std::uint64_t fallback) {
  const json* v = find(j, key);
  if (!v) return fallback;
  if (v->is_string()) {
    auto parsed = parse_size(v->get<std::string>());
    if (!parsed)
      bad(field, fmt::format("'{}' is not a size (examples: 4096, \"512Mi\", \"2G\")", v->get<std::string>()));
    return *parsed;
  }
  return get_unsigned(j, key, field, fallback);
}

std::map<std::string, std::string> get_string_map(const json& j, const char* key, std::string_view field) {
  std::map<std::string, std::string> out;
  const json* v = find(j, key);
  if (!v) return out;
  if (!v->is_object()) bad(field, "must be an object of strings");
  for (auto& [k, val] : v->items()) {
    if (!val.is_string()) bad(fmt::format("{}.{}", field, k), "must be a string");
    out.emplace(k, val.get<std::string>());
  }
  return out;
}

bool has_nul(std::string_view s) { return s.find('\0') != std::string_view::npos; }

std::vector<std::string> get_string_list(const json& j, const char* key, std::string_view field) {
  std::vector<std::string> out;
  const json* v = find(j, key);
  if (!v) return out;
  if (!v->is_array()) bad(field, "must be an array of strings");
  for (std::size_t i = 0; i < v->size(); ++i) {
    if (!(*v)[i].is_string()) bad(fmt::format("{}[{}]", field, i), "must be a string");
    out.push_back((*v)[i].get<std::string>());
  }
  return out;
}

[[noreturn]] void bad_answer(std::string_view field, std::string_view what) {
  throw Error(Code::kInternal, fmt::format("malformed answer: {}: {}", field, what));
}

std::string member(const json& j, const char* key, const char* fallback, std::string_view field) {
  return member<std::string>(j, key, std::string(fallback), field);
}

void expect_object(const json& j, std::string_view what) {
  if (!j.is_object()) bad_answer(what, "must be a JSON object");
}

void validate_labels(const Labels& labels, std::string_view field) {
  for (const auto& [k, v] : labels)
    if (k.empty() || k.size() > kMaxLabelKeyBytes || has_nul(k) || has_nul(v) || k.find('=') != std::string::npos)
      bad(fmt::format("{}.{}", field, k),
          fmt::format("a label key must be non-empty, at most {} bytes, without '=' or NUL", kMaxLabelKeyBytes));
}

void validate_request_id(std::string_view id) {
  if (id.size() > kMaxRequestIdBytes || has_nul(id))
    bad("request_id", fmt::format("at most {} bytes", kMaxRequestIdBytes));
}

void validate_env(const Env& env, std::string_view field) {
  for (const auto& [k, v] : env) {
    if (k.empty() || k.find('=') != std::string::npos || has_nul(k))
      bad(fmt::format("{}.{}", field, k), "a variable name must be non-empty, without '=' or NUL");
    if (has_nul(v)) bad(fmt::format("{}.{}", field, k), "a value must not contain NUL");
  }
}

void validate_image_ref(std::string_view image, std::string_view field) {
  auto name_ok = [](std::string_view n) {
    if (n.empty() || n.size() > 255 || n.front() == '.' || n.front() == '/') return false;
    for (char c : n)
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' || c == '/' || c == ':'))
        return false;
    return n.find("..") == std::string_view::npos;
  };
  auto digest_ok = [](std::string_view d) {
    if (d.size() != 71 || d.substr(0, 7) != "sha256:") return false;
    for (char c : d.substr(7))
      if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
    return true;
  };
  std::size_t at = image.find('@');
  if (!name_ok(image.substr(0, at)))
    bad(field, fmt::format("'{}' is not a valid image name (letters, digits, - _ . / :)", image));
  if (at != std::string_view::npos && !digest_ok(image.substr(at + 1)))
    bad(field, fmt::format("'{}': a pinned image ends in @sha256: and 64 lowercase hex digits", image));
}

}  // namespace dsec::protocol::fields
