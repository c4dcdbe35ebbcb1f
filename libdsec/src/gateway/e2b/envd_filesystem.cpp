#include "gateway/e2b/envd_filesystem.hpp"

#include <archive.h>
#include <archive_entry.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <boost/beast/http/field.hpp>
#include <boost/beast/http/status.hpp>

#include "dsec/exec.hpp"
#include "gateway/e2b/connect_rpc.hpp"
#include "gateway/e2b/control_plane.hpp"
#include "gateway/e2b/multipart.hpp"
#include "http/query.hpp"
#include "http/tokens.hpp"

namespace dsec::e2b {
namespace {

namespace http = boost::beast::http;
using agent::HttpRequest;
using agent::HttpResponse;
using Clock = std::chrono::steady_clock;

// One entry, NUL-separated: its path, "type|size|mode|owner|group|mtime" as stat prints them, its link's target.
constexpr std::string_view kEntryFunction =
    R"sh(e() { t=$(stat -c '%F|%s|%a|%U|%G|%Y' -- "$1") || return 1; l=; )sh"
    R"sh(if [ -L "$1" ]; then l=$(readlink -- "$1"); fi; printf '%s\0%s\0%s\0' "$1" "$t" "$l"; }; )sh";
constexpr int kMissing = 3, kNotDirectory = 4, kExists = 5;

struct Entry {
  std::string path, type, owner, group, target;
  std::uint64_t size = 0;
  unsigned mode = 0;
  double mtime = 0;
};

std::string base_name(const std::string& path) {
  auto slash = path.find_last_of('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

const char* file_type(const std::string& stat_type) {
  if (stat_type == "regular file" || stat_type == "regular empty file") return "FILE_TYPE_FILE";
  if (stat_type == "directory") return "FILE_TYPE_DIRECTORY";
  if (stat_type == "symbolic link") return "FILE_TYPE_SYMLINK";
  return "FILE_TYPE_UNSPECIFIED";
}

std::string permissions(const Entry& e) {
  std::string out = e.type == "directory" ? "d" : e.type == "symbolic link" ? "L" : "-";
  for (int shift = 6; shift >= 0; shift -= 3) {
    out += (e.mode >> shift & 4) ? 'r' : '-';
    out += (e.mode >> shift & 2) ? 'w' : '-';
    out += (e.mode >> shift & 1) ? 'x' : '-';
  }
  return out;
}

json entry_json(const Entry& e) {
  json out{{"name", base_name(e.path)},
           {"type", file_type(e.type)},
           {"path", e.path},
           {"size", std::to_string(e.size)},
           {"mode", e.mode},
           {"permissions", permissions(e)},
           {"owner", e.owner},
           {"group", e.group},
           {"modifiedTime", rfc3339(e.mtime)}};
  if (!e.target.empty()) out["symlinkTarget"] = e.target;
  return out;
}

std::vector<Entry> parse_entries(const std::string& out) {
  std::vector<std::string> fields;
  std::size_t start = 0;
  for (std::size_t nul; (nul = out.find('\0', start)) != std::string::npos; start = nul + 1)
    fields.push_back(out.substr(start, nul - start));
  std::vector<Entry> entries;
  for (std::size_t i = 0; i + 2 < fields.size(); i += 3) {
    Entry e;
    e.path = fields[i];
    e.target = fields[i + 2];
    std::vector<std::string> parts;
    std::size_t s = 0;
    for (std::size_t bar; (bar = fields[i + 1].find('|', s)) != std::string::npos; s = bar + 1)
      parts.push_back(fields[i + 1].substr(s, bar - s));
    parts.push_back(fields[i + 1].substr(s));
    if (parts.size() != 6) continue;
    e.type = parts[0];
    try {
      e.size = std::stoull(parts[1]);
      e.mode = static_cast<unsigned>(std::stoul(parts[2], nullptr, 8));
      e.mtime = std::stod(parts[5]);
    } catch (const std::exception&) {
      continue;
    }
    e.owner = parts[3];
    e.group = parts[4];
    entries.push_back(std::move(e));
  }
  return entries;
}

// Runs `script` with `args` ($1...) under /bin/sh in the sandbox, as the caller's user. The script's own exit codes
// kMissing, kNotDirectory and kExists become the RPC errors of their meaning.
std::string run_script(EnvdTarget& t, std::string_view script, const std::vector<std::string>& args,
                       const std::string& path_for_errors) {
  ExecRequest r;
  r.argv = {"/bin/sh", "-c", std::string(kEntryFunction) + std::string(script), "e2b"};
  r.argv.insert(r.argv.end(), args.begin(), args.end());
  r.user = t.user;
  r.timeout_seconds = 120;
  r.max_output_bytes = 256u << 20;
  ExecResult res = t.sandbox.exec(r);
  if (res.timed_out) throw RpcError("deadline_exceeded", fmt::format("{}: took over two minutes", path_for_errors));
  switch (res.exit_code) {
    case 0:
      return std::move(res.stdout_data);
    case kMissing:
      throw RpcError("not_found", fmt::format("path '{}' does not exist", path_for_errors));
    case kNotDirectory:
      throw RpcError("invalid_argument", fmt::format("path '{}' is not a directory", path_for_errors));
    case kExists:
      throw RpcError("already_exists", fmt::format("directory '{}' already exists", path_for_errors));
    default: {
      std::string why = res.stderr_data;
      while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) why.pop_back();
      if (why.find("Permission denied") != std::string::npos) throw RpcError("permission_denied", why);
      throw RpcError("internal", fmt::format("{}: {}", path_for_errors, why.empty() ? "failed" : why));
    }
  }
}

Entry one_entry(EnvdTarget& t, const std::string& path) {
  auto entries = parse_entries(run_script(t, R"sh([ -e "$1" ] || [ -L "$1" ] || exit 3; e "$1")sh", {path}, path));
  if (entries.empty()) throw RpcError("not_found", fmt::format("path '{}' does not exist", path));
  return entries.front();
}

std::vector<Entry> list_dir(EnvdTarget& t, const std::string& path, unsigned depth) {
  return parse_entries(
      run_script(t,
                 R"sh([ -e "$1" ] || [ -L "$1" ] || exit 3; [ -d "$1" ] || exit 4; )sh"
                 R"sh(find "$1" -mindepth 1 -maxdepth "$2" -exec /bin/sh -c "$3"' for f; do e "$f"; done' e2b {} +)sh",
                 {path, std::to_string(depth), std::string(kEntryFunction)}, path));
}

std::string path_field(const json& message, const char* field, const std::string& home) {
  auto it = message.find(field);
  if (it == message.end() || !it->is_string() || it->get<std::string>().empty())
    throw RpcError("invalid_argument", fmt::format("{}: a path is required", field));
  return resolve_path(it->get<std::string>(), home);
}

json watcher_call(EnvdTarget& t, std::string_view method, const json& m);

json unary(EnvdTarget& t, std::string_view method, const json& m) {
  if (method == "Stat") return json{{"entry", entry_json(one_entry(t, path_field(m, "path", t.home)))}};
  if (method == "ListDir") {
    const std::string path = path_field(m, "path", t.home);
    const unsigned depth = std::clamp(m.value("depth", 1u), 1u, 64u);
    json entries = json::array();
    for (const auto& e : list_dir(t, path, depth)) entries.push_back(entry_json(e));
    return json{{"entries", std::move(entries)}};
  }
  if (method == "MakeDir") {
    const std::string path = path_field(m, "path", t.home);
    run_script(t, R"sh([ -d "$1" ] && exit 5; { [ -e "$1" ] || [ -L "$1" ]; } && exit 4; mkdir -p -- "$1")sh", {path},
               path);
    return json{{"entry", entry_json(one_entry(t, path))}};
  }
  if (method == "Move") {
    const std::string from = path_field(m, "source", t.home), to = path_field(m, "destination", t.home);
    run_script(t, R"sh([ -e "$1" ] || [ -L "$1" ] || exit 3; mkdir -p -- "$(dirname -- "$2")" && mv -f -- "$1" "$2")sh",
               {from, to}, from);
    return json{{"entry", entry_json(one_entry(t, to))}};
  }
  if (method == "Remove") {
    const std::string path = path_field(m, "path", t.home);
    run_script(t, R"sh(rm -rf -- "$1")sh", {path}, path);
    return json::object();
  }
  if (method == "CreateWatcher" || method == "GetWatcherEvents" || method == "RemoveWatcher")
    return watcher_call(t, method, m);
  throw RpcError("unimplemented", fmt::format("filesystem.Filesystem/{} is not served", method));
}

// What a watched directory holds, by path: type, size and mtime, enough to tell a write.
std::map<std::string, Entry> watch_snapshot(EnvdTarget& t, const std::string& path, bool recursive) {
  std::map<std::string, Entry> out;
  for (auto& e : list_dir(t, path, recursive ? 64 : 1)) out.emplace(e.path, std::move(e));
  return out;
}

// What changed in a watched directory from `before` to `now`, as envd's FilesystemEvents (names relative to `dir`).
std::vector<json> changes(const std::map<std::string, Entry>& before, const std::map<std::string, Entry>& now,
                          const std::string& dir, bool include_entry) {
  const std::string prefix = dir == "/" ? "/" : dir + "/";
  std::vector<json> out;
  auto event = [&](const std::string& p, const char* type, const Entry* e) {
    json fs{{"name", p.rfind(prefix, 0) == 0 ? p.substr(prefix.size()) : p}, {"type", type}};
    if (include_entry && e) fs["entry"] = entry_json(*e);
    out.push_back(std::move(fs));
  };
  for (const auto& [p, e] : now) {
    auto old = before.find(p);
    if (old == before.end()) event(p, "EVENT_TYPE_CREATE", &e);
    else if (old->second.size != e.size || old->second.mtime != e.mtime) event(p, "EVENT_TYPE_WRITE", &e);
    else if (old->second.mode != e.mode) event(p, "EVENT_TYPE_CHMOD", &e);
  }
  for (const auto& [p, e] : before)
    if (!now.count(p)) event(p, "EVENT_TYPE_REMOVE", nullptr);
  return out;
}

HttpResponse watch_dir(EnvdTarget& t, HttpRequest& request, agent::ResponseStream& stream) {
  return serve_stream(request, stream, [&](const json& m, ServerStream& out) {
    const std::string path = path_field(m, "path", t.home);
    const bool recursive = m.value("recursive", false), include_entry = m.value("includeEntry", false);
    const auto timeout = connect_timeout(request);
    const auto keepalive = keepalive_interval(request);
    const auto stop_at = timeout && timeout->count() > 0 ? Clock::now() + *timeout : Clock::time_point::max();
    auto before = watch_snapshot(t, path, recursive);
    out.send(json{{"start", json::object()}});
    auto last_sent = Clock::now();
    while (!out.gone()) {
      if (Clock::now() >= stop_at) {
        out.finish(RpcError("deadline_exceeded", "the watch's timeout passed"));
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
      std::map<std::string, Entry> now;
      bool gone = false;
      try {
        now = watch_snapshot(t, path, recursive);
      } catch (const RpcError& e) {
        if (e.code() != "not_found") throw;
        gone = true;
      }
      for (auto& fs : changes(before, now, path, include_entry)) {
        out.send(json{{"filesystem", std::move(fs)}});
        last_sent = Clock::now();
      }
      if (gone) {
        out.finish(RpcError("not_found", fmt::format("the watched directory '{}' is gone", path)));
        return;
      }
      before = std::move(now);
      if (Clock::now() - last_sent >= keepalive) {
        out.send(json{{"keepalive", json::object()}});
        last_sent = Clock::now();
      }
    }
  });
}

// The polling watchers (CreateWatcher, GetWatcherEvents, RemoveWatcher: E2B's synchronous Python SDK). As with envd,
// whose state lives in the sandbox, a watcher's state is a file in the sandbox (root's, under /tmp), so the gateway
// keeps none: what it watches and what the directory held at the last look.
constexpr std::string_view kWatcherDir = "/tmp/.e2b-watchers/";

std::string watcher_file(const std::string& id) {
  if (id.empty() || id.size() > 64 || !std::all_of(id.begin(), id.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
      }))
    throw RpcError("invalid_argument", "watcherId: not a watcher id");
  return std::string(kWatcherDir) + id + ".json";
}

json watcher_state(const std::string& path, bool recursive, bool include_entry, const std::map<std::string, Entry>& m) {
  json entries = json::object();
  for (const auto& [p, e] : m) entries[p] = json::array({e.size, e.mtime, e.mode});
  return json{
      {"path", path}, {"recursive", recursive}, {"includeEntry", include_entry}, {"entries", std::move(entries)}};
}

json watcher_call(EnvdTarget& t, std::string_view method, const json& m) {
  if (method == "CreateWatcher") {
    const std::string path = path_field(m, "path", t.home);
    const bool recursive = m.value("recursive", false), include_entry = m.value("includeEntry", false);
    const auto snapshot = watch_snapshot(t, path, recursive);
    const std::string id = agent::auth::new_token().substr(5, 22);
    t.sandbox.write_file(watcher_file(id), watcher_state(path, recursive, include_entry, snapshot).dump(), 0600);
    return json{{"watcherId", id}};
  }
  const std::string id = m.value("watcherId", "");
  const std::string file = watcher_file(id);
  if (method == "RemoveWatcher") {
    ExecRequest r;
    r.argv = {"rm", "-f", "--", file};
    r.user = "0";
    t.sandbox.exec(r);
    return json::object();
  }
  json state;
  try {
    state = json::parse(t.sandbox.read_file(file));
  } catch (const Error& e) {
    if (e.code() == Code::kNotFound) throw RpcError("not_found", fmt::format("watcher '{}' not found", id));
    throw;
  } catch (const json::exception&) {
    throw RpcError("internal", fmt::format("watcher '{}': its state in the sandbox is damaged", id));
  }
  std::map<std::string, Entry> before;
  const json entries = state.value("entries", json::object());
  for (const auto& [p, v] : entries.items()) {
    if (!v.is_array() || v.size() != 3) continue;
    Entry e;
    e.path = p;
    e.size = v[0].get<std::uint64_t>();
    e.mtime = v[1].get<double>();
    e.mode = v[2].get<unsigned>();
    before.emplace(p, std::move(e));
  }
  const std::string path = state.value("path", "");
  const bool recursive = state.value("recursive", false), include_entry = state.value("includeEntry", false);
  std::map<std::string, Entry> now;
  try {
    now = watch_snapshot(t, path, recursive);
  } catch (const RpcError& e) {
    if (e.code() != "not_found") throw;
  }
  json events = json::array();
  for (auto& fs : changes(before, now, path, include_entry)) events.push_back(std::move(fs));
  t.sandbox.write_file(file, watcher_state(path, recursive, include_entry, now).dump(), 0600);
  return json{{"events", std::move(events)}};
}

// ---- /files ----

std::string gunzip(std::string_view data) {
  std::unique_ptr<archive, decltype(&archive_read_free)> a(archive_read_new(), archive_read_free);
  archive_read_support_filter_gzip(a.get());
  archive_read_support_format_raw(a.get());
  archive_entry* entry = nullptr;
  if (archive_read_open_memory(a.get(), data.data(), data.size()) != ARCHIVE_OK ||
      archive_read_next_header(a.get(), &entry) != ARCHIVE_OK)
    throw Error(Code::kInvalidArgument, fmt::format("the gzip body cannot be read: {}", archive_error_string(a.get())));
  std::string out;
  char buf[65536];
  for (;;) {
    la_ssize_t n = archive_read_data(a.get(), buf, sizeof buf);
    if (n < 0)
      throw Error(Code::kInvalidArgument, fmt::format("the gzip body is corrupt: {}", archive_error_string(a.get())));
    if (n == 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

std::string path_param(const agent::Query& q) { return q.get("path").value_or(""); }

HttpResponse files_get(EnvdTarget& t, const agent::Query& q) {
  const std::string asked = path_param(q);
  if (asked.empty()) return rest_error(400, "path: required");
  const std::string path = resolve_path(asked, t.home);
  std::string data;
  try {
    if (t.user.empty() || t.user == "root") {
      data = t.sandbox.read_file(path);
    } else {
      ExecRequest r;
      r.argv = {"/bin/sh", "-c", R"sh([ -e "$1" ] || exit 3; [ -d "$1" ] && exit 4; exec cat -- "$1")sh", "e2b", path};
      r.user = t.user;
      r.max_output_bytes = 1ull << 30;
      ExecResult res = t.sandbox.exec(r);
      if (res.exit_code == kMissing) return rest_error(404, fmt::format("path '{}' does not exist", path));
      if (res.exit_code == kNotDirectory) return rest_error(400, fmt::format("path '{}' is a directory", path));
      if (res.exit_code != 0)
        return rest_error(res.stderr_data.find("Permission denied") != std::string::npos ? 401 : 500,
                          fmt::format("{}: {}", path, res.stderr_data));
      data = std::move(res.stdout_data);
    }
  } catch (const Error& e) {
    if (e.code() == Code::kNotFound) return rest_error(404, fmt::format("path '{}' does not exist", path));
    if (e.code() == Code::kInvalidArgument || e.code() == Code::kFailedPrecondition) return rest_error(400, e.what());
    throw;
  }
  HttpResponse r{http::status::ok, 11};
  r.set(http::field::content_type, "application/octet-stream");
  r.body() = std::move(data);
  r.prepare_payload();
  return r;
}

void write_one(EnvdTarget& t, const std::string& path, const std::string& data) {
  if (t.user.empty() || t.user == "root") {
    t.sandbox.write_file(path, data);
    return;
  }
  ExecRequest r;
  r.argv = {"/bin/sh", "-c", R"sh(mkdir -p -- "$(dirname -- "$1")" && cat > "$1")sh", "e2b", path};
  r.user = t.user;
  r.stdin_data = data;
  ExecResult res = t.sandbox.exec(r);
  if (res.exit_code != 0)
    throw Error(
        res.stderr_data.find("Permission denied") != std::string::npos ? Code::kPermissionDenied : Code::kInternal,
        fmt::format("{}: {}", path, res.stderr_data));
}

HttpResponse files_post(EnvdTarget& t, const HttpRequest& request, const agent::Query& q) {
  std::string type(agent::std_view(request[http::field::content_type]));
  std::string lower = type;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  std::vector<Upload> uploads;
  if (lower.rfind("multipart/form-data", 0) == 0) {
    uploads = parse_multipart(type, request.body());
    if (uploads.empty()) return rest_error(400, "the multipart body has no part named \"file\"");
    // A path in the query names the (one) file.
    if (!path_param(q).empty()) {
      if (uploads.size() != 1) return rest_error(400, "path: given for a body of several files");
      uploads[0].path = path_param(q);
    }
  } else {
    if (path_param(q).empty()) return rest_error(400, "path: required for a raw upload");
    std::string data = request.body();
    std::string encoding(agent::std_view(request[http::field::content_encoding]));
    if (encoding == "gzip") data = gunzip(data);
    else if (!encoding.empty() && encoding != "identity")
      return rest_error(400, fmt::format("Content-Encoding '{}' is not supported (gzip is)", encoding));
    uploads.push_back(Upload{path_param(q), std::move(data)});
  }
  json written = json::array();
  for (auto& u : uploads) {
    if (u.path.empty()) return rest_error(400, "a part without a file name (its target path)");
    const std::string path = resolve_path(u.path, t.home);
    try {
      write_one(t, path, u.data);
    } catch (const Error& e) {
      if (e.code() == Code::kPermissionDenied) return rest_error(401, e.what());
      if (e.code() == Code::kResourceExhausted) return rest_error(507, e.what());
      if (e.code() == Code::kInvalidArgument || e.code() == Code::kFailedPrecondition) return rest_error(400, e.what());
      throw;
    }
    written.push_back(json{{"name", base_name(path)}, {"type", "file"}, {"path", path}});
  }
  HttpResponse r{http::status::ok, 11};
  r.set(http::field::content_type, "application/json");
  r.body() = written.dump(-1, ' ', false, json::error_handler_t::replace);
  r.prepare_payload();
  return r;
}

}  // namespace

HttpResponse filesystem_service(EnvdTarget& target, std::string_view method, HttpRequest& request,
                                agent::ResponseStream& stream) {
  if (method == "WatchDir") return watch_dir(target, request, stream);
  return serve_unary(request, [&](const json& message) { return unary(target, method, message); });
}

HttpResponse files_endpoint(EnvdTarget& target, HttpRequest& request) {
  const std::string raw(agent::std_view(request.target()));
  const auto q = raw.find('?');
  const agent::Query query = agent::parse_query(q == std::string::npos ? "" : raw.substr(q + 1));
  try {
    if (request.method() == http::verb::get) return files_get(target, query);
    if (request.method() == http::verb::post) return files_post(target, request, query);
    return rest_error(405, "/files: GET or POST");
  } catch (const Error& e) {
    const unsigned status = e.code() == Code::kNotFound             ? 404
                            : e.code() == Code::kInvalidArgument    ? 400
                            : e.code() == Code::kResourceExhausted  ? 507
                            : e.code() == Code::kUnauthenticated    ? 401
                            : e.code() == Code::kFailedPrecondition ? 400
                                                                    : 500;
    return rest_error(status, e.what());
  }
}

}  // namespace dsec::e2b
