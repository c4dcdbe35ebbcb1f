#include "agent/registry/tenant_quota.hpp"

#include <cmath>
#include <set>

#include <fmt/format.h>

#include "dsec/error.hpp"
#include "dsec/spec.hpp"
#include "http/tokens.hpp"

namespace dsec::agent {

std::pair<std::string, TenantQuota> parse_tenant_quota(std::string_view text) {
  auto bad = [&](const std::string& why) {
    return Error(Code::kInvalidArgument, fmt::format("--tenant-quota '{}': {}", text.substr(0, 200), why));
  };
  auto eq = text.find('=');
  if (eq == std::string_view::npos) throw bad("not TENANT=sandboxes:N,cpu:C,memory:SIZE");
  std::string tenant(text.substr(0, eq));
  try {
    auth::check_tenant_name(tenant);
  } catch (const Error& e) {
    throw bad(e.what());
  }
  TenantQuota q;
  std::set<std::string> seen;
  std::string_view rest = text.substr(eq + 1);
  if (rest.empty()) throw bad("no limits after '='");
  while (!rest.empty()) {
    auto comma = rest.find(',');
    std::string_view item = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    if (comma != std::string_view::npos && rest.empty()) throw bad("a limit is missing after the last ','");
    auto colon = item.find(':');
    if (colon == std::string_view::npos) throw bad(fmt::format("'{}' is not NAME:VALUE", item));
    std::string name(item.substr(0, colon));
    std::string value(item.substr(colon + 1));
    if (!seen.insert(name).second) throw bad(fmt::format("{} given twice", name));
    if (name == "sandboxes") {
      if (value.empty() || value.size() > 9 || value.find_first_not_of("0123456789") != std::string::npos)
        throw bad("sandboxes: a whole number up to 999999999");
      q.sandboxes = std::stoull(value);
    } else if (name == "cpu") {
      std::size_t used = 0;
      double cpu = 0;
      try {
        cpu = std::stod(value, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used == 0 || used != value.size() || !std::isfinite(cpu) || cpu < 0 || cpu > 1e6)
        throw bad("cpu: a number of cores from 0 to 1000000");
      q.cpu = cpu;
    } else if (name == "memory") {
      auto size = parse_size(value);
      if (!size) throw bad("memory: a size such as 64Gi");
      q.memory_bytes = *size;
    } else {
      throw bad(fmt::format("unknown limit '{}' (sandboxes, cpu, memory)", name));
    }
  }
  return {tenant, q};
}

}  // namespace dsec::agent
