// dsec-e2b: E2B's API on dsec. Flags into GatewayOptions, then serve until SIGTERM or SIGINT.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "gateway/e2b/gateway.hpp"
#include "http/server.hpp"

namespace {

constexpr const char* kUsage = R"(usage: dsec-e2b --listen HOST:PORT [options]

Serves E2B's API (the control plane and every sandbox's envd) on dsec, so E2B's official SDKs run unchanged:
  E2B_API_URL=http://HOST:PORT E2B_SANDBOX_URL=http://HOST:PORT E2B_API_KEY=<key>
Templates are dsec image names. See docs/e2b.md.

Where dsec is (as dsec.Client takes it; none of them: an embedded agent of the gateway's own):
  --endpoint URL        an agent (unix:/path or http(s)://host:port); repeatable
  --etcd URL            discover the agents through etcd; repeatable
  --etcd-prefix P       the agents' --etcd-prefix (default /dsec/)
  --store URL           image store (directory or http(s)://); repeatable
  --home DIR            the embedded agent's home (images and state; default $DSEC_HOME, else /var/lib/dsec)
  --agent-arg ARG       one more flag for the embedded agent; repeatable

The E2B side:
  --listen HOST:PORT    where to serve (port 0: any free one; the line "listening on HOST:PORT" says which)
  --tokens FILE         API keys are the tokens of this file (dsecd's format, docs/security.md): a key acts as its
                        tenant. Without it any API key is accepted (a one-user local setup)
  --domain D            the sandboxes' domain for deployments with wildcard DNS (<port>-<id>.D reaches the gateway)
  --default-user NAME   commands run as this user where the template has it, else as root (default: user)
  --network MODE        a create that does not set allow_internet_access: none (default) or open
  --timeout SECONDS     a create's timeout when it gives none (default 300)

Signals: SIGTERM or SIGINT stops it (an embedded agent destroys its sandboxes).
)";

[[noreturn]] void usage_error(const std::string& message) {
  fmt::print(stderr, "dsec-e2b: {}\n\n{}", message, kUsage);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  dsec::e2b::GatewayOptions options;
  std::string listen;
  std::vector<std::string> args(argv + 1, argv + argc);
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i];
    std::string value;
    if (flag == "-h" || flag == "--help") {
      fmt::print("{}", kUsage);
      return 0;
    }
    if (auto eq = flag.find('='); eq != std::string::npos && flag.rfind("--", 0) == 0) {
      value = flag.substr(eq + 1);
      flag.resize(eq);
    } else if (i + 1 < args.size()) {
      value = args[++i];
    } else {
      usage_error(fmt::format("{}: needs a value", flag));
    }
    if (value.empty()) usage_error(fmt::format("{}: needs a value", flag));
    if (flag == "--listen") listen = value;
    else if (flag == "--endpoint") options.client.endpoints.push_back(value);
    else if (flag == "--etcd") options.client.etcd_endpoints.push_back(value);
    else if (flag == "--etcd-prefix") options.client.etcd_prefix = value;
    else if (flag == "--store") options.client.stores.push_back(value);
    else if (flag == "--home") options.client.home = value;
    else if (flag == "--agent-arg") options.client.agent_args.push_back(value);
    else if (flag == "--tokens") options.tokens_file = value;
    else if (flag == "--domain") options.domain = value;
    else if (flag == "--default-user") options.default_user = value;
    else if (flag == "--network") {
      if (value != "none" && value != "open") usage_error("--network: none or open");
      options.network = value;
    } else if (flag == "--timeout") {
      char* end = nullptr;
      long seconds = std::strtol(value.c_str(), &end, 10);
      if (*end != '\0' || seconds < 1 || seconds > 365L * 86400) usage_error("--timeout: 1 to 31536000 seconds");
      options.default_timeout = std::chrono::seconds(seconds);
    } else {
      usage_error(fmt::format("unknown option {}", flag));
    }
  }
  if (listen.empty()) usage_error("--listen HOST:PORT is required");

  // Signals are taken by this thread; every thread started below inherits the blocked mask.
  ::signal(SIGTERM, SIG_DFL);
  ::signal(SIGINT, SIG_DFL);
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);

  try {
    dsec::e2b::Gateway gateway(options);
    dsec::agent::ConnectionCount connections;
    dsec::agent::ServerOptions server_options;
    server_options.tcp_listen = listen;
    server_options.max_body_bytes = 1ull << 30;  // file uploads
    server_options.idle_timeout = std::chrono::seconds(600);
    dsec::agent::Server server(
        server_options,
        [&gateway](dsec::agent::HttpRequest& request, dsec::agent::ResponseStream& stream, const dsec::agent::Peer&) {
          return gateway.handle(request, stream);
        },
        connections);
    server.start();
    fmt::print("listening on {}\n", server.tcp_endpoint());
    std::fflush(stdout);
    int sig = 0;
    while (sigwait(&stop_signals, &sig) != 0) {
    }
    fmt::print(stderr, "dsec-e2b: {}: stopping\n", sig == SIGTERM ? "SIGTERM" : "SIGINT");
    server.stop_accepting();
    gateway.close();  // streams that follow a process end with it
    server.wait_connections();
  } catch (const std::exception& e) {
    fmt::print(stderr, "dsec-e2b: {}\n", e.what());
    return 1;
  }
  return 0;
}
