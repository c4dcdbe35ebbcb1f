// dsec-e2b: E2B's API on dsec. Flags into GatewayOptions, then serve until SIGTERM or SIGINT.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "common/flags.hpp"
#include "gateway/e2b/gateway.hpp"
#include "http/server.hpp"

namespace {

using dsec::e2b::GatewayOptions;
namespace flags = dsec::flags;

constexpr std::string_view kHeader = R"(usage: dsec-e2b --listen HOST:PORT [options]

Serves E2B's API (the control plane and every sandbox's envd) on dsec, so E2B's official SDKs run unchanged:
  E2B_API_URL=http://HOST:PORT E2B_SANDBOX_URL=http://HOST:PORT E2B_API_KEY=<key>
Templates are dsec image names. See docs/e2b.md.
)";

constexpr std::string_view kFooter = R"(
Signals: SIGTERM or SIGINT stops it (an embedded agent destroys its sandboxes).
)";

constexpr std::size_t kHelpColumn = 24;
constexpr std::string_view kNeedsValue = "a value";

// Where dsec is, as dsec.Client takes it.
flags::Table client_flags(dsec::ClientOptions& client) {
  return {
      flags::repeated("--endpoint", "URL", "an agent (unix:/path or http(s)://host:port); repeatable",
                      &client.endpoints, kNeedsValue),
      flags::repeated("--etcd", "URL", "discover the agents through etcd; repeatable", &client.etcd_endpoints,
                      kNeedsValue),
      flags::text("--etcd-prefix", "P", "the agents' --etcd-prefix (default /dsec/)", &client.etcd_prefix, kNeedsValue),
      flags::repeated("--store", "URL", "image store (directory or http(s)://); repeatable", &client.stores,
                      kNeedsValue),
      flags::text("--home", "DIR",
                  "the embedded agent's home (images and state; default $DSEC_HOME, else /var/lib/dsec)", &client.home,
                  kNeedsValue),
      flags::repeated("--agent-arg", "ARG", "one more flag for the embedded agent; repeatable", &client.agent_args,
                      kNeedsValue),
  };
}

// The E2B side: where to serve and what E2B's calls mean on dsec.
flags::Table e2b_flags(GatewayOptions& options, std::string& listen) {
  return {
      flags::text("--listen", "HOST:PORT",
                  "where to serve (port 0: any free one; the line \"listening on HOST:PORT\" says which)", &listen,
                  kNeedsValue),
      flags::text("--tokens", "FILE",
                  "API keys are the tokens of this file (dsecd's format, docs/security.md): a key acts as its tenant. "
                  "Without it any API key is accepted (a one-user local setup)",
                  &options.tokens_file, kNeedsValue),
      flags::text("--domain", "D",
                  "the sandboxes' domain for deployments with wildcard DNS (<port>-<id>.D reaches the gateway)",
                  &options.domain, kNeedsValue),
      flags::text("--default-user", "NAME",
                  "commands run as this user where the template has it, else as root (default: user)",
                  &options.default_user, kNeedsValue),
      flags::choice("--network", "MODE", "a create that does not set allow_internet_access: none (default) or open",
                    {"none", "open"}, &options.network),
      flags::seconds("--timeout", "SECONDS", "a create's timeout when it gives none (default 300)",
                     &options.default_timeout, {.min = 1, .max = 365ull * 86400}),
  };
}

std::string usage(const flags::Table& where, const flags::Table& e2b) {
  return fmt::format(
      "{}\nWhere dsec is (as dsec.Client takes it; none of them: an embedded agent of the gateway's own):\n{}\n"
      "The E2B side:\n{}{}",
      kHeader, flags::help(where, kHelpColumn), flags::help(e2b, kHelpColumn), kFooter);
}

// The command line into options and the address to listen on; --help prints and exits 0, a bad flag exits 2.
GatewayOptions parse_command_line(int argc, char** argv, std::string& listen) {
  GatewayOptions options;
  flags::Table where = client_flags(options.client);
  flags::Table e2b = e2b_flags(options, listen);
  flags::Table table = where;
  table.insert(table.end(), e2b.begin(), e2b.end());
  auto usage_error = [&](std::string_view message) {
    fmt::print(stderr, "dsec-e2b: {}\n\n{}", message, usage(where, e2b));
    std::exit(2);
  };
  try {
    if (flags::parse(table, {argv + 1, argv + argc}) == flags::Parsed::kHelp) {
      fmt::print("{}", usage(where, e2b));
      std::exit(0);
    }
  } catch (const flags::FlagError& e) {
    usage_error(e.what());
  }
  if (listen.empty()) usage_error("--listen HOST:PORT is required");
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  std::string listen;
  GatewayOptions options = parse_command_line(argc, argv, listen);

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
    // A caller without an API key or the sandbox's credentials is answered from its header: its body is not read.
    server_options.admit = [&gateway](const dsec::agent::HttpRequest& header, const dsec::agent::Peer&) {
      return gateway.admit(header);
    };
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
