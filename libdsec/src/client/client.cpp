#include "dsec/client.hpp"

#include <fmt/format.h>

#include "client/client_core.hpp"

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
  auto infos = open_core(core_).create_many(n, spec);
  std::vector<Sandbox> out;
  out.reserve(infos.size());
  for (auto& info : infos) out.emplace_back(core_, std::move(info.id));
  return out;
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

std::string Client::endpoint() const { return open_core(core_).endpoint(); }

}  // namespace dsec
