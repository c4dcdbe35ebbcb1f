// BlobStore::claim's default: a claim within this process, by store and name.
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>

#include "image/store/blob_store.hpp"

namespace dsec::image {
namespace {

class ProcessClaims {
 public:
  std::shared_ptr<void> claim(std::string key) {
    std::unique_lock lock(mu_);
    freed_.wait(lock, [&] { return !held_.count(key); });
    held_.insert(key);
    return std::shared_ptr<void>(nullptr, [this, key = std::move(key)](void*) {
      {
        std::lock_guard inner(mu_);
        held_.erase(key);
      }
      freed_.notify_all();
    });
  }

 private:
  std::mutex mu_;
  std::condition_variable freed_;
  std::set<std::string> held_;
};

}  // namespace

std::shared_ptr<void> BlobStore::claim(const std::string& name) {
  static ProcessClaims* claims = new ProcessClaims();  // never destroyed: a claim may outlive static destruction
  return claims->claim(url() + "\n" + name);
}

}  // namespace dsec::image
