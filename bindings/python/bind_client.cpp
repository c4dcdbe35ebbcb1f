// Client: endpoints or an embedded agent; creates, lists, function calls and images.
#include "bind_internal.hpp"

#include "_dsec_aio.hpp"

std::shared_ptr<dsec::Client> client_of(py::handle py_client) {
  return py_client.cast<dsec::python::PyClient&>().get();
}

namespace dsec::python {

namespace {

// Client(endpoints=..., home=..., ...): ClientOptions from keywords, each checked.
void def_client_init(py::class_<PyClient>& client) {
  client.def(
      py::init([](std::vector<std::string> endpoints, std::string agent_binary,
                  std::vector<std::string> agent_candidates, std::string home, std::vector<std::string> agent_args,
                  double call_deadline, std::size_t create_concurrency, int max_attempts, double initial_backoff,
                  double max_backoff, double agent_start_timeout, double agent_stop_grace,
                  std::vector<std::string> stores, double image_cache_ttl, double request_timeout,
                  std::vector<std::string> etcd, std::string etcd_prefix, std::string placement, std::string token,
                  std::string tls_ca_file, std::string tls_client_cert, std::string tls_client_key,
                  std::string etcd_tls_ca_file, std::string etcd_tls_client_cert, std::string etcd_tls_client_key,
                  std::map<std::string, std::pair<std::string, std::string>> registry_auth,
                  std::map<std::string, std::string> registry_mirrors, std::vector<std::string> insecure_registries,
                  std::string registry_ca_file, std::string default_registry) {
        dsec::ClientOptions o;
        o.registry.auth = std::move(registry_auth);
        o.registry.mirrors = std::move(registry_mirrors);
        o.registry.insecure = std::move(insecure_registries);
        o.registry.ca_file = std::move(registry_ca_file);
        o.registry.default_registry = std::move(default_registry);
        o.etcd_tls_ca_file = std::move(etcd_tls_ca_file);
        o.etcd_tls_client_cert = std::move(etcd_tls_client_cert);
        o.etcd_tls_client_key = std::move(etcd_tls_client_key);
        o.token = std::move(token);
        o.tls_ca_file = std::move(tls_ca_file);
        o.tls_client_cert = std::move(tls_client_cert);
        o.tls_client_key = std::move(tls_client_key);
        o.endpoints = std::move(endpoints);
        o.stores = std::move(stores);
        o.image_cache_ttl = to_ms(image_cache_ttl, "image_cache_ttl");
        o.request_timeout = to_ms(request_timeout, "request_timeout");
        o.etcd_endpoints = std::move(etcd);
        o.etcd_prefix = std::move(etcd_prefix);
        o.agent_binary = std::move(agent_binary);
        o.agent_candidates = std::move(agent_candidates);
        o.home = std::move(home);
        o.agent_args = std::move(agent_args);
        o.call_deadline = to_ms(call_deadline, "call_deadline");
        if (create_concurrency == 0)
          throw dsec::Error(dsec::Code::kInvalidArgument, "create_concurrency: must be at least 1");
        o.create_concurrency = create_concurrency;
        if (max_attempts < 1) throw dsec::Error(dsec::Code::kInvalidArgument, "max_attempts: must be at least 1");
        o.retry.max_attempts = max_attempts;
        o.retry.initial_backoff = to_ms(initial_backoff, "initial_backoff");
        o.retry.max_backoff = to_ms(max_backoff, "max_backoff");
        o.agent_start_timeout = to_ms(agent_start_timeout, "agent_start_timeout");
        o.agent_stop_grace = to_ms(agent_stop_grace, "agent_stop_grace");
        dsec::make_placement_policy(placement);  // an unknown name is INVALID_ARGUMENT before anything starts
        o.placement = std::move(placement);
        return std::make_unique<PyClient>(std::move(o));
      }),
      py::arg("endpoints") = std::vector<std::string>{}, py::arg("agent_binary") = "",
      py::arg("agent_candidates") = std::vector<std::string>{}, py::arg("home") = "",
      py::arg("agent_args") = std::vector<std::string>{}, py::arg("call_deadline") = 60.0,
      py::arg("create_concurrency") = 32, py::arg("max_attempts") = 6, py::arg("initial_backoff") = 0.02,
      py::arg("max_backoff") = 2.0, py::arg("agent_start_timeout") = 30.0, py::arg("agent_stop_grace") = 10.0,
      py::arg("stores") = std::vector<std::string>{}, py::arg("image_cache_ttl") = 10.0,
      py::arg("request_timeout") = 15.0, py::arg("etcd") = std::vector<std::string>{},
      py::arg("etcd_prefix") = "/dsec/", py::arg("placement") = "spread", py::arg("token") = "",
      py::arg("tls_ca_file") = "", py::arg("tls_client_cert") = "", py::arg("tls_client_key") = "",
      py::arg("etcd_tls_ca_file") = "", py::arg("etcd_tls_client_cert") = "", py::arg("etcd_tls_client_key") = "",
      py::arg("registry_auth") = std::map<std::string, std::pair<std::string, std::string>>{},
      py::arg("registry_mirrors") = std::map<std::string, std::string>{},
      py::arg("insecure_registries") = std::vector<std::string>{}, py::arg("registry_ca_file") = "",
      py::arg("default_registry") = "");
}

}  // namespace

void bind_client(py::module_& m) {
  py::class_<PyClient> client(m, "Client");
  def_client_init(client);
  client
      .def(
          "create",
          [](PyClient& self, const dsec::SandboxSpec& spec) {
            auto c = self.get();
            return detach(*c, c->create(spec));
          },
          py::arg("spec"), py::call_guard<py::gil_scoped_release>())
      .def(
          "create_many",
          [](PyClient& self, std::size_t n, const dsec::SandboxSpec& spec) {
            auto c = self.get();
            return detach_all(*c, c->create_many(n, spec));
          },
          py::arg("n"), py::arg("spec"), py::call_guard<py::gil_scoped_release>())
      .def(
          "create_many",
          [](PyClient& self, const std::vector<dsec::SandboxSpec>& specs) {
            auto c = self.get();
            return detach_all(*c, c->create_many(specs));
          },
          py::arg("specs"), py::call_guard<py::gil_scoped_release>())
      .def(
          "create_group",
          [](PyClient& self, std::size_t n, const dsec::SandboxSpec& spec, double lease) {
            auto c = self.get();
            auto group = c->create_group(n, spec, lease_seconds(lease));
            return std::make_unique<PySandboxGroup>(*c, std::move(group));
          },
          py::arg("n"), py::arg("spec"), py::arg("lease"), py::call_guard<py::gil_scoped_release>())
      .def(
          "create_group",
          [](PyClient& self, const std::vector<dsec::SandboxSpec>& specs, double lease) {
            auto c = self.get();
            auto group = c->create_group(specs, lease_seconds(lease));
            return std::make_unique<PySandboxGroup>(*c, std::move(group));
          },
          py::arg("specs"), py::arg("lease"), py::call_guard<py::gil_scoped_release>())
      .def(
          "run_code", [](PyClient& self, const dsec::FnCallRequest& request) { return self.get()->run_code(request); },
          py::arg("request"), py::call_guard<py::gil_scoped_release>())
      .def(
          "run_code_many",
          [](PyClient& self, const std::vector<dsec::FnCallRequest>& requests) {
            return self.get()->run_code_many(requests);
          },
          py::arg("requests"), py::call_guard<py::gil_scoped_release>())
      .def(
          "attach", [](PyClient& self, const std::string& id) { return PySandbox(self.get()->attach(id)); },
          py::arg("id"))
      .def(
          "list",
          [](PyClient& self, const dsec::Labels& labels, const std::string& tenant) {
            return self.get()->list(labels, tenant);
          },
          py::arg("labels") = dsec::Labels{}, py::arg("tenant") = "", py::call_guard<py::gil_scoped_release>())
      .def(
          "nodes", [](PyClient& self) { return self.get()->nodes(); }, py::call_guard<py::gil_scoped_release>())
      .def(
          "images", [](PyClient& self) { return self.get()->images(); }, py::call_guard<py::gil_scoped_release>())
      .def(
          "remove_image", [](PyClient& self, const std::string& name) { self.get()->remove_image(name); },
          py::arg("name"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("endpoint", [](PyClient& self) { return self.get()->endpoint(); })
      .def("close", &PyClient::close)
      .def_property_readonly("closed", &PyClient::closed);
}

}  // namespace dsec::python
