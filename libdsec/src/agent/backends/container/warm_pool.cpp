#include "agent/backends/container/warm_pool.hpp"

#include <algorithm>
#include <charconv>

#include <fmt/format.h>

#include "common/log.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::container {
namespace {

constexpr std::uint32_t kMaxPoolSize = 4096;
// The refill waits until creates have left the node alone this long: during a pulse the CPU is the creates'.
constexpr auto kQuietBeforeRefill = std::chrono::milliseconds(25);
// Sandboxes started at once by the refill. A start mostly waits (for its user namespace's id maps, its cgroups'
// RCU grace periods), so a few in parallel fill a pool several times faster than one at a time.
constexpr int kRefillWorkers = 4;

[[noreturn]] void bad(std::string_view value, const std::string& why) {
  throw Error(Code::kInvalidArgument, fmt::format("--warm-pool {}: {}", value, why));
}

std::uint64_t whole_number(std::string_view value, std::string_view key, std::string_view text, std::uint64_t max) {
  std::uint64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v > max)
    bad(value, fmt::format("{}={} is not a whole number up to {}", key, text, max));
  return v;
}

}  // namespace

WarmPoolConfig parse_warm_pool(std::string_view value) {
  WarmPoolConfig out;
  bool sized = false;
  std::size_t at = 0;
  for (bool first = true; at <= value.size(); first = false) {
    std::size_t comma = value.find(',', at);
    std::string_view part = value.substr(at, comma == std::string_view::npos ? std::string_view::npos : comma - at);
    at = comma == std::string_view::npos ? value.size() + 1 : comma + 1;
    if (first) {
      if (part.empty() || part.find('=') != std::string_view::npos)
        bad(value, "starts with the image, e.g. busybox,size=8,cpu=0.5,memory=128Mi");
      out.image = std::string(part);
      continue;
    }
    std::size_t eq = part.find('=');
    if (eq == std::string_view::npos) bad(value, fmt::format("'{}' is not key=value", part));
    std::string_view key = part.substr(0, eq), text = part.substr(eq + 1);
    Resources& r = out.resources;
    if (key == "size") {
      out.size = static_cast<std::uint32_t>(whole_number(value, key, text, kMaxPoolSize));
      sized = true;
    } else if (key == "cpu") {
      double cpu = 0;
      auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), cpu);
      if (ec != std::errc() || end != text.data() + text.size() || !(cpu > 0) || cpu > 1024)
        bad(value, fmt::format("cpu={} is not a number of cores above 0", text));
      r.cpu = cpu;
    } else if (key == "memory" || key == "disk") {
      auto bytes = parse_size(text);
      if (!bytes || *bytes < (1u << 20)) bad(value, fmt::format("{}={} is not a size of at least 1Mi", key, text));
      (key == "memory" ? r.memory_bytes : r.disk_bytes) = *bytes;
    } else if (key == "pids") {
      r.pids = static_cast<std::uint32_t>(whole_number(value, key, text, 1u << 22));
    } else if (key == "open_files") {
      r.open_files = static_cast<std::uint32_t>(whole_number(value, key, text, 1u << 20));
    } else if (key == "priority") {
      auto p = parse_priority(text);
      if (!p) bad(value, fmt::format("priority={} is not latency, standard or batch", text));
      r.priority = *p;
    } else if (key == "ksm") {
      if (text != "true" && text != "false") bad(value, fmt::format("ksm={} is not true or false", text));
      r.ksm = text == "true";
    } else {
      bad(value,
          fmt::format("unknown key '{}' (known: size, cpu, memory, disk, pids, open_files, priority, ksm)", key));
    }
  }
  if (!sized || out.size == 0) bad(value, "needs size=N (sandboxes kept ready, 1 to 4096)");
  return out;
}

std::string describe_warm_pool(const WarmPoolConfig& pool) {
  const Resources& r = pool.resources;
  return fmt::format("{}, {} x (cpu {}, memory {} MiB, disk {} MiB, priority {}{})", pool.image, pool.size, r.cpu,
                     r.memory_bytes >> 20, r.disk_bytes >> 20, priority_name(r.priority), r.ksm ? ", ksm" : "");
}

bool matches(const WarmShape& shape, const SandboxSpec& spec, const std::vector<std::filesystem::path>& layers) {
  const Resources& a = shape.config.resources;
  const Resources& b = spec.resources;
  return spec.kind == "container" && !spec.allow_ptrace && layers == shape.layers && a.cpu == b.cpu &&
         a.memory_bytes == b.memory_bytes && a.disk_bytes == b.disk_bytes && a.pids == b.pids &&
         a.open_files == b.open_files && b.gpus == 0 && a.priority == b.priority && a.ksm == b.ksm;
}

WarmPools::WarmPools(std::vector<WarmShape> shapes, Make make) : make_(std::move(make)) {
  for (auto& s : shapes) pools_.push_back(Pool{std::move(s), {}, 0});
}

WarmPools::~WarmPools() { stop(); }

void WarmPools::start() {
  if (pools_.empty() || !threads_.empty()) return;
  for (int i = 0; i < kRefillWorkers; ++i) threads_.emplace_back([this] { refill_loop(); });
}

void WarmPools::stop() {
  std::vector<std::unique_ptr<PreMade>> drop;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    for (Pool& p : pools_) {
      for (auto& m : p.ready) drop.push_back(std::move(m));
      p.ready.clear();
    }
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
  drop.clear();  // destroys them, outside the lock
}

std::unique_ptr<PreMade> WarmPools::take(const SandboxSpec& spec, const std::vector<std::filesystem::path>& layers) {
  std::unique_ptr<PreMade> out;
  {
    std::lock_guard lock(mu_);
    for (Pool& p : pools_) {
      if (!matches(p.shape, spec, layers)) continue;
      if (p.ready.empty()) {
        ++misses_;
      } else {
        out = std::move(p.ready.front());
        p.ready.pop_front();
        ++claims_;
      }
      break;
    }
    last_take_ = std::chrono::steady_clock::now();
  }
  wake_.notify_all();
  return out;
}

WarmPoolStats WarmPools::stats() const {
  std::lock_guard lock(mu_);
  WarmPoolStats s;
  for (const Pool& p : pools_) {
    s.size += p.shape.config.size;
    s.ready += static_cast<std::uint32_t>(p.ready.size());
  }
  s.claims = claims_;
  s.misses = misses_;
  s.failures = failures_;
  return s;
}

void WarmPools::refill_loop() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    const auto quiet_at = last_take_ + kQuietBeforeRefill;
    if (std::chrono::steady_clock::now() < quiet_at) {
      wake_.wait_until(lock, quiet_at);
      continue;
    }
    // The emptiest pool (by its share of its size) first.
    Pool* next = nullptr;
    double fill = 1.0;
    for (Pool& p : pools_) {
      double f = static_cast<double>(p.ready.size() + p.starting) / static_cast<double>(p.shape.config.size);
      if (f < fill) fill = f, next = &p;
    }
    if (!next) {
      wake_.wait(lock);
      continue;
    }
    // A shape that keeps failing (its image's layers went away, the node is out of ids) is retried slowly.
    if (next->failures_in_a_row > 0) {
      const auto pause = std::chrono::milliseconds(std::min<std::uint32_t>(next->failures_in_a_row, 10) * 1000);
      if (wake_.wait_for(lock, pause, [&] { return stopping_; })) break;
    }
    const WarmShape& shape = next->shape;
    ++next->starting;
    lock.unlock();
    std::unique_ptr<PreMade> made;
    try {
      made = make_(shape);
    } catch (const std::exception& e) {
      log_warn("warm pool {}: starting a sandbox failed: {}", describe_warm_pool(shape.config), e.what());
    }
    lock.lock();
    --next->starting;
    if (!made) {
      ++next->failures_in_a_row;
      ++failures_;
      continue;
    }
    next->failures_in_a_row = 0;
    if (stopping_) {
      lock.unlock();
      made.reset();  // destroyed outside the lock
      return;
    }
    next->ready.push_back(std::move(made));
  }
}

}  // namespace dsec::agent::container
