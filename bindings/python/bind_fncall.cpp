// Function calls: FnCallRequest and FnCallResult (docs/fncall.md).
#include "bind_internal.hpp"

namespace dsec::python {

namespace {

py::str text_of(const std::string& bytes) {
  return py::reinterpret_steal<py::str>(
      PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()), "replace"));
}

// The dsec.errors exception a run_code_many result's error stands for (None when the call ran).
py::object fncall_exception(const dsec::FnCallResult& r) {
  if (r.error_code.empty() && r.error.empty()) return py::none();
  std::string code = r.error_code.empty() ? "UNKNOWN" : r.error_code;
  py::object errors = py::module_::import("dsec.errors");
  return errors.attr("_make")(code, r.error, dsec::is_retryable(dsec::code_from_name(code)), false);
}

}  // namespace

namespace {

// FnCallRequest: what to run, with what input and limits.
void bind_fncall_request(py::module_& m) {
  py::class_<dsec::FnCallRequest>(
      m, "FnCallRequest", "One function call (build it with dsec.fncall_request or Client.run_code's keywords).")
      .def(py::init<>())
      .def_readwrite("language", &dsec::FnCallRequest::language, "python, shell, c or cpp.")
      .def_readwrite("code", &dsec::FnCallRequest::code)
      .def_property(
          "stdin", [](const dsec::FnCallRequest& r) { return py::bytes(r.stdin_data); },
          [](dsec::FnCallRequest& r, const py::object& v) {
            r.stdin_data = v.is_none() ? "" : bytes_or_str(v, "stdin");
          },
          "Bytes fed to the program's stdin, then EOF.")
      .def_readwrite("args", &dsec::FnCallRequest::args)
      .def_property(
          "files",
          [](const dsec::FnCallRequest& r) {
            py::dict d;
            for (const auto& [path, bytes] : r.files) d[py::str(path)] = py::bytes(bytes);
            return d;
          },
          [](dsec::FnCallRequest& r, const py::object& v) {
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
}

// FnCallResult: what a call did, or why it could not run.
void bind_fncall_result(py::module_& m) {
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
}

}  // namespace

void bind_fncall(py::module_& m) {
  bind_fncall_request(m);
  bind_fncall_result(m);
}

}  // namespace dsec::python
