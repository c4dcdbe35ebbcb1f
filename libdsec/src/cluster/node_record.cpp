#include "cluster/node_record.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/protocol.hpp"

namespace dsec::cluster {

std::string nodes_prefix(std::string_view prefix) {
  if (prefix.empty()) throw Error(Code::kInvalidArgument, "etcd prefix is empty (the default is /dsec/)");
  return fmt::format("{}{}nodes/", prefix, prefix.back() == '/' ? "" : "/");
}

std::string node_key(std::string_view prefix, std::string_view node_id) {
  return nodes_prefix(prefix) + std::string(node_id);
}

std::string encode_node_record(const NodeRecord& record) {
  nlohmann::json node = protocol::encode(record.node);
  if (!record.fncall.empty()) {
    auto fncall = nlohmann::json::parse(record.fncall, nullptr, false);
    if (!fncall.is_object()) throw Error(Code::kInternal, "node record: the fncall status is not a JSON object");
    node["fncall"] = std::move(fncall);
  }
  return nlohmann::json{{"endpoint", record.endpoint}, {"node", std::move(node)}}.dump();
}

NodeRecord decode_node_record(std::string_view value) {
  auto j = nlohmann::json::parse(value, nullptr, false);
  if (!j.is_object())
    throw Error(Code::kInvalidArgument, fmt::format("node record is not a JSON object: {}", value.substr(0, 120)));
  NodeRecord r;
  auto e = j.find("endpoint");
  if (e == j.end() || !e->is_string() || e->get_ref<const std::string&>().empty())
    throw Error(Code::kInvalidArgument, "node record: 'endpoint' is missing or not a string");
  r.endpoint = e->get<std::string>();
  auto n = j.find("node");
  if (n == j.end() || !n->is_object())
    throw Error(Code::kInvalidArgument, "node record: 'node' is missing or not an object");
  try {
    r.node = protocol::decode_node_info(*n);
  } catch (const std::exception& x) {  // a member of the wrong type or out of range
    throw Error(Code::kInvalidArgument, fmt::format("node record: 'node': {}", x.what()));
  }
  if (r.node.id.empty()) throw Error(Code::kInvalidArgument, "node record: 'node.id' is missing");
  if (auto f = n->find("fncall"); f != n->end()) {
    if (!f->is_object()) throw Error(Code::kInvalidArgument, "node record: 'node.fncall' is not an object");
    r.fncall = f->dump();
  }
  return r;
}

}  // namespace dsec::cluster
