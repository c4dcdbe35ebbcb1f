// Network namespaces made ahead of time. Creating one costs about a millisecond (and tearing one down more, in the
// kernel's background), so a thread keeps a pool of fresh namespaces with loopback up; a sandbox takes one and its
// namespace dies with it. Namespaces are never reused between sandboxes.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <thread>

#include "common/unique_fd.hpp"

namespace dsec::agent::container {

class NetnsPool {
 public:
  explicit NetnsPool(std::size_t target);
  ~NetnsPool();
  NetnsPool(const NetnsPool&) = delete;
  NetnsPool& operator=(const NetnsPool&) = delete;

  // A fresh namespace (an fd of /proc/thread-self/ns/net); made on the spot when the pool is empty.
  UniqueFd take();
  std::size_t available();

  // Makes one namespace with loopback up, on the calling thread (which is left in it) .
  static UniqueFd make_namespace();

 private:
  void refill_loop();

  std::size_t target_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<UniqueFd> ready_;
  bool stop_ = false;
  std::thread refiller_;
};

}  // namespace dsec::agent::container
