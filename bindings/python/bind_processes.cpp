// Spawned processes and shell sessions: their handles and what the agent reports of them.
#include "bind_internal.hpp"

namespace dsec::python {

namespace {

// What the agent reports of processes and sessions.
void bind_process_infos(py::module_& m) {
  py::class_<dsec::ProcessInfo>(m, "ProcessInfo", "What the agent knows about a spawned process.")
      .def_readonly("pid", &dsec::ProcessInfo::pid, "Its pid inside the sandbox; its id in every call.")
      .def_readonly("argv", &dsec::ProcessInfo::argv)
      .def_readonly("tag", &dsec::ProcessInfo::tag, "The caller's label ('' for none).")
      .def_readonly("pty", &dsec::ProcessInfo::pty, "It runs on a terminal.")
      .def_readonly("running", &dsec::ProcessInfo::running)
      .def_readonly("exit_code", &dsec::ProcessInfo::exit_code,
                    "Once ended: its exit status, or -1 when a signal ended it; -1 while it runs.")
      .def_readonly("signal", &dsec::ProcessInfo::signal, "The signal that ended it, 0 if it exited.")
      .def_readonly("reason", &dsec::ProcessInfo::reason,
                    "Why it did not run, as ExecResult.reason ('executable_not_found', ...); '' when it ran.")
      .def_readonly("started_at", &dsec::ProcessInfo::started_at, "Unix seconds.")
      .def_readonly("ended_at", &dsec::ProcessInfo::ended_at, "Unix seconds; 0 while it runs.")
      .def_readonly("stdout_bytes", &dsec::ProcessInfo::stdout_bytes, "Everything it wrote to stdout so far.")
      .def_readonly("stderr_bytes", &dsec::ProcessInfo::stderr_bytes, "Everything it wrote to stderr so far.")
      .def_readonly("stdin_open", &dsec::ProcessInfo::stdin_open, "Its stdin takes writes.")
      .def("__repr__", [](const dsec::ProcessInfo& p) {
        std::string s =
            "ProcessInfo(pid=" + std::to_string(p.pid) + ", argv=" + py::repr(py::cast(p.argv)).cast<std::string>();
        if (!p.tag.empty()) s += ", tag=" + py::repr(py::str(p.tag)).cast<std::string>();
        if (p.running) return s + ", running=True)";
        s += ", exit_code=" + std::to_string(p.exit_code);
        if (p.signal) s += ", signal=" + std::to_string(p.signal);
        if (!p.reason.empty()) s += ", reason='" + p.reason + "'";
        return s + ")";
      });

  py::class_<dsec::ProcessOutput>(m, "ProcessOutput",
                                  "One read of a process's output: bytes of each stream from its offset.")
      .def_property_readonly("stdout", [](const dsec::ProcessOutput& o) { return py::bytes(o.stdout_data); })
      .def_property_readonly("stderr", [](const dsec::ProcessOutput& o) { return py::bytes(o.stderr_data); })
      .def_readonly("stdout_offset", &dsec::ProcessOutput::stdout_offset,
                    "Where stdout's bytes start: the offset asked for, or later when the bytes between were no "
                    "longer kept.")
      .def_readonly("stderr_offset", &dsec::ProcessOutput::stderr_offset)
      .def_readonly("stdout_end", &dsec::ProcessOutput::stdout_end, "The offset after everything written so far.")
      .def_readonly("stderr_end", &dsec::ProcessOutput::stderr_end)
      .def_readonly("running", &dsec::ProcessOutput::running)
      .def_readonly("exit_code", &dsec::ProcessOutput::exit_code)
      .def_readonly("signal", &dsec::ProcessOutput::signal)
      .def("__repr__", [](const dsec::ProcessOutput& o) {
        return "ProcessOutput(stdout=" + repr_bytes(o.stdout_data) + ", stderr=" + repr_bytes(o.stderr_data) +
               ", running=" + (o.running ? "True" : "False") + ")";
      });

  py::class_<dsec::SessionInfo>(m, "SessionInfo", "What the agent knows about a shell session.")
      .def_readonly("name", &dsec::SessionInfo::name)
      .def_readonly("shell", &dsec::SessionInfo::shell)
      .def_readonly("pid", &dsec::SessionInfo::pid, "The shell's pid inside the sandbox.")
      .def_readonly("alive", &dsec::SessionInfo::alive, "False once the shell ended, until restart().")
      .def_readonly("busy", &dsec::SessionInfo::busy, "A run is in progress.")
      .def_readonly("exit_code", &dsec::SessionInfo::exit_code,
                    "Once the shell ended: its exit status, or -1 when a signal ended it.")
      .def_readonly("signal", &dsec::SessionInfo::signal, "The signal that ended the shell, 0 otherwise.")
      .def("__repr__", [](const dsec::SessionInfo& i) {
        return "SessionInfo(name='" + i.name + "', shell='" + i.shell + "', pid=" + std::to_string(i.pid) +
               ", alive=" + (i.alive ? "True" : "False") + ", busy=" + (i.busy ? "True" : "False") +
               (i.alive ? "" : ", exit_code=" + std::to_string(i.exit_code) + ", signal=" + std::to_string(i.signal)) +
               ")";
      });
}

void bind_process_handles(py::module_& m) {
  // Handles: they own nothing and never change, so any thread may use them; every call releases the GIL.
  py::class_<dsec::Process>(m, "Process")
      .def_property_readonly("pid", &dsec::Process::pid)
      .def_property_readonly("sandbox_id", &dsec::Process::sandbox_id)
      .def("info", &dsec::Process::info, Release())
      .def("wait", &dsec::Process::wait, py::arg("timeout"), Release())
      .def(
          "read",
          [](const dsec::Process& self, std::optional<std::uint64_t> stdout_offset,
             std::optional<std::uint64_t> stderr_offset, double wait,
             std::size_t max_bytes) { return self.read(stdout_offset, stderr_offset, wait, max_bytes); },
          py::arg("stdout_offset") = py::none(), py::arg("stderr_offset") = py::none(), py::arg("wait") = 0.0,
          py::arg("max_bytes") = std::size_t{1} << 20, Release())
      .def(
          "write_stdin",
          [](const dsec::Process& self, const py::object& data) {
            std::string bytes = bytes_or_str(data, "data");
            py::gil_scoped_release release;
            self.write_stdin(bytes);
          },
          py::arg("data"))
      .def("close_stdin", &dsec::Process::close_stdin, Release())
      .def("signal", &dsec::Process::signal, py::arg("sig"), py::arg("group") = false, Release())
      .def("resize", &dsec::Process::resize, py::arg("rows"), py::arg("cols"), Release())
      .def("kill", &dsec::Process::kill, Release());

  py::class_<dsec::Session>(m, "Session")
      .def_property_readonly("name", &dsec::Session::name)
      .def_property_readonly("sandbox_id", &dsec::Session::sandbox_id)
      .def(
          "run",
          [](const dsec::Session& self, const std::string& command, double timeout, std::size_t max_output,
             const py::object& on_output) {
            if (on_output.is_none()) {
              py::gil_scoped_release release;
              return self.run(command, timeout, max_output);
            }
            auto callback = output_callback(on_output);  // the GIL is held only while it runs
            py::gil_scoped_release release;
            return self.run_stream(command, callback, timeout, max_output);
          },
          py::arg("command"), py::arg("timeout") = 600.0, py::arg("max_output") = std::size_t{16} << 20,
          py::arg("on_output") = py::none())
      .def("info", &dsec::Session::info, Release())
      .def("restart", &dsec::Session::restart, Release())
      .def("close", &dsec::Session::close, Release());
}

}  // namespace

void bind_processes(py::module_& m) {
  bind_process_infos(m);
  bind_process_handles(m);
}

// A Sandbox's processes and shell sessions: spawn, look up, list.
void def_sandbox_processes(SandboxClass& sandbox) {
  sandbox
      .def(
          "spawn",
          [](PySandbox& self, std::optional<std::vector<std::string>> argv, std::optional<std::string> shell,
             std::map<std::string, std::string> env, std::string cwd, std::string user, bool pty, unsigned rows,
             unsigned cols, std::string tag, std::string request_id) {
            auto req = command_request<dsec::ProcessRequest>(std::move(argv), std::move(shell), std::move(env),
                                                             std::move(cwd), std::move(user));
            req.pty = pty;
            req.rows = rows;
            req.cols = cols;
            req.tag = std::move(tag);
            req.request_id = std::move(request_id);
            py::gil_scoped_release release;
            return self.get().spawn(req);
          },
          py::arg("argv") = py::none(), py::arg("shell") = py::none(),
          py::arg("env") = std::map<std::string, std::string>{}, py::arg("cwd") = "", py::arg("user") = "",
          py::arg("pty") = false, py::arg("rows") = 24u, py::arg("cols") = 80u, py::arg("tag") = "",
          py::arg("request_id") = "")
      .def(
          "process", [](PySandbox& self, int pid) { return self.get().process(pid); }, py::arg("pid"))
      .def(
          "processes", [](PySandbox& self) { return self.get().processes(); }, Release())
      .def(
          "shell",
          [](PySandbox& self, std::string name, std::string shell, std::map<std::string, std::string> env,
             std::string cwd, std::string user) {
            dsec::SessionOptions o;
            o.name = std::move(name);
            o.shell = std::move(shell);
            o.env = std::move(env);
            o.cwd = std::move(cwd);
            o.user = std::move(user);
            py::gil_scoped_release release;
            return self.get().shell(o);
          },
          py::arg("name") = "", py::arg("shell") = "", py::arg("env") = std::map<std::string, std::string>{},
          py::arg("cwd") = "", py::arg("user") = "")
      .def(
          "session", [](PySandbox& self, std::string name) { return self.get().session(std::move(name)); },
          py::arg("name"))
      .def(
          "sessions", [](PySandbox& self) { return self.get().sessions(); }, Release());
}

}  // namespace dsec::python
