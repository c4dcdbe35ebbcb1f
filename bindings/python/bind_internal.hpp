// What the bind_*.cpp files of dsec._dsec share: the handles Python holds (PyClient, PySandbox, PySandboxGroup), the
// conversions between Python's values and dsec's, and the function of each file, called by _dsec.cpp in the order
// the module registers its types (a type a signature names is registered before it).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/dsec.hpp"

namespace py = pybind11;

namespace dsec::python {

using std::chrono::milliseconds;
// Every call of a handle releases the GIL.
using Release = py::call_guard<py::gil_scoped_release>;

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

milliseconds to_ms(double seconds, const char* what);
PySandbox detach(dsec::Client& client, dsec::Sandbox owned);
std::vector<PySandbox> detach_all(dsec::Client& client, std::vector<dsec::Sandbox> owned);
// A group's lease from Python seconds: 1 to 86400, rounded to whole seconds.
std::chrono::seconds lease_seconds(double lease);
std::string bytes_or_str(const py::handle& h, const char* what);
// An on_output(stream, data) callable as the C++ output callback of a streamed command: called with the GIL held,
// stream "stdout" or "stderr", data bytes. What it raises (py::error_already_set) aborts the call and reaches
// Python unchanged. `on_output` must outlive the callback.
std::function<void(int, std::string_view)> output_callback(const py::object& on_output);

// A command as Python passes it (argv or shell, env, cwd, user) as an ExecRequest or a ProcessRequest.
// The strings are moved into the request; clang-tidy 14 does not see a move inside a template.
template <typename Request>
// NOLINTBEGIN(performance-unnecessary-value-param)
Request command_request(std::optional<std::vector<std::string>> argv, std::optional<std::string> shell,
                        std::map<std::string, std::string> env, std::string cwd, std::string user) {
  // NOLINTEND(performance-unnecessary-value-param)
  Request req;
  if (argv) req.argv = std::move(*argv);
  if (shell) req.shell = std::move(*shell);
  req.env = std::move(env);
  req.cwd = std::move(cwd);
  req.user = std::move(user);
  return req;
}

// repr() of bytes, cut after 80 of them.
std::string repr_bytes(const std::string& b);
// A full VM's screen state as Python's dict: width, height, cursor (x, y) or None.
py::dict screen_dict(const dsec::ScreenState& st);

void bind_errors(py::module_& m);
void bind_spec(py::module_& m);
void bind_exec_result(py::module_& m);
void bind_fncall(py::module_& m);
void bind_sandbox_info(py::module_& m);
void bind_processes(py::module_& m);
void bind_sandbox_results(py::module_& m);
void bind_images(py::module_& m);
void bind_screen(py::module_& m);
void bind_node(py::module_& m);
void bind_sandbox(py::module_& m);
// Sandbox's methods kept with their concern: the screen (bind_screen.cpp), processes and sessions
// (bind_processes.cpp).
using SandboxClass = py::class_<PySandbox, std::shared_ptr<PySandbox>>;
void def_sandbox_screen(SandboxClass& sandbox);
void def_sandbox_processes(SandboxClass& sandbox);
void bind_group(py::module_& m);
void bind_client(py::module_& m);

}  // namespace dsec::python
