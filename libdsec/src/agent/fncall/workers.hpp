// A few threads that run posted jobs in order of posting: the fncall backend's background work (starting fork
// servers, arming children, cleaning up after calls), kept off the threads that answer requests.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dsec::agent::fncall {

class Workers {
 public:
  Workers(std::string name, std::size_t threads);
  ~Workers() { stop(); }
  Workers(const Workers&) = delete;
  Workers& operator=(const Workers&) = delete;

  // Jobs must not throw (what they throw is logged and dropped). Posting after stop() drops the job.
  void post(std::function<void()> job);
  // Runs what is queued, then joins the threads. Idempotent.
  void stop();
  std::size_t queued() const;

 private:
  void loop();

  std::string name_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace dsec::agent::fncall
