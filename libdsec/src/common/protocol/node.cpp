#include "common/protocol/node.hpp"

#include <fmt/format.h>

#include "common/protocol/fields_internal.hpp"

namespace dsec::protocol {

using namespace fields;

// A QEMU tier's part of the node info, under `name` (written only when the tier is offered or says why not).
static void encode_tier(json& out, const char* name, const QemuTierNodeInfo& m) {
  if (!m.offered && m.unavailable.empty()) return;
  out[name] = json{
      {"offered", m.offered},
      {"unavailable", m.unavailable},
      {"ready", m.ready},
      {"accelerator", m.accelerator},
      {"accelerator_reason", m.accelerator_reason},
      {"kernel", m.kernel},
      {"vms", m.vms},
      {"pool", {{"size", m.pool_size}, {"ready", m.pool_ready}, {"claims", m.pool_claims}, {"misses", m.pool_misses}}},
      {"templates", {{"count", m.templates}, {"bytes", m.template_bytes}}}};
}

static void decode_tier(const json& j, const std::string& name, QemuTierNodeInfo& v) {
  auto m = j.find(name);
  if (m == j.end() || !m->is_object()) return;
  auto field = [&](const char* f) { return name + "." + f; };
  v.offered = member(*m, "offered", false, field("offered"));
  v.unavailable = member(*m, "unavailable", "", field("unavailable"));
  v.ready = member(*m, "ready", false, field("ready"));
  v.accelerator = member(*m, "accelerator", "", field("accelerator"));
  v.accelerator_reason = member(*m, "accelerator_reason", "", field("accelerator_reason"));
  v.kernel = member(*m, "kernel", "", field("kernel"));
  v.vms = member(*m, "vms", 0u, field("vms"));
  if (auto p = m->find("pool"); p != m->end() && p->is_object()) {
    v.pool_size = member(*p, "size", 0u, field("pool.size"));
    v.pool_ready = member(*p, "ready", 0u, field("pool.ready"));
    v.pool_claims = member(*p, "claims", std::uint64_t{0}, field("pool.claims"));
    v.pool_misses = member(*p, "misses", std::uint64_t{0}, field("pool.misses"));
  }
  if (auto t = m->find("templates"); t != m->end() && t->is_object()) {
    v.templates = member(*t, "count", 0u, field("templates.count"));
    v.template_bytes = member(*t, "bytes", std::uint64_t{0}, field("templates.bytes"));
  }
}

json encode(const NodeInfo& n) {
  json layers = json::array();
  for (const auto& l : n.cached_layers)
    layers.push_back(json{{"digest", l.digest},
                          {"size", l.size},
                          {"cached_bytes", l.cached_bytes},
                          {"users", l.users},
                          {"images", l.images}});
  json out{{"id", n.id},
           {"version", n.version},
           {"protocol", n.protocol},
           {"backends", n.backends},
           {"capacity", {{"cores", n.cores}, {"memory", n.memory_bytes}, {"disk", n.disk_bytes}, {"gpus", n.gpus}}},
           {"disk_free", n.disk_free_bytes},
           {"gpus_free", n.gpus_free},
           {"labels", n.labels},
           {"load",
            {{"sandboxes", n.sandboxes},
             {"cpu_requested", n.cpu_requested},
             {"memory_requested", n.memory_requested},
             {"load1", n.load1}}},
           {"overcommit", {{"cpu", n.cpu_overcommit}, {"memory", n.memory_overcommit}}},
           {"cgroup_version", n.cgroup_version},
           {"images", n.images},
           {"layer_mode", n.layer_mode},
           {"userns", n.userns},
           {"network", n.network},
           {"cached_layers", layers},
           {"swap", {{"total", n.swap_bytes}, {"free", n.swap_free_bytes}}}};
  out["load"]["memory_used"] = n.memory_used_bytes;
  const NodePressure& p = n.pressure;
  out["pressure"] = {
      {"psi", p.psi},         {"cpu_some", p.cpu_some}, {"memory_some", p.memory_some}, {"memory_full", p.memory_full},
      {"io_some", p.io_some}, {"io_full", p.io_full}};
  const QosNodeInfo& q = n.qos;
  out["qos"] = {{"core_scheduling", q.core_scheduling},
                {"core_scheduling_reason", q.core_scheduling_reason},
                {"latency_cpus", q.latency_cpus},
                {"cpu_idle", q.cpu_idle},
                {"reclaim", q.reclaim},
                {"reclaim_reason", q.reclaim_reason},
                {"reclaimed_bytes", q.reclaimed_bytes},
                {"ksm", q.ksm},
                {"ksm_sandboxes", q.ksm_sandboxes},
                {"ksm_saved_bytes", q.ksm_saved_bytes}};
  out["warm_pool"] = {{"size", n.warm_pool_size},
                      {"ready", n.warm_pool_ready},
                      {"claims", n.warm_pool_claims},
                      {"misses", n.warm_pool_misses}};
  encode_tier(out, "microvm", n.microvm);
  encode_tier(out, "vm", n.vm);
  return out;
}

NodeInfo decode_node_info(const json& j) {
  expect_object(j, "node info");
  NodeInfo n;
  n.id = member(j, "id", "");
  n.version = member(j, "version", "");
  n.protocol = member(j, "protocol", "v1");
  n.backends = member(j, "backends", std::vector<std::string>{});
  if (auto c = j.find("capacity"); c != j.end() && c->is_object()) {
    n.cores = member(*c, "cores", 0u, "capacity.cores");
    n.memory_bytes = member(*c, "memory", std::uint64_t{0}, "capacity.memory");
    n.disk_bytes = member(*c, "disk", std::uint64_t{0}, "capacity.disk");
    n.gpus = member(*c, "gpus", 0u, "capacity.gpus");
  }
  n.disk_free_bytes = member(j, "disk_free", std::uint64_t{0});
  n.gpus_free = member(j, "gpus_free", 0u);
  if (auto l = j.find("labels"); l != j.end() && l->is_object())
    for (auto& [k, v] : l->items())
      if (v.is_string()) n.labels.emplace(k, v.get<std::string>());
  if (auto l = j.find("load"); l != j.end() && l->is_object()) {
    n.sandboxes = member(*l, "sandboxes", 0u, "load.sandboxes");
    n.cpu_requested = member(*l, "cpu_requested", 0.0, "load.cpu_requested");
    n.memory_requested = member(*l, "memory_requested", std::uint64_t{0}, "load.memory_requested");
    n.load1 = member(*l, "load1", 0.0, "load.load1");
    n.memory_used_bytes = member(*l, "memory_used", std::uint64_t{0}, "load.memory_used");
  }
  if (auto p = j.find("pressure"); p != j.end() && p->is_object()) {
    NodePressure& out = n.pressure;
    out.psi = member(*p, "psi", false, "pressure.psi");
    out.cpu_some = member(*p, "cpu_some", 0.0, "pressure.cpu_some");
    out.memory_some = member(*p, "memory_some", 0.0, "pressure.memory_some");
    out.memory_full = member(*p, "memory_full", 0.0, "pressure.memory_full");
    out.io_some = member(*p, "io_some", 0.0, "pressure.io_some");
    out.io_full = member(*p, "io_full", 0.0, "pressure.io_full");
  }
  if (auto q = j.find("qos"); q != j.end() && q->is_object()) {
    QosNodeInfo& out = n.qos;
    out.core_scheduling = member(*q, "core_scheduling", false, "qos.core_scheduling");
    out.core_scheduling_reason = member(*q, "core_scheduling_reason", "", "qos.core_scheduling_reason");
    out.latency_cpus = member(*q, "latency_cpus", "", "qos.latency_cpus");
    out.cpu_idle = member(*q, "cpu_idle", false, "qos.cpu_idle");
    out.reclaim = member(*q, "reclaim", "", "qos.reclaim");
    out.reclaim_reason = member(*q, "reclaim_reason", "", "qos.reclaim_reason");
    out.reclaimed_bytes = member(*q, "reclaimed_bytes", std::uint64_t{0}, "qos.reclaimed_bytes");
    out.ksm = member(*q, "ksm", false, "qos.ksm");
    out.ksm_sandboxes = member(*q, "ksm_sandboxes", 0u, "qos.ksm_sandboxes");
    out.ksm_saved_bytes = member(*q, "ksm_saved_bytes", std::uint64_t{0}, "qos.ksm_saved_bytes");
  }
  if (auto o = j.find("overcommit"); o != j.end() && o->is_object()) {
    n.cpu_overcommit = member(*o, "cpu", n.cpu_overcommit, "overcommit.cpu");
    n.memory_overcommit = member(*o, "memory", n.memory_overcommit, "overcommit.memory");
  }
  n.cgroup_version = member(j, "cgroup_version", "");
  n.images = member(j, "images", std::vector<std::string>{});
  n.layer_mode = member(j, "layer_mode", "");
  n.userns = member(j, "userns", "");
  n.network = member(j, "network", "");
  if (auto s = j.find("swap"); s != j.end() && s->is_object()) {
    n.swap_bytes = member(*s, "total", std::uint64_t{0}, "swap.total");
    n.swap_free_bytes = member(*s, "free", std::uint64_t{0}, "swap.free");
  }
  if (auto w = j.find("warm_pool"); w != j.end() && w->is_object()) {
    n.warm_pool_size = member(*w, "size", 0u, "warm_pool.size");
    n.warm_pool_ready = member(*w, "ready", 0u, "warm_pool.ready");
    n.warm_pool_claims = member(*w, "claims", std::uint64_t{0}, "warm_pool.claims");
    n.warm_pool_misses = member(*w, "misses", std::uint64_t{0}, "warm_pool.misses");
  }
  decode_tier(j, "microvm", n.microvm);
  decode_tier(j, "vm", n.vm);
  if (auto c = j.find("cached_layers"); c != j.end() && c->is_array()) {
    for (const auto& l : *c) {
      if (!l.is_object()) continue;
      n.cached_layers.push_back(CachedLayer{member(l, "digest", "", "cached_layers.digest"),
                                            member(l, "size", std::uint64_t{0}, "cached_layers.size"),
                                            member(l, "cached_bytes", std::uint64_t{0}, "cached_layers.cached_bytes"),
                                            member(l, "users", 0u, "cached_layers.users"),
                                            member(l, "images", std::vector<std::string>{}, "cached_layers.images")});
    }
  }
  return n;
}

}  // namespace dsec::protocol
