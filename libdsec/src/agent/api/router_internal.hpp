// What the router's rooms (router.cpp, access.cpp, processes.cpp, screen.cpp) share: answers, method and query checks,
// and an exec's answer, whole or streamed as NDJSON.
#pragma once

#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>

#include "agent/api/routes.hpp"
#include "agent/backends/backend.hpp"
#include "agent/registry/exec_journal.hpp"
#include "common/protocol.hpp"
#include "http/http.hpp"
#include "http/tokens.hpp"

namespace dsec::agent {

HttpResponse text_response(boost::beast::http::status status, std::string body, std::string_view content_type);
// Error messages may quote bytes a client sent (paths, ids); invalid UTF-8 in them is replaced, never fatal.
HttpResponse json_response(boost::beast::http::status status, const protocol::json& body);
HttpResponse error_response(const Error& error);
// UNIMPLEMENTED naming the methods `path` serves, unless the request's is one of `verbs`.
void allow(const HttpRequest& request, std::string_view path, std::initializer_list<boost::beast::http::verb> verbs);
// Query parameters a route does not know are refused, so a misspelt filter cannot silently match everything.
void only_params(const Query& query, std::initializer_list<std::string_view> known);

// The answer of a command run by `run` (an exec, a session's run): its ExecResult; or, `streaming`, an NDJSON body
// of output lines as `run` hands them to its sink, then one "result" (or "error") line (docs/protocol.md).
HttpResponse exec_answer(const HttpRequest& request, ResponseStream* stream, bool streaming, double timeout_seconds,
                         const std::function<ExecResult(const OutputSink&)>& run);

// Runs `run` once per request id of the sandbox (ExecJournal; an empty id: simply runs it). Streamed, the output
// sent to `sink` is kept too, and a repeat sends the first call's kept output to its sink before its result.
ExecResult run_exactly_once(ExecJournal& journal, const std::string& sandbox_id, const std::string& request_id,
                            const std::string& fingerprint, const OutputSink& sink,
                            const std::function<ExecResult(const OutputSink&)>& run);

// Access (access.cpp). Snapshots a tenant takes are images named tenants/<tenant>/...: its own to start sandboxes from,
// nobody else's. Images outside tenants/ (the operator's) are everyone's.
constexpr std::string_view kTenantImages = "tenants/";
std::string tenant_image_prefix(const auth::Principal& who);
bool tenant_may_use_image(const auth::Principal& who, std::string_view image);
// A tenant's request ids are its own: the same id from two tenants names two requests.
std::string tenant_request_id(const auth::Principal& who, const std::string& request_id);
// A tenant's group ids are its own: inside the agent a tenant's group "g" is "<tenant>:g" (INVALID_ARGUMENT for an
// id that is not one), and answers show the tenant "g" again. An admin's ids are taken as they are.
std::string tenant_group_id(const auth::Principal& who, const std::string& group);
std::string shown_group_id(const auth::Principal& who, const std::string& group);

}  // namespace dsec::agent
