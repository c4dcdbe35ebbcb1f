// The trainer's entry point: a Client talks to one or more node agents (dsecd) over HTTP/JSON, or starts a private
// one for itself when given no endpoints.
#pragma once

#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dsec/fncall.hpp"
#include "dsec/group.hpp"
#include "dsec/placement.hpp"
#include "dsec/retry.hpp"
#include "dsec/sandbox.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/spec.hpp"

namespace dsec {

namespace detail {
class ClientCore;
}

// OCI registries, for an embedded agent: it imports registry images on first use (docs/images.md). Agents running
// elsewhere use their own settings (dsecd --registry-auth, --registry-mirror, ...).
struct RegistrySettings {
  // Credentials by registry host ("ghcr.io", "127.0.0.1:5000"): user name and password (or token). The agent gets
  // them in a private file (mode 0600), never on its command line. Docker's ~/.docker/config.json is read too.
  std::map<std::string, std::pair<std::string, std::string>> auth;
  std::map<std::string, std::string> mirrors;  // registry host -> a mirror's URL, asked first
  std::vector<std::string> insecure;           // hosts spoken to over plain HTTP when HTTPS fails
  std::string ca_file;                         // a CA bundle to trust for registries
  std::string default_registry;                // where bare names no store has come from ("docker.io"); empty: none
};

struct ClientOptions {
  // "unix:/run/dsec/dsecd.sock" or "http://10.0.0.7:7070". Empty: start an embedded agent on a private unix
  // socket, owned by this client and stopped with it (SIGTERM, which destroys its sandboxes; it also gets SIGTERM
  // if the trainer dies). Its stdout and stderr go to $DSEC_AGENT_LOG when set, else to a file in its private
  // directory that is removed with it; errors about the agent quote the log's tail.
  std::vector<std::string> endpoints;
  // Discovery through etcd: client URLs of the etcd members ("http://10.0.0.2:2379"). When set, the client learns
  // its nodes from the agents' registrations (dsecd --etcd) under etcd_prefix and follows them as they come, change
  // load, and go (a dead agent's entry goes when its lease expires); `endpoints`, when also given, are used too.
  std::vector<std::string> etcd_endpoints;
  // The agents' --etcd-prefix: registrations live under <etcd_prefix>nodes/<node id>.
  std::string etcd_prefix = "/dsec/";
  // Image stores the client resolves image names in: directories (also shared filesystems) or http(s):// URLs.
  // create() then sends the agent a pinned reference and its manifest, so every sandbox of a pulse gets exactly the
  // same layers and agents need not look tags up. Empty: the embedded agent's <home>/store when there is an
  // embedded agent, else the agents resolve names in their own stores. An embedded agent is given these stores.
  std::vector<std::string> stores;
  // How long a resolved tag is trusted before it is looked up again (manifests themselves are immutable).
  std::chrono::milliseconds image_cache_ttl{10'000};
  // OCI registries, for an embedded agent (see RegistrySettings).
  RegistrySettings registry;
  // Embedded agent only: its binary (default: $DSEC_AGENT, then the dsecd of the build tree this library came
  // from, then each of agent_candidates, then dsecd on PATH) and the directory that holds its image store and state
  // (default: $DSEC_HOME, then /var/lib/dsec).
  std::string agent_binary;
  std::vector<std::string> agent_candidates;  // e.g. the dsecd shipped inside the Python package
  std::string home;
  std::vector<std::string> agent_args;  // extra dsecd flags, e.g. {"--backends", "container,null"}
  std::chrono::milliseconds agent_start_timeout{30'000};
  // After SIGTERM the agent destroys its sandboxes; past this grace it gets SIGKILL.
  std::chrono::milliseconds agent_stop_grace{10'000};
  RetryPolicy retry;
  // Deadline for one call, through all its retries (exec adds its own timeout on top).
  std::chrono::milliseconds call_deadline{60'000};
  // The longest one HTTP exchange with a node may take (an exec adds its own timeout): a node that does not answer
  // within it counts as failed, and a create moves to another node (with the same request id) instead of waiting
  // out the whole call deadline.
  std::chrono::milliseconds request_timeout{15'000};
  // How many creates create_many keeps in flight at once.
  std::size_t create_concurrency = 32;
  // Which node each sandbox goes to (dsec/placement.hpp): "spread" (most free capacity first: sandboxes spread over
  // the nodes) or "pack" (least free capacity that still fits: nodes fill up one after another, the rest stay
  // empty). Both prefer nodes that cache the image's layers. An unknown name is INVALID_ARGUMENT.
  std::string placement = "spread";
  // A policy of the caller's own; when set it is used and `placement` is ignored. Called concurrently.
  std::shared_ptr<PlacementPolicy> placement_policy;
  // Access (docs/security.md): the bearer token sent to every agent (empty: $DSEC_TOKEN, if set); the CA bundle
  // that signed https:// agents' certificates (empty: the system's); a client certificate and its key for agents
  // that ask for one (dsecd --tls-client-ca).
  std::string token;
  std::string tls_ca_file;
  std::string tls_client_cert;
  std::string tls_client_key;
  // TLS to https:// etcd members: their CA bundle (empty: the system's) and a client certificate for a cluster that
  // asks for one (etcd --client-cert-auth).
  std::string etcd_tls_ca_file;
  std::string etcd_tls_client_cert;
  std::string etcd_tls_client_key;
};

// Thread-safe: one Client serves every thread of a trainer. Sandbox handles share its connections and are usable
// while the Client is open; close() (or the destructor) stops an embedded agent, which destroys its sandboxes, and
// makes every later call through this client or its handles fail with FAILED_PRECONDITION.
class Client {
 public:
  explicit Client(ClientOptions options = {});
  ~Client();
  Client(Client&&) noexcept;
  Client& operator=(Client&&) noexcept;

  // Creates a sandbox and returns an owning handle. The request carries spec.request_id (a random one when empty),
  // so a create retried after a lost answer never makes two sandboxes.
  Sandbox create(const SandboxSpec& spec);
  // n sandboxes from one spec, created concurrently (ClientOptions::create_concurrency in flight). All or nothing:
  // if any create fails, the ones made are destroyed and the first error is thrown. Sandbox i carries the request
  // id "<spec.request_id>-<i>" (a random base when spec.request_id is empty), so the whole batch can be retried.
  std::vector<Sandbox> create_many(std::size_t n, const SandboxSpec& spec);
  // One sandbox per spec (sandbox i from specs[i], e.g. one image per task), as one pulse: equal specs are placed
  // and sent together, one batch request per node and distinct spec. All or nothing; the first spec's request_id
  // (a random one when empty) names the pulse, so the whole call can be retried.
  std::vector<Sandbox> create_many(const std::vector<SandboxSpec>& specs);
  // n sandboxes as one group under a lease (see dsec/group.hpp): placed over the nodes by the placement policy, one
  // batch request per node, all sent at once; a node that refuses or fails has its share made elsewhere. All or
  // nothing, like create_many. Renewed in the background every lease/3; when the trainer dies the agents destroy
  // the group's sandboxes once the lease runs out.
  SandboxGroup create_group(std::size_t n, const SandboxSpec& spec,
                            std::chrono::seconds lease = std::chrono::seconds(30));
  // A group of one sandbox per spec, placed and sent as create_many(specs) does.
  SandboxGroup create_group(const std::vector<SandboxSpec>& specs,
                            std::chrono::seconds lease = std::chrono::seconds(30));
  // Runs code in a node's warm pool of its language (dsec/fncall.hpp; protocol POST /v1/fncall) and returns what it
  // did. A program that fails, times out or runs out of memory is a result, not an error; errors are for calls that
  // could not run (INVALID_ARGUMENT, NOT_FOUND for an image, RESOURCE_EXHAUSTED, UNAVAILABLE...).
  FnCallResult run_code(const FnCallRequest& request);
  // Many calls at once, spread over the nodes (one batch request per node, POST /v1/fncall/batch); results in the
  // order of the requests. One call's failure to run is that result's error: it throws only when a whole batch
  // could not be placed on any node.
  std::vector<FnCallResult> run_code_many(const std::vector<FnCallRequest>& requests);
  // A handle on an existing sandbox (not owning: destroying it is explicit).
  Sandbox attach(const std::string& id);
  // Sandboxes on every node that carry all of `labels` (and belong to `tenant`, when given). Throws when a node
  // cannot be reached rather than answer with part of the list.
  std::vector<SandboxInfo> list(const Labels& labels = {}, const std::string& tenant = {});
  // Every node's capacity, load, backends and images; throws when a node cannot be reached.
  std::vector<NodeInfo> nodes();
  // The images in the client's stores (ClientOptions::stores; with an embedded agent and no stores, its
  // <home>/store), store by store, as `dsec image ls` lists them. FAILED_PRECONDITION for a client without stores
  // (its agents resolve images in their own); UNAVAILABLE when a store cannot be reached.
  std::vector<ImageInfo> images();
  // Removes the image tag `name` ("name[:tag]", tag "latest" when none) from every store of the client that has
  // it, as `dsec image rm` does: sandboxes running from it are not touched, its blobs stay until `dsec image gc`.
  // NOT_FOUND when no store has it; FAILED_PRECONDITION for a client without stores.
  void remove_image(const std::string& name);
  // The embedded agent's endpoint, or the first configured one.
  std::string endpoint() const;
  // Stops the embedded agent (if any) and closes the client. Idempotent; the destructor does the same.
  void close();

  // What dsec's own layers build on (the Python binding's asyncio core); nothing a trainer calls.
  const std::shared_ptr<detail::ClientCore>& core_handle() const noexcept { return core_; }

 private:
  std::shared_ptr<detail::ClientCore> core_;
};

}  // namespace dsec
