// Per-tenant quotas on one agent (dsecd --tenant-quota TENANT=sandboxes:N,cpu:C,memory:M): how many sandboxes a
// tenant may have on this node at once, and how much cpu and memory their specs may ask for together. Admission
// checks them beside the node's own capacity (registry/admission.cpp); a create past one is RESOURCE_EXHAUSTED
// naming the quota.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <string_view>
#include <utility>

namespace dsec::agent {

struct TenantQuota {
  std::uint64_t sandboxes = std::numeric_limits<std::uint64_t>::max();
  double cpu = std::numeric_limits<double>::infinity();
  std::uint64_t memory_bytes = std::numeric_limits<std::uint64_t>::max();
};

using TenantQuotas = std::map<std::string, TenantQuota, std::less<>>;

// "team-a=sandboxes:100,cpu:64,memory:256Gi" (any of the three, at least one) into the tenant and its quota;
// INVALID_ARGUMENT naming what is wrong.
std::pair<std::string, TenantQuota> parse_tenant_quota(std::string_view text);

}  // namespace dsec::agent
