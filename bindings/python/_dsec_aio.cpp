// _dsec.AsyncCore: the asyncio side of dsec._dsec (dsec/aio.py wraps it into dsec.AsyncClient), on the public
// dsec::AsyncClient (dsec/async_client.hpp).
//
// Each call starts a non-blocking exchange on the client's dsec::AsyncClient (one I/O thread) and returns a ticket
// at once. When the exchange ends, the I/O thread decodes the answer without the GIL and queues
// `resolve(future, exception, value)`; streamed output is queued as `deliver(future, on_output, stream, data)`, in
// the order it arrived. After each round of events the I/O thread takes the GIL once and hands each loop its queue
// with one loop.call_soon_threadsafe(run_batch, [...]), so on_output runs on the loop's thread, before the result.
// ticket.cancel() takes the transfer off the I/O thread.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "_dsec_aio.hpp"
#include "dsec/async_client.hpp"

namespace py = pybind11;

namespace {

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

py::object to_python(const std::string& bytes) { return py::bytes(bytes); }
template <typename T>
py::object to_python(T value) {
  return py::cast(std::move(value));
}

// A call's ticket for Python: cancel() takes its transfer off the I/O thread.
class Ticket {
 public:
  Ticket(const std::shared_ptr<dsec::AsyncClient>& calls, dsec::AsyncClient::Ticket id) : calls_(calls), id_(id) {}
  void cancel() {
    if (auto c = calls_.lock()) c->cancel(id_);
  }
  std::uint64_t id() const { return id_; }

 private:
  std::weak_ptr<dsec::AsyncClient> calls_;
  dsec::AsyncClient::Ticket id_;
};

using Str = std::string;
using Env = std::map<std::string, std::string>;
using OptionalArgv = std::optional<std::vector<std::string>>;

class AsyncCore {
 public:
  AsyncCore(py::handle client, py::object resolve, py::object deliver, py::object run_batch)
      : client_(client_of(client)),
        resolve_(std::move(resolve)),
        deliver_(std::move(deliver)),
        run_batch_(std::make_shared<py::object>(std::move(run_batch))),
        outbox_(std::make_shared<Outbox>()) {
    py::gil_scoped_release release;
    calls_ = std::make_shared<dsec::AsyncClient>(
        *client_, [outbox = outbox_, run_batch = run_batch_] { outbox->flush(*run_batch); });
  }

  ~AsyncCore() {
    close();
    py::gil_scoped_acquire gil;
    *run_batch_ = py::object();
  }

  void close() {
    auto c = std::move(calls_);
    if (!c) return;
    // The I/O thread ends the calls in flight, which takes the GIL.
    if (PyGILState_Check()) {
      py::gil_scoped_release release;
      c->close();
    } else {
      c->close();
    }
  }

  std::size_t in_flight() const { return calls_ ? calls_->in_flight() : 0; }

  Ticket exec(const py::object& loop, const py::object& future, const Str& id, OptionalArgv argv,
              std::optional<Str> shell, Env env, Str cwd, std::optional<Str> stdin_data, double timeout,
              std::size_t max_output, const py::object& on_output, Str user, Str request_id) {
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
    return streamed(loop, future, on_output,
                    [&](auto done, auto output) { return calls_->exec(id, req, std::move(done), std::move(output)); });
  }

  Ticket session_run(const py::object& loop, const py::object& future, const Str& id, const Str& name,
                     const Str& command_text, double timeout, std::size_t max_output, const py::object& on_output) {
    return streamed(loop, future, on_output, [&](auto done, auto output) {
      return calls_->session_run(id, name, command_text, timeout, max_output, std::move(done), std::move(output));
    });
  }

  Ticket shell(const py::object& loop, const py::object& future, const Str& id, Str name, Str shell, Env env, Str cwd,
               Str user) {
    dsec::SessionOptions o;
    o.name = std::move(name);
    o.shell = std::move(shell);
    o.env = std::move(env);
    o.cwd = std::move(cwd);
    o.user = std::move(user);
    return call<dsec::SessionInfo>(loop, future,
                                   [&](auto done) { return calls_->open_session(id, o, std::move(done)); });
  }

  Ticket spawn(const py::object& loop, const py::object& future, const Str& id, OptionalArgv argv,
               std::optional<Str> shell, Env env, Str cwd, Str user, bool pty, unsigned rows, unsigned cols, Str tag,
               Str request_id) {
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
    return call<dsec::ProcessInfo>(loop, future, [&](auto done) { return calls_->spawn(id, req, std::move(done)); });
  }

  Ticket process_read(const py::object& loop, const py::object& future, const Str& id, int pid,
                      std::optional<std::uint64_t> stdout_offset, std::optional<std::uint64_t> stderr_offset,
                      double wait, std::size_t max_bytes) {
    return call<dsec::ProcessOutput>(loop, future, [&](auto done) {
      return calls_->process_output(id, pid, stdout_offset, stderr_offset, wait, max_bytes, std::move(done));
    });
  }

  // A call of dsec::AsyncClient that takes the sandbox id and `Args` and answers a T, as a method of AsyncCore
  // that takes (loop, future, sandbox_id, args...): Bind<T, Args...>::of(&dsec::AsyncClient::...). A class
  // template, as a pack before the completion is not deduced.
  template <typename T, typename... Args>
  struct Bind {
    using Method = dsec::AsyncClient::Ticket (dsec::AsyncClient::*)(std::string_view, Args..., dsec::Completion<T>);
    static auto of(Method method) {
      return [method](AsyncCore& self, const py::object& loop, const py::object& future, const Str& id, Args... args) {
        return self.call<T>(loop, future, [&](dsec::Completion<T> done) {
          return (self.live().*method)(id, std::move(args)..., std::move(done));
        });
      };
    }
  };

 private:
  dsec::AsyncClient& live() {
    if (!calls_) throw dsec::Error(dsec::Code::kFailedPrecondition, "this dsec client is closed");
    return *calls_;
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

  // The completion that resolves the target's future on its loop, through the outbox.
  template <typename T>
  dsec::Completion<T> resolver(const std::shared_ptr<PyTarget>& target) {
    return [target, outbox = outbox_.get()](dsec::AsyncOutcome<T>&& outcome) {
      auto done = std::make_shared<dsec::AsyncOutcome<T>>(std::move(outcome));
      outbox->post(target, true, [done] {
        py::object exc = done->error ? exception_object(done->error) : py::none();
        py::object result = py::none();
        if constexpr (!std::is_void_v<T>) {
          if (done->value) result = to_python(std::move(*done->value));
        }
        return py::make_tuple(exc, result);
      });
    };
  }

  // Starts a call: `start(completion)` submits it (without the GIL) and answers its ticket.
  template <typename T, typename Start>
  Ticket call(const py::object& loop, const py::object& future, Start start,
              std::shared_ptr<PyTarget> target = nullptr) {
    live();
    if (!target) target = make_target(loop, future, py::none());
    dsec::Completion<T> done = resolver<T>(target);
    dsec::AsyncClient::Ticket ticket;
    {
      py::gil_scoped_release release;
      ticket = start(std::move(done));
    }
    return Ticket(calls_, ticket);
  }

  // A command (exec, a session's run): its output streamed to on_output through the outbox when that is not None.
  template <typename Start>
  Ticket streamed(const py::object& loop, const py::object& future, const py::object& on_output, Start start) {
    live();
    if (on_output.is_none())
      return call<dsec::ExecResult>(loop, future, [&](auto done) { return start(std::move(done), nullptr); });
    if (!PyCallable_Check(on_output.ptr()))
      throw dsec::Error(dsec::Code::kInvalidArgument, "on_output: must be a callable(stream, data)");
    auto target = make_target(loop, future, on_output);
    dsec::OutputCallback output = [target, outbox = outbox_.get()](int fd, std::string_view data) {
      outbox->post(target, false, [t = target.get(), fd, bytes = std::string(data)] {
        return py::make_tuple(t->on_output, fd == 2 ? "stderr" : "stdout", py::bytes(bytes));
      });
    };
    return call<dsec::ExecResult>(
        loop, future, [&](auto done) { return start(std::move(done), std::move(output)); }, target);
  }

  std::shared_ptr<dsec::Client> client_;  // what calls_ sends through: kept alive while it is open
  std::shared_ptr<dsec::AsyncClient> calls_;
  py::object resolve_;
  py::object deliver_;
  std::shared_ptr<py::object> run_batch_;
  std::shared_ptr<Outbox> outbox_;  // the I/O thread's
};

}  // namespace

void bind_aio(py::module_& m) {
  py::class_<Ticket>(m, "AsyncTicket", "A call in flight on an AsyncCore.")
      .def("cancel", &Ticket::cancel, "Takes the call's transfer off the I/O thread; its future is never resolved.")
      .def_property_readonly("id", &Ticket::id);

  using dsec::AsyncClient;
  using dsec::ProcessInfo;
  using dsec::SessionInfo;
  using SV = std::string_view;
  auto loop = py::arg("loop");
  auto future = py::arg("future");
  auto id = py::arg("sandbox_id");
  auto pid = py::arg("pid");
  auto name = py::arg("name");
  py::class_<AsyncCore>(m, "AsyncCore",
                        "The asyncio core of a _dsec.Client: one I/O thread (dsec::AsyncClient). Each call takes "
                        "(loop, future, sandbox_id, ...) and returns an AsyncTicket at once; the future is resolved on "
                        "the loop through resolve(future, exception, value).")
      .def(py::init<py::handle, py::object, py::object, py::object>(), py::arg("client"), py::arg("resolve"),
           py::arg("deliver"), py::arg("run_batch"))
      .def("close", &AsyncCore::close)
      .def_property_readonly("in_flight", &AsyncCore::in_flight)
      // Commands, streamed to on_output when it is not None.
      .def("exec", &AsyncCore::exec, loop, future, id, py::arg("argv"), py::arg("shell"), py::arg("env"),
           py::arg("cwd"), py::arg("stdin"), py::arg("timeout"), py::arg("max_output"), py::arg("on_output"),
           py::arg("user"), py::arg("request_id"))
      .def("session_run", &AsyncCore::session_run, loop, future, id, name, py::arg("command"), py::arg("timeout"),
           py::arg("max_output"), py::arg("on_output"))
      // The sandbox and its files.
      .def("info", AsyncCore::Bind<dsec::SandboxInfo>::of(&AsyncClient::info), loop, future, id)
      .def("destroy", AsyncCore::Bind<void>::of(&AsyncClient::destroy), loop, future, id)
      .def("sleep", AsyncCore::Bind<dsec::SleepResult>::of(&AsyncClient::sleep), loop, future, id)
      .def("wake", AsyncCore::Bind<dsec::SleepResult>::of(&AsyncClient::wake), loop, future, id)
      .def("write_file", AsyncCore::Bind<void, SV, std::string, unsigned>::of(&AsyncClient::write_file), loop, future,
           id, py::arg("path"), py::arg("data"), py::arg("mode"))
      .def("read_file", AsyncCore::Bind<std::string, SV>::of(&AsyncClient::read_file), loop, future, id,
           py::arg("path"))
      .def("upload_tar", AsyncCore::Bind<void, SV, std::string>::of(&AsyncClient::upload_tar), loop, future, id,
           py::arg("dir"), py::arg("tar_bytes"))
      .def("download_tar", AsyncCore::Bind<std::string, SV>::of(&AsyncClient::download_tar), loop, future, id,
           py::arg("dir"))
      // Spawned processes.
      .def("spawn", &AsyncCore::spawn, loop, future, id, py::arg("argv"), py::arg("shell"), py::arg("env"),
           py::arg("cwd"), py::arg("user"), py::arg("pty"), py::arg("rows"), py::arg("cols"), py::arg("tag"),
           py::arg("request_id") = Str{})
      .def("processes", AsyncCore::Bind<std::vector<ProcessInfo>>::of(&AsyncClient::processes), loop, future, id)
      .def("process_info", AsyncCore::Bind<ProcessInfo, int>::of(&AsyncClient::process_info), loop, future, id, pid)
      .def("process_wait", AsyncCore::Bind<ProcessInfo, int, double>::of(&AsyncClient::process_wait), loop, future, id,
           pid, py::arg("wait"))
      .def("process_read", &AsyncCore::process_read, loop, future, id, pid, py::arg("stdout_offset"),
           py::arg("stderr_offset"), py::arg("wait"), py::arg("max_bytes"))
      .def("write_stdin", AsyncCore::Bind<void, int, std::string>::of(&AsyncClient::write_stdin), loop, future, id, pid,
           py::arg("data"))
      .def("close_stdin", AsyncCore::Bind<void, int>::of(&AsyncClient::close_stdin), loop, future, id, pid)
      .def("signal", AsyncCore::Bind<ProcessInfo, int, int, bool>::of(&AsyncClient::signal), loop, future, id, pid,
           py::arg("signal"), py::arg("group"))
      .def("resize", AsyncCore::Bind<ProcessInfo, int, unsigned, unsigned>::of(&AsyncClient::resize), loop, future, id,
           pid, py::arg("rows"), py::arg("cols"))
      .def("kill", AsyncCore::Bind<ProcessInfo, int>::of(&AsyncClient::kill), loop, future, id, pid)
      // Shell sessions.
      .def("shell", &AsyncCore::shell, loop, future, id, name, py::arg("shell"), py::arg("env") = Env{},
           py::arg("cwd") = Str{}, py::arg("user") = Str{})
      .def("sessions", AsyncCore::Bind<std::vector<SessionInfo>>::of(&AsyncClient::sessions), loop, future, id)
      .def("session_info", AsyncCore::Bind<SessionInfo, SV>::of(&AsyncClient::session_info), loop, future, id, name)
      .def("restart_session", AsyncCore::Bind<SessionInfo, SV>::of(&AsyncClient::restart_session), loop, future, id,
           name)
      .def("close_session", AsyncCore::Bind<void, SV>::of(&AsyncClient::close_session), loop, future, id, name);
}
