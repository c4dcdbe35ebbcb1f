#include "agent/node/qos/usage_overcommit.hpp"

#include <algorithm>

namespace dsec::agent::qos {

double usage_overcommit(const UsageOvercommitInputs& in) {
  if (in.ceiling <= in.base || in.memory_bytes == 0) return in.base;
  const double ram = static_cast<double>(in.memory_bytes);
  const double granted = static_cast<double>(in.granted_bytes);
  if (granted < ram / 10 || in.in_use_bytes == 0) return in.base;
  const double per_granted = static_cast<double>(in.in_use_bytes) / granted;
  const double ratio = 0.8 / per_granted;
  return std::clamp(ratio, in.base, in.ceiling);
}

}  // namespace dsec::agent::qos
