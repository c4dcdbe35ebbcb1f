// A full VM's screen: the input actions Sandbox.input takes and the state Sandbox.screen answers.
#include "bind_internal.hpp"

namespace dsec::python {

py::dict screen_dict(const dsec::ScreenState& st) {
  py::dict d;
  d["width"] = st.width;
  d["height"] = st.height;
  if (st.cursor_x && st.cursor_y) d["cursor"] = py::make_tuple(*st.cursor_x, *st.cursor_y);
  else d["cursor"] = py::none();
  return d;
}

void bind_screen(py::module_& m) {
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
}

// A full VM's screen on its Sandbox: screenshots, state, input and VNC.
void def_sandbox_screen(SandboxClass& sandbox) {
  sandbox
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
          "vnc_endpoint",
          [](PySandbox& self) {
            dsec::VncEndpoint e = self.get().vnc_endpoint();
            return std::make_pair(e.address, e.password);
          },
          py::call_guard<py::gil_scoped_release>(), "The VNC endpoint's address and the password a viewer gives.")
      .def(
          "stop_vnc", [](PySandbox& self) { self.get().stop_vnc(); }, py::call_guard<py::gil_scoped_release>());
}

}  // namespace dsec::python
