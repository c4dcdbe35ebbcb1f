#include "common/protocol/sandbox.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>

#include <fmt/format.h>

#include "common/network_rules.hpp"

#include "common/protocol/fields_internal.hpp"

namespace dsec::protocol {

using namespace fields;

namespace {

// A spec's and a sandbox info's "resources" object: cpu, memory, disk, pids, open_files and gpus, and with
// `with_network` egress_mbps and connections too (a spec writes those only when set, in encode(SandboxSpec)).
json encode_limits(const Resources& r, bool with_network = false) {
  json j{{"cpu", r.cpu},   {"memory", r.memory_bytes},   {"disk", r.disk_bytes},
         {"pids", r.pids}, {"open_files", r.open_files}, {"gpus", r.gpus}};
  if (with_network) {
    j["egress_mbps"] = r.egress_mbps;
    j["connections"] = r.connections;
  }
  return j;
}

}  // namespace

json encode(const SandboxSpec& s) {
  json j{
      {"image", s.image},
      {"kind", s.kind},
      {"resources", encode_limits(s.resources)},
      {"ttl", s.ttl.count()},
      {"env", s.env},
      {"labels", s.labels},
      {"tenant", s.tenant},
      {"hostname", s.hostname},
      {"allow_ptrace", s.allow_ptrace},
      {"request_id", s.request_id},
      {"node_selector", s.node_selector},
      {"anti_affinity", s.anti_affinity},
      {"group", s.group},
      {"group_ttl", s.group_ttl.count()},
  };
  // Only when given: an agent of before image configs reads a missing workdir as "/", and refuses an empty one.
  if (!s.workdir.empty()) j["workdir"] = s.workdir;
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
    if (pids > kMaxPids) bad("resources.pids", fmt::format("at most {}", kMaxPids));
    s.resources.pids = static_cast<std::uint32_t>(pids);
    auto files = get_unsigned(*r, "open_files", "resources.open_files", s.resources.open_files);
    if (files > kMaxOpenFiles) bad("resources.open_files", fmt::format("at most {}", kMaxOpenFiles));
    s.resources.open_files = static_cast<std::uint32_t>(files);
    auto gpus = get_unsigned(*r, "gpus", "resources.gpus", s.resources.gpus);
    if (gpus > kMaxGpus) bad("resources.gpus", fmt::format("at most {}", kMaxGpus));
    s.resources.gpus = static_cast<std::uint32_t>(gpus);
    auto mbps = get_unsigned(*r, "egress_mbps", "resources.egress_mbps", 0);
    if (mbps > kMaxEgressMbps)
      bad("resources.egress_mbps", fmt::format("at most {} (400 Gbit/s); 0 is unlimited", kMaxEgressMbps));
    s.resources.egress_mbps = static_cast<std::uint32_t>(mbps);
    auto connections = get_unsigned(*r, "connections", "resources.connections", 0);
    if (connections > kMaxConnections)
      bad("resources.connections", fmt::format("at most {}; 0 is unlimited", kMaxConnections));
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
    bad("group_ttl", fmt::format("must be from 1 to {} seconds", kMaxGroupTtlSeconds));
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
    if (!(wait >= 0 && wait <= kMaxQueueTimeoutSeconds))
      bad("queue_timeout", fmt::format("must be from 0 to {} seconds", kMaxQueueTimeoutSeconds));
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
                                           "1-{}",
                                           ports->dump(), kMaxPort));
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
          if (lo < 1 || hi > kMaxPort || hi < lo) bad_ports();
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

void validate(const SandboxSpec& s) {
  validate_image_ref(s.image, "image");
  if (s.kind.empty()) bad("kind", "must not be empty");
  const auto& r = s.resources;
  if (!(r.cpu > 0) || r.cpu > kMaxCpus) bad("resources.cpu", fmt::format("must be in (0, {}] cores", kMaxCpus));
  if (r.memory_bytes < kMinMemoryBytes) bad("resources.memory", "must be at least 4Mi");
  if (r.memory_bytes > kMaxResourceBytes) bad("resources.memory", "at most 16Ti");
  if (r.disk_bytes < kMinDiskBytes) bad("resources.disk", "must be at least 1Mi");
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
    if (!valid_scoped_group_id(s.group))
      bad("group",
          fmt::format("'{}' is not a group id (1 to {} letters, digits, '.', '_', '-')", s.group, kMaxGroupIdBytes));
    if (s.group_ttl.count() < 1 || s.group_ttl.count() > static_cast<std::int64_t>(kMaxGroupTtlSeconds))
      bad("group_ttl", fmt::format("required with a group: from 1 to {} seconds", kMaxGroupTtlSeconds));
  }
  if (s.hostname.size() > kMaxHostnameBytes) bad("hostname", fmt::format("at most {} characters", kMaxHostnameBytes));
  for (char c : s.hostname)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.'))
      bad("hostname", "letters, digits, '-' and '.' only");
  if (!s.workdir.empty() && (s.workdir.front() != '/' || has_nul(s.workdir)))
    bad("workdir", "must be an absolute path (or absent: the image's WorkingDir, else /)");
  validate_request_id(s.request_id);
  if (s.tenant.size() > kMaxTenantBytes || has_nul(s.tenant))
    bad("tenant", fmt::format("at most {} bytes", kMaxTenantBytes));
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
  if (body.empty() || user.size() > kMaxUserNameBytes || body.front() == '-' ||
      !std::all_of(body.begin(), body.end(), name_char))
    bad(field, fmt::format("'{}' is not a user name (1 to {} letters, digits, '.', '_', '-', not starting with '-'), "
                           "a uid or a uid:gid",
                           has_nul(user) ? std::string("(contains NUL)") : std::string(user.substr(0, 80)),
                           kMaxUserNameBytes));
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
    if (p.size() > kMaxPathBytes || has_nul(p) || p.find('\n') != std::string::npos)
      bad(name, fmt::format("at most {} bytes, without NUL or newline", kMaxPathBytes));
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
  if (id.empty() || id.size() > kMaxGroupIdBytes) return false;
  for (char c : id)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.')) return false;
  return true;
}

bool valid_scoped_group_id(std::string_view id) noexcept {
  const auto colon = id.find(':');
  if (colon == std::string_view::npos) return valid_group_id(id);
  return colon > 0 && colon <= kMaxTenantBytes && valid_group_id(id.substr(0, colon)) &&
         valid_group_id(id.substr(colon + 1));
}

json encode(const SandboxInfo& s) {
  return json{{"id", s.id},
              {"node", s.node},
              {"state", s.state},
              {"image", s.image},
              {"image_command", s.image_command},
              {"kind", s.kind},
              {"tenant", s.tenant},
              {"labels", s.labels},
              {"group", s.group},
              {"resources", encode_limits(s.resources, true)},
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
  s.image_command = member(j, "image_command", std::vector<std::string>{});
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

json encode_ttl_request(std::chrono::seconds ttl) { return json{{"ttl", ttl.count()}}; }

std::chrono::seconds decode_ttl_request(const json& body) {
  if (!body.is_object() || !body.contains("ttl"))
    throw Error(Code::kInvalidArgument, "ttl: the body must be a JSON object such as {\"ttl\": 300}");
  for (const auto& [key, value] : body.items())
    if (key != "ttl") throw Error(Code::kInvalidArgument, fmt::format("ttl: unknown field '{}' (known: ttl)", key));
  const json& v = body.at("ttl");
  if (!v.is_number_integer() || v.get<std::int64_t>() < 0 || v.get<std::int64_t>() > kMaxTtlSeconds)
    throw Error(Code::kInvalidArgument,
                fmt::format("ttl: {} is not a whole number of seconds from 0 to {}", v.dump(), kMaxTtlSeconds));
  return std::chrono::seconds(v.get<std::int64_t>());
}

json encode(const ForkRequest& request) {
  json j{{"count", request.count}};
  if (!request.labels.empty()) j["labels"] = request.labels;
  return j;
}

ForkRequest decode_fork_request(const json& body) {
  if (!body.is_object())
    throw Error(Code::kInvalidArgument, "fork: the body must be a JSON object such as {\"count\": 4}");
  ForkRequest r;
  for (const auto& [key, value] : body.items()) {
    if (key == "count") {
      if (!value.is_number_unsigned()) throw Error(Code::kInvalidArgument, "count: must be a positive integer");
      r.count = value.get<std::size_t>();
    } else if (key == "labels") {
      if (!value.is_object()) throw Error(Code::kInvalidArgument, "labels: must be an object of strings");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) throw Error(Code::kInvalidArgument, fmt::format("labels.{}: must be a string", k));
        r.labels[k] = v.get<std::string>();
      }
    } else {
      throw Error(Code::kInvalidArgument, fmt::format("fork: unknown field '{}' (known: count, labels)", key));
    }
  }
  return r;
}

json encode_sleep_request(std::string_view request_id) { return json{{"request_id", request_id}}; }

std::string decode_sleep_request(const json& body, std::string_view what) {
  if (!body.is_object())
    throw Error(Code::kInvalidArgument, fmt::format("{}: the body must be empty or a JSON object such as "
                                                    "{{\"request_id\": \"...\"}}",
                                                    what));
  std::string request_id;
  for (const auto& [key, value] : body.items()) {
    if (key != "request_id")
      throw Error(Code::kInvalidArgument, fmt::format("{}: unknown field '{}' (known: request_id)", what, key));
    if (!value.is_string() || value.get_ref<const std::string&>().size() > kMaxRequestIdBytes ||
        value.get_ref<const std::string&>().find('\0') != std::string::npos)
      throw Error(Code::kInvalidArgument, fmt::format("request_id: a string of at most {} bytes", kMaxRequestIdBytes));
    request_id = value.get<std::string>();
  }
  return request_id;
}

json encode(const SnapshotCall& call) { return json{{"name", call.name}, {"request_id", call.request_id}}; }

SnapshotCall decode_snapshot_call(const json& body) {
  if (!body.is_object())
    throw Error(Code::kInvalidArgument, "snapshot: the body must be a JSON object such as {\"name\": \"repo:tag\"}");
  SnapshotCall call;
  for (const auto& [key, value] : body.items()) {
    if (key == "name" || key == "request_id") {
      if (!value.is_string()) throw Error(Code::kInvalidArgument, fmt::format("{}: must be a string", key));
      (key == "name" ? call.name : call.request_id) = value.get<std::string>();
    } else {
      throw Error(Code::kInvalidArgument, fmt::format("snapshot: unknown field '{}' (known: name, request_id)", key));
    }
  }
  if (call.name.empty()) throw Error(Code::kInvalidArgument, "name: missing (the new image's repo[:tag])");
  return call;
}

json encode_expose_request(std::uint32_t port) { return json{{"port", port}}; }

std::uint32_t decode_expose_request(const json& body) {
  if (!body.is_object())
    throw Error(Code::kInvalidArgument, "ports: the body must be a JSON object such as {\"port\": 8000}");
  for (const auto& [key, value] : body.items())
    if (key != "port") throw Error(Code::kInvalidArgument, fmt::format("ports: unknown field '{}' (known: port)", key));
  auto it = body.find("port");
  if (it == body.end() || !it->is_number_integer() || it->get<std::int64_t>() < 1 || it->get<std::int64_t>() > kMaxPort)
    throw Error(Code::kInvalidArgument, fmt::format("port: a TCP port (1-{}) is required", kMaxPort));
  return static_cast<std::uint32_t>(it->get<std::int64_t>());
}

json encode_group_renew(std::chrono::seconds ttl) { return json{{"ttl", ttl.count()}}; }

double decode_group_renew(const json& body) {
  if (!body.is_object())
    throw Error(Code::kInvalidArgument, "renew: the body must be a JSON object such as {\"ttl\": 30}");
  double ttl = 0;
  if (auto it = body.find("ttl"); it != body.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() < 1 || it->get<double>() > kMaxGroupTtlSeconds)
      throw Error(Code::kInvalidArgument,
                  fmt::format("ttl: must be a number of seconds from 1 to {}", kMaxGroupTtlSeconds));
    ttl = it->get<double>();
  }
  for (const auto& [key, value] : body.items())
    if (key != "ttl") throw Error(Code::kInvalidArgument, fmt::format("renew: unknown field '{}' (known: ttl)", key));
  return ttl;
}

}  // namespace dsec::protocol
