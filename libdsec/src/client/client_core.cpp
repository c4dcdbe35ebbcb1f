#include "client/client_core.hpp"

#include "client/exec_stream.hpp"

#include <exception>
#include <optional>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "common/protocol.hpp"
#include "dsec/retry.hpp"

namespace dsec::detail {
namespace {

using std::chrono::milliseconds;

constexpr std::string_view kJson = "application/json";
constexpr std::string_view kTar = "application/x-tar";
constexpr std::string_view kOctets = "application/octet-stream";
// Asking a node for its id while routing is quick or not at all.
constexpr milliseconds kDiscoveryTimeout{5'000};

std::mt19937_64& thread_rng() {
  thread_local std::mt19937_64 rng = [] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd()};
    return std::mt19937_64(seq);
  }();
  return rng;
}

protocol::json parse_json(const HttpResponse& r, std::string_view what) {
  try {
    return protocol::json::parse(r.body);
  } catch (const protocol::json::exception& e) {
    throw Error(Code::kInternal, fmt::format("{}: the agent answered HTTP {} with a body that is not JSON: {}", what,
                                             r.status, e.what()));
  }
}

std::vector<SandboxInfo> decode_sandbox_list(const HttpResponse& r, std::string_view what) {
  auto j = parse_json(r, what);
  auto it = j.find("sandboxes");
  if (it == j.end() || !it->is_array())
    throw Error(Code::kInternal, fmt::format("{}: the agent's answer has no \"sandboxes\" array", what));
  std::vector<SandboxInfo> out;
  out.reserve(it->size());
  for (const auto& s : *it) out.push_back(protocol::decode_sandbox_info(s));
  return out;
}

// Runs fn(worker) on `workers` threads and waits for all of them.
template <typename Fn>
void run_workers(std::size_t workers, Fn&& fn) {
  std::vector<std::thread> threads;
  threads.reserve(workers);
  try {
    for (std::size_t w = 0; w < workers; ++w) threads.emplace_back(fn);
  } catch (...) {
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
}

}  // namespace

std::string random_request_id() {
  auto& rng = thread_rng();
  return fmt::format("{:016x}{:016x}", rng(), rng());
}

ClientCore::ClientCore(ClientOptions options) : options_(std::move(options)) {
  std::vector<std::string> endpoints = options_.endpoints;
  if (endpoints.empty()) {
    EmbeddedAgentOptions ao;
    ao.binary = options_.agent_binary;
    ao.candidates = options_.agent_candidates;
    ao.home = options_.home;
    ao.extra_args = options_.agent_args;
    ao.stores = options_.stores;
    ao.start_timeout = options_.agent_start_timeout;
    ao.stop_grace = options_.agent_stop_grace;
    agent_ = std::make_unique<EmbeddedAgent>(ao);
    endpoints.push_back(agent_->endpoint());
  }
  for (const auto& e : endpoints) transports_.push_back(std::make_unique<Transport>(parse_endpoint(e)));
  std::vector<std::string> stores = options_.stores;
  if (stores.empty() && agent_) stores.push_back(agent_->home() + "/store");
  images_ = std::make_unique<ImageResolver>(stores, options_.image_cache_ttl);
  nodes_ = NodeTable(transports_.size());
  if (options_.create_concurrency == 0) options_.create_concurrency = 1;
}

ClientCore::~ClientCore() { close(); }

void ClientCore::close() {
  if (closed_.exchange(true)) return;
  if (agent_) agent_->stop();
}

std::string ClientCore::endpoint() const { return transports_.front()->endpoint().text; }

TransportStats ClientCore::stats() const {
  TransportStats total;
  for (const auto& t : transports_) {
    auto s = t->stats();
    total.requests += s.requests;
    total.connects += s.connects;
    total.idle_handles += s.idle_handles;
  }
  return total;
}

SteadyClock::time_point ClientCore::deadline_after(milliseconds extra) const {
  return SteadyClock::now() + options_.call_deadline + extra;
}

void ClientCore::check_open() const {
  if (closed_.load()) throw Error(Code::kFailedPrecondition, "this dsec client is closed");
  if (agent_) {
    if (auto why = agent_->exited_unexpectedly()) throw Error(Code::kUnavailable, *why, false);
  }
}

template <typename Op>
auto ClientCore::retrying(SteadyClock::time_point deadline, Op&& op) -> decltype(op()) {
  auto sleep = [](milliseconds d) { std::this_thread::sleep_for(d); };
  return retry_call<SteadyClock>(options_.retry, deadline, sleep, thread_rng(), [&] {
    check_open();
    return op();
  });
}

HttpResponse ClientCore::call(std::size_t ep, const HttpRequest& request, SteadyClock::time_point deadline) {
  HttpResponse r = transports_.at(ep)->send(request, deadline);
  if (r.status >= 200 && r.status < 300) return r;
  protocol::json body;
  try {
    body = protocol::json::parse(r.body);
  } catch (const protocol::json::exception&) {
    body = nullptr;  // decode_error falls back to the HTTP status
  }
  Error e = protocol::decode_error(body, static_cast<int>(r.status));
  throw Error(e.code(), fmt::format("{} {} on {}: {}", request.method, request.target,
                                    transports_[ep]->endpoint().text, e.what()),
              e.retryable());
}

void ClientCore::learn_node(std::size_t ep, const std::string& node_id) {
  if (node_id.empty()) return;
  std::lock_guard lock(nodes_mu_);
  if (!nodes_.known(ep)) nodes_.set(ep, node_id);
}

std::size_t ClientCore::route(const std::string& id, SteadyClock::time_point deadline) {
  if (!valid_sandbox_id(id))
    throw Error(Code::kInvalidArgument, fmt::format("'{}' is not a sandbox id (letters, digits, '-', '_', '.')", id));
  if (transports_.size() == 1) return 0;
  {
    std::lock_guard lock(nodes_mu_);
    if (auto ep = nodes_.route(id)) return *ep;
  }
  // Ask the endpoints whose node we do not know yet (one discovery round at a time).
  std::lock_guard discovery(discover_mu_);
  std::vector<std::string> unreachable;
  for (std::size_t ep = 0; ep < transports_.size(); ++ep) {
    {
      std::lock_guard lock(nodes_mu_);
      if (nodes_.known(ep)) continue;
    }
    try {
      auto d = std::min(deadline, SteadyClock::now() + kDiscoveryTimeout);
      auto r = call(ep, http_request("GET", "/v1/node"), d);
      learn_node(ep, protocol::decode_node_info(parse_json(r, "GET /v1/node")).id);
    } catch (const Error& e) {
      unreachable.push_back(fmt::format("{} ({})", transports_[ep]->endpoint().text, e.code_name()));
    }
  }
  std::lock_guard lock(nodes_mu_);
  if (auto ep = nodes_.route(id)) return *ep;
  std::string known;
  for (std::size_t ep = 0; ep < nodes_.size(); ++ep)
    if (nodes_.known(ep))
      known += fmt::format("{}{} at {}", known.empty() ? "" : ", ", nodes_.node_id(ep), transports_[ep]->endpoint().text);
  std::string down;
  for (const auto& u : unreachable) down += (down.empty() ? "" : ", ") + u;
  // A node that could not be asked may be the one: that is worth a retry, an unknown node is not.
  if (!unreachable.empty())
    throw Error(Code::kUnavailable,
                fmt::format("sandbox '{}': no reachable node made it (known nodes: {}; unreachable: {})", id,
                            known.empty() ? "none" : known, down));
  throw Error(Code::kNotFound, fmt::format("sandbox '{}': no node of this client made it (nodes: {})", id, known));
}

std::string ClientCore::sandbox_path(const std::string& id, std::string_view suffix) const {
  return fmt::format("/v1/sandboxes/{}{}", url_escape(id), suffix);
}

SandboxInfo ClientCore::create(SandboxSpec spec) {
  if (spec.request_id.empty()) spec.request_id = random_request_id();
  protocol::validate(spec);
  protocol::json request = protocol::encode(spec);
  if (images_->enabled()) {
    // The agent gets the exact manifest: same layers for every sandbox of a pulse, no tag lookup on the node.
    auto image = images_->resolve(spec.image);
    request["image"] = image->reference;
    request["image_manifest"] = image->manifest_json;
  }
  const std::string body = request.dump();
  const std::size_t n = transports_.size();
  const std::size_t first = n == 1 ? 0 : next_create_.fetch_add(1) % n;
  std::size_t shift = 0;
  std::size_t used = first;
  auto deadline = deadline_after();
  HttpResponse r = retrying(deadline, [&] {
    used = (first + shift) % n;
    try {
      return call(used, http_request("POST", "/v1/sandboxes", body, kJson), deadline);
    } catch (const TransportError& e) {
      // A node that never saw the request cannot have made the sandbox: try the next node. Once the request may
      // have arrived, stay on that node so that the request id makes the retry idempotent.
      if (!e.maybe_sent()) ++shift;
      throw;
    }
  });
  SandboxInfo info = protocol::decode_sandbox_info(parse_json(r, "POST /v1/sandboxes"));
  if (info.id.empty()) throw Error(Code::kInternal, "POST /v1/sandboxes: the agent's answer has no sandbox id");
  learn_node(used, info.node);
  if (info.state == "failed") {
    try {
      destroy(info.id);
    } catch (const Error&) {
    }
    throw Error(Code::kInternal, fmt::format("sandbox {} failed to start: {}", info.id, info.message));
  }
  return info;
}

std::vector<SandboxInfo> ClientCore::create_many(std::size_t n, const SandboxSpec& spec) {
  if (n == 0) return {};
  protocol::validate(spec);
  const std::string base = spec.request_id.empty() ? random_request_id() : spec.request_id;
  std::vector<std::optional<SandboxInfo>> made(n);
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex error_mu;
  std::exception_ptr first_error;

  run_workers(std::min(n, options_.create_concurrency), [&] {
    while (!failed.load()) {
      std::size_t i = next.fetch_add(1);
      if (i >= n) return;
      SandboxSpec s = spec;
      s.request_id = fmt::format("{}-{}", base, i);
      try {
        made[i] = create(std::move(s));
      } catch (...) {
        std::lock_guard lock(error_mu);
        if (!first_error) first_error = std::current_exception();
        failed.store(true);
      }
    }
  });

  if (failed.load()) {
    // All or nothing: take back what was made, as concurrently as it was made.
    std::atomic<std::size_t> k{0};
    run_workers(std::min(n, options_.create_concurrency), [&] {
      for (std::size_t i = k.fetch_add(1); i < n; i = k.fetch_add(1)) {
        if (!made[i]) continue;
        try {
          destroy(made[i]->id);
        } catch (const Error&) {
          // Its TTL takes it.
        }
      }
    });
    std::rethrow_exception(first_error);
  }
  std::vector<SandboxInfo> out;
  out.reserve(n);
  for (auto& m : made) out.push_back(std::move(*m));
  return out;
}

HttpResponse ClientCore::call_sandbox(const std::string& id, const HttpRequest& request) {
  auto deadline = deadline_after();
  return retrying(deadline, [&] { return call(route(id, deadline), request, deadline); });
}

SandboxInfo ClientCore::get(const std::string& id) {
  auto r = call_sandbox(id, http_request("GET", sandbox_path(id)));
  return protocol::decode_sandbox_info(parse_json(r, "GET /v1/sandboxes/{id}"));
}

std::vector<SandboxInfo> ClientCore::list(const Labels& labels, const std::string& tenant) {
  std::string target = "/v1/sandboxes";
  char sep = '?';
  for (const auto& [k, v] : labels) {
    target += fmt::format("{}label={}", sep, url_escape(k + "=" + v));
    sep = '&';
  }
  if (!tenant.empty()) target += fmt::format("{}tenant={}", sep, url_escape(tenant));
  std::vector<SandboxInfo> out;
  for (std::size_t ep = 0; ep < transports_.size(); ++ep) {
    auto deadline = deadline_after();
    auto r = retrying(deadline, [&] { return call(ep, http_request("GET", target), deadline); });
    auto part = decode_sandbox_list(r, "GET /v1/sandboxes");
    for (auto& s : part) out.push_back(std::move(s));
  }
  return out;
}

std::vector<NodeInfo> ClientCore::nodes() {
  std::vector<NodeInfo> out;
  for (std::size_t ep = 0; ep < transports_.size(); ++ep) {
    auto deadline = deadline_after();
    auto r = retrying(deadline, [&] { return call(ep, http_request("GET", "/v1/node"), deadline); });
    out.push_back(protocol::decode_node_info(parse_json(r, "GET /v1/node")));
    learn_node(ep, out.back().id);
  }
  return out;
}

void ClientCore::destroy(const std::string& id) {
  try {
    call_sandbox(id, http_request("DELETE", sandbox_path(id)));
  } catch (const Error& e) {
    if (e.code() != Code::kNotFound) throw;
  }
}

ExecResult ClientCore::exec(const std::string& id, const ExecRequest& request) {
  // The agent's own validation, run here first: a malformed request fails before it costs a round trip.
  const protocol::json encoded = protocol::encode(request);
  protocol::decode_exec_request(encoded);
  const std::string body = encoded.dump();
  auto deadline = deadline_after(milliseconds{static_cast<std::int64_t>(request.timeout_seconds * 1000.0)});
  auto r = retrying(deadline, [&] {
    std::size_t ep = route(id, deadline);
    try {
      return call(ep, http_request("POST", sandbox_path(id, "/exec"), body, kJson),
                  deadline);
    } catch (const TransportError& e) {
      // An exec is not idempotent: once the agent may have it, running it twice is worse than failing.
      if (e.maybe_sent() && e.retryable())
        throw Error(e.code(), std::string(e.what()) + " (not retried: the command may have started)", false);
      throw;
    } catch (const Error& e) {
      throw Error(e.code(), e.what(), false);
    }
  });
  return protocol::decode_exec_result(parse_json(r, "POST /v1/sandboxes/{id}/exec"));
}

namespace {
// Carries an on_output exception through curl and the retry loop, which must neither wrap nor retry it.
struct OutputCallbackFailed {};
}  // namespace

ExecResult ClientCore::exec_stream(const std::string& id, const ExecRequest& request,
                                   const std::function<void(int fd, std::string_view data)>& on_output) {
  protocol::json encoded = protocol::encode(request);
  protocol::decode_exec_request(encoded);
  encoded["stream"] = true;
  const std::string body = encoded.dump();
  auto deadline = deadline_after(milliseconds{static_cast<std::int64_t>(request.timeout_seconds * 1000.0)});
  std::exception_ptr callback_error;
  std::optional<ExecStreamDecoder> decoder;
  HttpRequest http = http_request("POST", sandbox_path(id, "/exec"), body, kJson);
  http.on_body = [&](std::string_view bytes) { decoder->feed(bytes); };
  try {
    retrying(deadline, [&] {
      std::size_t ep = route(id, deadline);
      decoder.emplace([&](int fd, std::string_view data) {
        if (!on_output) return;
        try {
          on_output(fd, data);
        } catch (...) {
          callback_error = std::current_exception();
          throw OutputCallbackFailed{};
        }
      });
      try {
        return call(ep, http, deadline);
      } catch (const TransportError& e) {
        // Like exec: once the agent may have the command, running it twice is worse than failing.
        if (e.maybe_sent() && e.retryable())
          throw Error(e.code(), std::string(e.what()) + " (not retried: the command may have started)", false);
        throw;
      } catch (const Error& e) {
        throw Error(e.code(), e.what(), false);
      }
    });
  } catch (const OutputCallbackFailed&) {
    std::rethrow_exception(callback_error);
  }
  return decoder->finish();
}

void ClientCore::write_file(const std::string& id, std::string_view path, std::string_view data, unsigned mode) {
  if (mode > 07777) throw Error(Code::kInvalidArgument, fmt::format("mode: {:#o} is above 07777", mode));
  std::string target = sandbox_path(id, fmt::format("/files?path={}&mode={:04o}", url_escape(path), mode));
  call_sandbox(id, http_request("PUT", target, data, kOctets));
}

std::string ClientCore::read_file(const std::string& id, std::string_view path) {
  auto r = call_sandbox(id, http_request("GET", sandbox_path(id, fmt::format("/files?path={}", url_escape(path)))));
  if (r.content_type.starts_with(kTar))
    throw Error(Code::kInvalidArgument,
                fmt::format("{} in sandbox {} is a directory (download_tar reads a directory)", path, id));
  return std::move(r.body);
}

void ClientCore::upload_tar(const std::string& id, std::string_view dir, std::string_view tar_bytes) {
  std::string target = sandbox_path(id, fmt::format("/files?path={}", url_escape(dir)));
  call_sandbox(id, http_request("PUT", target, tar_bytes, kTar));
}

std::string ClientCore::download_tar(const std::string& id, std::string_view dir) {
  return call_sandbox(id, http_request("GET", sandbox_path(id, fmt::format("/files?path={}&format=tar", url_escape(dir)))))
      .body;
}

}  // namespace dsec::detail
