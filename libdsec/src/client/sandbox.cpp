#include "dsec/sandbox.hpp"

#include <utility>

#include "client/client_core.hpp"

namespace dsec {

Sandbox::Sandbox(std::shared_ptr<detail::ClientCore> core, std::string id, bool owning)
    : core_(std::move(core)), id_(std::move(id)), owning_(owning) {}

Sandbox::Sandbox(Sandbox&& other) noexcept
    : core_(std::move(other.core_)), id_(std::move(other.id_)), owning_(other.owning_) {
  other.id_.clear();
}

Sandbox& Sandbox::operator=(Sandbox&& other) noexcept {
  if (this != &other) {
    if (core_ && owning_) {
      try {
        core_->destroy(id_);
      } catch (...) {
      }
    }
    core_ = std::move(other.core_);
    id_ = std::exchange(other.id_, {});
    owning_ = other.owning_;
  }
  return *this;
}

Sandbox::~Sandbox() {
  // A destructor never throws: a sandbox that cannot be destroyed now is left to its TTL.
  if (core_ && owning_ && !core_->closed()) {
    try {
      core_->destroy(id_);
    } catch (...) {
    }
  }
}

detail::ClientCore& Sandbox::core() const {
  if (!core_) throw Error(Code::kFailedPrecondition, "empty dsec::Sandbox handle (destroyed, released or moved from)");
  return *core_;
}

ExecResult Sandbox::exec(const ExecRequest& request) const { return core().exec(id_, request); }

ExecResult Sandbox::exec(std::string shell_command, double timeout_seconds) const {
  ExecRequest request;
  request.shell = std::move(shell_command);
  request.timeout_seconds = timeout_seconds;
  return core().exec(id_, request);
}

ExecResult Sandbox::exec_stream(const ExecRequest& request,
                                const std::function<void(int fd, std::string_view data)>& on_output) const {
  return core().exec_stream(id_, request, on_output);
}

void Sandbox::write_file(std::string_view path, std::string_view data, unsigned mode) const {
  core().write_file(id_, path, data, mode);
}

std::string Sandbox::read_file(std::string_view path) const { return core().read_file(id_, path); }

void Sandbox::upload_tar(std::string_view dir, std::string_view tar_bytes) const {
  core().upload_tar(id_, dir, tar_bytes);
}

std::string Sandbox::download_tar(std::string_view dir) const { return core().download_tar(id_, dir); }

SandboxInfo Sandbox::info() const { return core().get(id_); }

SleepResult Sandbox::sleep() const { return core().sleep_or_wake(id_, true); }
NetworkPolicy Sandbox::network() const { return core().network(id_); }
SandboxInfo Sandbox::set_ttl(std::chrono::seconds ttl) const { return core().set_ttl(id_, ttl); }
NetworkPolicy Sandbox::set_network(const NetworkPolicy& policy) const { return core().set_network(id_, policy); }
std::string Sandbox::expose(std::uint32_t port) const { return core().expose(id_, port); }
void Sandbox::unexpose(std::uint32_t port) const { core().unexpose(id_, port); }
std::map<std::uint32_t, std::string> Sandbox::exposed() const { return core().exposed(id_); }
NetworkUsage Sandbox::network_usage() const { return core().network_usage(id_); }

std::string Sandbox::screenshot() const { return core().screenshot(id_); }
ScreenState Sandbox::screen() const { return core().screen_state(id_); }
ScreenState Sandbox::input(const std::vector<InputAction>& actions) const { return core().input(id_, actions); }
ScreenState Sandbox::mouse_move(std::uint32_t x, std::uint32_t y) const { return input({InputAction::move(x, y)}); }
ScreenState Sandbox::click(std::uint32_t x, std::uint32_t y, std::string button, bool double_click) const {
  return input({InputAction::click(x, y, std::move(button), double_click ? 2 : 1)});
}
ScreenState Sandbox::scroll(std::int32_t dy) const { return input({InputAction::scroll(dy)}); }
ScreenState Sandbox::drag(std::uint32_t x, std::uint32_t y, std::uint32_t to_x, std::uint32_t to_y) const {
  return input({InputAction::drag(x, y, to_x, to_y)});
}
ScreenState Sandbox::key(std::string combo) const { return input({InputAction::key(std::move(combo))}); }
ScreenState Sandbox::type_text(std::string text) const { return input({InputAction::type_text(std::move(text))}); }
VncEndpoint Sandbox::vnc_endpoint() const { return core().vnc(id_); }
std::string Sandbox::vnc() const { return core().vnc(id_).address; }
void Sandbox::stop_vnc() const { core().stop_vnc(id_); }

SleepResult Sandbox::wake() const { return core().sleep_or_wake(id_, false); }

SnapshotResult Sandbox::snapshot(std::string_view name) const { return core().snapshot(id_, name); }

std::vector<Sandbox> Sandbox::fork(std::size_t n, std::string_view name, bool keep) const {
  auto infos = core().fork(id_, n, name, keep);
  std::vector<Sandbox> out;
  out.reserve(infos.size());
  for (auto& info : infos) out.emplace_back(core_, std::move(info.id));
  return out;
}

void Sandbox::destroy() {
  core().destroy(id_);
  core_.reset();
  id_.clear();
}

std::string Sandbox::release() noexcept {
  core_.reset();
  return std::exchange(id_, {});
}

}  // namespace dsec
