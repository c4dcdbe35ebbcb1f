#include "agent/backends/qemu/vm_pool.hpp"

#include <algorithm>
#include <fstream>

#include <fmt/format.h>

#include "common/log.hpp"

namespace dsec::agent::qemu {

namespace fs = std::filesystem;

PooledVm::PooledVm(BackendContext& c) : ctx(c) {}

PooledVm::~PooledVm() {
  if (claimed_) return;
  try {
    if (vm) vm->kill();
    vm.reset();
    if (cgroup) cgroup->destroy();
  } catch (const std::exception& e) {
    log_warn("pooled VM {}: release: {}", name, e.what());
  }
  std::error_code ec;
  if (!run_dir.empty()) fs::remove_all(run_dir, ec);
  if (!data_dir.empty()) fs::remove_all(data_dir, ec);
  if (has_uid) ctx.uids.give_back(uid);
}

fs::path PooledVm::run_dir_of(const BackendContext& ctx, const std::string& name) {
  return ctx.work_dir / "pool" / name;
}

fs::path PooledVm::data_dir_of(const BackendContext& ctx, const std::string& name) {
  return ctx.data_dir / "pool" / name;
}

std::unique_ptr<VmInstance> PooledVm::claim_into(const std::string& id, const fs::path& to_run_dir,
                                                 const std::string& hostname, Clock::time_point deadline) {
  if (!vm || vm->exited() || !vm->guest().connected())
    throw Error(Code::kUnavailable, fmt::format("pooled VM {} stopped while it waited", name));
  const fs::path to_data_dir = ctx.data_dir / id;
  // Moving a directory keeps what QEMU holds open in it (its disk, its logs, the sockets it listens on), and a
  // restarted agent finds the sockets at the new path.
  fs::rename(run_dir, to_run_dir);
  run_dir = to_run_dir;
  fs::rename(data_dir, to_data_dir);
  data_dir = to_data_dir;
  boot.id = id;
  boot.run_dir = to_run_dir;
  boot.disk = to_data_dir / boot.disk.filename();
  boot.hostname = hostname;
  vm->become(id, to_run_dir, hostname, deadline);
  claimed_ = true;
  return std::move(vm);
}

VmPool::VmPool(std::uint32_t size, std::chrono::milliseconds idle) : size_(size), idle_(idle) {
  counts_.size = size;
  if (size_ > 0) filler_ = std::thread([this] { fill(); });
}

VmPool::~VmPool() { stop(); }

std::unique_ptr<PooledVm> VmPool::take(const std::string& key, Maker make) {
  if (size_ == 0) return nullptr;
  std::unique_ptr<PooledVm> out;
  {
    std::lock_guard lock(mu_);
    if (stopping_) return nullptr;
    auto [it, fresh] = shapes_.try_emplace(key);
    Shape& shape = it->second;
    shape.make = std::move(make);
    shape.last_used = Clock::now();
    if (!shape.ready.empty()) {
      out = std::move(shape.ready.front());
      shape.ready.pop_front();
      ++counts_.claims;
    } else if (!fresh) {
      ++counts_.misses;
    }
  }
  wake_.notify_all();
  return out;
}

VmPoolStatus VmPool::status() const {
  std::lock_guard lock(mu_);
  VmPoolStatus s = counts_;
  s.shapes = static_cast<std::uint32_t>(shapes_.size());
  s.ready = 0;
  for (const auto& [key, shape] : shapes_) s.ready += static_cast<std::uint32_t>(shape.ready.size());
  return s;
}

void VmPool::stop() {
  std::vector<std::unique_ptr<PooledVm>> drop;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    for (auto& [key, shape] : shapes_)
      for (auto& vm : shape.ready) drop.push_back(std::move(vm));
    shapes_.clear();
  }
  wake_.notify_all();
  if (filler_.joinable()) filler_.join();
  drop.clear();
}

std::vector<std::unique_ptr<PooledVm>> VmPool::take_idle(Clock::time_point now) {
  std::vector<std::unique_ptr<PooledVm>> out;
  for (auto it = shapes_.begin(); it != shapes_.end();) {
    if (now - it->second.last_used < idle_) {
      ++it;
      continue;
    }
    log_info("VM pool: no create of a shape for {:.1f} s: its {} pooled VMs stopped",
             std::chrono::duration<double>(idle_).count(), it->second.ready.size());
    for (auto& vm : it->second.ready) out.push_back(std::move(vm));
    it = shapes_.erase(it);
  }
  return out;
}

// One VM at a time, for the shape with the fewest ready: making one costs a restore and a command under the
// node's accelerator, which must not crowd out the creates and execs it is there to speed up.
void VmPool::fill() {
  std::unique_lock lock(mu_);
  while (!stopping_) {
    const auto now = Clock::now();
    {
      auto idle = take_idle(now);
      if (!idle.empty()) {
        lock.unlock();
        idle.clear();
        lock.lock();
        continue;
      }
    }
    std::string key;
    Maker make;
    std::size_t fewest = size_;
    Clock::time_point next_event = now + std::min<std::chrono::milliseconds>(idle_, std::chrono::seconds(5));
    for (auto& [k, shape] : shapes_) {
      if (shape.ready.size() >= size_) continue;
      if (shape.next_try > now) {
        next_event = std::min(next_event, shape.next_try);
        continue;
      }
      if (shape.ready.size() < fewest) {
        fewest = shape.ready.size();
        key = k;
        make = shape.make;
      }
    }
    if (!make) {
      wake_.wait_until(lock, next_event);
      continue;
    }
    lock.unlock();
    std::unique_ptr<PooledVm> vm;
    std::string failure;
    try {
      vm = make();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    lock.lock();
    auto it = shapes_.find(key);
    if (!vm) {
      ++counts_.failures;
      if (it != shapes_.end()) {
        Shape& shape = it->second;
        ++shape.failures_in_row;
        auto backoff = std::chrono::seconds(std::min<std::uint32_t>(60, 1u << std::min(shape.failures_in_row, 6u)));
        shape.next_try = Clock::now() + backoff;
        log_warn("VM pool: a VM could not be made ({}); next try in {} s", failure, backoff.count());
      }
      continue;
    }
    if (it == shapes_.end() || stopping_) {
      lock.unlock();
      vm.reset();  // the shape went idle (or the agent stops) while it was made
      lock.lock();
      continue;
    }
    it->second.failures_in_row = 0;
    it->second.ready.push_back(std::move(vm));
  }
}

void remove_pool_leftovers(BackendContext& ctx) {
  std::error_code ec;
  const fs::path dir = ctx.data_dir / "pool";
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    try {
      ctx.cgroups->remove_sandbox_groups(name);
    } catch (const std::exception& e) {
      log_warn("pooled VM {} of an earlier run: remove its cgroups: {}", name, e.what());
    }
  }
  fs::remove_all(dir, ec);
  fs::remove_all(ctx.work_dir / "pool", ec);
}

}  // namespace dsec::agent::qemu
