// _dsec.AsyncCore: the asyncio side of dsec._dsec (dsec/aio.py wraps it into dsec.AsyncClient).
//
// Each call starts a non-blocking exchange on the client's AsyncTransport (one libcurl multi handle, one I/O thread)
// and returns a ticket at once. When the exchange ends, the I/O thread decodes the answer without the GIL and queues
// `resolve(future, exception, value)`; streamed output is queued as `deliver(future, on_output, stream, data)`, in
// the order it arrived. After each round of events the I/O thread takes the GIL once and hands each loop its queue
// with one loop.call_soon_threadsafe(run_batch, [...]), so on_output runs on the loop's thread, before the result.
// ticket.cancel() takes the transfer off the multi handle.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "_dsec_aio.hpp"
#include "client/async_transport.hpp"
#include "client/exec_stream.hpp"
#include "client/requests.hpp"

namespace py = pybind11;

namespace {

using dsec::detail::AsyncCall;
using dsec::detail::HttpResponse;
using dsec::detail::SandboxRequest;
namespace requests = dsec::detail::requests;
namespace answers = dsec::detail::answers;

// The Python objects of one call. Released with the GIL held, whichever thread lets go of them last.
struct PyTarget {
  py::object call_soon;  // loop.call_soon_threadsafe
  py::object future;
  py::object resolve;
  py::object deliver;
  py::object on_output;

  ~PyTarget() {
    py::gil_scoped_acquire gil;
    call_soon = py::object();
    future = py::object();
    resolve = py::object();
    deliver = py::object();
    on_output = py::object();
  }
};

// What the I/O thread hands the loops after a round of events, in the order it happened: one
// call_soon_threadsafe (and one taking of the GIL) per round and loop, however many calls ended in it.
class Outbox {
 public:
  // Queues fn(future, args...) for the target's loop. `make_args` builds the args' Python objects; it runs with
  // the GIL at the next flush. I/O thread only.
  void post(std::shared_ptr<PyTarget> target, bool resolve, std::function<py::tuple()> make_args) {
    items_.push_back({std::move(target), resolve, std::move(make_args)});
  }
  // Schedules everything queued: run_batch([(fn, future, *args), ...]) on each loop.
  void flush(const py::object& run_batch) {
    if (items_.empty()) return;
    std::vector<Item> items;
    items.swap(items_);
    py::gil_scoped_acquire gil;
    std::vector<std::pair<PyTarget*, py::list>> batches;  // per loop, in first-seen order
    for (auto& item : items) {
      PyTarget& t = *item.target;
      py::tuple args = item.make_args();
      py::list call;
      call.append(item.resolve ? t.resolve : t.deliver);
      call.append(t.future);
      for (auto a : args) call.append(a);
      auto it = std::find_if(batches.begin(), batches.end(),
                             [&](const auto& b) { return b.first->call_soon.is(t.call_soon); });
      if (it == batches.end()) {
        batches.emplace_back(&t, py::list());
        it = std::prev(batches.end());
      }
      it->second.append(py::tuple(call));
    }
    for (auto& [target, list] : batches) {
      try {
        target->call_soon(run_batch, list);
      } catch (py::error_already_set&) {
        // The loop is closed: nobody awaits its futures any more.
      }
    }
    batches.clear();
    items.clear();  // the targets let go of their Python objects with the GIL held
  }

 private:
  struct Item {
    std::shared_ptr<PyTarget> target;
    bool resolve;
    std::function<py::tuple()> make_args;
  };
  std::vector<Item> items_;
};

py::object exception_object(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const dsec::Error& e) {
    try {
      return dsec_exception(e);
    } catch (py::error_already_set&) {
      return py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(std::string(e.code_name()) + ": " + e.what());
    }
  } catch (py::error_already_set& e) {
    return e.value();
  } catch (const std::exception& e) {
    return py::reinterpret_borrow<py::object>(PyExc_RuntimeError)(e.what());
  }
}

struct Nothing {};
py::object to_python(Nothing) { return py::none(); }
py::object to_python(const std::string& bytes) { return py::bytes(bytes); }
template <typename T>
py::object to_python(T value) {
  return py::cast(std::move(value));
}

// A call's ticket for Python: cancel() takes its transfer off the multi handle.
class Ticket {
 public:
  Ticket(const std::shared_ptr<dsec::detail::AsyncTransport>& transport, std::uint64_t id)
      : transport_(transport), id_(id) {}
  void cancel() {
    if (auto t = transport_.lock()) t->cancel(id_);
  }
  std::uint64_t id() const { return id_; }

 private:
  std::weak_ptr<dsec::detail::AsyncTransport> transport_;
  std::uint64_t id_;
};

// A streamed command's state across its attempts: output goes to on_output through the outbox, in the order it
// arrived, without what an earlier attempt delivered.
struct Streamed {
  explicit Streamed(std::shared_ptr<PyTarget> t, Outbox* o)
      : target(std::move(t)), outbox(o), command([this](int fd, std::string_view data) {
          outbox->post(target, false, [t = target.get(), fd, bytes = std::string(data)] {
            return py::make_tuple(t->on_output, fd == 2 ? "stderr" : "stdout", py::bytes(bytes));
          });
        }) {}

  std::shared_ptr<PyTarget> target;
  Outbox* outbox;
  dsec::detail::StreamedCommand command;
};

class AsyncCore {
 public:
  AsyncCore(py::handle client, py::object resolve, py::object deliver, py::object run_batch)
      : core_(client_of(client)->core_handle()),
        resolve_(std::move(resolve)),
        deliver_(std::move(deliver)),
        run_batch_(std::make_shared<py::object>(std::move(run_batch))),
        outbox_(std::make_shared<Outbox>()) {
    py::gil_scoped_release release;
    transport_ = std::make_shared<dsec::detail::AsyncTransport>(
        core_, [outbox = outbox_, run_batch = run_batch_] { outbox->flush(*run_batch); });
  }

  ~AsyncCore() {
    close();
    py::gil_scoped_acquire gil;
    *run_batch_ = py::object();
  }

  void close() {
    auto t = std::move(transport_);
    if (!t) return;
    // The I/O thread ends the calls in flight, which takes the GIL.
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      t->close();
    } else {
      t->close();
    }
  }

  std::size_t in_flight() const { return transport_ ? transport_->in_flight() : 0; }

  // Starts `call`; the answer, decoded by `decode` on the I/O thread, resolves `future`.
  // `call` is moved into the transport below; clang-tidy 14 does not see a move inside a template.
  template <typename Decode>
  // NOLINTNEXTLINE(performance-unnecessary-value-param)
  Ticket start(const py::object& loop, const py::object& future, AsyncCall call, Decode decode,
               std::shared_ptr<PyTarget> target = nullptr) {
    if (!transport_) throw dsec::Error(dsec::Code::kFailedPrecondition, "this dsec client is closed");
    if (!target) target = make_target(loop, future, py::none());
    auto done = [target, outbox = outbox_.get(), decode = std::move(decode)](HttpResponse* response,
                                                                             std::exception_ptr error) {
      using T = decltype(decode(*response));
      auto value = std::make_shared<std::optional<T>>();
      if (!error) {
        try {
          value->emplace(decode(*response));
        } catch (...) {
          error = std::current_exception();
        }
      }
      outbox->post(target, true, [error, value] {
        py::object exc = error ? exception_object(error) : py::none();
        py::object result = *value ? to_python(std::move(**value)) : py::none();
        return py::make_tuple(exc, result);
      });
    };
    std::uint64_t id;
    {
      py::gil_scoped_release release;
      id = transport_->submit(std::move(call), std::move(done));
    }
    return Ticket(transport_, id);
  }

  std::shared_ptr<PyTarget> make_target(const py::object& loop, const py::object& future, py::object on_output) {
    auto t = std::make_shared<PyTarget>();
    t->call_soon = loop.attr("call_soon_threadsafe");
    t->future = future;
    t->resolve = resolve_;
    t->deliver = deliver_;
    t->on_output = std::move(on_output);
    return t;
  }

  // A command run exactly once under its request's id (exec, a session's run), its answer an ExecResult, streamed
  // to on_output when it is not None.
  Ticket command(const py::object& loop, const py::object& future, SandboxRequest request, py::object on_output) {
    AsyncCall call{std::move(request)};
    if (on_output.is_none()) {
      std::string what = call.request.what;  // before call is moved
      return start(loop, future, std::move(call),
                   [what = std::move(what)](HttpResponse& r) { return answers::exec_result(r, what); });
    }
    auto target = make_target(loop, future, std::move(on_output));
    auto stream = std::make_shared<Streamed>(target, outbox_.get());
    call.on_attempt = [s = stream.get()] { s->command.new_attempt(); };
    call.on_body = [s = stream.get()](std::string_view bytes) { s->command.feed(bytes); };
    return start(
        loop, future, std::move(call), [stream](HttpResponse&) { return stream->command.finish(); }, target);
  }

  Ticket exec(const py::object& loop, const py::object& future, const std::string& id,
              std::optional<std::vector<std::string>> argv, std::optional<std::string> shell,
              std::map<std::string, std::string> env, std::string cwd, std::optional<std::string> stdin_data,
              double timeout, std::size_t max_output, py::object on_output, std::string user, std::string request_id) {
    dsec::ExecRequest req;
    if (argv) req.argv = std::move(*argv);
    if (shell) req.shell = std::move(*shell);
    req.env = std::move(env);
    req.cwd = std::move(cwd);
    req.user = std::move(user);
    if (stdin_data) req.stdin_data = std::move(*stdin_data);
    req.timeout_seconds = timeout;
    req.max_output_bytes = max_output;
    req.request_id = std::move(request_id);
    SandboxRequest request = requests::exec(id, req, !on_output.is_none());
    check_output_callback(on_output);
    return command(loop, future, std::move(request), std::move(on_output));
  }

  Ticket session_run(const py::object& loop, const py::object& future, const std::string& id, const std::string& name,
                     const std::string& command_text, double timeout, std::size_t max_output, py::object on_output) {
    SandboxRequest request = requests::session_run(id, name, command_text, timeout, max_output, !on_output.is_none());
    check_output_callback(on_output);
    return command(loop, future, std::move(request), std::move(on_output));
  }

  Ticket shell(const py::object& loop, const py::object& future, const std::string& id, std::string name,
               std::string shell, std::map<std::string, std::string> env, std::string cwd, std::string user) {
    dsec::SessionOptions o;
    o.name = std::move(name);
    o.shell = std::move(shell);
    o.env = std::move(env);
    o.cwd = std::move(cwd);
    o.user = std::move(user);
    AsyncCall call{requests::open_session(id, o)};
    std::string what = call.request.what;  // before call is moved
    return start(loop, future, std::move(call),
                 [what = std::move(what)](HttpResponse& r) { return answers::session_info(r, what); });
  }

  Ticket spawn(const py::object& loop, const py::object& future, const std::string& id,
               std::optional<std::vector<std::string>> argv, std::optional<std::string> shell,
               std::map<std::string, std::string> env, std::string cwd, std::string user, bool pty, unsigned rows,
               unsigned cols, std::string tag, std::string request_id) {
    dsec::ProcessRequest req;
    if (argv) req.argv = std::move(*argv);
    if (shell) req.shell = std::move(*shell);
    req.env = std::move(env);
    req.cwd = std::move(cwd);
    req.user = std::move(user);
    req.pty = pty;
    req.rows = rows;
    req.cols = cols;
    req.tag = std::move(tag);
    req.request_id = std::move(request_id);
    AsyncCall call{requests::spawn(id, req)};
    std::string what = call.request.what;  // before call is moved
    return start(loop, future, std::move(call),
                 [what = std::move(what)](HttpResponse& r) { return answers::process_info(r, what); });
  }

  Ticket process_read(const py::object& loop, const py::object& future, const std::string& id, int pid,
                      std::optional<std::uint64_t> stdout_offset, std::optional<std::uint64_t> stderr_offset,
                      double wait, std::size_t max_bytes) {
    AsyncCall call{requests::process_output(id, pid, stdout_offset, stderr_offset, wait, max_bytes)};
    std::string what = call.request.what;  // before call is moved
    return start(loop, future, std::move(call),
                 [what = std::move(what), want_out = stdout_offset.has_value(), want_err = stderr_offset.has_value()](
                     HttpResponse& r) { return answers::process_output(r, what, want_out, want_err); });
  }

  Ticket sleep_or_wake(const py::object& loop, const py::object& future, const std::string& id, bool sleep) {
    return start(loop, future, AsyncCall{requests::sleep_or_wake(id, sleep)},
                 [sleep](HttpResponse& r) { return answers::sleep_result(r, sleep); });
  }

  // Any other one-exchange call: `answer` names how its answer is decoded.
  Ticket request(const py::object& loop, const py::object& future, const std::string& id, std::string method,
                 const std::string& suffix, const py::bytes& body, const std::string& content_type,
                 double extra_seconds, bool repeatable, const std::string& answer) {
    AsyncCall call{requests::sandbox(id, std::move(method), suffix, std::string(body), content_type,
                                     {requests::wait_time(extra_seconds), repeatable})};
    const std::string what = call.request.what;
    if (answer == "none") return start(loop, future, std::move(call), [](HttpResponse&) { return Nothing{}; });
    if (answer == "bytes")
      return start(loop, future, std::move(call), [](HttpResponse& r) { return std::move(r.body); });
    if (answer == "file")
      return start(loop, future, std::move(call),
                   [what, id](HttpResponse& r) { return answers::file(std::move(r), what, id); });
    if (answer == "sandbox_info")
      return start(loop, future, std::move(call), [what](HttpResponse& r) { return answers::sandbox_info(r, what); });
    if (answer == "session_info")
      return start(loop, future, std::move(call), [what](HttpResponse& r) { return answers::session_info(r, what); });
    if (answer == "session_list")
      return start(loop, future, std::move(call), [what](HttpResponse& r) { return answers::session_list(r, what); });
    if (answer == "process_info")
      return start(loop, future, std::move(call), [what](HttpResponse& r) { return answers::process_info(r, what); });
    if (answer == "process_list")
      return start(loop, future, std::move(call), [what](HttpResponse& r) { return answers::process_list(r, what); });
    throw dsec::Error(dsec::Code::kInvalidArgument, "answer: unknown kind '" + answer + "'");
  }

 private:
  static void check_output_callback(const py::object& on_output) {
    if (!on_output.is_none() && !PyCallable_Check(on_output.ptr()))
      throw dsec::Error(dsec::Code::kInvalidArgument, "on_output: must be a callable(stream, data)");
  }

  std::shared_ptr<dsec::detail::ClientCore> core_;
  std::shared_ptr<dsec::detail::AsyncTransport> transport_;
  py::object resolve_;
  py::object deliver_;
  std::shared_ptr<py::object> run_batch_;
  std::shared_ptr<Outbox> outbox_;  // the I/O thread's
};

}  // namespace

void bind_aio(py::module_& m) {
  py::class_<Ticket>(m, "AsyncTicket", "A call in flight on an AsyncCore.")
      .def("cancel", &Ticket::cancel, "Takes the call's transfer off the multi handle; its future is never resolved.")
      .def_property_readonly("id", &Ticket::id);

  using Str = std::string;
  using Env = std::map<std::string, std::string>;
  py::class_<AsyncCore>(m, "AsyncCore",
                        "The asyncio core of a _dsec.Client: one I/O thread driving a libcurl multi handle. Each call "
                        "takes (loop, future, ...) and returns an AsyncTicket at once; the future is resolved on the "
                        "loop through resolve(future, exception, value).")
      .def(py::init<py::handle, py::object, py::object, py::object>(), py::arg("client"), py::arg("resolve"),
           py::arg("deliver"), py::arg("run_batch"))
      .def("close", &AsyncCore::close)
      .def_property_readonly("in_flight", &AsyncCore::in_flight)
      .def("exec", &AsyncCore::exec, py::arg("loop"), py::arg("future"), py::arg("sandbox_id"), py::arg("argv"),
           py::arg("shell"), py::arg("env"), py::arg("cwd"), py::arg("stdin"), py::arg("timeout"),
           py::arg("max_output"), py::arg("on_output"), py::arg("user"), py::arg("request_id"))
      .def("session_run", &AsyncCore::session_run, py::arg("loop"), py::arg("future"), py::arg("sandbox_id"),
           py::arg("name"), py::arg("command"), py::arg("timeout"), py::arg("max_output"), py::arg("on_output"))
      .def("shell", &AsyncCore::shell, py::arg("loop"), py::arg("future"), py::arg("sandbox_id"), py::arg("name"),
           py::arg("shell"), py::arg("env") = Env{}, py::arg("cwd") = Str{}, py::arg("user") = Str{})
      .def("spawn", &AsyncCore::spawn, py::arg("loop"), py::arg("future"), py::arg("sandbox_id"), py::arg("argv"),
           py::arg("shell"), py::arg("env"), py::arg("cwd"), py::arg("user"), py::arg("pty"), py::arg("rows"),
           py::arg("cols"), py::arg("tag"), py::arg("request_id") = Str{})
      .def("process_read", &AsyncCore::process_read, py::arg("loop"), py::arg("future"), py::arg("sandbox_id"),
           py::arg("pid"), py::arg("stdout_offset"), py::arg("stderr_offset"), py::arg("wait"), py::arg("max_bytes"))
      .def("sleep_or_wake", &AsyncCore::sleep_or_wake, py::arg("loop"), py::arg("future"), py::arg("sandbox_id"),
           py::arg("sleep"))
      .def("request", &AsyncCore::request, py::arg("loop"), py::arg("future"), py::arg("sandbox_id"), py::arg("method"),
           py::arg("suffix"), py::arg("body") = py::bytes(), py::arg("content_type") = Str{}, py::arg("extra") = 0.0,
           py::arg("repeatable") = true, py::arg("answer") = Str("none"));
}
