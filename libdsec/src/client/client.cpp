#include "dsec/client.hpp"

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "common/protocol/limits.hpp"

namespace dsec {

Client::Client(ClientOptions options) : core_(std::make_shared<detail::ClientCore>(std::move(options))) {}

Client::~Client() { close(); }

Client::Client(Client&&) noexcept = default;

Client& Client::operator=(Client&& other) noexcept {
  if (this != &other) {
    close();
    core_ = std::move(other.core_);
  }
  return *this;
}

void Client::close() {
  if (core_) core_->close();
}

static detail::ClientCore& open_core(const std::shared_ptr<detail::ClientCore>& core) {
  if (!core) throw Error(Code::kFailedPrecondition, "this dsec::Client was moved from");
  return *core;
}

Sandbox Client::create(const SandboxSpec& spec) {
  auto info = open_core(core_).create(spec);
  return Sandbox(core_, std::move(info.id));
}

std::vector<Sandbox> Client::create_many(std::size_t n, const SandboxSpec& spec) {
  return create_many(std::vector<SandboxSpec>(n, spec));
}

std::vector<Sandbox> Client::create_many(const std::vector<SandboxSpec>& specs) {
  auto infos = open_core(core_).create_many(specs);
  std::vector<Sandbox> out;
  out.reserve(infos.size());
  for (auto& info : infos) out.emplace_back(core_, std::move(info.id));
  return out;
}

SandboxGroup Client::create_group(std::size_t n, const SandboxSpec& spec, std::chrono::seconds lease) {
  return create_group(std::vector<SandboxSpec>(n, spec), lease);
}

SandboxGroup Client::create_group(const std::vector<SandboxSpec>& specs, std::chrono::seconds lease) {
  if (lease.count() < 1 || static_cast<double>(lease.count()) > protocol::kMaxGroupTtlSeconds)
    throw Error(Code::kInvalidArgument,
                fmt::format("create_group: the lease must be 1 to {} seconds", protocol::kMaxGroupTtlSeconds));
  const std::string first = specs.empty() ? std::string() : specs.front().request_id;
  std::string group = first.empty() ? detail::random_request_id() : first;
  std::vector<SandboxSpec> named = specs;
  if (!named.empty()) named.front().request_id = group;
  auto infos = open_core(core_).create_many(named, group, lease);
  std::vector<Sandbox> members;
  members.reserve(infos.size());
  for (auto& info : infos) members.emplace_back(core_, std::move(info.id));
  return SandboxGroup(core_, std::move(group), std::move(members), lease);
}

FnCallResult Client::run_code(const FnCallRequest& request) { return open_core(core_).run_code(request); }

std::vector<FnCallResult> Client::run_code_many(const std::vector<FnCallRequest>& requests) {
  return open_core(core_).run_code_many(requests);
}

Sandbox Client::attach(const std::string& id) {
  open_core(core_);
  if (!detail::valid_sandbox_id(id))
    throw Error(Code::kInvalidArgument, fmt::format("'{}' is not a sandbox id (letters, digits, '-', '_', '.')", id));
  return Sandbox(core_, id, /*owning=*/false);
}

std::vector<SandboxInfo> Client::list(const Labels& labels, const std::string& tenant) {
  return open_core(core_).list(labels, tenant);
}

std::vector<NodeInfo> Client::nodes() { return open_core(core_).nodes(); }

std::vector<ImageInfo> Client::images() { return open_core(core_).images(); }

void Client::remove_image(const std::string& name) { open_core(core_).remove_image(name); }

std::string Client::endpoint() const { return open_core(core_).endpoint(); }

}  // namespace dsec
