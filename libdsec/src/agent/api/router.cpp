#include "agent/api/router.hpp"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <initializer_list>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "agent/api/router_internal.hpp"
#include "agent/fncall/fncall_service.hpp"
#include "common/protocol.hpp"

namespace dsec::agent {
namespace http = boost::beast::http;
using protocol::json;

HttpResponse text_response(http::status status, std::string body, std::string_view content_type) {
  HttpResponse res{status, 11};
  res.set(http::field::content_type, beast_view(content_type));
  res.body() = std::move(body);
  return res;
}

// Error messages may quote bytes a client sent (paths, ids); invalid UTF-8 in them is replaced, never fatal.
HttpResponse json_response(http::status status, const json& body) {
  return text_response(status, body.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

HttpResponse error_response(const Error& error) {
  return json_response(static_cast<http::status>(http_status(error.code())), protocol::encode_error(error));
}

void allow(const HttpRequest& request, std::string_view path, std::initializer_list<http::verb> verbs) {
  for (auto v : verbs)
    if (request.method() == v) return;
  std::vector<std::string_view> names;
  for (auto v : verbs) names.push_back(std_view(http::to_string(v)));
  throw Error(Code::kUnimplemented, fmt::format("method {} is not served on {}; use {}",
                                                std_view(request.method_string()), path, fmt::join(names, " or ")));
}

// Query parameters a route does not know are refused, so a misspelt filter cannot silently match everything.
void only_params(const Query& query, std::initializer_list<std::string_view> known) {
  for (const auto& [key, value] : query.items()) {
    bool ok = false;
    for (auto k : known) ok = ok || key == k;
    if (!ok)
      throw Error(Code::kInvalidArgument,
                  fmt::format("query parameter '{}' is not known here (known: {})", key, fmt::join(known, ", ")));
  }
}

HttpResponse exec_answer(const HttpRequest& request, ResponseStream* stream, bool streaming, double timeout_seconds,
                         const std::function<ExecResult(const OutputSink&)>& run) {
  if (streaming && !stream)
    throw Error(Code::kUnimplemented, "a streaming exec needs the agent's HTTP server, which this caller is not");
  if (streaming && request.version() < 11)
    throw Error(Code::kInvalidArgument, "stream: a streaming exec answers with chunked encoding, which needs HTTP/1.1");
  if (!streaming) return json_response(http::status::ok, protocol::encode(run(OutputSink{})));

  // A client that went away stops the writing, not the command: it runs to its end or timeout like any exec.
  // A client that stops reading is dropped shortly after the command's deadline, so the timeout still holds (the
  // command is killed by then); the final line waits for the client as long as any answer does (idle timeout).
  const auto give_up_at = std::chrono::steady_clock::now() +
                          std::chrono::microseconds(static_cast<std::int64_t>(timeout_seconds * 1e6)) +
                          std::chrono::seconds(2);
  bool client_gone = false;
  auto send_line = [&](const json& line, bool last) {
    if (!stream->begun()) {
      HttpResponse head{http::status::ok, 11};
      head.set(http::field::content_type, "application/x-ndjson");
      head.set(http::field::cache_control, "no-store");
      stream->begin(std::move(head));
    }
    std::string text = line.dump(-1, ' ', false, json::error_handler_t::replace);
    text += '\n';
    client_gone = !(last ? stream->write(text) : stream->write(text, give_up_at));
  };
  OutputSink sink = [&](int fd, std::string_view data) {
    if (client_gone) return;  // the command's output is read on, and dropped
    send_line(json{{fd == 2 ? "stderr" : "stdout", protocol::base64_encode(data)}}, false);
  };
  ExecResult result;
  try {
    result = run(sink);
  } catch (const Error& e) {
    if (!stream->begun()) throw;
    send_line(json{{"error", protocol::encode_error(e)}}, true);
    return HttpResponse{http::status::ok, 11};
  } catch (const std::exception& e) {
    if (!stream->begun()) throw;
    send_line(json{{"error", protocol::encode_error(Error(Code::kInternal, e.what()))}}, true);
    return HttpResponse{http::status::ok, 11};
  }
  result.stdout_data.clear();
  result.stderr_data.clear();
  send_line(json{{"result", protocol::encode(result)}}, true);
  return HttpResponse{http::status::ok, 11};
}

ExecResult run_exactly_once(ExecJournal& journal, const std::string& sandbox_id, const std::string& request_id,
                            const std::string& fingerprint, const OutputSink& sink,
                            const std::function<ExecResult(const OutputSink&)>& run) {
  if (request_id.empty()) return run(sink);
  bool ran = false;
  ExecResult result = journal.run_once(sandbox_id, request_id, fingerprint, [&] {
    ran = true;
    if (!sink) return run(sink);
    // Streamed: what is sent is kept too, for a repeat to be answered with.
    std::string kept[2];
    bool dropped[2] = {false, false};
    ExecResult r = run([&](int fd, std::string_view data) {
      const int i = fd == 2 ? 1 : 0;
      std::size_t room = ExecJournal::kKeptOutput - std::min(ExecJournal::kKeptOutput, kept[i].size());
      kept[i].append(data.substr(0, room));
      dropped[i] = dropped[i] || data.size() > room;
      sink(fd, data);
    });
    r.stdout_data = std::move(kept[0]);
    r.stderr_data = std::move(kept[1]);
    r.stdout_truncated = r.stdout_truncated || dropped[0];
    r.stderr_truncated = r.stderr_truncated || dropped[1];
    return r;
  });
  if (!ran && sink) {  // a repeat, streamed: the first call's output, as it was kept
    if (!result.stdout_data.empty()) sink(1, result.stdout_data);
    if (!result.stderr_data.empty()) sink(2, result.stderr_data);
  }
  return result;
}

namespace {

// A sandbox as `who` sees it: a tenant's group by the id the tenant gave it.
json encode_info(const auth::Principal& who, SandboxInfo info) {
  info.group = shown_group_id(who, info.group);
  return protocol::encode(info);
}

json sandbox_list(const auth::Principal& who, const std::vector<SandboxInfo>& infos) {
  json list = json::array();
  for (const auto& info : infos) list.push_back(encode_info(who, info));
  return json{{"sandboxes", std::move(list)}};
}

json encode_group(const auth::Principal& who, const GroupInfo& g, double now) {
  return json{{"id", shown_group_id(who, g.id)},
              {"node", g.node},
              {"ttl", g.ttl},
              {"expires_at", g.expires_at},
              {"expires_in", std::max(0.0, g.expires_at - now)},
              {"sandbox_count", g.sandbox_count}};
}

// GET /v1/node's "fncall": what placement needs to prefer nodes with warm pools of a call's image and language.
json encode_fncall_status(const fncall::FnCallStatus& st) {
  json pools = json::array();
  for (const auto& p : st.pools)
    pools.push_back(json{{"image", p.image},
                         {"language", p.language},
                         {"idle", p.idle},
                         {"busy", p.busy},
                         {"starting", p.starting},
                         {"waiting", p.waiting},
                         {"min", p.min},
                         {"max", p.max},
                         {"calls", p.calls}});
  json gpus = json::array();
  json usage = json::array();
  for (const auto& g : st.gpus) {
    gpus.push_back(g.device);
    usage.push_back(json{{"device", g.device}, {"exclusive", g.exclusive}, {"shares_used", g.shares_used}});
  }
  return json{{"languages", st.languages},    {"default_image", st.default_image}, {"pools", std::move(pools)},
              {"gpus", std::move(gpus)},      {"gpu_shares", st.gpu_shares},       {"gpus_free", st.gpus_free},
              {"gpu_usage", std::move(usage)}};
}

// How a function call ended, for the metrics.
std::string_view fncall_outcome(const FnCallResult& r) {
  if (r.compile_exit_code != 0) return "compile_error";
  if (r.timed_out) return "timed_out";
  if (r.oom_killed) return "oom_killed";
  if (r.exit_code != 0 || r.signal != 0) return "failed";
  return "ok";
}

// A call's "image_manifest": the pinned image's manifest as the client resolved it.
std::string image_manifest_of(const json& body) {
  if (!body.is_object()) return {};
  auto it = body.find("image_manifest");
  if (it == body.end() || it->is_null()) return {};
  if (!it->is_string()) throw Error(Code::kInvalidArgument, "image_manifest: must be the manifest's JSON as a string");
  return it->get<std::string>();
}

// A group id in a path: a tenant's own (tenant_group_id checks it further), or, from an admin, any tenant's.
void check_group_id(const std::string& id) {
  if (!protocol::valid_scoped_group_id(id))
    throw Error(Code::kInvalidArgument,
                fmt::format("group: '{}' is not a group id (1 to 128 letters, digits, '.', '_', '-')", id));
}

}  // namespace

std::string fncall_status_json(fncall::FnCallService& service) { return encode_fncall_status(service.status()).dump(); }

Router::Router(Registry& registry, Metrics& metrics, std::function<NodeInfo()> node_info, Snapshots* snapshots,
               fncall::FnCallService* fncall, AccessPolicy access)
    : registry_(registry),
      metrics_(metrics),
      node_info_(std::move(node_info)),
      snapshots_(snapshots),
      fncall_(fncall),
      access_(std::move(access)) {}

HttpResponse Router::handle(HttpRequest& request, ResponseStream* stream, const Peer& peer) {
  Route route = Route::kUnknown;
  HttpResponse res;
  std::string_view code = "OK";
  std::string who_name = "operator";
  std::string target_id;
  auto answer_error = [&](const Error& e) {
    res = error_response(e);
    code = code_name(e.code());
  };
  try {
    Target target = parse_target(std_view(request.target()));
    route = target.route;
    target_id = !target.sandbox_id.empty() ? target.sandbox_id : target.group_id;
    auth::Principal who = authenticate(request, peer, route);
    if (access_.tokens && (peer.tcp || access_.tokens_on_unix))
      who_name = who.admin ? (who.tenant.empty() ? "admin" : "admin:" + who.tenant) : "tenant:" + who.tenant;
    res = dispatch(request, target, stream, who);
  } catch (const Error& e) {
    answer_error(e);
  } catch (const std::exception& e) {
    answer_error(Error(Code::kInternal, e.what()));
  } catch (...) {
    answer_error(Error(Code::kInternal, "unknown exception"));
  }
  record(request, route, res, code, who_name, peer, target_id);
  return res;
}

void Router::record(const HttpRequest& request, Route route, const HttpResponse& res, std::string_view code,
                    const std::string& who_name, const Peer& peer, const std::string& target_id) {
  // Methods outside HTTP's known set are counted as one label value, so clients cannot grow the metrics at will.
  std::string_view method = request.method() == http::verb::unknown ? "other" : std_view(request.method_string());
  metrics_.count_request(route_template(route), method, res.result_int());
  if (access_.audit && route != Route::kHealthz && route != Route::kMetrics && route != Route::kNode)
    access_.audit->record(auth::AuditEntry{who_name, peer.address, method, route_template(route), target_id,
                                           static_cast<int>(res.result_int()), code});
}

std::optional<HttpResponse> Router::admit(const HttpRequest& header, const Peer& peer) {
  if (!access_.tokens) return std::nullopt;
  Route route = Route::kUnknown;
  std::string target_id;
  try {
    Target target = parse_target(std_view(header.target()));
    route = target.route;
    target_id = !target.sandbox_id.empty() ? target.sandbox_id : target.group_id;
    authenticate(header, peer, route);
    return std::nullopt;
  } catch (const Error& e) {
    if (e.code() != Code::kUnauthenticated) return std::nullopt;  // answered by handle(), body and all
    HttpResponse res = error_response(e);
    record(header, route, res, code_name(e.code()), "unauthenticated", peer, target_id);
    return res;
  }
}

HttpResponse Router::dispatch(HttpRequest& request, const Target& target, ResponseStream* stream,
                              const auth::Principal& who) {
  if (!target.sandbox_id.empty()) check_sandbox_access(who, target.sandbox_id);
  if (!who.admin && !target.group_id.empty() && (target.route == Route::kGroup || target.route == Route::kGroupRenew)) {
    // A tenant's group id names its own group: another tenant's group of that id is another group.
    Target own = target;
    own.group_id = tenant_group_id(who, target.group_id);
    check_group_access(who, own.group_id);
    return own.route == Route::kGroup ? group(request, own, who) : group_renew(request, own, who);
  }
  switch (target.route) {
    case Route::kHealthz:
      return healthz(request);
    case Route::kMetrics:
      return metrics_text(request);
    case Route::kNode:
      return node(request, who);
    case Route::kSandboxes:
      return sandboxes(request, target, who, stream);
    case Route::kSandbox:
      return sandbox(request, target, who);
    case Route::kSandboxExec:
      return exec(request, target, stream);
    case Route::kSandboxFiles:
      return files(request, target);
    case Route::kSandboxSleep:
      return sleep_or_wake(request, target, who, true);
    case Route::kSandboxNetwork:
      return network(request, target);
    case Route::kSandboxTtl:
      return ttl(request, target);
    case Route::kSandboxPorts:
      return ports(request, target);
    case Route::kSandboxNetworkUsage: {
      allow(request, "/v1/sandboxes/{id}/network/usage", {http::verb::get});
      only_params(target.query, {});
      return json_response(http::status::ok, protocol::encode(registry_.network_usage(target.sandbox_id)));
    }
    case Route::kSandboxWake:
      return sleep_or_wake(request, target, who, false);
    case Route::kSandboxProcesses:
      return processes(request, target);
    case Route::kSandboxScreen:
    case Route::kSandboxScreenState:
    case Route::kSandboxScreenInput:
    case Route::kSandboxScreenVnc:
      return screen(request, target);
    case Route::kSandboxProcess:
    case Route::kSandboxProcessOutput:
    case Route::kSandboxProcessStdin:
    case Route::kSandboxProcessSignal:
    case Route::kSandboxProcessResize:
      return process(request, target);
    case Route::kSandboxSessions:
      return sessions(request, target);
    case Route::kSandboxSession:
    case Route::kSandboxSessionRun:
    case Route::kSandboxSessionRestart:
      return session(request, target, stream);
    case Route::kSandboxSnapshot:
      return snapshot(request, target, who);
    case Route::kSandboxFork:
      return fork(request, target, who);
    case Route::kGroups:
      return groups(request, target, who);
    case Route::kGroup:
      return group(request, target, who);
    case Route::kGroupRenew:
      return group_renew(request, target, who);
    case Route::kFnCall:
      return fncall(request, target, who);
    case Route::kFnCallBatch:
      return fncall_batch(request, target, who);
    case Route::kUnknown:
      break;
  }
  throw Error(Code::kNotFound, fmt::format("no route {} {} (protocol v1: /v1/node, /v1/sandboxes, /v1/groups, "
                                           "/v1/fncall, /metrics, /healthz)",
                                           std_view(request.method_string()), target.path));
}

HttpResponse Router::healthz(HttpRequest& request) {
  allow(request, "/healthz", {http::verb::get});
  return text_response(http::status::ok, "ok\n", "text/plain");
}

HttpResponse Router::metrics_text(HttpRequest& request) {
  allow(request, "/metrics", {http::verb::get});
  return text_response(http::status::ok, metrics_.render(registry_.load().by_kind), "text/plain; version=0.0.4");
}

HttpResponse Router::node(HttpRequest& request, const auth::Principal& who) {
  allow(request, "/v1/node", {http::verb::get});
  NodeInfo info = node_info_();
  // A tenant sees the images it may start sandboxes from: not another tenant's snapshots.
  std::erase_if(info.images, [&](const std::string& image) { return !tenant_may_use_image(who, image); });
  // And the cached layers of those images only: a digest is a name another tenant could try.
  for (auto& layer : info.cached_layers)
    std::erase_if(layer.images, [&](const std::string& image) { return !tenant_may_use_image(who, image); });
  if (!who.admin) std::erase_if(info.cached_layers, [](const CachedLayer& layer) { return layer.images.empty(); });
  json body = protocol::encode(info);
  if (fncall_) body["fncall"] = encode_fncall_status(fncall_->status());
  return json_response(http::status::ok, body);
}

// POST: create one sandbox, or `count` of them. GET: list, filtered by labels and tenant.
HttpResponse Router::sandboxes(HttpRequest& request, const Target& target, const auth::Principal& who,
                               ResponseStream* stream) {
  allow(request, "/v1/sandboxes", {http::verb::get, http::verb::post});
  if (request.method() == http::verb::get) {
    only_params(target.query, {"label", "tenant"});
    Labels labels = parse_label_filters(target.query.get_all("label"));
    std::string tenant = target.query.get("tenant").value_or("");
    // A tenant lists its own sandboxes, whatever tenant it asked for.
    if (!who.admin) {
      if (!tenant.empty() && tenant != who.tenant) return json_response(http::status::ok, sandbox_list(who, {}));
      tenant = who.tenant;
    }
    return json_response(http::status::ok, sandbox_list(who, registry_.list(labels, tenant)));
  }

  only_params(target.query, {});
  json body = protocol::parse_body(request.body());
  std::optional<std::size_t> count;
  if (body.is_object()) {
    if (auto it = body.find("count"); it != body.end() && !it->is_null()) {
      if (!it->is_number_integer() || it->get<std::int64_t>() < 1 ||
          it->get<std::int64_t>() > static_cast<std::int64_t>(kMaxBatch))
        throw Error(Code::kInvalidArgument, fmt::format("count: must be an integer from 1 to {}", kMaxBatch));
      count = it->get<std::size_t>();
    }
  }
  // The manifest a client resolved the image to (it pins the spec's image to its digest); the node checks it.
  std::string image_manifest;
  if (body.is_object()) {
    if (auto it = body.find("image_manifest"); it != body.end() && !it->is_null()) {
      if (!it->is_string())
        throw Error(Code::kInvalidArgument, "image_manifest: must be the manifest's JSON as a string");
      image_manifest = it->get<std::string>();
    }
  }
  SandboxSpec spec = protocol::decode_spec(body);
  if (!spec.tenant.empty()) auth::check_tenant_name(spec.tenant);
  if (!who.admin) {
    // A tenant's sandboxes are its own: the spec names that tenant or none.
    if (!spec.tenant.empty() && spec.tenant != who.tenant)
      throw Error(Code::kPermissionDenied,
                  fmt::format("tenant: this token is tenant '{}'s and cannot create sandboxes of tenant '{}'",
                              who.tenant, spec.tenant));
    spec.tenant = who.tenant;
    check_image_access(who, spec.image);
    spec.request_id = tenant_request_id(who, spec.request_id);
    // A tenant's group ids are its own: the same id from another tenant is another group.
    spec.group = tenant_group_id(who, spec.group);
  }
  // A create that waits for room (queue_timeout) stops waiting when its caller has gone.
  Registry::ClientGone client_gone;
  if (stream) client_gone = [stream] { return stream->client_gone(); };
  if (!count) {
    CreateOutcome outcome = registry_.create(spec, image_manifest, client_gone);
    return json_response(outcome.created ? http::status::created : http::status::ok, encode_info(who, outcome.info));
  }
  std::vector<CreateOutcome> outcomes = registry_.create_batch(spec, *count, image_manifest, client_gone);
  bool any_created = false;
  std::vector<SandboxInfo> infos;
  for (auto& o : outcomes) {
    any_created = any_created || o.created;
    infos.push_back(std::move(o.info));
  }
  return json_response(any_created ? http::status::created : http::status::ok, sandbox_list(who, infos));
}

// GET: status. DELETE: destroy (idempotent).
HttpResponse Router::sandbox(HttpRequest& request, const Target& target, const auth::Principal& who) {
  allow(request, "/v1/sandboxes/{id}", {http::verb::get, http::verb::delete_});
  only_params(target.query, {});
  if (request.method() == http::verb::get)
    return json_response(http::status::ok, encode_info(who, registry_.get(target.sandbox_id)));
  SandboxInfo info = registry_.destroy(target.sandbox_id);
  return json_response(http::status::ok, json{{"id", info.id}, {"state", "destroyed"}});
}

// Without "stream": one ExecResult when the command ends. With "stream": true, an NDJSON body of output chunks
// as they are read, then one "result" (or "error") line. The head goes out with the first line, so an exec that
// fails before any output (unknown sandbox, missing executable) still gets a plain error answer.
HttpResponse Router::exec(HttpRequest& request, const Target& target, ResponseStream* stream) {
  allow(request, "/v1/sandboxes/{id}/exec", {http::verb::post});
  only_params(target.query, {});
  json body = protocol::parse_body(request.body());
  const bool streaming = protocol::exec_streams(body);
  ExecRequest exec_request = protocol::decode_exec_request(body);
  SandboxHandle handle = registry_.acquire(target.sandbox_id);
  return exec_answer(request, stream, streaming, exec_request.timeout_seconds, [&](const OutputSink& sink) {
    return run_exactly_once(registry_.exec_journal(), target.sandbox_id, exec_request.request_id,
                            ExecJournal::fingerprint(exec_request), sink, [&](const OutputSink& to) {
                              auto started = std::chrono::steady_clock::now();
                              ExecResult result = handle.sandbox->exec(exec_request, to);
                              metrics_.exec_done(
                                  handle.kind,
                                  std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
                              return result;
                            });
  });
}

// PUT: write one file (raw body) or extract a tar stream into a directory. GET: read one file, or a directory as
// a tar stream.
HttpResponse Router::files(HttpRequest& request, const Target& target) {
  allow(request, "/v1/sandboxes/{id}/files", {http::verb::get, http::verb::put});
  const std::string path = target.query.get("path").value_or("");
  check_sandbox_path(path, "path");
  if (request.method() == http::verb::put) {
    only_params(target.query, {"path", "mode"});
    unsigned mode = 0644;
    if (auto m = target.query.get("mode")) mode = parse_file_mode(*m);
    std::string_view content_type = std_view(request[http::field::content_type]);
    bool tar = content_type.substr(0, content_type.find(';')) == "application/x-tar";
    SandboxHandle handle = registry_.acquire(target.sandbox_id);
    if (tar) handle.sandbox->put_archive(path, request.body());
    else handle.sandbox->write_file(path, request.body(), mode);
    return json_response(http::status::ok, json{{"path", path}, {"bytes", request.body().size()}, {"tar", tar}});
  }

  only_params(target.query, {"path", "format"});
  std::string format = target.query.get("format").value_or("");
  if (!format.empty() && format != "tar" && format != "raw")
    throw Error(Code::kInvalidArgument, fmt::format("format: '{}' is neither tar nor raw", format));
  SandboxHandle handle = registry_.acquire(target.sandbox_id);
  bool tar = format == "tar" || (format.empty() && handle.sandbox->is_directory(path));
  if (tar) return text_response(http::status::ok, handle.sandbox->get_archive(path), "application/x-tar");
  return text_response(http::status::ok, handle.sandbox->read_file(path), "application/octet-stream");
}

// POST: freeze the sandbox and release its memory (sleep), or restore it (wake). The answer is the sandbox's info
// with memory charged to it before and after, and the seconds it took.
// GET: the network policy in force. PUT {"mode": ..., "rules": [...]} (or "none"/"open"/"egress"): replace it.
HttpResponse Router::network(HttpRequest& request, const Target& target) {
  allow(request, "/v1/sandboxes/{id}/network", {http::verb::get, http::verb::put});
  only_params(target.query, {});
  if (request.method() == http::verb::get)
    return json_response(http::status::ok, protocol::encode(registry_.get(target.sandbox_id).network));
  NetworkPolicy policy = protocol::decode_network(protocol::parse_body(request.body()));
  SandboxInfo info = registry_.set_network(target.sandbox_id, policy);
  return json_response(http::status::ok, protocol::encode(info.network));
}

// PUT {"ttl": seconds}: the sandbox is destroyed that long from now (0: never), earlier or later than its deadline
// was. The answer is its status.
HttpResponse Router::ttl(HttpRequest& request, const Target& target) {
  allow(request, "/v1/sandboxes/{id}/ttl", {http::verb::put});
  only_params(target.query, {});
  const std::chrono::seconds ttl = protocol::decode_ttl_request(protocol::parse_body(request.body()));
  return json_response(http::status::ok, protocol::encode(registry_.set_ttl(target.sandbox_id, ttl)));
}

// GET: the exposed ports. POST {"port": N}: expose one (201 with its address). DELETE ?port=N: unexpose it.
HttpResponse Router::ports(HttpRequest& request, const Target& target) {
  allow(request, "/v1/sandboxes/{id}/ports", {http::verb::get, http::verb::post, http::verb::delete_});
  auto listing = [&] {
    json list = json::array();
    for (const auto& [port, address] : registry_.exposed(target.sandbox_id))
      list.push_back(json{{"port", port}, {"address", address}});
    return json{{"ports", std::move(list)}};
  };
  if (request.method() == http::verb::get) {
    only_params(target.query, {});
    return json_response(http::status::ok, listing());
  }
  if (request.method() == http::verb::delete_) {
    only_params(target.query, {"port"});
    const std::string text = target.query.get("port").value_or("");
    std::uint32_t port = 0;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), port);
    if (text.empty() || ec != std::errc() || ptr != text.data() + text.size() || port < 1 || port > protocol::kMaxPort)
      throw Error(Code::kInvalidArgument, fmt::format("port: '{}' is not a TCP port (1-{})", text, protocol::kMaxPort));
    registry_.unexpose(target.sandbox_id, port);
    return json_response(http::status::ok, listing());
  }
  only_params(target.query, {});
  const std::uint32_t port = protocol::decode_expose_request(protocol::parse_body(request.body()));
  std::string address = registry_.expose(target.sandbox_id, port);
  return json_response(http::status::created, json{{"port", port}, {"address", address}});
}

HttpResponse Router::sleep_or_wake(HttpRequest& request, const Target& target, const auth::Principal& who, bool sleep) {
  allow(request, sleep ? "/v1/sandboxes/{id}/sleep" : "/v1/sandboxes/{id}/wake", {http::verb::post});
  only_params(target.query, {});
  // An empty body, or {"request_id": "..."}: the same id again answers what the first call did (a retry).
  const std::string request_id =
      protocol::decode_sleep_request(protocol::parse_body(request.body()), sleep ? "sleep" : "wake");
  Registry::SleepOutcome out =
      sleep ? registry_.sleep(target.sandbox_id, request_id) : registry_.wake(target.sandbox_id, request_id);
  json body = encode_info(who, out.info);
  const auto& r = out.report;
  body["memory_before_bytes"] = r.memory_before_bytes;
  body["memory_after_bytes"] = r.memory_after_bytes;
  body["memory_released_bytes"] =
      r.memory_before_bytes > r.memory_after_bytes ? r.memory_before_bytes - r.memory_after_bytes : 0;
  body["seconds"] = r.seconds;
  body["swap_bytes"] = r.swap_bytes;
  if (sleep) body["reclaim_timed_out"] = r.reclaim_timed_out;
  return json_response(http::status::ok, body);
}

// POST {"count": n, "labels": {...}}: n copies of a running sandbox, processes and memory included, on this node
// (Registry::fork). Answers like a batch create: {"sandboxes": [...]}.
HttpResponse Router::fork(HttpRequest& request, const Target& target, const auth::Principal& who) {
  allow(request, "/v1/sandboxes/{id}/fork", {http::verb::post});
  only_params(target.query, {});
  const protocol::ForkRequest fork = protocol::decode_fork_request(protocol::parse_body(request.body()));
  std::vector<CreateOutcome> outcomes = registry_.fork(target.sandbox_id, fork.count, fork.labels);
  std::vector<SandboxInfo> infos;
  infos.reserve(outcomes.size());
  for (auto& o : outcomes) infos.push_back(std::move(o.info));
  return json_response(http::status::created, sandbox_list(who, infos));
}

// POST {"name": "repo[:tag]", "request_id": "..."}: capture the sandbox's files as a new image
// (agent/images/snapshots.hpp).
HttpResponse Router::snapshot(HttpRequest& request, const Target& target, const auth::Principal& who) {
  allow(request, "/v1/sandboxes/{id}/snapshot", {http::verb::post});
  only_params(target.query, {});
  protocol::SnapshotCall call = protocol::decode_snapshot_call(protocol::parse_body(request.body()));
  SnapshotRequest req;
  req.sandbox_id = target.sandbox_id;
  req.name = std::move(call.name);
  req.request_id = std::move(call.request_id);
  if (!who.admin) {
    // A tenant's snapshots go under tenants/<tenant>/ (said in the answer's "image").
    if (req.name.starts_with(kTenantImages) && !req.name.starts_with(tenant_image_prefix(who)))
      throw Error(Code::kInvalidArgument,
                  fmt::format("name: '{}' is under another tenant's {}; name it without the prefix (it goes under {})",
                              req.name, kTenantImages, tenant_image_prefix(who)));
    if (!req.name.starts_with(tenant_image_prefix(who))) req.name = tenant_image_prefix(who) + req.name;
    if (req.request_id.size() > 128) throw Error(Code::kInvalidArgument, "request_id: longer than 128 bytes");
    req.request_id = tenant_request_id(who, req.request_id);
  }
  if (!snapshots_) throw Error(Code::kUnimplemented, "this agent takes no snapshots (it has no snapshot store)");
  SnapshotOutcome o = snapshots_->take(req);
  const auto& f = o.files;
  json files{{"entries", f.entries},
             {"files", f.files},
             {"directories", f.directories},
             {"symlinks", f.symlinks},
             {"fifos", f.fifos},
             {"whiteouts", f.whiteouts},
             {"opaque_directories", f.opaque_directories},
             {"hard_links", f.hard_links},
             {"bytes", f.file_bytes},
             {"data_bytes", f.data_bytes},
             {"skipped", f.skipped}};
  json layer{{"digest", o.layer.digest},
             {"role", std::string(image::to_string(o.layer.role))},
             {"size", o.layer.size},
             {"stored_size", o.layer.stored_size},
             {"files_size", o.layer.files_size},
             {"existed", o.layer_existed}};
  o.spec.group = shown_group_id(who, o.spec.group);  // the tenant's own group id, as it wrote it
  json answer{{"image", o.image},
              {"digest", o.digest},
              {"sandbox", o.sandbox_id},
              {"node", o.node},
              {"parent", o.parent},
              {"store", o.store},
              {"layer", std::move(layer)},
              {"files", std::move(files)},
              {"notes", o.notes},
              {"frozen_seconds", o.frozen_seconds},
              {"capture_seconds", o.capture_seconds},
              {"build_seconds", o.build_seconds},
              {"seconds", o.seconds},
              {"spec", protocol::encode(o.spec)}};
  return json_response(o.created ? http::status::created : http::status::ok, answer);
}

// GET: the node's lease groups.
HttpResponse Router::groups(HttpRequest& request, const Target& target, const auth::Principal& who) {
  allow(request, "/v1/groups", {http::verb::get});
  only_params(target.query, {});
  const double now = registry_.options().clock();
  json list = json::array();
  for (const auto& g : registry_.list_groups()) {
    if (!who.admin && shown_group_id(who, g.id) == g.id) continue;  // not one of the tenant's ids
    list.push_back(encode_group(who, g, now));
  }
  return json_response(http::status::ok, json{{"groups", std::move(list)}});
}

// GET: the group's lease and its sandboxes. DELETE: destroy them all and forget the group.
HttpResponse Router::group(HttpRequest& request, const Target& target, const auth::Principal& who) {
  allow(request, "/v1/groups/{id}", {http::verb::get, http::verb::delete_});
  only_params(target.query, {});
  check_group_id(target.group_id);
  if (request.method() == http::verb::get) {
    GroupInfo g = registry_.get_group(target.group_id);
    json body = encode_group(who, g, registry_.options().clock());
    body.update(sandbox_list(who, g.sandboxes));
    return json_response(http::status::ok, body);
  }
  GroupInfo g = registry_.destroy_group(target.group_id);
  return json_response(http::status::ok,
                       json{{"id", shown_group_id(who, g.id)}, {"node", g.node}, {"destroyed", g.sandbox_count}});
}

// POST {"ttl": seconds}: extend the group's lease to now + ttl (never shortens it; no ttl: the group's own).
HttpResponse Router::group_renew(HttpRequest& request, const Target& target, const auth::Principal& who) {
  allow(request, "/v1/groups/{id}/renew", {http::verb::post});
  only_params(target.query, {});
  check_group_id(target.group_id);
  const double ttl = protocol::decode_group_renew(protocol::parse_body(request.body()));
  GroupInfo g = registry_.renew_group(target.group_id, ttl);
  return json_response(http::status::ok, encode_group(who, g, registry_.options().clock()));
}

fncall::FnCallService& Router::fncall_service() {
  if (!fncall_)
    throw Error(Code::kFailedPrecondition,
                "this node does not serve function calls (start dsecd with fncall among --backends)");
  return *fncall_;
}

// POST: run one function call; the answer is its result (a program that fails is a result, not an error).
HttpResponse Router::fncall(HttpRequest& request, const Target& target, const auth::Principal& who) {
  allow(request, "/v1/fncall", {http::verb::post});
  only_params(target.query, {});
  json body = protocol::parse_body(request.body());
  FnCallRequest call = protocol::decode_fncall_request(body);
  std::string manifest = image_manifest_of(body);
  admit_fncall(who, call);
  FnCallResult result;
  try {
    result = fncall_service().run(call, manifest);
  } catch (const Error&) {
    metrics_.fncall_done(call.language, "error", 0);
    throw;
  }
  metrics_.fncall_done(call.language, fncall_outcome(result), result.duration_seconds);
  return json_response(http::status::ok, protocol::encode(result));
}

// POST {"calls": [...]}: run them concurrently; the answer has one result or {"error": ...} per call, in order.
// A tenant's function calls run over the images it may use, and their request ids are its own.
void Router::admit_fncall(const auth::Principal& who, FnCallRequest& call) {
  if (!call.image.empty()) check_image_access(who, call.image);
  call.request_id = tenant_request_id(who, call.request_id);
}

HttpResponse Router::fncall_batch(HttpRequest& request, const Target& target, const auth::Principal& who) {
  allow(request, "/v1/fncall/batch", {http::verb::post});
  only_params(target.query, {});
  json body = protocol::parse_body(request.body());
  if (!body.is_object() || !body.contains("calls") || !body["calls"].is_array())
    throw Error(Code::kInvalidArgument, "calls: the body must be {\"calls\": [<function call>, ...]}");
  json& calls = body["calls"];
  if (calls.empty() || calls.size() > protocol::kMaxFnCallBatch)
    throw Error(Code::kInvalidArgument,
                fmt::format("calls: from 1 to {} calls per batch (got {})", protocol::kMaxFnCallBatch, calls.size()));
  fncall::FnCallService& service = fncall_service();
  std::vector<fncall::BatchCall> batch(calls.size());
  for (std::size_t i = 0; i < calls.size(); ++i) {
    try {
      FnCallRequest call = protocol::decode_fncall_request(calls[i]);
      batch[i].image_manifest = image_manifest_of(calls[i]);
      admit_fncall(who, call);
      batch[i].request = std::move(call);
    } catch (const Error& e) {
      batch[i].error = Error(e.code(), fmt::format("calls[{}]: {}", i, e.what()), e.retryable());
    }
  }
  calls = json();  // the requests' bytes are in `batch` now
  std::vector<std::string> languages;
  languages.reserve(batch.size());
  for (const auto& b : batch) languages.push_back(b.request ? b.request->language : "unknown");
  std::vector<fncall::BatchOutcome> outcomes = service.run_batch(std::move(batch));
  json results = json::array();
  for (std::size_t i = 0; i < outcomes.size(); ++i) {
    const auto& o = outcomes[i];
    if (o.result) {
      metrics_.fncall_done(languages[i], fncall_outcome(*o.result), o.result->duration_seconds);
      results.push_back(protocol::encode(*o.result));
    } else {
      metrics_.fncall_done(languages[i], "error", 0);
      results.push_back(json{{"error", protocol::encode_error(*o.error)}});
    }
  }
  return json_response(http::status::ok, json{{"results", std::move(results)}});
}

}  // namespace dsec::agent
