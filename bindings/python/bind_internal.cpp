#include "bind_internal.hpp"

#include <cmath>

namespace dsec::python {

milliseconds to_ms(double seconds, const char* what) {
  if (!(seconds > 0) || seconds > 365.0 * 86400)
    throw dsec::Error(dsec::Code::kInvalidArgument, std::string(what) + ": must be a positive number of seconds");
  return milliseconds{std::llround(seconds * 1000.0)};
}

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
  return std::chrono::seconds(std::llround(lease));
}

std::string bytes_or_str(const py::handle& h, const char* what) {
  if (py::isinstance<py::bytes>(h)) return h.cast<std::string>();
  if (py::isinstance<py::bytearray>(h) || py::isinstance<py::memoryview>(h))
    return py::bytes(py::reinterpret_borrow<py::object>(h)).cast<std::string>();
  if (py::isinstance<py::str>(h)) return h.cast<std::string>();  // UTF-8
  throw dsec::Error(dsec::Code::kInvalidArgument, std::string(what) + ": expected bytes or str");
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

std::string repr_bytes(const std::string& b) {
  std::string s = py::repr(py::bytes(b.substr(0, 80))).cast<std::string>();
  return b.size() > 80 ? s + "..." : s;
}

}  // namespace dsec::python
