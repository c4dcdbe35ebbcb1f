// A group: the sandboxes of one pulse (Client::create_group), created across nodes in one batch request per node,
// driven together, and held by a lease. The client renews the lease on every node holding members, in the
// background, every lease/3; if the trainer dies and the renewals stop, each agent destroys the group's sandboxes
// once the lease runs out, so no orphan outlives a crashed trainer.
//
// Owning, like Sandbox: the destructor destroys the group's sandboxes unless release() was called (then the lease is
// no longer renewed either, and the agents reap them when it runs out).
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/exec.hpp"
#include "dsec/sandbox.hpp"

namespace dsec {
namespace detail {
class ClientCore;
class GroupLease;
}  // namespace detail

class SandboxGroup {
 public:
  SandboxGroup() = default;
  SandboxGroup(std::shared_ptr<detail::ClientCore> core, std::string id, std::vector<Sandbox> members,
               std::chrono::seconds lease);
  SandboxGroup(SandboxGroup&&) noexcept;
  SandboxGroup& operator=(SandboxGroup&&) noexcept;
  ~SandboxGroup();

  const std::string& id() const noexcept { return id_; }
  std::size_t size() const noexcept { return members_.size(); }
  Sandbox& operator[](std::size_t i) { return members_.at(i); }
  const Sandbox& operator[](std::size_t i) const { return members_.at(i); }
  std::vector<Sandbox>::iterator begin() { return members_.begin(); }
  std::vector<Sandbox>::iterator end() { return members_.end(); }
  std::chrono::seconds lease() const noexcept { return lease_; }

  // The same command in every member, concurrently (up to the client's create_concurrency at once); results in
  // member order. A member whose call fails gets a result with exit_code -1 and the error in stderr, so one bad
  // sandbox does not hide the others' results.
  std::vector<ExecResult> exec(const ExecRequest& request) const;
  std::vector<ExecResult> exec(std::string shell_command, double timeout_seconds = 600) const;
  // Sleeps or wakes every member (Sandbox::sleep/wake), concurrently; results in member order. Every member is
  // tried; then the first error, if any, is thrown.
  std::vector<SleepResult> sleep() const;
  std::vector<SleepResult> wake() const;
  // Puts one network policy in force in every member (Sandbox::set_network), concurrently: a task's phase change
  // for the whole group. Answers each member's policy now in force, in member order; every member is tried, then
  // the first error, if any, is thrown.
  std::vector<NetworkPolicy> set_network(const NetworkPolicy& policy) const;
  // Snapshots every member (Sandbox::snapshot), concurrently; member i is named `name` with "-<i>" added to its tag
  // ("swe/ep:step3" gives "swe/ep:step3-0", "swe/ep:step3-1", ...; without a tag, "swe/ep:0", ...). Results in member
  // order. Every member is tried; then the first error, if any, is thrown.
  std::vector<SnapshotResult> snapshot(std::string_view name) const;
  // Renews the lease now (it is also renewed in the background). UNAVAILABLE when a node holding members could not
  // be reached.
  void renew();
  // Destroys every member (one request per node); idempotent. The group is empty afterwards.
  void destroy();
  // Stops renewing and gives the members up: the agents reap them when the lease runs out. Returns their ids.
  std::vector<std::string> release();

 private:
  std::shared_ptr<detail::ClientCore> core_;
  std::string id_;
  std::vector<Sandbox> members_;
  std::chrono::seconds lease_{0};
  std::unique_ptr<detail::GroupLease> renewer_;
};

}  // namespace dsec
