// dsec::Error as the exception class of its code from dsec/errors.py, carrying .code and .retryable.
#include "bind_internal.hpp"

#include "_dsec_aio.hpp"

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

namespace dsec::python {

namespace {

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

}  // namespace

void bind_errors(py::module_& m) {
  // NOLINTNEXTLINE(performance-unnecessary-value-param): pybind11's translator type takes the pointer by value
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dsec::Error& e) {
      raise_dsec_error(e);
    }
  });
}

}  // namespace dsec::python
