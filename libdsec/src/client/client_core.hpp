// What dsec::Client and dsec::Sandbox stand on: the endpoints and their connection pools, the node table that
// routes a sandbox id to its node, retries under one deadline, and the embedded agent when there is one.
// Public headers only forward-declare it, so a trainer's translation units never see curl or JSON.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "client/embedded_agent.hpp"
#include "client/image_resolver.hpp"
#include "client/node_table.hpp"
#include "client/transport.hpp"
#include "dsec/client.hpp"
#include "dsec/exec.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/spec.hpp"

namespace dsec::detail {

class ClientCore {
 public:
  explicit ClientCore(ClientOptions options);
  ~ClientCore();
  ClientCore(const ClientCore&) = delete;
  ClientCore& operator=(const ClientCore&) = delete;

  // Stops the embedded agent; every later call throws FAILED_PRECONDITION. Idempotent.
  void close();
  bool closed() const noexcept { return closed_.load(); }

  SandboxInfo create(SandboxSpec spec);
  std::vector<SandboxInfo> create_many(std::size_t n, const SandboxSpec& spec);
  SandboxInfo get(const std::string& id);
  std::vector<SandboxInfo> list(const Labels& labels, const std::string& tenant);
  std::vector<NodeInfo> nodes();
  // Idempotent: a sandbox that is already gone is not an error.
  void destroy(const std::string& id);
  ExecResult exec(const std::string& id, const ExecRequest& request);
  // A streaming exec: output goes to on_output as the agent sends it; what on_output throws aborts the call (the
  // connection is dropped; the command runs on in the sandbox to its end or timeout) and is rethrown as it was.
  ExecResult exec_stream(const std::string& id, const ExecRequest& request,
                         const std::function<void(int fd, std::string_view data)>& on_output);
  void write_file(const std::string& id, std::string_view path, std::string_view data, unsigned mode);
  std::string read_file(const std::string& id, std::string_view path);
  void upload_tar(const std::string& id, std::string_view dir, std::string_view tar_bytes);
  std::string download_tar(const std::string& id, std::string_view dir);

  std::string endpoint() const;
  std::size_t endpoint_count() const noexcept { return transports_.size(); }
  // Summed over every endpoint: how many requests were sent and how many connections opened for them.
  TransportStats stats() const;
  const EmbeddedAgent* embedded_agent() const noexcept { return agent_.get(); }

 private:
  template <typename Op>
  auto retrying(SteadyClock::time_point deadline, Op&& op) -> decltype(op());

  SteadyClock::time_point deadline_after(std::chrono::milliseconds extra = {}) const;
  void check_open() const;
  // One HTTP exchange with endpoint `ep`; a non-2xx answer is thrown as the agent's dsec::Error.
  HttpResponse call(std::size_t ep, const HttpRequest& request, SteadyClock::time_point deadline);
  // The endpoint of the node that made sandbox `id` (asks unknown endpoints for their node ids when needed).
  std::size_t route(const std::string& id, SteadyClock::time_point deadline);
  void learn_node(std::size_t ep, const std::string& node_id);
  // A call about sandbox `id`: sent to the node that made it, retried under one fresh call deadline.
  HttpResponse call_sandbox(const std::string& id, const HttpRequest& request);
  std::string sandbox_path(const std::string& id, std::string_view suffix = {}) const;

  ClientOptions options_;
  std::unique_ptr<EmbeddedAgent> agent_;
  std::unique_ptr<ImageResolver> images_;
  std::vector<std::unique_ptr<Transport>> transports_;
  mutable std::mutex nodes_mu_;
  NodeTable nodes_;
  std::mutex discover_mu_;  // one discovery round at a time
  std::atomic<std::size_t> next_create_{0};
  std::atomic<bool> closed_{false};
};

// 32 hex digits from a random 128-bit value: request ids for creates that came without one.
std::string random_request_id();

}  // namespace dsec::detail
