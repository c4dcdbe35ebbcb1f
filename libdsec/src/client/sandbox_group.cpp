#include "dsec/group.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "image/store/manifest.hpp"

namespace dsec {
namespace detail {

// Renews a group's lease every lease/3 on its own thread until stopped. A failed renewal is tried again at the next
// tick (the lease has two more ticks of slack).
class GroupLease {
 public:
  GroupLease(std::shared_ptr<ClientCore> core, std::string group, std::vector<std::string> members,
             std::chrono::seconds ttl)
      : core_(std::move(core)), group_(std::move(group)), members_(std::move(members)), ttl_(ttl) {
    thread_ = std::thread([this] { run(); });
  }
  ~GroupLease() { stop(); }

  void stop() {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    const auto period = std::max<std::chrono::milliseconds>(ttl_ / 3, std::chrono::milliseconds(200));
    std::unique_lock lock(mu_);
    while (!cv_.wait_for(lock, period, [&] { return stopping_; })) {
      lock.unlock();
      try {
        if (!core_->closed()) core_->renew_group(group_, members_, ttl_);
      } catch (const Error&) {
        // Next tick.
      }
      lock.lock();
    }
  }

  std::shared_ptr<ClientCore> core_;
  std::string group_;
  std::vector<std::string> members_;
  std::chrono::seconds ttl_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace detail

SandboxGroup::SandboxGroup(std::shared_ptr<detail::ClientCore> core, std::string id, std::vector<Sandbox> members,
                           std::chrono::seconds lease)
    : core_(std::move(core)), id_(std::move(id)), members_(std::move(members)), lease_(lease) {
  if (lease_.count() > 0) {
    std::vector<std::string> ids;
    for (const auto& m : members_) ids.push_back(m.id());
    renewer_ = std::make_unique<detail::GroupLease>(core_, id_, std::move(ids), lease_);
  }
}

SandboxGroup::SandboxGroup(SandboxGroup&&) noexcept = default;

SandboxGroup& SandboxGroup::operator=(SandboxGroup&& other) noexcept {
  if (this != &other) {
    try {
      destroy();
    } catch (...) {
    }
    core_ = std::move(other.core_);
    id_ = std::move(other.id_);
    members_ = std::move(other.members_);
    lease_ = other.lease_;
    renewer_ = std::move(other.renewer_);
  }
  return *this;
}

SandboxGroup::~SandboxGroup() {
  try {
    destroy();
  } catch (...) {
    // The members' lease runs out and the agents reap them.
  }
}

std::vector<ExecResult> SandboxGroup::exec(const ExecRequest& request) const {
  std::vector<ExecResult> out(members_.size());
  if (members_.empty()) return out;
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i = next.fetch_add(1); i < members_.size(); i = next.fetch_add(1)) {
      try {
        out[i] = members_[i].exec(request);
      } catch (const Error& e) {
        out[i].exit_code = -1;
        out[i].stderr_data = fmt::format("dsec: {}: {}", e.code_name(), e.what());
      }
    }
  };
  const std::size_t workers = std::min(members_.size(), core_ ? core_->create_concurrency() : std::size_t{1});
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  return out;
}

std::vector<ExecResult> SandboxGroup::exec(std::string shell_command, double timeout_seconds) const {
  ExecRequest r;
  r.shell = std::move(shell_command);
  r.timeout_seconds = timeout_seconds;
  return exec(r);
}

namespace {

// Calls `call(i, members[i])` for every member, concurrently (at most `concurrency` at once); results in member
// order. Every member is tried; then the first error, if any, is thrown.
template <typename Result, typename Call>
std::vector<Result> for_every_member(const std::vector<Sandbox>& members, std::size_t concurrency, Call call) {
  std::vector<Result> out(members.size());
  std::optional<Error> first_error;
  std::mutex error_mutex;
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t i = next.fetch_add(1); i < members.size(); i = next.fetch_add(1)) {
      try {
        out[i] = call(i, members[i]);
      } catch (const Error& e) {
        std::lock_guard lock(error_mutex);
        if (!first_error) first_error = e;
      }
    }
  };
  const std::size_t workers = std::min(members.size(), std::max<std::size_t>(concurrency, 1));
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  if (first_error) throw *first_error;
  return out;
}

}  // namespace

std::vector<SleepResult> SandboxGroup::sleep() const {
  return for_every_member<SleepResult>(members_, core_ ? core_->create_concurrency() : 1,
                                       [](std::size_t, const Sandbox& sb) { return sb.sleep(); });
}

std::vector<SleepResult> SandboxGroup::wake() const {
  return for_every_member<SleepResult>(members_, core_ ? core_->create_concurrency() : 1,
                                       [](std::size_t, const Sandbox& sb) { return sb.wake(); });
}

std::vector<NetworkPolicy> SandboxGroup::set_network(const NetworkPolicy& policy) const {
  return for_every_member<NetworkPolicy>(members_, core_ ? core_->create_concurrency() : 1,
                                         [&](std::size_t, const Sandbox& sb) { return sb.set_network(policy); });
}

std::vector<SnapshotResult> SandboxGroup::snapshot(std::string_view name) const {
  // The name is checked once, up front, so a bad one fails before any member is frozen.
  image::ImageReference ref = image::parse_reference(name);
  if (!ref.digest.empty())
    throw Error(Code::kInvalidArgument,
                fmt::format("name: '{}' pins a digest; a snapshot is named by a repository and a tag", name));
  const bool tagged = name.find(':') != std::string_view::npos;
  return for_every_member<SnapshotResult>(
      members_, core_ ? core_->create_concurrency() : 1, [&](std::size_t i, const Sandbox& sb) {
        return sb.snapshot(tagged ? fmt::format("{}:{}-{}", ref.name, ref.tag, i) : fmt::format("{}:{}", ref.name, i));
      });
}

void SandboxGroup::renew() {
  if (!core_ || members_.empty()) return;
  std::vector<std::string> ids;
  for (const auto& m : members_) ids.push_back(m.id());
  core_->renew_group(id_, ids, lease_);
}

void SandboxGroup::destroy() {
  if (renewer_) renewer_->stop();
  renewer_.reset();
  if (!core_ || members_.empty()) return;
  std::vector<std::string> ids;
  for (auto& m : members_) ids.push_back(m.release());
  members_.clear();
  if (core_->closed()) return;  // a closed client's agent took its sandboxes with it, or their lease will
  core_->destroy_group(id_, ids);
}

std::vector<std::string> SandboxGroup::release() {
  if (renewer_) renewer_->stop();
  renewer_.reset();
  std::vector<std::string> ids;
  for (auto& m : members_) ids.push_back(m.release());
  members_.clear();
  return ids;
}

}  // namespace dsec
