// Sandbox (a non-owning handle) and what its calls answer: ExecResult, SandboxInfo, SleepResult, SnapshotResult.
#include "bind_internal.hpp"

namespace dsec::python {

void bind_exec_result(py::module_& m) {
  py::class_<dsec::ExecResult>(m, "ExecResult", "What a command run in a sandbox did. stdout/stderr are bytes.")
      .def_readonly("exit_code", &dsec::ExecResult::exit_code, "Exit status, or -1 when a signal ended it.")
      .def_readonly("signal", &dsec::ExecResult::signal, "The signal that ended it, 0 if it exited.")
      .def_property_readonly("stdout", [](const dsec::ExecResult& r) { return py::bytes(r.stdout_data); })
      .def_property_readonly("stderr", [](const dsec::ExecResult& r) { return py::bytes(r.stderr_data); })
      .def_readonly("stdout_truncated", &dsec::ExecResult::stdout_truncated)
      .def_readonly("stderr_truncated", &dsec::ExecResult::stderr_truncated)
      .def_readonly("timed_out", &dsec::ExecResult::timed_out,
                    "The timeout passed and the command's processes were killed.")
      .def_readonly("oom_killed", &dsec::ExecResult::oom_killed,
                    "The OOM killer ended it: the sandbox's memory limit was reached (signal is 9).")
      .def_readonly("duration", &dsec::ExecResult::duration_seconds, "Wall-clock seconds.")
      .def_readonly("reason", &dsec::ExecResult::reason,
                    "Why the command did not run, when what it named was not there: 'executable_not_found' (127), "
                    "'not_executable' (126), 'cwd_not_found' (127), 'cwd_not_accessible' (126); '' when it ran.")
      .def_property_readonly(
          "ok", [](const dsec::ExecResult& r) { return r.exit_code == 0 && !r.timed_out; },
          "exit_code == 0 and not timed_out.")
      .def("__repr__", [](const dsec::ExecResult& r) {
        std::string s = "ExecResult(exit_code=" + std::to_string(r.exit_code);
        if (r.signal) s += ", signal=" + std::to_string(r.signal);
        if (r.timed_out) s += ", timed_out=True";
        if (r.oom_killed) s += ", oom_killed=True";
        if (!r.reason.empty()) s += ", reason='" + r.reason + "'";
        s += ", stdout=" + py::repr(py::bytes(r.stdout_data.substr(0, 80))).cast<std::string>();
        if (r.stdout_data.size() > 80) s += "...";
        if (!r.stderr_data.empty()) {
          s += ", stderr=" + py::repr(py::bytes(r.stderr_data.substr(0, 80))).cast<std::string>();
          if (r.stderr_data.size() > 80) s += "...";
        }
        return s + ")";
      });
}

void bind_sandbox_info(py::module_& m) {
  py::class_<dsec::QosGrant>(m, "QosGrant", "What a node gave a sandbox's class of service (docs/qos.md).")
      .def_readonly("granted", &dsec::QosGrant::granted, "Mechanisms in force, e.g. 'cpu.shares 4096'.")
      .def_readonly("missing", &dsec::QosGrant::missing, "What its class asks for that the node cannot give, and why.");

  py::class_<dsec::ColdMemoryInfo>(m, "ColdMemoryInfo", "What the node's cold-memory reclaimer took from a sandbox.")
      .def_readonly("reclaimed_bytes", &dsec::ColdMemoryInfo::reclaimed_bytes)
      .def_readonly("reclaims", &dsec::ColdMemoryInfo::reclaims)
      .def_readonly("last_reclaim_at", &dsec::ColdMemoryInfo::last_reclaim_at, "Unix seconds; 0: never.")
      .def_readonly("refaults", &dsec::ColdMemoryInfo::refaults, "Pages read back in after a reclaim.");

  py::class_<dsec::SandboxInfo>(m, "SandboxInfo", "What the agent knows about a sandbox.")
      .def_readonly("id", &dsec::SandboxInfo::id)
      .def_readonly("node", &dsec::SandboxInfo::node)
      .def_readonly("state", &dsec::SandboxInfo::state, "creating | running | failed | destroyed")
      .def_readonly("image", &dsec::SandboxInfo::image)
      .def_readonly("image_command", &dsec::SandboxInfo::image_command)
      .def_readonly("kind", &dsec::SandboxInfo::kind)
      .def_readonly("tenant", &dsec::SandboxInfo::tenant)
      .def_readonly("labels", &dsec::SandboxInfo::labels)
      .def_readonly("group", &dsec::SandboxInfo::group, "The lease group it belongs to; '' for none.")
      .def_readonly("resources", &dsec::SandboxInfo::resources)
      .def_readonly("created_at", &dsec::SandboxInfo::created_at, "Unix seconds.")
      .def_readonly("expires_at", &dsec::SandboxInfo::expires_at, "Unix seconds; 0 when it has no TTL.")
      .def_readonly("message", &dsec::SandboxInfo::message, "Why it failed, when it did.")
      .def_readonly("qos", &dsec::SandboxInfo::qos, "What its class of service got on its node.")
      .def_readonly("cold_memory", &dsec::SandboxInfo::cold_memory)
      .def("__repr__", [](const dsec::SandboxInfo& i) {
        return "SandboxInfo(id='" + i.id + "', state='" + i.state + "', image='" + i.image + "', kind='" + i.kind +
               "', node='" + i.node + "')";
      });
}

void bind_sandbox_results(py::module_& m) {
  py::class_<dsec::SleepResult>(m, "SleepResult", "What a sleep or a wake did.")
      .def_readonly("info", &dsec::SleepResult::info, "The sandbox after it.")
      .def_readonly("memory_before_bytes", &dsec::SleepResult::memory_before_bytes)
      .def_readonly("memory_after_bytes", &dsec::SleepResult::memory_after_bytes)
      .def_readonly("memory_released_bytes", &dsec::SleepResult::memory_released_bytes)
      .def_readonly("seconds", &dsec::SleepResult::seconds, "How long the agent took.")
      .def_readonly("swap_bytes", &dsec::SleepResult::swap_bytes,
                    "The sandbox's memory in the node's swap after the call.")
      .def("__repr__", [](const dsec::SleepResult& r) {
        return "SleepResult(state='" + r.info.state +
               "', memory_before_bytes=" + std::to_string(r.memory_before_bytes) +
               ", memory_after_bytes=" + std::to_string(r.memory_after_bytes) +
               ", seconds=" + std::to_string(r.seconds) + ")";
      });

  py::class_<dsec::SnapshotResult>(m, "SnapshotResult", "What a snapshot made and what it took.")
      .def_readonly("image", &dsec::SnapshotResult::image, "The new image, pinned: repo:tag@sha256:...")
      .def_readonly("sandbox_id", &dsec::SnapshotResult::sandbox_id)
      .def_readonly("parent", &dsec::SnapshotResult::parent, "The sandbox's image, pinned.")
      .def_readonly("store", &dsec::SnapshotResult::store)
      .def_readonly("layer_digest", &dsec::SnapshotResult::layer_digest)
      .def_readonly("layer_bytes", &dsec::SnapshotResult::layer_bytes)
      .def_readonly("stored_bytes", &dsec::SnapshotResult::stored_bytes)
      .def_readonly("file_bytes", &dsec::SnapshotResult::file_bytes)
      .def_readonly("entries", &dsec::SnapshotResult::entries)
      .def_readonly("frozen_seconds", &dsec::SnapshotResult::frozen_seconds)
      .def_readonly("seconds", &dsec::SnapshotResult::seconds)
      .def_readonly("spec", &dsec::SnapshotResult::spec, "The sandbox's spec.")
      .def("__repr__", [](const dsec::SnapshotResult& r) {
        return "SnapshotResult(image='" + r.image + "', frozen_seconds=" + std::to_string(r.frozen_seconds) +
               ", seconds=" + std::to_string(r.seconds) + ")";
      });
}

namespace {

// exec and the files API.
void def_sandbox_exec_and_files(SandboxClass& sandbox) {
  sandbox
      .def(
          "exec",
          [](PySandbox& self, std::optional<std::vector<std::string>> argv, std::optional<std::string> shell,
             std::map<std::string, std::string> env, std::string cwd, const py::object& stdin_data, double timeout,
             std::size_t max_output, const py::object& on_output, std::string user, std::string request_id) {
            auto req = command_request<dsec::ExecRequest>(std::move(argv), std::move(shell), std::move(env),
                                                          std::move(cwd), std::move(user));
            if (!stdin_data.is_none()) req.stdin_data = bytes_or_str(stdin_data, "stdin");
            req.timeout_seconds = timeout;
            req.max_output_bytes = max_output;
            req.request_id = std::move(request_id);
            if (on_output.is_none()) {
              py::gil_scoped_release release;
              return self.get().exec(req);
            }
            auto callback = output_callback(on_output);  // the GIL is held only while it runs
            py::gil_scoped_release release;
            return self.get().exec_stream(req, callback);
          },
          py::arg("argv") = py::none(), py::arg("shell") = py::none(),
          py::arg("env") = std::map<std::string, std::string>{}, py::arg("cwd") = "", py::arg("stdin") = py::none(),
          py::arg("timeout") = 600.0, py::arg("max_output") = std::size_t{16} << 20, py::arg("on_output") = py::none(),
          py::arg("user") = "", py::arg("request_id") = "")
      .def(
          "write_file",
          [](PySandbox& self, const std::string& path, const py::object& data, unsigned mode) {
            std::string bytes = bytes_or_str(data, "data");
            py::gil_scoped_release release;
            self.get().write_file(path, bytes, mode);
          },
          py::arg("path"), py::arg("data"), py::arg("mode") = 0644)
      .def(
          "read_file",
          [](PySandbox& self, const std::string& path) {
            std::string out;
            {
              py::gil_scoped_release release;
              out = self.get().read_file(path);
            }
            return py::bytes(out);
          },
          py::arg("path"))
      .def(
          "upload_tar",
          [](PySandbox& self, const std::string& dir, const py::object& data) {
            std::string bytes = bytes_or_str(data, "tar_bytes");
            py::gil_scoped_release release;
            self.get().upload_tar(dir, bytes);
          },
          py::arg("dir"), py::arg("tar_bytes"))
      .def(
          "download_tar",
          [](PySandbox& self, const std::string& dir) {
            std::string out;
            {
              py::gil_scoped_release release;
              out = self.get().download_tar(dir);
            }
            return py::bytes(out);
          },
          py::arg("dir"));
}

// What the agent knows of it, its TTL, its network and exposed ports.
void def_sandbox_info_and_network(SandboxClass& sandbox) {
  sandbox
      .def(
          "info", [](PySandbox& self) { return self.get().info(); }, py::call_guard<py::gil_scoped_release>())
      .def(
          "set_ttl",
          [](PySandbox& self, std::int64_t seconds) { return self.get().set_ttl(std::chrono::seconds(seconds)); },
          py::arg("seconds"), py::call_guard<py::gil_scoped_release>(),
          "Destroys the sandbox that many seconds from now (0: never); answers its info.")
      .def(
          "network", [](PySandbox& self) { return self.get().network(); }, py::call_guard<py::gil_scoped_release>(),
          "The network policy in force.")
      .def(
          "set_network", [](PySandbox& self, const dsec::NetworkPolicy& p) { return self.get().set_network(p); },
          py::arg("policy"), py::call_guard<py::gil_scoped_release>(),
          "Puts a network policy in force; answers the policy now in force.")
      .def(
          "expose", [](PySandbox& self, std::uint32_t port) { return self.get().expose(port); }, py::arg("port"),
          py::call_guard<py::gil_scoped_release>(), "Exposes a TCP port at the node; answers 'host:port'.")
      .def(
          "unexpose", [](PySandbox& self, std::uint32_t port) { self.get().unexpose(port); }, py::arg("port"),
          py::call_guard<py::gil_scoped_release>())
      .def(
          "exposed", [](PySandbox& self) { return self.get().exposed(); }, py::call_guard<py::gil_scoped_release>())
      .def(
          "network_usage",
          [](PySandbox& self) {
            dsec::NetworkUsage u;
            {
              py::gil_scoped_release release;
              u = self.get().network_usage();
            }
            py::dict d;
            d["bytes_out"] = u.bytes_out;
            d["packets_out"] = u.packets_out;
            d["bytes_in"] = u.bytes_in;
            d["packets_in"] = u.packets_in;
            d["refused"] = u.refused;
            d["resolved"] = u.resolved;
            return d;
          },
          "What its network carried: bytes and packets each way, refused new connections, resolved names.");
}

// Sleep, wake, snapshots, forks and destroy.
void def_sandbox_lifecycle(SandboxClass& sandbox) {
  sandbox
      .def(
          "sleep", [](PySandbox& self) { return self.get().sleep(); }, py::call_guard<py::gil_scoped_release>(),
          "Freezes the sandbox in place and releases its memory; exec fails until wake().")
      .def(
          "wake", [](PySandbox& self) { return self.get().wake(); }, py::call_guard<py::gil_scoped_release>(),
          "Lets a sleeping sandbox's processes run on.")
      .def(
          "snapshot", [](PySandbox& self, const std::string& name) { return self.get().snapshot(name); },
          py::arg("name"), py::call_guard<py::gil_scoped_release>(),
          "Captures the sandbox's files as a new image named `name`; the result's image is its pinned reference.")
      .def(
          "fork",
          [](PySandbox& self, std::size_t n, const std::string& name, bool keep) {
            std::vector<PySandbox> out;
            auto made = self.get().fork(n, name, keep);
            out.reserve(made.size());
            for (auto& sb : made) {
              out.emplace_back(sb.borrow());  // Python handles never own
              sb.release();
            }
            return out;
          },
          py::arg("n"), py::arg("name") = "", py::arg("keep") = false, py::call_guard<py::gil_scoped_release>(),
          "Snapshots the sandbox and creates n sandboxes from the snapshot with its spec; a generated snapshot goes "
          "with the last of them unless keep.")
      .def("destroy", &PySandbox::destroy, py::call_guard<py::gil_scoped_release>());
}

}  // namespace

void bind_sandbox(py::module_& m) {
  SandboxClass sandbox(m, "Sandbox");
  sandbox.def_property_readonly("id", &PySandbox::id).def_property_readonly("destroyed", &PySandbox::destroyed);
  def_sandbox_exec_and_files(sandbox);
  def_sandbox_info_and_network(sandbox);
  def_sandbox_screen(sandbox);
  def_sandbox_lifecycle(sandbox);
  def_sandbox_processes(sandbox);
}

}  // namespace dsec::python
