#include "agent/fncall/workers.hpp"

#include <exception>

#include "common/log.hpp"

namespace dsec::agent::fncall {

Workers::Workers(std::string name, std::size_t threads) : name_(std::move(name)) {
  for (std::size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { loop(); });
}

void Workers::post(std::function<void()> job) {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    jobs_.push_back(std::move(job));
  }
  cv_.notify_one();
}

void Workers::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_ && threads_.empty()) return;
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_)
    if (t.joinable()) t.join();
  threads_.clear();
}

std::size_t Workers::queued() const {
  std::lock_guard lock(mu_);
  return jobs_.size();
}

void Workers::loop() {
  for (;;) {
    std::function<void()> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and nothing left
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    try {
      job();
    } catch (const std::exception& e) {
      log_warn("fncall {}: {}", name_, e.what());
    } catch (...) {
      log_warn("fncall {}: unknown exception", name_);
    }
  }
}

}  // namespace dsec::agent::fncall
