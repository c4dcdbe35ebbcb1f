#include "agent/node/qos/ksm.hpp"

#include <unistd.h>

#include <fstream>
#include <mutex>
#include <string>

#include <fmt/format.h>

#include "common/log.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::qos {
namespace {

constexpr const char* kRun = "/sys/kernel/mm/ksm/run";

struct KsmState {
  std::mutex mu;
  std::uint32_t holders = 0;
  std::string found;  // the run setting before the first holder ("" while none holds)
};

KsmState& state() {
  static KsmState s;
  return s;
}

std::string read_value(const std::string& path) {
  std::ifstream in(path);
  std::string v;
  in >> v;
  return v;
}

bool write_value(const std::string& path, const std::string& value) {
  std::ofstream out(path);
  out << value;
  out.flush();
  return static_cast<bool>(out);
}

void release() {
  KsmState& s = state();
  std::lock_guard lock(s.mu);
  if (s.holders == 0 || --s.holders > 0) return;
  // The last one went: what the host had before. "0" stops ksmd but keeps merged pages merged (unmerging them all,
  // "2", would cost memory at once for nothing).
  if (!s.found.empty() && s.found != "1" && !write_value(kRun, s.found))
    log_warn("ksm: could not put {} back to {}", kRun, s.found);
  s.found.clear();
}

}  // namespace

std::shared_ptr<void> hold_ksm() {
  KsmState& s = state();
  {
    std::lock_guard lock(s.mu);
    if (s.holders == 0) {
      std::string now = read_value(kRun);
      if (now.empty())
        throw Error(Code::kFailedPrecondition,
                    fmt::format("ksm: {} cannot be read (a kernel without CONFIG_KSM)", kRun));
      if (now != "1" && !write_value(kRun, "1"))
        throw Error(Code::kFailedPrecondition, fmt::format("ksm: {} cannot be set to 1 (needs root)", kRun));
      s.found = now;
    }
    ++s.holders;
  }
  return std::shared_ptr<void>(nullptr, [](void*) { release(); });
}

KsmStatus ksm_status() {
  KsmStatus out;
  {
    KsmState& s = state();
    std::lock_guard lock(s.mu);
    out.holders = s.holders;
  }
  std::string sharing = read_value("/sys/kernel/mm/ksm/pages_sharing");
  try {
    if (!sharing.empty()) out.saved_bytes = std::stoull(sharing) * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  } catch (const std::exception&) {
  }
  return out;
}

}  // namespace dsec::agent::qos
