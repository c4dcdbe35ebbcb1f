// Fuzz target: the bytes a client sends dsecd on one connection. They go through what server.cpp does with them
// (Boost.Beast's request parser with the agent's default header and body limits, read_header then read, over a
// stream that hands them out in pieces; keep-alive requests one after another), then each parsed request through
// what the router decodes before it dispatches (routes.hpp): the target's route, ids and query, label filters, the
// files API's path and mode parameters, and the body as JSON.
//
// Input: byte 0 picks how many bytes a read returns (1 to 256), the rest is the connection's stream.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <boost/asio/buffer.hpp>
#include <boost/asio/error.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/string_body.hpp>
#include <boost/system/system_error.hpp>

#include "agent/api/routes.hpp"
#include "agent/config.hpp"
#include "common/protocol.hpp"
#include "dsec/error.hpp"
#include "fuzz_util.hpp"
#include "http/http.hpp"

namespace {

namespace http = boost::beast::http;

// A SyncReadStream over memory: at most `step` bytes per read, then end of stream.
class MemoryStream {
 public:
  MemoryStream(std::string_view data, std::size_t step) : data_(data), step_(step) {}

  template <typename MutableBufferSequence>
  std::size_t read_some(const MutableBufferSequence& buffers, boost::system::error_code& ec) {
    ec = {};
    if (data_.empty()) {
      ec = boost::asio::error::eof;
      return 0;
    }
    std::size_t n = boost::asio::buffer_copy(buffers, boost::asio::buffer(data_.data(), std::min(step_, data_.size())));
    data_.remove_prefix(n);
    return n;
  }

  template <typename MutableBufferSequence>
  std::size_t read_some(const MutableBufferSequence& buffers) {
    boost::system::error_code ec;
    std::size_t n = read_some(buffers, ec);
    if (ec) throw boost::system::system_error(ec);
    return n;
  }

 private:
  std::string_view data_;
  std::size_t step_;
};

// What the router decodes of a request before it reaches the registry. Bad input is dsec::Error, nothing else.
void route(const dsec::agent::HttpRequest& request) {
  using namespace dsec::agent;
  std::string_view raw(request.target().data(), request.target().size());
  Target target;
  try {
    target = parse_target(raw);
  } catch (const dsec::Error& e) {
    fuzz::expect_code(e, dsec::Code::kInvalidArgument, "parse_target");
    return;
  }
  if (route_template(target.route).empty()) fuzz::fail("route_template: empty for a route");
  // Every route from /v1/sandboxes/{id} to the last one below it (networks, processes, sessions, the screen) names a
  // sandbox.
  bool per_sandbox = target.route >= Route::kSandbox && target.route <= Route::kSandboxScreenVnc;
  bool per_group = target.route == Route::kGroup || target.route == Route::kGroupRenew;
  bool per_item = (target.route >= Route::kSandboxProcess && target.route <= Route::kSandboxProcessResize) ||
                  (target.route >= Route::kSandboxSession && target.route <= Route::kSandboxSessionRestart);
  if (per_sandbox != !target.sandbox_id.empty()) fuzz::fail("parse_target: a sandbox id without its route, or back");
  if (per_group != !target.group_id.empty()) fuzz::fail("parse_target: a group id without its route, or back");
  if (per_item != !target.item.empty()) fuzz::fail("parse_target: a pid or session name without its route, or back");
  // Every decoded query item came from the raw query: decoding never makes a string longer.
  for (const auto& [k, v] : target.query.items())
    if (k.size() + v.size() > raw.size()) fuzz::fail("parse_query: an item longer than the target");
  try {
    dsec::Labels labels = parse_label_filters(target.query.get_all("label"));
    for (const auto& [k, v] : labels)
      if (k.empty() || k.find('=') != std::string::npos) fuzz::fail("parse_label_filters: a bad key got through");
  } catch (const dsec::Error& e) {
    fuzz::expect_code(e, dsec::Code::kInvalidArgument, "parse_label_filters");
  }
  for (const char* param : {"path", "dest"}) {
    if (auto p = target.query.get(param)) {
      try {
        check_sandbox_path(*p, param);
        if (p->empty() || p->front() != '/' || p->find('\0') != std::string::npos)
          fuzz::fail("check_sandbox_path: accepted a path that is not absolute");
      } catch (const dsec::Error& e) {
        fuzz::expect_code(e, dsec::Code::kInvalidArgument, "check_sandbox_path");
      }
    }
  }
  if (auto m = target.query.get("mode")) {
    try {
      if (parse_file_mode(*m) > 07777) fuzz::fail("parse_file_mode: above 07777");
    } catch (const dsec::Error& e) {
      fuzz::expect_code(e, dsec::Code::kInvalidArgument, "parse_file_mode");
    }
  }
  try {
    (void)dsec::protocol::parse_body(request.body());
  } catch (const dsec::Error& e) {
    fuzz::expect_code(e, dsec::Code::kInvalidArgument, "parse_body");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  static const dsec::agent::AgentConfig defaults;
  MemoryStream stream(std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1), 1 + data[0]);
  boost::beast::flat_buffer buffer;
  // As server.cpp serves one connection: requests until the stream ends or one is refused.
  for (int requests = 0; requests < 16; ++requests) {
    http::request_parser<http::string_body> parser;
    parser.header_limit(static_cast<std::uint32_t>(defaults.max_header_bytes));
    parser.body_limit(static_cast<std::uint64_t>(defaults.max_body_bytes));
    boost::system::error_code ec;
    http::read_header(stream, buffer, parser, ec);
    if (!ec && !parser.is_done()) http::read(stream, buffer, parser, ec);
    if (ec) break;
    dsec::agent::HttpRequest request = parser.release();
    route(request);
    if (!request.keep_alive()) break;
  }
  return 0;
}
