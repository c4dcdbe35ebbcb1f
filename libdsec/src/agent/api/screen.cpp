// The router's room for a full VM's screen (docs/protocol.md, "Screen"): a PNG of it, its state, and input.
#include <fmt/format.h>

#include "agent/api/router.hpp"
#include "agent/api/router_internal.hpp"
#include "common/protocol/screen.hpp"

namespace dsec::agent {
namespace http = boost::beast::http;

HttpResponse Router::screen(HttpRequest& request, const Target& target) {
  const std::string path(route_template(target.route));
  if (target.route == Route::kSandboxScreenVnc) allow(request, path, {http::verb::post, http::verb::delete_});
  else allow(request, path, {target.route == Route::kSandboxScreenInput ? http::verb::post : http::verb::get});
  only_params(target.query, {});
  SandboxHandle handle = registry_.acquire(target.sandbox_id);
  Screen* screen = handle.sandbox->screen();
  if (!screen)
    throw Error(Code::kFailedPrecondition,
                fmt::format("sandbox {} has no screen: only full VMs (kind 'vm') made with a display have one (it "
                            "is a {} sandbox)",
                            target.sandbox_id, handle.kind));
  switch (target.route) {
    case Route::kSandboxScreen:
      return text_response(http::status::ok, screen->screenshot_png(), "image/png");
    case Route::kSandboxScreenState:
      return json_response(http::status::ok, protocol::encode(screen->state()));
    case Route::kSandboxScreenVnc:
      if (request.method() == http::verb::delete_) {
        screen->stop_vnc();
        return json_response(http::status::ok, protocol::json::object());
      }
      {
        const VncEndpoint vnc = screen->vnc();
        return json_response(http::status::ok, protocol::json{{"address", vnc.address}, {"password", vnc.password}});
      }
    default:
      break;
  }
  std::vector<InputAction> actions = protocol::decode_input(protocol::parse_body(request.body()));
  return json_response(http::status::ok, protocol::encode(screen->input(actions)));
}

}  // namespace dsec::agent
