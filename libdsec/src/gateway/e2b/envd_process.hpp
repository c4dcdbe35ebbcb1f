// envd's process.Process service on dsec's processes (dsec/process.hpp): a started command is a spawned process of
// the sandbox (its output kept by the sandbox's init, read from offsets), so a stream that breaks loses nothing and
// any gateway can Connect to it later.
//
//   Start       spawn, then stream start {pid}, data {stdout|stderr|pty}, keepalives, end {exitCode, status}
//   Connect     the same stream for a running process, from its output's current end (no replay, as envd)
//   List        the running processes
//   SendInput   stdin (or the pty's input); CloseStdin; SendSignal (SIGKILL/SIGTERM to its process group)
//   Update      a pty's size
//
// As envd: Connect-Timeout-Ms on Start is the process's lifetime (killed when it passes, even if the caller went
// away); a caller that goes away without one leaves it running. A process whose end a stream delivered is forgotten
// with its output.
#pragma once

#include <string_view>

#include "gateway/e2b/gateway.hpp"
#include "http/http.hpp"

namespace dsec::e2b {

agent::HttpResponse process_service(EnvdTarget& target, std::string_view method, agent::HttpRequest& request,
                                    agent::ResponseStream& stream);

}  // namespace dsec::e2b
