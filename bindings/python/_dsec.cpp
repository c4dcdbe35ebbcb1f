// dsec._dsec: the C++ client under `import dsec`. The pure-Python package (dsec/__init__.py) wraps these classes
// into the user-facing API; dsec::Error becomes the exception class of its code from dsec/errors.py.
//
// Every call that may block (network, the embedded agent) releases the GIL, so a trainer's Python threads drive
// many sandboxes at once.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "dsec/dsec.hpp"

#include "_dsec_aio.hpp"

namespace py = pybind11;

namespace {

using std::chrono::milliseconds;

milliseconds to_ms(double seconds, const char* what) {
  if (!(seconds > 0) || seconds > 365.0 * 86400)
    throw dsec::Error(dsec::Code::kInvalidArgument, std::string(what) + ": must be a positive number of seconds");
  return milliseconds{static_cast<std::int64_t>(seconds * 1000.0 + 0.5)};
}

// Raises the dsec.errors class for e's code, carrying .code and .retryable.
void raise_dsec_error(const dsec::Error& e) {
  try {
    py::object exc = dsec_exception(e);
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  } catch (py::error_already_set& inner) {
    // dsec.errors itself failed to import: still raise something that says what went wrong.
    PyErr_SetString(PyExc_RuntimeError, (std::string(e.code_name()) + ": " + e.what()).c_str());
  }
}

// A Client that Python can close explicitly; calls after close() raise FailedPrecondition. A call in flight keeps
// the client alive (it holds a reference) while close() runs in another thread.
class PyClient {
 public:
  explicit PyClient(dsec::ClientOptions options) {
    py::gil_scoped_release release;  // starting the embedded agent takes a while
    client_ = std::make_shared<dsec::Client>(std::move(options));
  }

  // Dropped without close(): stopping the embedded agent may take a while, so other Python threads run meanwhile.
  ~PyClient() {
    std::shared_ptr<dsec::Client> c = std::move(client_);
    if (c && PyGILState_Check()) {
      py::gil_scoped_release release;
      c.reset();
    }
  }

  std::shared_ptr<dsec::Client> get() {
    std::lock_guard lock(mu_);
    if (!client_) throw dsec::Error(dsec::Code::kFailedPrecondition, "this dsec client is closed");
    return client_;
  }

  void close() {
    std::shared_ptr<dsec::Client> c;
    {
      std::lock_guard lock(mu_);
      c = std::move(client_);
    }
    if (c) {
      py::gil_scoped_release release;
      c->close();  // stops the embedded agent; calls still in flight fail
    }
  }
  bool closed() {
    std::lock_guard lock(mu_);
    return client_ == nullptr;
  }

 private:
  std::mutex mu_;
  std::shared_ptr<dsec::Client> client_;
};

// Python sandboxes never own: they are destroyed by destroy() or a with-block, not by the garbage collector. The
// handle itself never changes, so any number of Python threads may use it at once.
class PySandbox {
 public:
  explicit PySandbox(dsec::Sandbox sb) : id_(sb.id()), sb_(std::move(sb)) {}
  PySandbox(PySandbox&& o) noexcept : id_(std::move(o.id_)), sb_(std::move(o.sb_)), destroyed_(o.destroyed_.load()) {}

  const std::string& id() const { return id_; }
  const dsec::Sandbox& get() const {
    if (destroyed_.load())
      throw dsec::Error(dsec::Code::kFailedPrecondition, "sandbox " + id_ + " was destroyed through this handle");
    return sb_;
  }
  void destroy() {
    if (destroyed_.load()) return;
    sb_.borrow().destroy();
    destroyed_.store(true);
  }
  bool destroyed() const { return destroyed_.load(); }

 private:
  std::string id_;
  dsec::Sandbox sb_;  // non-owning
  std::atomic<bool> destroyed_{false};
};

// A group: the C++ SandboxGroup (which renews the lease) plus non-owning handles on its members for Python.
class PySandboxGroup {
 public:
  PySandboxGroup(dsec::Client& client, dsec::SandboxGroup group) : group_(std::move(group)) {
    for (auto& m : group_) members_.push_back(std::make_shared<PySandbox>(client.attach(m.id())));
  }
  const std::string& id() const { return group_.id(); }
  double lease() const { return static_cast<double>(group_.lease().count()); }
  const std::vector<std::shared_ptr<PySandbox>>& members() const { return members_; }
  dsec::SandboxGroup& get() { return group_; }
  void destroy() {
    group_.destroy();
    members_.clear();
  }
  std::vector<std::string> release() {
    members_.clear();
    return group_.release();
  }

 private:
  dsec::SandboxGroup group_;
  std::vector<std::shared_ptr<PySandbox>> members_;
};

PySandbox detach(dsec::Client& client, dsec::Sandbox owned) {
  std::string id = owned.release();
  return PySandbox(client.attach(id));
}

std::vector<PySandbox> detach_all(dsec::Client& client, std::vector<dsec::Sandbox> owned) {
  std::vector<PySandbox> out;
  out.reserve(owned.size());
  for (auto& sb : owned) out.push_back(detach(client, std::move(sb)));
  return out;
}

// A group's lease from Python seconds: 1 to 86400, rounded to whole seconds.
std::chrono::seconds lease_seconds(double lease) {
  if (!(lease >= 1) || lease > 86400)
    throw dsec::Error(dsec::Code::kInvalidArgument, "lease: must be 1 to 86400 seconds");
  return std::chrono::seconds(static_cast<std::int64_t>(lease + 0.5));
}

std::string bytes_or_str(const py::handle& h, const char* what) {
  if (py::isinstance<py::bytes>(h)) return h.cast<std::string>();
  if (py::isinstance<py::bytearray>(h) || py::isinstance<py::memoryview>(h))
    return py::bytes(py::reinterpret_borrow<py::object>(h)).cast<std::string>();
  if (py::isinstance<py::str>(h)) return h.cast<std::string>();  // UTF-8
  throw dsec::Error(dsec::Code::kInvalidArgument, std::string(what) + ": expected bytes or str");
}

// The dsec.errors exception a run_code_many result's error stands for (None when the call ran).
py::object fncall_exception(const dsec::FnCallResult& r) {
  if (r.error_code.empty() && r.error.empty()) return py::none();
  std::string code = r.error_code.empty() ? "UNKNOWN" : r.error_code;
  py::object errors = py::module_::import("dsec.errors");
  return errors.attr("_make")(code, r.error, dsec::is_retryable(dsec::code_from_name(code)), false);
}

// An on_output(stream, data) callable as the C++ output callback of a streamed command: called with the GIL held,
// stream "stdout" or "stderr", data bytes. What it raises (py::error_already_set) aborts the call and reaches
// Python unchanged. `on_output` must outlive the callback.
std::function<void(int, std::string_view)> output_callback(const py::object& on_output) {
  if (!PyCallable_Check(on_output.ptr()))
    throw dsec::Error(dsec::Code::kInvalidArgument, "on_output: must be a callable(stream, data)");
  return [&on_output](int fd, std::string_view data) {
    py::gil_scoped_acquire acquire;
    on_output(fd == 2 ? "stderr" : "stdout", py::bytes(data.data(), data.size()));
  };
}

// A command as Python passes it (argv or shell, env, cwd, user) as an ExecRequest or a ProcessRequest.
template <typename Request>
Request command_request(std::optional<std::vector<std::string>> argv, std::optional<std::string> shell,
                        std::map<std::string, std::string> env, std::string cwd, std::string user) {
  Request req;
  if (argv) req.argv = std::move(*argv);
  if (shell) req.shell = std::move(*shell);
  req.env = std::move(env);
  req.cwd = std::move(cwd);
  req.user = std::move(user);
  return req;
}

py::str text_of(const std::string& bytes) {
  return py::reinterpret_steal<py::str>(
      PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "replace"));
}

std::string repr_bytes(const std::string& b) {
  std::string s = py::repr(py::bytes(b.substr(0, 80))).cast<std::string>();
  return b.size() > 80 ? s + "..." : s;
}

}  // namespace

py::object dsec_exception(const dsec::Error& e) {
  py::object errors = py::module_::import("dsec.errors");
  const bool node_lost = dynamic_cast<const dsec::NodeLost*>(&e) != nullptr;
  // An error whose outcome is unknown raises dsec.OutcomeUnknown, with its request id where the client knows it.
  const auto* unknown = dynamic_cast<const dsec::OutcomeUnknown*>(&e);
  py::object outcome_unknown = py::none();
  if (e.outcome_unknown()) outcome_unknown = py::str(unknown ? unknown->request_id() : std::string());
  return errors.attr("_make")(std::string(e.code_name()), std::string(e.what()), e.retryable(), node_lost,
                              e.infrastructure(), outcome_unknown);
}

std::shared_ptr<dsec::Client> client_of(py::handle py_client) { return py_client.cast<PyClient&>().get(); }

namespace {

py::dict screen_dict(const dsec::ScreenState& st) {
  py::dict d;
  d["width"] = st.width;
  d["height"] = st.height;
  if (st.cursor_x && st.cursor_y) d["cursor"] = py::make_tuple(*st.cursor_x, *st.cursor_y);
  else d["cursor"] = py::none();
  return d;
}

}  // namespace

PYBIND11_MODULE(_dsec, m) {
  m.doc() = "dsec's C++ client (use the `dsec` package, not this module)";
  m.attr("__version__") = dsec::kVersion;
  m.attr("PROTOCOL_VERSION") = dsec::kProtocolVersion;

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dsec::Error& e) {
      raise_dsec_error(e);
    }
  });

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

  py::class_<dsec::FnCallRequest>(
      m, "FnCallRequest", "One function call (build it with dsec.fncall_request or Client.run_code's keywords).")
      .def(py::init<>())
      .def_readwrite("language", &dsec::FnCallRequest::language, "python, shell, c or cpp.")
      .def_readwrite("code", &dsec::FnCallRequest::code)
      .def_property(
          "stdin", [](const dsec::FnCallRequest& r) { return py::bytes(r.stdin_data); },
          [](dsec::FnCallRequest& r, py::object v) { r.stdin_data = v.is_none() ? "" : bytes_or_str(v, "stdin"); },
          "Bytes fed to the program's stdin, then EOF.")
      .def_readwrite("args", &dsec::FnCallRequest::args)
      .def_property(
          "files",
          [](const dsec::FnCallRequest& r) {
            py::dict d;
            for (const auto& [path, bytes] : r.files) d[py::str(path)] = py::bytes(bytes);
            return d;
          },
          [](dsec::FnCallRequest& r, py::object v) {
            r.files.clear();
            if (v.is_none()) return;
            if (!py::isinstance<py::dict>(v))
              throw dsec::Error(dsec::Code::kInvalidArgument, "files: expected a dict of path to bytes or str");
            for (auto item : v.cast<py::dict>()) {
              if (!py::isinstance<py::str>(item.first))
                throw dsec::Error(dsec::Code::kInvalidArgument, "files: every path must be a str");
              std::string path = item.first.cast<std::string>();
              r.files[path] = bytes_or_str(item.second, ("files." + path).c_str());
            }
          },
          "Relative path -> bytes, written under the call's working directory (in its private /tmp) before it runs.")
      .def_readwrite("env", &dsec::FnCallRequest::env)
      .def_readwrite("image", &dsec::FnCallRequest::image, "'' for the node's default function-call image.")
      .def_readwrite("timeout", &dsec::FnCallRequest::timeout_seconds, "Wall-clock seconds.")
      .def_readwrite("cpu_time", &dsec::FnCallRequest::cpu_seconds, "CPU seconds (0: the wall timeout alone).")
      .def_readwrite("memory", &dsec::FnCallRequest::memory_bytes, "Bytes for the call's processes together.")
      .def_readwrite("pids", &dsec::FnCallRequest::pids)
      .def_readwrite("max_output_bytes", &dsec::FnCallRequest::max_output_bytes)
      .def_property(
          "gpu_mode",
          [](const dsec::FnCallRequest& r) {
            return r.gpu_mode == dsec::GpuMode::kExclusive ? "exclusive"
                   : r.gpu_mode == dsec::GpuMode::kShared  ? "shared"
                                                           : "none";
          },
          [](dsec::FnCallRequest& r, const std::string& mode) {
            if (mode == "none" || mode.empty()) r.gpu_mode = dsec::GpuMode::kNone;
            else if (mode == "exclusive") r.gpu_mode = dsec::GpuMode::kExclusive;
            else if (mode == "shared") r.gpu_mode = dsec::GpuMode::kShared;
            else
              throw dsec::Error(dsec::Code::kInvalidArgument,
                                "gpu_mode: '" + mode + "' is not a GPU mode (none, exclusive, shared)");
          },
          "none, exclusive (whole GPUs) or shared (shares of a GPU).")
      .def_readwrite("gpus", &dsec::FnCallRequest::gpus)
      .def_readwrite("request_id", &dsec::FnCallRequest::request_id)
      .def("__repr__", [](const dsec::FnCallRequest& r) {
        std::string code = py::repr(py::str(r.code.substr(0, 60))).cast<std::string>();
        return "FnCallRequest(language='" + r.language + "', code=" + code + (r.code.size() > 60 ? "..." : "") +
               (r.image.empty() ? "" : ", image='" + r.image + "'") + ")";
      });

  py::class_<dsec::FnCallResult>(m, "FnCallResult",
                                 "What a function call did. stdout/stderr are bytes (stdout_text/stderr_text: str).")
      .def_readonly("exit_code", &dsec::FnCallResult::exit_code, "Exit status, or -1 when a signal ended it.")
      .def_readonly("signal", &dsec::FnCallResult::signal, "The signal that ended it, 0 if it exited.")
      .def_property_readonly("stdout", [](const dsec::FnCallResult& r) { return py::bytes(r.stdout_data); })
      .def_property_readonly("stderr", [](const dsec::FnCallResult& r) { return py::bytes(r.stderr_data); })
      .def_property_readonly(
          "stdout_text", [](const dsec::FnCallResult& r) { return text_of(r.stdout_data); },
          "stdout decoded as UTF-8 (undecodable bytes become U+FFFD).")
      .def_property_readonly(
          "stderr_text", [](const dsec::FnCallResult& r) { return text_of(r.stderr_data); },
          "stderr decoded as UTF-8 (undecodable bytes become U+FFFD).")
      .def_readonly("stdout_truncated", &dsec::FnCallResult::stdout_truncated)
      .def_readonly("stderr_truncated", &dsec::FnCallResult::stderr_truncated)
      .def_readonly("timed_out", &dsec::FnCallResult::timed_out, "The wall or CPU time limit ended it.")
      .def_readonly("oom_killed", &dsec::FnCallResult::oom_killed, "The memory limit ended it.")
      .def_readonly("duration", &dsec::FnCallResult::duration_seconds,
                    "Wall-clock seconds of the run (compile excluded).")
      .def_readonly("cpu_time", &dsec::FnCallResult::cpu_seconds, "User + system CPU seconds of its processes.")
      .def_readonly("peak_memory", &dsec::FnCallResult::peak_memory_bytes, "Bytes.")
      .def_readonly("compile_exit_code", &dsec::FnCallResult::compile_exit_code, "C and C++: the compiler's status.")
      .def_property_readonly(
          "compile_output", [](const dsec::FnCallResult& r) { return py::bytes(r.compile_output); },
          "C and C++: the compiler's messages.")
      .def_readonly("compile_seconds", &dsec::FnCallResult::compile_seconds)
      .def_readonly("gpus", &dsec::FnCallResult::gpus, "The devices it was given (CUDA_VISIBLE_DEVICES).")
      .def_readonly("node", &dsec::FnCallResult::node, "The node that ran it.")
      .def_readonly("error", &dsec::FnCallResult::error,
                    "run_code_many only: why the call could not run at all ('' when it ran).")
      .def_readonly("error_code", &dsec::FnCallResult::error_code, "run_code_many only: the error's code name.")
      .def_property_readonly(
          "ok",
          [](const dsec::FnCallResult& r) {
            return r.error_code.empty() && r.exit_code == 0 && !r.timed_out && !r.oom_killed;
          },
          "It ran and exited 0 within its limits.")
      .def("exception", &fncall_exception,
           "The dsec.errors exception for error/error_code (dsec.NotFound, ...), or None when the call ran.")
      .def("__repr__", [](const dsec::FnCallResult& r) {
        if (!r.error_code.empty())
          return "FnCallResult(error_code='" + r.error_code +
                 "', error=" + py::repr(py::str(r.error)).cast<std::string>() + ")";
        std::string s = "FnCallResult(exit_code=" + std::to_string(r.exit_code);
        if (r.signal) s += ", signal=" + std::to_string(r.signal);
        if (r.timed_out) s += ", timed_out=True";
        if (r.oom_killed) s += ", oom_killed=True";
        if (r.compile_exit_code) s += ", compile_exit_code=" + std::to_string(r.compile_exit_code);
        s += ", stdout=" + repr_bytes(r.stdout_data);
        if (!r.stderr_data.empty()) s += ", stderr=" + repr_bytes(r.stderr_data);
        return s + ", duration=" + py::repr(py::float_(r.duration_seconds)).cast<std::string>() + ")";
      });

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

  // Handles: they own nothing and never change, so any thread may use them; every call releases the GIL.
  using Release = py::call_guard<py::gil_scoped_release>;
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
          [](const dsec::Process& self, py::object data) {
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
             py::object on_output) {
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

  py::class_<dsec::CachedLayer>(m, "CachedLayer", "An image layer in a node's cache.")
      .def_readonly("digest", &dsec::CachedLayer::digest)
      .def_readonly("size", &dsec::CachedLayer::size)
      .def_readonly("cached_bytes", &dsec::CachedLayer::cached_bytes)
      .def_readonly("users", &dsec::CachedLayer::users)
      .def("__repr__", [](const dsec::CachedLayer& l) {
        return "CachedLayer(digest='" + l.digest + "', size=" + std::to_string(l.size) +
               ", cached_bytes=" + std::to_string(l.cached_bytes) + ", users=" + std::to_string(l.users) + ")";
      });

  py::class_<dsec::ImageLayerInfo>(m, "ImageLayerInfo", "A layer of an image in a store.")
      .def_readonly("role", &dsec::ImageLayerInfo::role)
      .def_readonly("digest", &dsec::ImageLayerInfo::digest)
      .def_readonly("size", &dsec::ImageLayerInfo::size)
      .def_readonly("stored_size", &dsec::ImageLayerInfo::stored_size)
      .def("__repr__", [](const dsec::ImageLayerInfo& l) {
        return "ImageLayerInfo(role='" + l.role + "', digest='" + l.digest + "', size=" + std::to_string(l.size) + ")";
      });

  py::class_<dsec::ImageInfo>(m, "ImageInfo", "An image in one of the client's stores, as `dsec image ls` shows it.")
      .def_readonly("name", &dsec::ImageInfo::name)
      .def_readonly("tag", &dsec::ImageInfo::tag)
      .def_readonly("reference", &dsec::ImageInfo::reference)
      .def_readonly("digest", &dsec::ImageInfo::digest)
      .def_readonly("layers", &dsec::ImageInfo::layers)
      .def_readonly("size", &dsec::ImageInfo::size)
      .def_readonly("stored_size", &dsec::ImageInfo::stored_size)
      .def_readonly("created_at", &dsec::ImageInfo::created_at)
      .def_readonly("source", &dsec::ImageInfo::source)
      .def_readonly("parent", &dsec::ImageInfo::parent)
      .def_readonly("store", &dsec::ImageInfo::store)
      .def("__repr__", [](const dsec::ImageInfo& i) {
        return "ImageInfo(reference='" + i.reference + "', digest='" + i.digest +
               "', layers=" + std::to_string(i.layers.size()) + ", size=" + std::to_string(i.size) + ")";
      });

  {
    py::class_<dsec::InputAction> action(m, "InputAction", "One input action on a full VM's screen (dsec/screen.hpp).");
    py::enum_<dsec::InputAction::Type>(action, "Type")
        .value("MOVE", dsec::InputAction::Type::kMove)
        .value("CLICK", dsec::InputAction::Type::kClick)
        .value("SCROLL", dsec::InputAction::Type::kScroll)
        .value("DRAG", dsec::InputAction::Type::kDrag)
        .value("KEY", dsec::InputAction::Type::kKey)
        .value("TYPE", dsec::InputAction::Type::kType)
        .value("WAIT", dsec::InputAction::Type::kWait);
    action.def(py::init<>())
        .def_readwrite("type", &dsec::InputAction::type)
        .def_readwrite("x", &dsec::InputAction::x)
        .def_readwrite("y", &dsec::InputAction::y)
        .def_readwrite("to_x", &dsec::InputAction::to_x)
        .def_readwrite("to_y", &dsec::InputAction::to_y)
        .def_readwrite("button", &dsec::InputAction::button)
        .def_readwrite("count", &dsec::InputAction::count)
        .def_readwrite("dy", &dsec::InputAction::dy)
        .def_readwrite("keys", &dsec::InputAction::keys)
        .def_readwrite("text", &dsec::InputAction::text)
        .def_readwrite("interval_ms", &dsec::InputAction::interval_ms);
  }

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

  py::class_<PySandbox, std::shared_ptr<PySandbox>>(m, "Sandbox")
      .def_property_readonly("id", &PySandbox::id)
      .def_property_readonly("destroyed", &PySandbox::destroyed)
      .def(
          "exec",
          [](PySandbox& self, std::optional<std::vector<std::string>> argv, std::optional<std::string> shell,
             std::map<std::string, std::string> env, std::string cwd, py::object stdin_data, double timeout,
             std::size_t max_output, py::object on_output, std::string user, std::string request_id) {
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
          [](PySandbox& self, const std::string& path, py::object data, unsigned mode) {
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
          [](PySandbox& self, const std::string& dir, py::object data) {
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
          py::arg("dir"))
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
          "screenshot",
          [](PySandbox& self) {
            std::string png;
            {
              py::gil_scoped_release release;
              png = self.get().screenshot();
            }
            return py::bytes(png);
          },
          "PNG bytes of a full VM's screen now.")
      .def(
          "screen",
          [](PySandbox& self) {
            dsec::ScreenState st;
            {
              py::gil_scoped_release release;
              st = self.get().screen();
            }
            return screen_dict(st);
          },
          "The screen's size and where the pointer was last put.")
      .def(
          "input",
          [](PySandbox& self, const std::vector<dsec::InputAction>& actions) {
            dsec::ScreenState st;
            {
              py::gil_scoped_release release;
              st = self.get().input(actions);
            }
            return screen_dict(st);
          },
          py::arg("actions"), "Sends input actions in order; answers the screen's state after them.")
      .def(
          "vnc", [](PySandbox& self) { return self.get().vnc(); }, py::call_guard<py::gil_scoped_release>(),
          "A VNC endpoint 'host:port' to watch (and drive) the screen.")
      .def(
          "stop_vnc", [](PySandbox& self) { self.get().stop_vnc(); }, py::call_guard<py::gil_scoped_release>())
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
          "What its network carried: bytes and packets each way, refused new connections, resolved names.")
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
          "sessions", [](PySandbox& self) { return self.get().sessions(); }, Release())
      .def("destroy", &PySandbox::destroy, py::call_guard<py::gil_scoped_release>());

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

  py::class_<PyClient>(m, "Client")
      .def(
          py::init([](std::vector<std::string> endpoints, std::string agent_binary,
                      std::vector<std::string> agent_candidates, std::string home, std::vector<std::string> agent_args,
                      double call_deadline, std::size_t create_concurrency, int max_attempts, double initial_backoff,
                      double max_backoff, double agent_start_timeout, double agent_stop_grace,
                      std::vector<std::string> stores, double image_cache_ttl, double request_timeout,
                      std::vector<std::string> etcd, std::string etcd_prefix, std::string placement, std::string token,
                      std::string tls_ca_file, std::string tls_client_cert, std::string tls_client_key,
                      std::string etcd_tls_ca_file, std::string etcd_tls_client_cert, std::string etcd_tls_client_key) {
            dsec::ClientOptions o;
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
          py::arg("etcd_tls_ca_file") = "", py::arg("etcd_tls_client_cert") = "", py::arg("etcd_tls_client_key") = "")
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

  bind_aio(m);
}
