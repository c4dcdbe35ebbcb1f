// Snapshots of a sandbox, and forks: copies made on its node, or sandboxes created from a snapshot.
#include <cctype>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "client/client_core_internal.hpp"
#include "common/protocol.hpp"
#include "image/store/manifest.hpp"

namespace dsec::detail {
namespace {

SnapshotResult decode_snapshot_result(const HttpResponse& r, std::string_view what) {
  protocol::json j = parse_json(r, what);
  SnapshotResult out;
  try {
    out.image = j.at("image").get<std::string>();
    out.sandbox_id = j.at("sandbox").get<std::string>();
    out.parent = j.at("parent").get<std::string>();
    out.store = j.at("store").get<std::string>();
    const auto& layer = j.at("layer");
    out.layer_digest = layer.at("digest").get<std::string>();
    out.layer_bytes = layer.at("size").get<std::uint64_t>();
    out.stored_bytes = layer.at("stored_size").get<std::uint64_t>();
    const auto& files = j.at("files");
    out.file_bytes = files.at("bytes").get<std::uint64_t>();
    out.entries = files.at("entries").get<std::uint64_t>();
    out.frozen_seconds = j.at("frozen_seconds").get<double>();
    out.seconds = j.at("seconds").get<double>();
    out.spec = protocol::decode_spec(j.at("spec"));
  } catch (const Error& e) {
    throw Error(Code::kInternal, fmt::format("{}: malformed answer: {}", what, e.what()));
  } catch (const std::exception& e) {
    throw Error(Code::kInternal, fmt::format("{}: malformed answer: {}", what, e.what()));
  }
  return out;
}

}  // namespace

SnapshotResult ClientCore::snapshot(const std::string& id, std::string_view name) {
  const SandboxRequest request = requests::snapshot(id, name);
  return decode_snapshot_result(call_sandbox(request), request.what);
}

std::vector<SandboxInfo> ClientCore::fork(const std::string& id, std::size_t n, std::string_view name, bool keep) {
  if (n == 0) throw Error(Code::kInvalidArgument, "fork: n must be at least 1");
  if (name.empty()) {
    // A backend that can copy a running sandbox (a microVM: processes and memory too) does it on the sandbox's
    // node; the others answer UNIMPLEMENTED and fork through a snapshot of the files. Not retried: the copies may
    // exist once the request arrived.
    const SandboxRequest request = requests::fork(id, n);
    try {
      return answers::sandbox_list(send_once(request, deadline_after(request.how.extra)), request.what);
    } catch (const Error& e) {
      if (e.code() != Code::kUnimplemented) throw;
    }
  }
  std::string snapshot_name(name);
  const bool generated = snapshot_name.empty();
  if (generated) {
    // A repository part starts with a letter or digit; sandbox ids are letters, digits, '-', '_' and '.'.
    std::string_view head = id.empty() ? std::string_view("x") : std::string_view(id).substr(0, 1);
    bool alnum = std::isalnum(static_cast<unsigned char>(head.front()));
    snapshot_name = fmt::format("{}{}{}:{}", protocol::kForkSnapshotPrefix, alnum ? "" : "x", id,
                                random_request_id().substr(0, 16));
  }
  SnapshotResult snap = snapshot(id, snapshot_name);
  SandboxSpec spec = snap.spec;
  spec.image = snap.image;
  spec.request_id.clear();
  spec.group.clear();
  spec.group_ttl = std::chrono::seconds{0};
  spec.labels.erase(std::string(kRequestLabel));
  spec.labels.erase(std::string(kPulseLabel));
  // A generated snapshot lives as long as the sandboxes made from it: their nodes remove its tag when the last of
  // them goes (protocol::kForkSnapshotLabel). A copy of a fork child does not keep its parent's snapshot.
  spec.labels.erase(std::string(protocol::kForkSnapshotLabel));
  if (generated && !keep)
    spec.labels[std::string(protocol::kForkSnapshotLabel)] = image::parse_reference(snap.image).tagged();
  return create_many(n, spec);
}

}  // namespace dsec::detail
