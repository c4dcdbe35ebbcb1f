// dsec._dsec: the C++ client under `import dsec`. The pure-Python package (dsec/__init__.py) wraps these classes
// into the user-facing API; dsec::Error becomes the exception class of its code from dsec/errors.py.
//
// Every call that may block (network, the embedded agent) releases the GIL, so a trainer's Python threads drive
// many sandboxes at once.
#include "bind_internal.hpp"

#include "_dsec_aio.hpp"

PYBIND11_MODULE(_dsec, m) {
  m.doc() = "dsec's C++ client (use the `dsec` package, not this module)";
  m.attr("__version__") = dsec::kVersion;
  m.attr("PROTOCOL_VERSION") = dsec::kProtocolVersion;

  using namespace dsec::python;
  bind_errors(m);
  bind_spec(m);
  bind_exec_result(m);
  bind_fncall(m);
  bind_sandbox_info(m);
  bind_processes(m);
  bind_sandbox_results(m);
  bind_images(m);
  bind_screen(m);
  bind_node(m);
  bind_sandbox(m);
  bind_group(m);
  bind_client(m);
  bind_aio(m);
}
