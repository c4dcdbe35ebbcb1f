// What a sandbox is made of: its spec, resources and network policy, and sizes as the spec reads them.
#include "bind_internal.hpp"

namespace dsec::python {

namespace {

void bind_resources(py::module_& m) {
  py::class_<dsec::Resources>(m, "Resources")
      .def(py::init<>())
      .def_readwrite("cpu", &dsec::Resources::cpu)
      .def_readwrite("memory_bytes", &dsec::Resources::memory_bytes)
      .def_readwrite("disk_bytes", &dsec::Resources::disk_bytes)
      .def_readwrite("pids", &dsec::Resources::pids)
      .def_readwrite("open_files", &dsec::Resources::open_files)
      .def_readwrite("gpus", &dsec::Resources::gpus)
      .def_readwrite("egress_mbps", &dsec::Resources::egress_mbps, "Megabits a second it may send; 0: unlimited.")
      .def_readwrite("connections", &dsec::Resources::connections,
                     "Connections to the outside it may hold at once; 0: unlimited.")
      .def_property(
          "priority", [](const dsec::Resources& r) { return std::string(dsec::priority_name(r.priority)); },
          [](dsec::Resources& r, const std::string& name) {
            auto p = dsec::parse_priority(name);
            if (!p) throw py::value_error("priority: '" + name + "' is not latency, standard or batch");
            r.priority = *p;
          },
          "Its class of service: 'latency', 'standard' or 'batch' (docs/qos.md).")
      .def_readwrite("ksm", &dsec::Resources::ksm, "Its memory is offered to the kernel's same-page merging.")
      .def_readwrite("reclaim", &dsec::Resources::reclaim,
                     "False keeps the node's cold-memory reclaimer away from it (docs/qos.md).")
      .def("__repr__", [](const dsec::Resources& r) {
        return "Resources(cpu=" + py::repr(py::float_(r.cpu)).cast<std::string>() +
               ", memory_bytes=" + std::to_string(r.memory_bytes) + ", disk_bytes=" + std::to_string(r.disk_bytes) +
               ", pids=" + std::to_string(r.pids) + ", open_files=" + std::to_string(r.open_files) + ")";
      });
}

void bind_network_policy(py::module_& m) {
  py::class_<dsec::NetworkRule>(m, "NetworkRule", "One egress rule: allow or deny a network, protocol and ports.")
      .def(py::init<>())
      .def_readwrite("allow", &dsec::NetworkRule::allow)
      .def_readwrite("cidr", &dsec::NetworkRule::cidr)
      .def_readwrite("host", &dsec::NetworkRule::host,
                     "A host name instead of a cidr: 'pypi.internal', '*.example.org'.")
      .def_readwrite("protocol", &dsec::NetworkRule::protocol, "tcp, udp, icmp or any.")
      .def_readwrite("port_min", &dsec::NetworkRule::port_min, "0 with port_max 0: every port.")
      .def_readwrite("port_max", &dsec::NetworkRule::port_max);
  py::class_<dsec::NetworkPolicy>(m, "NetworkPolicy", "A sandbox's network: mode none, egress (rules) or open.")
      .def(py::init<>())
      .def_readwrite("mode", &dsec::NetworkPolicy::mode)
      .def_readwrite("rules", &dsec::NetworkPolicy::rules);
}

void bind_sandbox_spec(py::module_& m) {
  py::class_<dsec::SandboxSpec>(m, "SandboxSpec")
      .def(py::init<>())
      .def_readwrite("image", &dsec::SandboxSpec::image)
      .def_readwrite("kind", &dsec::SandboxSpec::kind)
      .def_readwrite("resources", &dsec::SandboxSpec::resources)
      .def_property(
          "ttl", [](const dsec::SandboxSpec& s) { return static_cast<double>(s.ttl.count()); },
          [](dsec::SandboxSpec& s, double seconds) {
            if (!(seconds >= 0)) throw dsec::Error(dsec::Code::kInvalidArgument, "ttl: must be >= 0 seconds");
            s.ttl = std::chrono::seconds{static_cast<std::int64_t>(seconds)};
          })
      .def_readwrite("env", &dsec::SandboxSpec::env)
      .def_readwrite("labels", &dsec::SandboxSpec::labels)
      .def_readwrite("tenant", &dsec::SandboxSpec::tenant)
      .def_readwrite("hostname", &dsec::SandboxSpec::hostname)
      .def_readwrite("workdir", &dsec::SandboxSpec::workdir)
      .def_readwrite("allow_ptrace", &dsec::SandboxSpec::allow_ptrace)
      .def_readwrite("user", &dsec::SandboxSpec::user,
                     "Who execs run as by default: a user name of the sandbox's /etc/passwd, \"uid\" or "
                     "\"uid:gid\"; \"\" is root.")
      .def_readwrite("protected_paths", &dsec::SandboxSpec::protected_paths,
                     "Absolute paths made root's own (0:0, mode 0700) at create.")
      .def_readwrite("display", &dsec::SandboxSpec::display,
                     "A full VM's screen: \"WIDTHxHEIGHT\" or \"none\"; \"\" is the kind's default.")
      .def_readwrite("request_id", &dsec::SandboxSpec::request_id)
      .def_readwrite("node_selector", &dsec::SandboxSpec::node_selector)
      .def_readwrite("anti_affinity", &dsec::SandboxSpec::anti_affinity)
      .def_readwrite("network", &dsec::SandboxSpec::network, "Its network policy (docs/networking.md).")
      .def_property(
          "queue_timeout",
          [](const dsec::SandboxSpec& s) { return static_cast<double>(s.queue_timeout.count()) / 1000; },
          [](dsec::SandboxSpec& s, double seconds) {
            if (!(seconds >= 0 && seconds <= 3600))
              throw dsec::Error(dsec::Code::kInvalidArgument, "queue_timeout: must be from 0 to 3600 seconds");
            s.queue_timeout = std::chrono::milliseconds{static_cast<std::int64_t>(seconds * 1000)};
          },
          "Seconds a create may wait on a full node for room, in order (0: refused at once).");
}

}  // namespace

void bind_spec(py::module_& m) {
  m.def(
      "parse_size",
      [](const std::string& text) {
        auto v = dsec::parse_size(text);
        if (!v)
          throw dsec::Error(dsec::Code::kInvalidArgument,
                            "'" + text + "' is not a size (examples: 4096, \"512Mi\", \"2G\", \"1.5GiB\")");
        return *v;
      },
      py::arg("text"), "Bytes in a size such as '512Mi', '2G' or '4096'.");
  bind_resources(m);
  bind_network_policy(m);
  bind_sandbox_spec(m);
}

}  // namespace dsec::python
