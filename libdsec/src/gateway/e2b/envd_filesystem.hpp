// envd's filesystem.Filesystem service (Stat, ListDir, MakeDir, Move, Remove, WatchDir) and its plain-HTTP /files
// endpoint, on a dsec sandbox.
//
// Each call runs as the caller's user inside the sandbox, so the sandbox's own permissions decide, as in envd: the
// directory calls are one small POSIX shell script each (stat, find, mkdir, mv, rm: in busybox and coreutils alike),
// its entries NUL-separated so any file name comes back whole. /files reads and writes through dsec's files API when
// the user is root, and through `cat` as the user otherwise. WatchDir polls the directory (every 250 ms) and sends
// what changed: dsec has no watch of its own yet. The polling watchers (CreateWatcher, GetWatcherEvents,
// RemoveWatcher: E2B's synchronous Python SDK) keep their state in a file in the sandbox, as envd keeps it there.
#pragma once

#include <string_view>

#include "gateway/e2b/gateway.hpp"
#include "http/http.hpp"

namespace dsec::e2b {

agent::HttpResponse filesystem_service(EnvdTarget& target, std::string_view method, agent::HttpRequest& request,
                                       agent::ResponseStream& stream);

// GET /files?path=P (the file's bytes) and POST /files?path=P (multipart parts named "file", or the raw body;
// gzip Content-Encoding undone): [{"name", "type": "file", "path"}].
agent::HttpResponse files_endpoint(EnvdTarget& target, agent::HttpRequest& request);

}  // namespace dsec::e2b
