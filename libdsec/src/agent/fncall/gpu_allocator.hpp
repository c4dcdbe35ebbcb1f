// The node's GPUs as function calls take them: whole GPUs (exclusive) or shares of one GPU (shared; the node cuts
// each GPU into a fixed number of shares). Requests wait in one FIFO queue: the oldest waits first, so a stream of
// small shared requests cannot starve an exclusive one. Pure bookkeeping over device names, so unit tests run it
// with a fake device list; the fncall backend turns a grant into CUDA_VISIBLE_DEVICES and device nodes.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dsec/fncall.hpp"

namespace dsec::agent::fncall {

class GpuAllocator;

// GPUs held by one call; given back when destroyed.
class GpuGrant {
 public:
  GpuGrant() = default;
  GpuGrant(GpuGrant&& other) noexcept { *this = std::move(other); }
  GpuGrant& operator=(GpuGrant&& other) noexcept;
  GpuGrant(const GpuGrant&) = delete;
  GpuGrant& operator=(const GpuGrant&) = delete;
  ~GpuGrant() { release(); }

  // The devices' names ("0", "1"), in the order of CUDA_VISIBLE_DEVICES.
  const std::vector<std::string>& devices() const noexcept { return devices_; }
  GpuMode mode() const noexcept { return mode_; }
  std::uint32_t shares() const noexcept { return shares_; }  // shared: shares of the one device
  bool empty() const noexcept { return devices_.empty(); }
  void release();

 private:
  friend class GpuAllocator;
  std::shared_ptr<GpuAllocator> owner_;
  std::vector<std::size_t> indexes_;
  std::vector<std::string> devices_;
  GpuMode mode_ = GpuMode::kNone;
  std::uint32_t shares_ = 0;
};

struct GpuUsage {
  std::string device;
  bool exclusive = false;  // held whole by one call
  std::uint32_t shares_used = 0;
};

class GpuAllocator : public std::enable_shared_from_this<GpuAllocator> {
 public:
  using Clock = std::chrono::steady_clock;

  // `shares_per_gpu` >= 1. Device names must be distinct and non-empty (INVALID_ARGUMENT otherwise).
  static std::shared_ptr<GpuAllocator> make(std::vector<std::string> devices, std::uint32_t shares_per_gpu);

  // Exclusive: `count` whole GPUs (the lowest-numbered free ones). Shared: `count` shares of one GPU (the one with
  // the most free shares). Waits in FIFO order until the request fits or `deadline` passes (RESOURCE_EXHAUSTED,
  // retryable). A request the node could never meet (more GPUs or shares than it has, or a node without GPUs) is
  // FAILED_PRECONDITION at once; kNone or a count of 0 is an empty grant.
  GpuGrant acquire(GpuMode mode, std::uint32_t count, Clock::time_point deadline);

  const std::vector<std::string>& devices() const noexcept { return devices_; }
  std::uint32_t shares_per_gpu() const noexcept { return shares_per_gpu_; }
  std::vector<GpuUsage> usage() const;
  std::size_t waiting() const;
  // GPUs no call holds any share of.
  std::size_t free_gpus() const;

 private:
  GpuAllocator(std::vector<std::string> devices, std::uint32_t shares_per_gpu);
  friend class GpuGrant;
  struct Device {
    bool exclusive = false;
    std::uint32_t shares_used = 0;
  };
  // The devices a request would get now, or empty when it does not fit.
  std::vector<std::size_t> fit(GpuMode mode, std::uint32_t count) const;
  void give_back(const std::vector<std::size_t>& indexes, GpuMode mode, std::uint32_t shares);

  std::vector<std::string> devices_;
  std::uint32_t shares_per_gpu_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Device> state_;
  std::deque<std::uint64_t> queue_;  // tickets of waiting requests, oldest first
  std::uint64_t next_ticket_ = 0;
};

}  // namespace dsec::agent::fncall
