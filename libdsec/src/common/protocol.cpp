#include "common/protocol.hpp"

#include "common/network_rules.hpp"

#include <openssl/evp.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

namespace dsec::protocol {
namespace {

[[noreturn]] void bad(std::string_view field, std::string_view what) {
  throw Error(Code::kInvalidArgument, fmt::format("{}: {}", field, what));
}

const json* find(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string get_string(const json& j, const char* key, std::string_view field, std::string fallback = {}) {
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

// Sizes are bytes as an integer, or a string such as "512Mi".
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

// An answer (what an agent sends back, or a record an agent wrote) that does not hold what it should: INTERNAL, as
// for an answer that is not JSON at all, naming the field.
[[noreturn]] void bad_answer(std::string_view field, std::string_view what) {
  throw Error(Code::kInternal, fmt::format("malformed answer: {}: {}", field, what));
}

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
std::string member(const json& j, const char* key, const char* fallback, std::string_view field = {}) {
  return member<std::string>(j, key, std::string(fallback), field);
}

void expect_object(const json& j, std::string_view what) {
  if (!j.is_object()) bad_answer(what, "must be a JSON object");
}

constexpr std::uint64_t kMaxGpus = 256;

void validate_labels(const Labels& labels, std::string_view field) {
  for (const auto& [k, v] : labels)
    if (k.empty() || k.size() > 253 || has_nul(k) || has_nul(v) || k.find('=') != std::string::npos)
      bad(fmt::format("{}.{}", field, k), "a label key must be non-empty, at most 253 bytes, without '=' or NUL");
}

void validate_env(const Env& env, std::string_view field) {
  for (const auto& [k, v] : env) {
    if (k.empty() || k.find('=') != std::string::npos || has_nul(k))
      bad(fmt::format("{}.{}", field, k), "a variable name must be non-empty, without '=' or NUL");
    if (has_nul(v)) bad(fmt::format("{}.{}", field, k), "a value must not contain NUL");
  }
}

}  // namespace

json parse_body(std::string_view body) {
  if (body.empty()) return json::object();
  try {
    return json::parse(body);
  } catch (const json::exception& e) {
    // Syntax errors, and numbers too large for a double (1e999: out_of_range, not a parse_error).
    throw Error(Code::kInvalidArgument, fmt::format("request body is not valid JSON: {}", e.what()));
  }
}

json encode(const SandboxSpec& s) {
  json j{
      {"image", s.image},
      {"kind", s.kind},
      {"resources",
       {{"cpu", s.resources.cpu},
        {"memory", s.resources.memory_bytes},
        {"disk", s.resources.disk_bytes},
        {"pids", s.resources.pids},
        {"open_files", s.resources.open_files},
        {"gpus", s.resources.gpus}}},
      {"ttl", s.ttl.count()},
      {"env", s.env},
      {"labels", s.labels},
      {"tenant", s.tenant},
      {"hostname", s.hostname},
      {"workdir", s.workdir},
      {"allow_ptrace", s.allow_ptrace},
      {"request_id", s.request_id},
      {"node_selector", s.node_selector},
      {"anti_affinity", s.anti_affinity},
      {"group", s.group},
      {"group_ttl", s.group_ttl.count()},
  };
  // Written only when set, so a spec without them encodes (and fingerprints, for request ids) as before.
  if (s.resources.egress_mbps) j["resources"]["egress_mbps"] = s.resources.egress_mbps;
  if (s.resources.connections) j["resources"]["connections"] = s.resources.connections;
  if (!s.user.empty()) j["user"] = s.user;
  if (!s.protected_paths.empty()) j["protected_paths"] = s.protected_paths;
  if (s.network.mode != "none" || !s.network.rules.empty()) j["network"] = encode(s.network);
  if (!s.display.empty()) j["display"] = s.display;
  if (s.resources.priority != Priority::kStandard) j["priority"] = priority_name(s.resources.priority);
  if (s.resources.ksm) j["ksm"] = true;
  if (s.queue_timeout.count() > 0) j["queue_timeout"] = static_cast<double>(s.queue_timeout.count()) / 1000;
  if (!s.resources.reclaim) j["reclaim"] = false;
  return j;
}

SandboxSpec decode_spec(const json& j) {
  if (!j.is_object()) bad("spec", "must be a JSON object");
  SandboxSpec s;
  s.image = get_string(j, "image", "image", s.image);
  s.kind = get_string(j, "kind", "kind", s.kind);
  if (const json* r = find(j, "resources")) {
    if (!r->is_object()) bad("resources", "must be an object");
    s.resources.cpu = get_number(*r, "cpu", "resources.cpu", s.resources.cpu);
    s.resources.memory_bytes = get_size(*r, "memory", "resources.memory", s.resources.memory_bytes);
    s.resources.disk_bytes = get_size(*r, "disk", "resources.disk", s.resources.disk_bytes);
    auto pids = get_unsigned(*r, "pids", "resources.pids", s.resources.pids);
    if (pids > 1u << 22) bad("resources.pids", "at most 4194304");
    s.resources.pids = static_cast<std::uint32_t>(pids);
    auto files = get_unsigned(*r, "open_files", "resources.open_files", s.resources.open_files);
    if (files > 1u << 20) bad("resources.open_files", "at most 1048576");
    s.resources.open_files = static_cast<std::uint32_t>(files);
    auto gpus = get_unsigned(*r, "gpus", "resources.gpus", s.resources.gpus);
    if (gpus > kMaxGpus) bad("resources.gpus", fmt::format("at most {}", kMaxGpus));
    s.resources.gpus = static_cast<std::uint32_t>(gpus);
    auto mbps = get_unsigned(*r, "egress_mbps", "resources.egress_mbps", 0);
    if (mbps > 400000) bad("resources.egress_mbps", "at most 400000 (400 Gbit/s); 0 is unlimited");
    s.resources.egress_mbps = static_cast<std::uint32_t>(mbps);
    auto connections = get_unsigned(*r, "connections", "resources.connections", 0);
    if (connections > 1u << 20) bad("resources.connections", "at most 1048576; 0 is unlimited");
    s.resources.connections = static_cast<std::uint32_t>(connections);
  }
  double ttl = get_number(j, "ttl", "ttl", static_cast<double>(s.ttl.count()));
  if (ttl < 0 || ttl > static_cast<double>(kMaxTtlSeconds))
    bad("ttl", "must be between 0 (no TTL) and one year, in seconds");
  s.ttl = std::chrono::seconds{static_cast<std::int64_t>(ttl)};
  s.env = get_string_map(j, "env", "env");
  s.labels = get_string_map(j, "labels", "labels");
  s.tenant = get_string(j, "tenant", "tenant");
  s.hostname = get_string(j, "hostname", "hostname");
  s.workdir = get_string(j, "workdir", "workdir", s.workdir);
  s.allow_ptrace = get_bool(j, "allow_ptrace", "allow_ptrace", false);
  s.request_id = get_string(j, "request_id", "request_id");
  s.node_selector = get_string_map(j, "node_selector", "node_selector");
  s.anti_affinity = get_string(j, "anti_affinity", "anti_affinity");
  s.group = get_string(j, "group", "group");
  double group_ttl = get_number(j, "group_ttl", "group_ttl", 0);
  if (group_ttl != 0 && (group_ttl < 1 || group_ttl > kMaxGroupTtlSeconds))
    bad("group_ttl", "must be from 1 to 86400 seconds");
  s.group_ttl = std::chrono::seconds{static_cast<std::int64_t>(group_ttl)};
  s.user = get_string(j, "user", "user");
  s.protected_paths = get_string_list(j, "protected_paths", "protected_paths");
  if (const json* n = find(j, "network")) s.network = decode_network(*n);
  s.display = get_string(j, "display", "display");
  {
    const std::string priority = get_string(j, "priority", "priority", "standard");
    auto p = parse_priority(priority);
    if (!p) bad("priority", fmt::format("'{}' is not latency, standard or batch", priority.substr(0, 40)));
    s.resources.priority = *p;
  }
  s.resources.ksm = get_bool(j, "ksm", "ksm", false);
  {
    double wait = get_number(j, "queue_timeout", "queue_timeout", 0);
    if (!(wait >= 0 && wait <= 3600)) bad("queue_timeout", "must be from 0 to 3600 seconds");
    s.queue_timeout = std::chrono::milliseconds{static_cast<std::int64_t>(wait * 1000)};
  }
  s.resources.reclaim = get_bool(j, "reclaim", "reclaim", true);
  validate(s);
  return s;
}

json encode(const NetworkPolicy& p) {
  json rules = json::array();
  for (const NetworkRule& r : p.rules) {
    json rule{{"allow", r.allow}, {"protocol", r.protocol}};
    if (r.host.empty()) rule["cidr"] = r.cidr;
    else rule["host"] = r.host;
    if (r.port_min != 0 || r.port_max != 0)
      rule["ports"] =
          r.port_min == r.port_max ? std::to_string(r.port_min) : fmt::format("{}-{}", r.port_min, r.port_max);
    rules.push_back(std::move(rule));
  }
  return json{{"mode", p.mode}, {"rules", std::move(rules)}};
}

json encode(const NetworkUsage& u) {
  return json{{"bytes_out", u.bytes_out},   {"packets_out", u.packets_out}, {"bytes_in", u.bytes_in},
              {"packets_in", u.packets_in}, {"refused", u.refused},         {"resolved", u.resolved}};
}

NetworkUsage decode_network_usage(const json& j) {
  expect_object(j, "network usage");
  NetworkUsage u;
  u.bytes_out = member(j, "bytes_out", u.bytes_out, "bytes_out");
  u.packets_out = member(j, "packets_out", u.packets_out, "packets_out");
  u.bytes_in = member(j, "bytes_in", u.bytes_in, "bytes_in");
  u.packets_in = member(j, "packets_in", u.packets_in, "packets_in");
  u.refused = member(j, "refused", u.refused, "refused");
  if (const json* resolved = find(j, "resolved")) {
    if (!resolved->is_object()) bad_answer("resolved", "must be an object of names to lists of addresses");
    for (auto it = resolved->begin(); it != resolved->end(); ++it)
      u.resolved[it.key()] =
          member<std::vector<std::string>>(*resolved, it.key().c_str(), {}, fmt::format("resolved.{}", it.key()));
  }
  return u;
}

// "none" | "open" | "egress" (no rules: nothing allowed), or {"mode": ..., "rules": [...]}; validated whole.
NetworkPolicy decode_network(const json& j) {
  NetworkPolicy p;
  if (j.is_string()) {
    p.mode = j.get<std::string>();
  } else if (j.is_object()) {
    for (const auto& [key, value] : j.items())
      if (key != "mode" && key != "rules") bad("network", fmt::format("unknown field '{}' (known: mode, rules)", key));
    p.mode = get_string(j, "mode", "network.mode", "egress");
    if (const json* rules = find(j, "rules")) {
      if (!rules->is_array()) bad("network.rules", "must be a list of rules");
      if (rules->size() > network::kMaxRules) bad("network.rules", fmt::format("at most {} rules", network::kMaxRules));
      for (std::size_t i = 0; i < rules->size(); ++i) {
        const json& r = (*rules)[i];
        const std::string at = fmt::format("network.rules[{}]", i);
        if (!r.is_object()) bad(at, "must be an object such as {\"cidr\": \"10.0.0.0/8\", \"ports\": \"443\"}");
        for (const auto& [key, value] : r.items())
          if (key != "allow" && key != "cidr" && key != "host" && key != "protocol" && key != "ports")
            bad(at, fmt::format("unknown field '{}' (known: allow, cidr, host, protocol, ports)", key));
        NetworkRule rule;
        rule.allow = get_bool(r, "allow", at + ".allow", true);
        rule.cidr = get_string(r, "cidr", at + ".cidr");
        rule.host = get_string(r, "host", at + ".host");
        if (rule.cidr.empty() && rule.host.empty())
          bad(at + ".cidr", "missing (an IPv4 address or network such as 10.0.0.0/8, or a host name as host)");
        rule.protocol = get_string(r, "protocol", at + ".protocol", "any");
        if (const json* ports = find(r, "ports")) {
          auto bad_ports = [&] {
            bad(at + ".ports", fmt::format("{} is not a port or a range such as \"80\" or \"8000-8100\" within "
                                           "1-65535",
                                           ports->dump()));
          };
          std::uint64_t lo = 0, hi = 0;
          if (ports->is_number_unsigned()) {
            lo = hi = ports->get<std::uint64_t>();
          } else if (ports->is_string()) {
            const std::string t = ports->get<std::string>();
            const std::size_t dash = t.find('-');
            auto num = [&](std::string_view v, std::uint64_t& out) {
              auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
              return !v.empty() && ec == std::errc() && ptr == v.data() + v.size();
            };
            std::string_view tv(t);
            if (!(dash == std::string::npos ? num(tv, lo) && (hi = lo, true)
                                            : num(tv.substr(0, dash), lo) && num(tv.substr(dash + 1), hi)))
              bad_ports();
          } else {
            bad_ports();
          }
          if (lo < 1 || hi > 65535 || hi < lo) bad_ports();
          rule.port_min = static_cast<std::uint16_t>(lo);
          rule.port_max = static_cast<std::uint16_t>(hi);
        }
        p.rules.push_back(std::move(rule));
      }
    }
  } else {
    bad("network", "must be \"none\", \"egress\", \"open\" or an object {\"mode\": ..., \"rules\": [...]}");
  }
  network::validate(p);
  return p;
}

namespace {

// "name[:tag]" or, pinned to one manifest, "name[:tag]@sha256:<64 hex>".
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

}  // namespace

// Memory and disk a sandbox may ask for: far beyond any node, and small enough that no sum of them in admission,
// quotas or metrics can wrap.
constexpr std::uint64_t kMaxResourceBytes = 16ull << 40;

void validate(const SandboxSpec& s) {
  validate_image_ref(s.image, "image");
  if (s.kind.empty()) bad("kind", "must not be empty");
  const auto& r = s.resources;
  if (!(r.cpu > 0) || r.cpu > 1024) bad("resources.cpu", "must be in (0, 1024] cores");
  if (r.memory_bytes < (4ull << 20)) bad("resources.memory", "must be at least 4Mi");
  if (r.memory_bytes > kMaxResourceBytes) bad("resources.memory", "at most 16Ti");
  if (r.disk_bytes < (1ull << 20)) bad("resources.disk", "must be at least 1Mi");
  if (r.disk_bytes > kMaxResourceBytes) bad("resources.disk", "at most 16Ti");
  network::validate(s.network);
  if (r.pids < 1) bad("resources.pids", "must be at least 1");
  if (r.open_files < 16) bad("resources.open_files", "must be at least 16");
  if (r.gpus > kMaxGpus) bad("resources.gpus", fmt::format("at most {}", kMaxGpus));
  validate_env(s.env, "env");
  validate_labels(s.labels, "labels");
  validate_labels(s.node_selector, "node_selector");
  if (!s.anti_affinity.empty() && !s.labels.count(s.anti_affinity))
    bad("anti_affinity", fmt::format("'{}' is not a key of the spec's labels (sandboxes are spread by that label's "
                                     "value)",
                                     s.anti_affinity));
  if (s.group.empty()) {
    if (s.group_ttl.count() != 0) bad("group_ttl", "only with a group");
  } else {
    if (!valid_group_id(s.group))
      bad("group", fmt::format("'{}' is not a group id (1 to 128 letters, digits, '.', '_', '-')", s.group));
    if (s.group_ttl.count() < 1 || s.group_ttl.count() > static_cast<std::int64_t>(kMaxGroupTtlSeconds))
      bad("group_ttl", "required with a group: from 1 to 86400 seconds");
  }
  if (s.hostname.size() > 64) bad("hostname", "at most 64 characters");
  for (char c : s.hostname)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.'))
      bad("hostname", "letters, digits, '-' and '.' only");
  if (s.workdir.empty() || s.workdir.front() != '/' || has_nul(s.workdir)) bad("workdir", "must be an absolute path");
  if (s.request_id.size() > 128 || has_nul(s.request_id)) bad("request_id", "at most 128 bytes");
  if (s.tenant.size() > 128 || has_nul(s.tenant)) bad("tenant", "at most 128 bytes");
  (void)parse_user(s.user, "user");
  validate_protected_paths(s.protected_paths, "protected_paths");
  if (!s.display.empty() && s.display != "none") {
    std::optional<DisplaySize> size = parse_display(s.display);
    if (!size)
      bad("display", fmt::format("'{}' is not a screen size: WIDTHxHEIGHT from 320x200 to 3840x2160, or none",
                                 s.display.substr(0, 40)));
    if (s.kind != "vm")
      bad("display", fmt::format("kind '{}' has no screen: only full VMs (kind 'vm') do", s.kind.substr(0, 40)));
  }
}

UserRef parse_user(std::string_view user, std::string_view field) {
  UserRef out;
  if (user.empty()) return out;
  auto all_digits = [](std::string_view t) {
    return !t.empty() && std::all_of(t.begin(), t.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  auto id = [&](std::string_view t, std::string_view what) -> std::uint32_t {
    // At most 5 digits fit the range; longer is out of range however it reads.
    std::uint64_t v = 0;
    for (char c : t.substr(0, 12)) v = v * 10 + static_cast<std::uint64_t>(c - '0');
    if (t.size() > 12 || v > kMaxUserId)
      bad(field, fmt::format("'{}': {} {} is out of range (0 to {})", user, what, t, kMaxUserId));
    return static_cast<std::uint32_t>(v);
  };
  std::size_t colon = user.find(':');
  if (colon != std::string_view::npos) {
    std::string_view u = user.substr(0, colon), g = user.substr(colon + 1);
    if (!all_digits(u) || !all_digits(g))
      bad(field, fmt::format("'{}' is neither a user name nor a numeric uid:gid", user));
    out.uid = id(u, "uid");
    out.gid = id(g, "gid");
    return out;
  }
  if (all_digits(user)) {
    out.uid = id(user, "uid");
    return out;
  }
  auto name_char = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  };
  std::string_view body = user.back() == '$' ? user.substr(0, user.size() - 1) : user;
  if (body.empty() || user.size() > 64 || body.front() == '-' || !std::all_of(body.begin(), body.end(), name_char))
    bad(field, fmt::format("'{}' is not a user name (1 to 64 letters, digits, '.', '_', '-', not starting with '-'), "
                           "a uid or a uid:gid",
                           has_nul(user) ? std::string("(contains NUL)") : std::string(user.substr(0, 80))));
  out.name = std::string(user);
  return out;
}

void validate_protected_paths(const std::vector<std::string>& paths, std::string_view field) {
  if (paths.size() > kMaxProtectedPaths)
    bad(field, fmt::format("{} paths given, at most {}", paths.size(), kMaxProtectedPaths));
  for (std::size_t i = 0; i < paths.size(); ++i) {
    const std::string& p = paths[i];
    std::string name = fmt::format("{}[{}]", field, i);
    if (p.empty() || p.front() != '/') bad(name, fmt::format("'{}' is not an absolute path", p));
    if (p.size() > 4096 || has_nul(p) || p.find('\n') != std::string::npos)
      bad(name, "at most 4096 bytes, without NUL or newline");
    if (p == "/") bad(name, "'/' itself cannot be protected");
    std::string normal;
    for (std::size_t pos = 1; pos <= p.size();) {
      std::size_t end = p.find('/', pos);
      if (end == std::string::npos) end = p.size();
      std::string_view part = std::string_view(p).substr(pos, end - pos);
      if (part == "..") bad(name, fmt::format("'{}' has a '..' component", p));
      if (!part.empty() && part != ".") normal += "/" + std::string(part);
      pos = end + 1;
    }
    if (normal != p) bad(name, fmt::format("'{}' is not normalized (write '{}')", p, normal.empty() ? "/" : normal));
    for (std::string_view top : {"/proc", "/sys", "/dev"})
      if (p == top || (p.size() > top.size() && p.compare(0, top.size(), top) == 0 && p[top.size()] == '/'))
        bad(name, fmt::format("'{}' is under {}, which the sandbox's runtime provides", p, top));
  }
}

bool valid_group_id(std::string_view id) noexcept {
  if (id.empty() || id.size() > 128) return false;
  for (char c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

json encode(const ExecRequest& r) {
  json j{{"env", r.env}, {"cwd", r.cwd}, {"timeout", r.timeout_seconds}, {"max_output", r.max_output_bytes}};
  if (!r.shell.empty()) j["shell"] = r.shell;
  else j["argv"] = r.argv;
  if (!r.stdin_data.empty()) j["stdin"] = base64_encode(r.stdin_data);
  if (!r.user.empty()) j["user"] = r.user;
  if (!r.request_id.empty()) j["request_id"] = r.request_id;
  return j;
}

ExecRequest decode_exec_request(const json& j) {
  if (!j.is_object()) bad("exec", "must be a JSON object");
  ExecRequest r;
  r.shell = get_string(j, "shell", "shell");
  if (const json* a = find(j, "argv")) {
    if (!a->is_array()) bad("argv", "must be an array of strings");
    for (const auto& x : *a) {
      if (!x.is_string()) bad("argv", "must be an array of strings");
      r.argv.push_back(x.get<std::string>());
    }
  }
  if (r.shell.empty() == r.argv.empty()) bad("argv", "give exactly one of a non-empty argv or shell");
  if (!r.argv.empty() && r.argv[0].empty()) bad("argv[0]", "must not be empty");
  for (const auto& a : r.argv)
    if (has_nul(a)) bad("argv", "arguments must not contain NUL");
  if (has_nul(r.shell)) bad("shell", "must not contain NUL");
  r.env = get_string_map(j, "env", "env");
  validate_env(r.env, "env");
  r.cwd = get_string(j, "cwd", "cwd");
  if (!r.cwd.empty() && (r.cwd.front() != '/' || has_nul(r.cwd))) bad("cwd", "must be an absolute path");
  if (const json* s = find(j, "stdin")) {
    if (!s->is_string()) bad("stdin", "must be a base64 string");
    r.stdin_data = base64_decode(s->get<std::string>());
  }
  r.timeout_seconds = get_number(j, "timeout", "timeout", r.timeout_seconds);
  if (!(r.timeout_seconds > 0) || r.timeout_seconds > 86400 * 7) bad("timeout", "must be in (0, 604800] seconds");
  r.max_output_bytes = get_unsigned(j, "max_output", "max_output", r.max_output_bytes);
  if (r.max_output_bytes > (1ull << 30)) bad("max_output", "at most 1 GiB");
  r.user = get_string(j, "user", "user");
  (void)parse_user(r.user, "user");
  r.request_id = get_string(j, "request_id", "request_id");
  if (r.request_id.size() > 128 || has_nul(r.request_id)) bad("request_id", "at most 128 bytes");
  return r;
}

json encode(const ExecResult& r) {
  json j{{"exit_code", r.exit_code},
         {"signal", r.signal},
         {"stdout", base64_encode(r.stdout_data)},
         {"stderr", base64_encode(r.stderr_data)},
         {"stdout_truncated", r.stdout_truncated},
         {"stderr_truncated", r.stderr_truncated},
         {"timed_out", r.timed_out},
         {"duration", r.duration_seconds}};
  if (!r.reason.empty()) j["reason"] = r.reason;
  if (r.oom_killed) j["oom_killed"] = true;
  return j;
}

ExecResult decode_exec_result(const json& j) {
  expect_object(j, "exec result");
  ExecResult r;
  r.exit_code = member(j, "exit_code", -1);
  r.signal = member(j, "signal", 0);
  r.stdout_data = base64_decode(member(j, "stdout", ""));
  r.stderr_data = base64_decode(member(j, "stderr", ""));
  r.stdout_truncated = member(j, "stdout_truncated", false);
  r.stderr_truncated = member(j, "stderr_truncated", false);
  r.timed_out = member(j, "timed_out", false);
  r.duration_seconds = member(j, "duration", 0.0);
  r.reason = member(j, "reason", "");
  r.oom_killed = member(j, "oom_killed", false);
  return r;
}

std::string_view gpu_mode_name(GpuMode mode) noexcept {
  switch (mode) {
    case GpuMode::kExclusive:
      return "exclusive";
    case GpuMode::kShared:
      return "shared";
    case GpuMode::kNone:
      break;
  }
  return "none";
}

GpuMode parse_gpu_mode(std::string_view name, std::string_view field) {
  if (name == "none" || name.empty()) return GpuMode::kNone;
  if (name == "exclusive") return GpuMode::kExclusive;
  if (name == "shared") return GpuMode::kShared;
  bad(field, fmt::format("'{}' is not a GPU mode (none, exclusive, shared)", name));
}

json encode(const FnCallRequest& r) {
  json files = json::object();
  for (const auto& [path, bytes] : r.files) files[path] = base64_encode(bytes);
  json j{{"language", r.language},
         {"code", r.code},
         {"args", r.args},
         {"files", std::move(files)},
         {"env", r.env},
         {"timeout", r.timeout_seconds},
         {"cpu_time", r.cpu_seconds},
         {"memory", r.memory_bytes},
         {"pids", r.pids},
         {"max_output_bytes", r.max_output_bytes},
         {"gpu_mode", std::string(gpu_mode_name(r.gpu_mode))},
         {"gpus", r.gpus}};
  if (!r.stdin_data.empty()) j["stdin"] = base64_encode(r.stdin_data);
  if (!r.image.empty()) j["image"] = r.image;
  if (!r.request_id.empty()) j["request_id"] = r.request_id;
  return j;
}

namespace {

// A file of a call: a relative path under its working directory, without "." or ".." components.
void validate_fncall_path(const std::string& path) {
  std::string field = fmt::format("files.{}", path);
  if (path.empty() || path.size() > 4096 || has_nul(path)) bad(field, "a path must be 1 to 4096 bytes without NUL");
  if (path.front() == '/') bad(field, "must be relative (files go under the call's working directory in /tmp)");
  std::size_t start = 0;
  while (start <= path.size()) {
    std::size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    std::string_view part(path.data() + start, end - start);
    if (part.empty() || part == "." || part == "..") bad(field, "must not have empty, '.' or '..' components");
    if (part.size() > 255) bad(field, "a path component is at most 255 bytes");
    start = end + 1;
  }
}

}  // namespace

FnCallRequest decode_fncall_request(const json& j) {
  if (!j.is_object()) bad("fncall", "must be a JSON object");
  FnCallRequest r;
  r.language = get_string(j, "language", "language", r.language);
  bool known = false;
  for (const char* l : kFnCallLanguages) known = known || r.language == l;
  if (!known)
    bad("language", fmt::format("'{}' is not a language of function calls (python, shell, c, cpp)", r.language));
  const json* code = find(j, "code");
  if (!code || !code->is_string()) bad("code", "required: the program's source as a string");
  r.code = code->get<std::string>();
  if (r.code.size() > kMaxFnCallCodeBytes)
    bad("code", fmt::format("{} bytes is more than the limit of {} bytes", r.code.size(), kMaxFnCallCodeBytes));
  if (has_nul(r.code)) bad("code", "must not contain NUL");
  std::size_t input = r.code.size();
  if (const json* s = find(j, "stdin")) {
    if (!s->is_string()) bad("stdin", "must be a base64 string");
    r.stdin_data = base64_decode(s->get<std::string>());
    input += r.stdin_data.size();
  }
  if (const json* a = find(j, "args")) {
    if (!a->is_array()) bad("args", "must be an array of strings");
    if (a->size() > kMaxFnCallArgs) bad("args", fmt::format("at most {} arguments", kMaxFnCallArgs));
    for (const auto& x : *a) {
      if (!x.is_string()) bad("args", "must be an array of strings");
      r.args.push_back(x.get<std::string>());
      if (has_nul(r.args.back())) bad("args", "arguments must not contain NUL");
      input += r.args.back().size();
    }
  }
  if (const json* f = find(j, "files")) {
    if (!f->is_object()) bad("files", "must be an object of path: base64 content");
    if (f->size() > kMaxFnCallFiles) bad("files", fmt::format("at most {} files", kMaxFnCallFiles));
    for (auto& [path, val] : f->items()) {
      validate_fncall_path(path);
      if (!val.is_string()) bad(fmt::format("files.{}", path), "must be a base64 string");
      std::string bytes = base64_decode(val.get<std::string>());
      input += bytes.size();
      r.files.emplace(path, std::move(bytes));
    }
  }
  if (input > kMaxFnCallInputBytes)
    bad("files", fmt::format("code, stdin, args and files together are {} bytes, more than the limit of {}", input,
                             kMaxFnCallInputBytes));
  r.env = get_string_map(j, "env", "env");
  validate_env(r.env, "env");
  r.image = get_string(j, "image", "image");
  if (!r.image.empty()) validate_image_ref(r.image, "image");
  r.timeout_seconds = get_number(j, "timeout", "timeout", r.timeout_seconds);
  if (!(r.timeout_seconds > 0) || r.timeout_seconds > kMaxFnCallTimeoutSeconds)
    bad("timeout", fmt::format("must be in (0, {}] seconds", kMaxFnCallTimeoutSeconds));
  r.cpu_seconds = get_number(j, "cpu_time", "cpu_time", r.cpu_seconds);
  if (r.cpu_seconds < 0 || r.cpu_seconds > kMaxFnCallTimeoutSeconds)
    bad("cpu_time", fmt::format("must be in [0, {}] seconds (0: the wall timeout alone)", kMaxFnCallTimeoutSeconds));
  r.memory_bytes = get_size(j, "memory", "memory", r.memory_bytes);
  if (r.memory_bytes < (4ull << 20)) bad("memory", "must be at least 4Mi");
  if (r.memory_bytes > (1ull << 40)) bad("memory", "at most 1Ti");
  auto pids = get_unsigned(j, "pids", "pids", r.pids);
  if (pids < 1 || pids > (1u << 22)) bad("pids", "must be from 1 to 4194304");
  r.pids = static_cast<std::uint32_t>(pids);
  r.max_output_bytes = get_size(j, "max_output_bytes", "max_output_bytes", r.max_output_bytes);
  if (r.max_output_bytes > (1ull << 30)) bad("max_output_bytes", "at most 1 GiB");
  r.gpu_mode = parse_gpu_mode(get_string(j, "gpu_mode", "gpu_mode", "none"));
  auto gpus = get_unsigned(j, "gpus", "gpus", 0);
  if (gpus > kMaxGpus) bad("gpus", fmt::format("at most {}", kMaxGpus));
  r.gpus = static_cast<std::uint32_t>(gpus);
  if (r.gpu_mode == GpuMode::kNone && r.gpus != 0) bad("gpus", "needs gpu_mode \"exclusive\" or \"shared\"");
  if (r.gpu_mode != GpuMode::kNone && r.gpus == 0) r.gpus = 1;
  r.request_id = get_string(j, "request_id", "request_id");
  if (r.request_id.size() > 128 || has_nul(r.request_id)) bad("request_id", "at most 128 bytes");
  return r;
}

json encode(const FnCallResult& r) {
  return json{{"exit_code", r.exit_code},
              {"signal", r.signal},
              {"stdout", base64_encode(r.stdout_data)},
              {"stderr", base64_encode(r.stderr_data)},
              {"stdout_truncated", r.stdout_truncated},
              {"stderr_truncated", r.stderr_truncated},
              {"timed_out", r.timed_out},
              {"oom_killed", r.oom_killed},
              {"duration", r.duration_seconds},
              {"cpu_time", r.cpu_seconds},
              {"peak_memory", r.peak_memory_bytes},
              {"compile_exit_code", r.compile_exit_code},
              {"compile_output", base64_encode(r.compile_output)},
              {"compile_seconds", r.compile_seconds},
              {"gpus", r.gpus},
              {"node", r.node}};
}

FnCallResult decode_fncall_result(const json& j) {
  FnCallResult r;
  if (!j.is_object()) throw Error(Code::kInternal, "a function call's result is not a JSON object");
  if (auto e = j.find("error"); e != j.end() && e->is_object()) {
    r.error_code = member(*e, "code", "UNKNOWN", "error.code");
    r.error = member(*e, "message", "", "error.message");
    if (r.error.empty()) r.error = r.error_code;
    return r;
  }
  r.exit_code = member(j, "exit_code", -1);
  r.signal = member(j, "signal", 0);
  r.stdout_data = base64_decode(member(j, "stdout", ""));
  r.stderr_data = base64_decode(member(j, "stderr", ""));
  r.stdout_truncated = member(j, "stdout_truncated", false);
  r.stderr_truncated = member(j, "stderr_truncated", false);
  r.timed_out = member(j, "timed_out", false);
  r.oom_killed = member(j, "oom_killed", false);
  r.duration_seconds = member(j, "duration", 0.0);
  r.cpu_seconds = member(j, "cpu_time", 0.0);
  r.peak_memory_bytes = member(j, "peak_memory", std::uint64_t{0});
  r.compile_exit_code = member(j, "compile_exit_code", 0);
  r.compile_output = base64_decode(member(j, "compile_output", ""));
  r.compile_seconds = member(j, "compile_seconds", 0.0);
  r.gpus = member(j, "gpus", std::vector<std::string>{});
  r.node = member(j, "node", "");
  return r;
}

json encode(const SandboxInfo& s) {
  return json{{"id", s.id},
              {"node", s.node},
              {"state", s.state},
              {"image", s.image},
              {"kind", s.kind},
              {"tenant", s.tenant},
              {"labels", s.labels},
              {"group", s.group},
              {"resources",
               {{"cpu", s.resources.cpu},
                {"memory", s.resources.memory_bytes},
                {"disk", s.resources.disk_bytes},
                {"pids", s.resources.pids},
                {"open_files", s.resources.open_files},
                {"gpus", s.resources.gpus},
                {"egress_mbps", s.resources.egress_mbps},
                {"connections", s.resources.connections}}},
              {"priority", priority_name(s.resources.priority)},
              {"ksm", s.resources.ksm},
              {"reclaim", s.resources.reclaim},
              {"qos", {{"granted", s.qos.granted}, {"missing", s.qos.missing}}},
              {"cold_memory",
               {{"reclaimed_bytes", s.cold_memory.reclaimed_bytes},
                {"reclaims", s.cold_memory.reclaims},
                {"last_reclaim_at", s.cold_memory.last_reclaim_at},
                {"refaults", s.cold_memory.refaults}}},
              {"created_at", s.created_at},
              {"expires_at", s.expires_at},
              {"message", s.message},
              {"network", encode(s.network)}};
}

SandboxInfo decode_sandbox_info(const json& j) {
  expect_object(j, "sandbox info");
  SandboxInfo s;
  s.id = member(j, "id", "");
  s.node = member(j, "node", "");
  s.state = member(j, "state", "");
  s.image = member(j, "image", "");
  s.kind = member(j, "kind", "");
  s.tenant = member(j, "tenant", "");
  s.labels = member(j, "labels", Labels{});
  s.group = member(j, "group", "");
  if (auto it = j.find("resources"); it != j.end() && it->is_object()) {
    auto& r = s.resources;
    r.cpu = member(*it, "cpu", r.cpu, "resources.cpu");
    r.memory_bytes = member(*it, "memory", r.memory_bytes, "resources.memory");
    r.disk_bytes = member(*it, "disk", r.disk_bytes, "resources.disk");
    r.pids = member(*it, "pids", r.pids, "resources.pids");
    r.open_files = member(*it, "open_files", r.open_files, "resources.open_files");
    r.gpus = member(*it, "gpus", r.gpus, "resources.gpus");
    r.egress_mbps = member(*it, "egress_mbps", r.egress_mbps, "resources.egress_mbps");
    r.connections = member(*it, "connections", r.connections, "resources.connections");
  }
  {
    // An older agent's answer has none: standard.
    const std::string priority = member(j, "priority", "standard", "priority");
    auto p = parse_priority(priority);
    if (!p) bad_answer("priority", fmt::format("'{}' is not latency, standard or batch", priority.substr(0, 40)));
    s.resources.priority = *p;
  }
  s.resources.ksm = member(j, "ksm", false);
  s.resources.reclaim = member(j, "reclaim", true);
  if (auto it = j.find("qos"); it != j.end() && it->is_object()) {
    s.qos.granted = member(*it, "granted", std::vector<std::string>{}, "qos.granted");
    s.qos.missing = member(*it, "missing", std::vector<std::string>{}, "qos.missing");
  }
  if (auto it = j.find("cold_memory"); it != j.end() && it->is_object()) {
    auto& c = s.cold_memory;
    c.reclaimed_bytes = member(*it, "reclaimed_bytes", c.reclaimed_bytes, "cold_memory.reclaimed_bytes");
    c.reclaims = member(*it, "reclaims", c.reclaims, "cold_memory.reclaims");
    c.last_reclaim_at = member(*it, "last_reclaim_at", c.last_reclaim_at, "cold_memory.last_reclaim_at");
    c.refaults = member(*it, "refaults", c.refaults, "cold_memory.refaults");
  }
  s.created_at = member(j, "created_at", 0.0);
  s.expires_at = member(j, "expires_at", 0.0);
  s.message = member(j, "message", "");
  if (auto it = j.find("network"); it != j.end() && it->is_object()) {
    try {
      s.network = decode_network(*it);
    } catch (const Error& e) {
      throw Error(Code::kDataLoss, fmt::format("sandbox info: {}", e.what()));
    }
  }
  return s;
}

// A QEMU tier's part of the node info, under `name` (written only when the tier is offered or says why not).
static void encode_tier(json& out, const char* name, const QemuTierNodeInfo& m) {
  if (!m.offered && m.unavailable.empty()) return;
  out[name] = json{
      {"offered", m.offered},
      {"unavailable", m.unavailable},
      {"ready", m.ready},
      {"accelerator", m.accelerator},
      {"accelerator_reason", m.accelerator_reason},
      {"kernel", m.kernel},
      {"vms", m.vms},
      {"pool", {{"size", m.pool_size}, {"ready", m.pool_ready}, {"claims", m.pool_claims}, {"misses", m.pool_misses}}},
      {"templates", {{"count", m.templates}, {"bytes", m.template_bytes}}}};
}

static void decode_tier(const json& j, const std::string& name, QemuTierNodeInfo& v) {
  auto m = j.find(name);
  if (m == j.end() || !m->is_object()) return;
  auto field = [&](const char* f) { return name + "." + f; };
  v.offered = member(*m, "offered", false, field("offered"));
  v.unavailable = member(*m, "unavailable", "", field("unavailable"));
  v.ready = member(*m, "ready", false, field("ready"));
  v.accelerator = member(*m, "accelerator", "", field("accelerator"));
  v.accelerator_reason = member(*m, "accelerator_reason", "", field("accelerator_reason"));
  v.kernel = member(*m, "kernel", "", field("kernel"));
  v.vms = member(*m, "vms", 0u, field("vms"));
  if (auto p = m->find("pool"); p != m->end() && p->is_object()) {
    v.pool_size = member(*p, "size", 0u, field("pool.size"));
    v.pool_ready = member(*p, "ready", 0u, field("pool.ready"));
    v.pool_claims = member(*p, "claims", std::uint64_t{0}, field("pool.claims"));
    v.pool_misses = member(*p, "misses", std::uint64_t{0}, field("pool.misses"));
  }
  if (auto t = m->find("templates"); t != m->end() && t->is_object()) {
    v.templates = member(*t, "count", 0u, field("templates.count"));
    v.template_bytes = member(*t, "bytes", std::uint64_t{0}, field("templates.bytes"));
  }
}

json encode(const NodeInfo& n) {
  json layers = json::array();
  for (const auto& l : n.cached_layers)
    layers.push_back(
        json{{"digest", l.digest}, {"size", l.size}, {"cached_bytes", l.cached_bytes}, {"users", l.users}});
  json out{{"id", n.id},
           {"version", n.version},
           {"protocol", n.protocol},
           {"backends", n.backends},
           {"capacity", {{"cores", n.cores}, {"memory", n.memory_bytes}, {"disk", n.disk_bytes}, {"gpus", n.gpus}}},
           {"disk_free", n.disk_free_bytes},
           {"gpus_free", n.gpus_free},
           {"labels", n.labels},
           {"load",
            {{"sandboxes", n.sandboxes},
             {"cpu_requested", n.cpu_requested},
             {"memory_requested", n.memory_requested},
             {"load1", n.load1}}},
           {"overcommit", {{"cpu", n.cpu_overcommit}, {"memory", n.memory_overcommit}}},
           {"cgroup_version", n.cgroup_version},
           {"images", n.images},
           {"layer_mode", n.layer_mode},
           {"userns", n.userns},
           {"network", n.network},
           {"cached_layers", layers},
           {"swap", {{"total", n.swap_bytes}, {"free", n.swap_free_bytes}}}};
  out["load"]["memory_used"] = n.memory_used_bytes;
  const NodePressure& p = n.pressure;
  out["pressure"] = {
      {"psi", p.psi},         {"cpu_some", p.cpu_some}, {"memory_some", p.memory_some}, {"memory_full", p.memory_full},
      {"io_some", p.io_some}, {"io_full", p.io_full}};
  const QosNodeInfo& q = n.qos;
  out["qos"] = {{"core_scheduling", q.core_scheduling},
                {"core_scheduling_reason", q.core_scheduling_reason},
                {"latency_cpus", q.latency_cpus},
                {"cpu_idle", q.cpu_idle},
                {"reclaim", q.reclaim},
                {"reclaim_reason", q.reclaim_reason},
                {"reclaimed_bytes", q.reclaimed_bytes},
                {"ksm", q.ksm},
                {"ksm_sandboxes", q.ksm_sandboxes},
                {"ksm_saved_bytes", q.ksm_saved_bytes}};
  out["warm_pool"] = {{"size", n.warm_pool_size},
                      {"ready", n.warm_pool_ready},
                      {"claims", n.warm_pool_claims},
                      {"misses", n.warm_pool_misses}};
  encode_tier(out, "microvm", n.microvm);
  encode_tier(out, "vm", n.vm);
  return out;
}

NodeInfo decode_node_info(const json& j) {
  expect_object(j, "node info");
  NodeInfo n;
  n.id = member(j, "id", "");
  n.version = member(j, "version", "");
  n.protocol = member(j, "protocol", "v1");
  n.backends = member(j, "backends", std::vector<std::string>{});
  if (auto c = j.find("capacity"); c != j.end() && c->is_object()) {
    n.cores = member(*c, "cores", 0u, "capacity.cores");
    n.memory_bytes = member(*c, "memory", std::uint64_t{0}, "capacity.memory");
    n.disk_bytes = member(*c, "disk", std::uint64_t{0}, "capacity.disk");
    n.gpus = member(*c, "gpus", 0u, "capacity.gpus");
  }
  n.disk_free_bytes = member(j, "disk_free", std::uint64_t{0});
  n.gpus_free = member(j, "gpus_free", 0u);
  if (auto l = j.find("labels"); l != j.end() && l->is_object())
    for (auto& [k, v] : l->items())
      if (v.is_string()) n.labels.emplace(k, v.get<std::string>());
  if (auto l = j.find("load"); l != j.end() && l->is_object()) {
    n.sandboxes = member(*l, "sandboxes", 0u, "load.sandboxes");
    n.cpu_requested = member(*l, "cpu_requested", 0.0, "load.cpu_requested");
    n.memory_requested = member(*l, "memory_requested", std::uint64_t{0}, "load.memory_requested");
    n.load1 = member(*l, "load1", 0.0, "load.load1");
    n.memory_used_bytes = member(*l, "memory_used", std::uint64_t{0}, "load.memory_used");
  }
  if (auto p = j.find("pressure"); p != j.end() && p->is_object()) {
    NodePressure& out = n.pressure;
    out.psi = member(*p, "psi", false, "pressure.psi");
    out.cpu_some = member(*p, "cpu_some", 0.0, "pressure.cpu_some");
    out.memory_some = member(*p, "memory_some", 0.0, "pressure.memory_some");
    out.memory_full = member(*p, "memory_full", 0.0, "pressure.memory_full");
    out.io_some = member(*p, "io_some", 0.0, "pressure.io_some");
    out.io_full = member(*p, "io_full", 0.0, "pressure.io_full");
  }
  if (auto q = j.find("qos"); q != j.end() && q->is_object()) {
    QosNodeInfo& out = n.qos;
    out.core_scheduling = member(*q, "core_scheduling", false, "qos.core_scheduling");
    out.core_scheduling_reason = member(*q, "core_scheduling_reason", "", "qos.core_scheduling_reason");
    out.latency_cpus = member(*q, "latency_cpus", "", "qos.latency_cpus");
    out.cpu_idle = member(*q, "cpu_idle", false, "qos.cpu_idle");
    out.reclaim = member(*q, "reclaim", "", "qos.reclaim");
    out.reclaim_reason = member(*q, "reclaim_reason", "", "qos.reclaim_reason");
    out.reclaimed_bytes = member(*q, "reclaimed_bytes", std::uint64_t{0}, "qos.reclaimed_bytes");
    out.ksm = member(*q, "ksm", false, "qos.ksm");
    out.ksm_sandboxes = member(*q, "ksm_sandboxes", 0u, "qos.ksm_sandboxes");
    out.ksm_saved_bytes = member(*q, "ksm_saved_bytes", std::uint64_t{0}, "qos.ksm_saved_bytes");
  }
  if (auto o = j.find("overcommit"); o != j.end() && o->is_object()) {
    n.cpu_overcommit = member(*o, "cpu", n.cpu_overcommit, "overcommit.cpu");
    n.memory_overcommit = member(*o, "memory", n.memory_overcommit, "overcommit.memory");
  }
  n.cgroup_version = member(j, "cgroup_version", "");
  n.images = member(j, "images", std::vector<std::string>{});
  n.layer_mode = member(j, "layer_mode", "");
  n.userns = member(j, "userns", "");
  n.network = member(j, "network", "");
  if (auto s = j.find("swap"); s != j.end() && s->is_object()) {
    n.swap_bytes = member(*s, "total", std::uint64_t{0}, "swap.total");
    n.swap_free_bytes = member(*s, "free", std::uint64_t{0}, "swap.free");
  }
  if (auto w = j.find("warm_pool"); w != j.end() && w->is_object()) {
    n.warm_pool_size = member(*w, "size", 0u, "warm_pool.size");
    n.warm_pool_ready = member(*w, "ready", 0u, "warm_pool.ready");
    n.warm_pool_claims = member(*w, "claims", std::uint64_t{0}, "warm_pool.claims");
    n.warm_pool_misses = member(*w, "misses", std::uint64_t{0}, "warm_pool.misses");
  }
  decode_tier(j, "microvm", n.microvm);
  decode_tier(j, "vm", n.vm);
  if (auto c = j.find("cached_layers"); c != j.end() && c->is_array()) {
    for (const auto& l : *c) {
      if (!l.is_object()) continue;
      n.cached_layers.push_back(CachedLayer{member(l, "digest", "", "cached_layers.digest"),
                                            member(l, "size", std::uint64_t{0}, "cached_layers.size"),
                                            member(l, "cached_bytes", std::uint64_t{0}, "cached_layers.cached_bytes"),
                                            member(l, "users", 0u, "cached_layers.users")});
    }
  }
  return n;
}

json encode_error(const Error& e) {
  return json{{"code", std::string(e.code_name())},
              {"message", e.what()},
              {"retryable", e.retryable()},
              {"fault", std::string(fault_name(e.fault()))}};
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
    return Error(code, message, retryable, fault);
  }
  Code code = status == 404   ? Code::kNotFound
              : status == 400 ? Code::kInvalidArgument
              : status == 503 ? Code::kUnavailable
              : status == 504 ? Code::kDeadlineExceeded
                              : Code::kUnknown;
  return Error(code, fmt::format("agent answered HTTP {} without a dsec error body", status));
}

std::string base64_encode(std::string_view bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3), '\0');
  int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(bytes.data()), static_cast<int>(bytes.size()));
  out.resize(static_cast<std::size_t>(n));
  return out;
}

std::string base64_decode(std::string_view text) {
  if (text.size() % 4 != 0) throw Error(Code::kInvalidArgument, "malformed base64: length is not a multiple of 4");
  std::string out(3 * (text.size() / 4), '\0');
  int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                          reinterpret_cast<const unsigned char*>(text.data()), static_cast<int>(text.size()));
  if (n < 0) throw Error(Code::kInvalidArgument, "malformed base64");
  std::size_t len = static_cast<std::size_t>(n);
  // EVP_DecodeBlock keeps the padding bytes as zeros; drop them.
  if (!text.empty() && text.back() == '=') --len;
  if (text.size() >= 2 && text[text.size() - 2] == '=') --len;
  out.resize(len);
  return out;
}

}  // namespace dsec::protocol
