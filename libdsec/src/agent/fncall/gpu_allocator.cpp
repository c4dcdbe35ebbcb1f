#include "agent/fncall/gpu_allocator.hpp"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "dsec/error.hpp"

namespace dsec::agent::fncall {

GpuGrant& GpuGrant::operator=(GpuGrant&& other) noexcept {
  if (this != &other) {
    release();
    owner_ = std::move(other.owner_);
    indexes_ = std::move(other.indexes_);
    devices_ = std::move(other.devices_);
    mode_ = other.mode_;
    shares_ = other.shares_;
    other.owner_.reset();
    other.indexes_.clear();
    other.devices_.clear();
    other.mode_ = GpuMode::kNone;
    other.shares_ = 0;
  }
  return *this;
}

void GpuGrant::release() {
  if (owner_) owner_->give_back(indexes_, mode_, shares_);
  owner_.reset();
  indexes_.clear();
  devices_.clear();
  mode_ = GpuMode::kNone;
  shares_ = 0;
}

std::shared_ptr<GpuAllocator> GpuAllocator::make(std::vector<std::string> devices, std::uint32_t shares_per_gpu) {
  if (shares_per_gpu < 1) throw Error(Code::kInvalidArgument, "gpu shares: at least 1 per GPU");
  std::set<std::string> seen;
  for (const auto& d : devices) {
    if (d.empty()) throw Error(Code::kInvalidArgument, "gpus: a device name is empty");
    if (!seen.insert(d).second) throw Error(Code::kInvalidArgument, fmt::format("gpus: '{}' is listed twice", d));
  }
  return std::shared_ptr<GpuAllocator>(new GpuAllocator(std::move(devices), shares_per_gpu));
}

GpuAllocator::GpuAllocator(std::vector<std::string> devices, std::uint32_t shares_per_gpu)
    : devices_(std::move(devices)), shares_per_gpu_(shares_per_gpu), state_(devices_.size()) {}

std::vector<std::size_t> GpuAllocator::fit(GpuMode mode, std::uint32_t count) const {
  std::vector<std::size_t> out;
  if (mode == GpuMode::kExclusive) {
    for (std::size_t i = 0; i < state_.size() && out.size() < count; ++i)
      if (!state_[i].exclusive && state_[i].shares_used == 0) out.push_back(i);
    if (out.size() < count) out.clear();
    return out;
  }
  // Shared: the GPU with the most free shares that has room (ties: the lowest-numbered).
  std::size_t best = state_.size();
  for (std::size_t i = 0; i < state_.size(); ++i) {
    const Device& d = state_[i];
    if (d.exclusive || d.shares_used + count > shares_per_gpu_) continue;
    if (best == state_.size() || d.shares_used < state_[best].shares_used) best = i;
  }
  if (best != state_.size()) out.push_back(best);
  return out;
}

GpuGrant GpuAllocator::acquire(GpuMode mode, std::uint32_t count, Clock::time_point deadline) {
  GpuGrant grant;
  if (mode == GpuMode::kNone || count == 0) return grant;
  if (devices_.empty())
    throw Error(Code::kFailedPrecondition, "this node has no GPUs for function calls (dsecd --fncall-gpus)");
  if (mode == GpuMode::kExclusive && count > devices_.size())
    throw Error(Code::kFailedPrecondition,
                fmt::format("{} GPUs asked for, and this node has {}", count, devices_.size()));
  if (mode == GpuMode::kShared && count > shares_per_gpu_)
    throw Error(
        Code::kFailedPrecondition,
        fmt::format("{} shares of one GPU asked for, and this node cuts a GPU into {}", count, shares_per_gpu_));

  std::unique_lock lock(mu_);
  const std::uint64_t ticket = next_ticket_++;
  queue_.push_back(ticket);
  std::vector<std::size_t> got;
  for (;;) {
    if (queue_.front() == ticket) {
      got = fit(mode, count);
      if (!got.empty()) break;
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline) {
      if (queue_.front() == ticket) {
        got = fit(mode, count);
        if (!got.empty()) break;
      }
      queue_.erase(std::find(queue_.begin(), queue_.end(), ticket));
      lock.unlock();
      cv_.notify_all();  // the head may have changed
      throw Error(Code::kResourceExhausted,
                  fmt::format("GPUs: {} did not come free before the call's timeout",
                              mode == GpuMode::kExclusive ? fmt::format("{} whole GPU(s)", count)
                                                          : fmt::format("{} share(s) of one GPU", count)));
    }
  }
  queue_.pop_front();
  for (std::size_t i : got) {
    if (mode == GpuMode::kExclusive) state_[i].exclusive = true;
    else state_[i].shares_used += count;
    grant.devices_.push_back(devices_[i]);
  }
  grant.indexes_ = got;
  grant.mode_ = mode;
  grant.shares_ = mode == GpuMode::kShared ? count : 0;
  grant.owner_ = shared_from_this();
  lock.unlock();
  cv_.notify_all();  // the next in line may fit too
  return grant;
}

void GpuAllocator::give_back(const std::vector<std::size_t>& indexes, GpuMode mode, std::uint32_t shares) {
  {
    std::lock_guard lock(mu_);
    for (std::size_t i : indexes) {
      if (mode == GpuMode::kExclusive) state_[i].exclusive = false;
      else state_[i].shares_used -= std::min(shares, state_[i].shares_used);
    }
  }
  cv_.notify_all();
}

std::vector<GpuUsage> GpuAllocator::usage() const {
  std::lock_guard lock(mu_);
  std::vector<GpuUsage> out;
  for (std::size_t i = 0; i < devices_.size(); ++i)
    out.push_back(GpuUsage{devices_[i], state_[i].exclusive, state_[i].shares_used});
  return out;
}

std::size_t GpuAllocator::waiting() const {
  std::lock_guard lock(mu_);
  return queue_.size();
}

std::size_t GpuAllocator::free_gpus() const {
  std::lock_guard lock(mu_);
  return static_cast<std::size_t>(
      std::count_if(state_.begin(), state_.end(), [](const Device& d) { return !d.exclusive && d.shares_used == 0; }));
}

}  // namespace dsec::agent::fncall
