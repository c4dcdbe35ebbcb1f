// SandboxGroup: sandboxes under one lease.
#include "bind_internal.hpp"

namespace dsec::python {

void bind_group(py::module_& m) {
  py::class_<PySandboxGroup>(m, "SandboxGroup")
      .def_property_readonly("id", &PySandboxGroup::id)
      .def_property_readonly("lease", &PySandboxGroup::lease)
      .def_property_readonly("members", &PySandboxGroup::members)
      .def(
          "exec",
          [](PySandboxGroup& self, std::optional<std::vector<std::string>> argv, std::optional<std::string> shell,
             std::map<std::string, std::string> env, std::string cwd, double timeout, std::size_t max_output,
             std::string user) {
            auto req = command_request<dsec::ExecRequest>(std::move(argv), std::move(shell), std::move(env),
                                                          std::move(cwd), std::move(user));
            req.timeout_seconds = timeout;
            req.max_output_bytes = max_output;
            py::gil_scoped_release release;
            return self.get().exec(req);
          },
          py::arg("argv"), py::arg("shell"), py::arg("env"), py::arg("cwd"), py::arg("timeout"), py::arg("max_output"),
          py::arg("user") = "")
      .def(
          "renew", [](PySandboxGroup& self) { self.get().renew(); }, py::call_guard<py::gil_scoped_release>())
      .def(
          "sleep", [](PySandboxGroup& self) { return self.get().sleep(); }, py::call_guard<py::gil_scoped_release>())
      .def(
          "set_network", [](PySandboxGroup& self, const dsec::NetworkPolicy& p) { return self.get().set_network(p); },
          py::arg("policy"), py::call_guard<py::gil_scoped_release>())
      .def(
          "wake", [](PySandboxGroup& self) { return self.get().wake(); }, py::call_guard<py::gil_scoped_release>())
      .def(
          "snapshot", [](PySandboxGroup& self, const std::string& name) { return self.get().snapshot(name); },
          py::arg("name"), py::call_guard<py::gil_scoped_release>())
      .def("destroy", &PySandboxGroup::destroy, py::call_guard<py::gil_scoped_release>())
      .def("release", &PySandboxGroup::release, py::call_guard<py::gil_scoped_release>());
}

}  // namespace dsec::python
