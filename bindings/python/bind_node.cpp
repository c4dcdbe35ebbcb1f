// What a node agent reports of itself: NodeInfo and its parts.
#include "bind_internal.hpp"

namespace dsec::python {

namespace {

// The parts of NodeInfo: a QEMU tier, pressure, classes of service.
void bind_node_parts(py::module_& m) {
  py::class_<dsec::QemuTierNodeInfo>(m, "MicroVmNodeInfo",
                                     "A QEMU tier of the node (microvm, vm): offered or why not, on what.")
      .def_readonly("offered", &dsec::MicroVmNodeInfo::offered)
      .def_readonly("unavailable", &dsec::MicroVmNodeInfo::unavailable)
      .def_readonly("ready", &dsec::MicroVmNodeInfo::ready)
      .def_readonly("accelerator", &dsec::MicroVmNodeInfo::accelerator, "'kvm' or 'tcg'.")
      .def_readonly("accelerator_reason", &dsec::MicroVmNodeInfo::accelerator_reason)
      .def_readonly("kernel", &dsec::MicroVmNodeInfo::kernel)
      .def_readonly("vms", &dsec::MicroVmNodeInfo::vms)
      .def_readonly("pool_size", &dsec::MicroVmNodeInfo::pool_size, "VMs kept ready per shape in use (0: no pools).")
      .def_readonly("pool_ready", &dsec::MicroVmNodeInfo::pool_ready, "Pooled VMs waiting now.")
      .def_readonly("pool_claims", &dsec::MicroVmNodeInfo::pool_claims, "Creates served from a pool.")
      .def_readonly("pool_misses", &dsec::MicroVmNodeInfo::pool_misses,
                    "Creates of a pooled shape that found its pool empty.")
      .def_readonly("templates", &dsec::MicroVmNodeInfo::templates, "Templates (frozen guests) kept now.")
      .def_readonly("template_bytes", &dsec::MicroVmNodeInfo::template_bytes, "Guest RAM the templates hold.")
      .def("__repr__", [](const dsec::MicroVmNodeInfo& v) {
        return "MicroVmNodeInfo(offered=" + std::string(v.offered ? "True" : "False") + ", accelerator='" +
               v.accelerator + "', vms=" + std::to_string(v.vms) + ")";
      });

  py::class_<dsec::NodePressure>(m, "NodePressure", "The node's pressure stall information, % of the last 10 s.")
      .def_readonly("psi", &dsec::NodePressure::psi, "False: the kernel has no PSI.")
      .def_readonly("cpu_some", &dsec::NodePressure::cpu_some)
      .def_readonly("memory_some", &dsec::NodePressure::memory_some)
      .def_readonly("memory_full", &dsec::NodePressure::memory_full)
      .def_readonly("io_some", &dsec::NodePressure::io_some)
      .def_readonly("io_full", &dsec::NodePressure::io_full);

  py::class_<dsec::QosNodeInfo>(m, "QosNodeInfo", "What the node's kernel gives classes of service (docs/qos.md).")
      .def_readonly("core_scheduling", &dsec::QosNodeInfo::core_scheduling)
      .def_readonly("core_scheduling_reason", &dsec::QosNodeInfo::core_scheduling_reason)
      .def_readonly("latency_cpus", &dsec::QosNodeInfo::latency_cpus, "CPUs reserved for latency sandboxes ('': none).")
      .def_readonly("cpu_idle", &dsec::QosNodeInfo::cpu_idle)
      .def_readonly("reclaim", &dsec::QosNodeInfo::reclaim, "The cold-memory reclaimer: 'idle' or 'off'.")
      .def_readonly("reclaim_reason", &dsec::QosNodeInfo::reclaim_reason)
      .def_readonly("reclaimed_bytes", &dsec::QosNodeInfo::reclaimed_bytes)
      .def_readonly("ksm", &dsec::QosNodeInfo::ksm)
      .def_readonly("ksm_sandboxes", &dsec::QosNodeInfo::ksm_sandboxes)
      .def_readonly("ksm_saved_bytes", &dsec::QosNodeInfo::ksm_saved_bytes);
}

}  // namespace

void bind_node(py::module_& m) {
  bind_node_parts(m);
  py::class_<dsec::NodeInfo>(m, "NodeInfo", "A node agent: its capacity, load and images.")
      .def_readonly("id", &dsec::NodeInfo::id)
      .def_readonly("version", &dsec::NodeInfo::version)
      .def_readonly("protocol", &dsec::NodeInfo::protocol)
      .def_readonly("backends", &dsec::NodeInfo::backends)
      .def_readonly("cores", &dsec::NodeInfo::cores)
      .def_readonly("memory_bytes", &dsec::NodeInfo::memory_bytes)
      .def_readonly("disk_bytes", &dsec::NodeInfo::disk_bytes)
      .def_readonly("disk_free_bytes", &dsec::NodeInfo::disk_free_bytes)
      .def_readonly("gpus", &dsec::NodeInfo::gpus)
      .def_readonly("gpus_free", &dsec::NodeInfo::gpus_free)
      .def_readonly("labels", &dsec::NodeInfo::labels, "The node's labels (dsecd --label), for node_selector.")
      .def_readonly("sandboxes", &dsec::NodeInfo::sandboxes)
      .def_readonly("cpu_requested", &dsec::NodeInfo::cpu_requested)
      .def_readonly("memory_requested", &dsec::NodeInfo::memory_requested)
      .def_readonly("cpu_overcommit", &dsec::NodeInfo::cpu_overcommit)
      .def_readonly("memory_overcommit", &dsec::NodeInfo::memory_overcommit)
      .def_readonly("cgroup_version", &dsec::NodeInfo::cgroup_version)
      .def_readonly("images", &dsec::NodeInfo::images)
      .def_readonly("layer_mode", &dsec::NodeInfo::layer_mode)
      .def_readonly("userns", &dsec::NodeInfo::userns)
      .def_readonly("network", &dsec::NodeInfo::network)
      .def_readonly("cached_layers", &dsec::NodeInfo::cached_layers)
      .def_readonly("load1", &dsec::NodeInfo::load1)
      .def_readonly("swap_bytes", &dsec::NodeInfo::swap_bytes, "The node's swap (0: none).")
      .def_readonly("swap_free_bytes", &dsec::NodeInfo::swap_free_bytes)
      .def_readonly("microvm", &dsec::NodeInfo::microvm, "The microVM backend (offered, accelerator, ...).")
      .def_readonly("vm", &dsec::NodeInfo::vm, "The full VM backend (offered, accelerator, ...).")
      .def_readonly("memory_used_bytes", &dsec::NodeInfo::memory_used_bytes, "Host memory in use now.")
      .def_readonly("pressure", &dsec::NodeInfo::pressure)
      .def_readonly("qos", &dsec::NodeInfo::qos)
      .def_readonly("warm_pool_size", &dsec::NodeInfo::warm_pool_size,
                    "Container sandboxes its warm pools keep started ahead of creates (dsecd --warm-pool).")
      .def_readonly("warm_pool_ready", &dsec::NodeInfo::warm_pool_ready)
      .def_readonly("warm_pool_claims", &dsec::NodeInfo::warm_pool_claims, "Creates a warm pool served.")
      .def_readonly("warm_pool_misses", &dsec::NodeInfo::warm_pool_misses,
                    "Creates of a pooled shape that found its pool empty.")
      .def("__repr__", [](const dsec::NodeInfo& n) {
        std::string backends;
        for (const auto& b : n.backends) backends += (backends.empty() ? "" : ",") + b;
        return "NodeInfo(id='" + n.id + "', backends='" + backends + "', cores=" + std::to_string(n.cores) +
               ", sandboxes=" + std::to_string(n.sandboxes) + ")";
      });
}

}  // namespace dsec::python
