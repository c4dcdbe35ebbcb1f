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
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "_dsec_aio.hpp"
#include "client/async_transport.hpp"
#include "client/client_core.hpp"
#include "client/endpoint.hpp"
#include "client/exec_stream.hpp"
#include "common/protocol.hpp"
#include "common/protocol/process.hpp"

namespace py = pybind11;

namespace {

using dsec::detail::AsyncCall;
using dsec::detail::HttpResponse;
using std::chrono::milliseconds;

constexpr std::string_view kJson = "application/json";
constexpr std::string_view kTar = "application/x-tar";

milliseconds seconds_ms(double seconds) {
  return milliseconds{static_cast<std::int64_t>(std::ceil(std::max(seconds, 0.0) * 1000.0))};
}

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

py::object exception_object(std::exception_ptr error) {
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
py::object to_python(std::string bytes) { return py::bytes(bytes); }
template <typename T>
py::object to_python(T value) {
  return py::cast(std::move(value));
}

// A call's ticket for Python: cancel() takes its transfer off the multi handle.
class Ticket {
 public:
  Ticket(std::shared_ptr<dsec::detail::AsyncTransport> transport, std::uint64_t id)
      : transport_(std::move(transport)), id_(id) {}
  void cancel() {
    if (auto t = transport_.lock()) t->cancel(id_);
  }
  std::uint64_t id() const { return id_; }

 private:
  std::weak_ptr<dsec::detail::AsyncTransport> transport_;
  std::uint64_t id_;
};

// A streamed command's state across its attempts: the NDJSON decoder of the current attempt and what on_output
// has had.
struct Streamed {
  std::shared_ptr<PyTarget> target;
  Outbox* outbox = nullptr;
  std::optional<dsec::detail::ExecStreamDecoder> decoder;
  dsec::detail::StreamReplayFilter replay;

  void new_attempt() {
    replay.new_attempt();
    decoder.emplace([this](int fd, std::string_view data) {
      data = replay.fresh(fd, data);
      if (data.empty()) return;
      outbox->post(target, false, [t = target.get(), fd, bytes = std::string(data)] {
        return py::make_tuple(t->on_output, fd == 2 ? "stderr" : "stdout", py::bytes(bytes));
      });
    });
  }
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
  template <typename Decode>
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

  AsyncCall sandbox_call(const std::string& id, std::string method, std::string_view suffix, std::string body = {},
                         std::string_view content_type = {}, dsec::detail::SandboxCall how = {}) const {
    AsyncCall c;
    c.sandbox_id = id;
    c.method = std::move(method);
    c.target = core_->sandbox_path(id, suffix);
    c.body = std::move(body);
    c.content_type = content_type;
    c.how = std::move(how);
    return c;
  }

  // A command run exactly once under `request_id`: POST `suffix` with `body`, its answer an ExecResult, streamed
  // to on_output when it is not None.
  Ticket command(const py::object& loop, const py::object& future, const std::string& id, std::string_view suffix,
                 dsec::protocol::json body, milliseconds run_time, std::string request_id, py::object on_output) {
    const bool streamed = !on_output.is_none();
    if (streamed) {
      if (!PyCallable_Check(on_output.ptr()))
        throw dsec::Error(dsec::Code::kInvalidArgument, "on_output: must be a callable(stream, data)");
      body["stream"] = true;
    }
    body["request_id"] = request_id;
    AsyncCall call = sandbox_call(id, "POST", suffix, body.dump(), kJson, {run_time, true, request_id});
    if (!streamed)
      return start(loop, future, std::move(call), [](HttpResponse& r) {
        return dsec::protocol::decode_exec_result(dsec::detail::parse_json(r, "POST /v1/sandboxes/{id}/exec"));
      });
    auto target = make_target(loop, future, std::move(on_output));
    auto stream = std::make_shared<Streamed>();
    stream->target = target;
    stream->outbox = outbox_.get();
    call.on_attempt = [s = stream.get()] { s->new_attempt(); };
    call.on_body = [s = stream.get()](std::string_view bytes) { s->decoder->feed(bytes); };
    return start(
        loop, future, std::move(call), [stream](HttpResponse&) { return stream->decoder->finish(); }, target);
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
    // The agent's own validation, run here first: a malformed request fails before it costs a round trip.
    dsec::protocol::json encoded = dsec::protocol::encode(req);
    dsec::protocol::decode_exec_request(encoded);
    if (request_id.empty()) request_id = dsec::detail::random_request_id();
    return command(loop, future, id, "/exec", std::move(encoded), seconds_ms(timeout), std::move(request_id),
                   std::move(on_output));
  }

  Ticket session_run(const py::object& loop, const py::object& future, const std::string& id, const std::string& name,
                     const std::string& command_text, double timeout, std::size_t max_output, py::object on_output) {
    auto encoded = dsec::detail::encode_session_run(command_text, timeout, max_output, false);
    return command(loop, future, id, session_suffix(name, "/run"), std::move(encoded), seconds_ms(timeout),
                   dsec::detail::random_request_id(), std::move(on_output));
  }

  Ticket shell(const py::object& loop, const py::object& future, const std::string& id, std::string name,
               std::string shell, std::map<std::string, std::string> env, std::string cwd, std::string user) {
    dsec::SessionOptions o;
    o.name = std::move(name);
    o.shell = std::move(shell);
    o.env = std::move(env);
    o.cwd = std::move(cwd);
    o.user = std::move(user);
    // Not retried once the agent may have it: a second attempt would start a second shell.
    return start(
        loop, future,
        sandbox_call(id, "POST", "/sessions", dsec::detail::encode(o).dump(), kJson, {milliseconds{0}, false}),
        [](HttpResponse& r) {
          return dsec::detail::decode_session_info(dsec::detail::parse_json(r, "POST /v1/sandboxes/{id}/sessions"));
        });
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
    // Exactly-once on the agent by its request id (one is made when the caller gave none): a retry after a lost
    // answer gets the first spawn's process, never a second one.
    dsec::protocol::json encoded = dsec::detail::encode(req);
    if (request_id.empty()) request_id = dsec::detail::random_request_id();
    if (request_id.size() > 128) throw dsec::Error(dsec::Code::kInvalidArgument, "request_id: at most 128 bytes");
    encoded["request_id"] = request_id;
    return start(
        loop, future,
        sandbox_call(id, "POST", "/processes", encoded.dump(), kJson, {milliseconds{0}, true, request_id}),
        [](HttpResponse& r) {
          return dsec::detail::decode_process_info(dsec::detail::parse_json(r, "POST /v1/sandboxes/{id}/processes"));
        });
  }

  Ticket process_read(const py::object& loop, const py::object& future, const std::string& id, int pid,
                      std::optional<std::uint64_t> stdout_offset, std::optional<std::uint64_t> stderr_offset,
                      double wait, std::size_t max_bytes) {
    if (std::isnan(wait) || wait > dsec::detail::kMaxProcessWait)
      throw dsec::Error(dsec::Code::kInvalidArgument,
                        fmt::format("wait: at most {} seconds, got {}", dsec::detail::kMaxProcessWait, wait));
    if (max_bytes < 1 || max_bytes > dsec::detail::kMaxOutputRead)
      throw dsec::Error(dsec::Code::kInvalidArgument,
                        fmt::format("max_bytes: 1 to {}, got {}", dsec::detail::kMaxOutputRead, max_bytes));
    std::string query;
    auto add = [&query](std::string_view key, const std::string& value) {
      query += fmt::format("{}{}={}", query.empty() ? '?' : '&', key, value);
    };
    if (stdout_offset) add("stdout", std::to_string(*stdout_offset));
    if (stderr_offset) add("stderr", std::to_string(*stderr_offset));
    if (wait > 0) add("wait", dsec::detail::query_seconds(wait));
    if (max_bytes != dsec::detail::kMaxOutputRead) add("max", std::to_string(max_bytes));
    const bool want_out = stdout_offset.has_value(), want_err = stderr_offset.has_value();
    return start(
        loop, future,
        sandbox_call(id, "GET", fmt::format("/processes/{}/output{}", pid, query), {}, {}, {seconds_ms(wait), true}),
        [want_out, want_err](HttpResponse& r) {
          auto out = dsec::detail::decode_process_output(
              dsec::detail::parse_json(r, "GET /v1/sandboxes/{id}/processes/{pid}/output"));
          // A stream that was not asked for says nothing, whatever the agent put there.
          if (!want_out) out.stdout_data.clear(), out.stdout_offset = out.stdout_end = 0;
          if (!want_err) out.stderr_data.clear(), out.stderr_offset = out.stderr_end = 0;
          return out;
        });
  }

  Ticket sleep_or_wake(const py::object& loop, const py::object& future, const std::string& id, bool sleep) {
    // The sync client's kSleepTime: a sleep writes the sandbox's memory out to swap.
    constexpr milliseconds kSleepTime{60'000};
    // Every attempt carries the same request id: the agent answers a retry as it answered the first attempt.
    const std::string body = dsec::protocol::json{{"request_id", dsec::detail::random_request_id()}}.dump();
    AsyncCall call = sandbox_call(id, "POST", sleep ? "/sleep" : "/wake", body, kJson, {kSleepTime, true});
    call.retry_timeouts = true;
    return start(loop, future, std::move(call),
                 [sleep](HttpResponse& r) { return dsec::detail::decode_sleep_result(r, sleep); });
  }

  // Any other one-exchange call: `answer` names how its answer is decoded.
  Ticket request(const py::object& loop, const py::object& future, const std::string& id, std::string method,
                 const std::string& suffix, py::bytes body, std::string content_type, double extra_seconds,
                 bool repeatable, const std::string& answer) {
    AsyncCall call = sandbox_call(id, std::move(method), suffix, std::string(body), content_type,
                                  {seconds_ms(extra_seconds), repeatable});
    const std::string what = call.method + " " + suffix;
    auto json = [what](HttpResponse& r) { return dsec::detail::parse_json(r, what); };
    if (answer == "none") return start(loop, future, std::move(call), [](HttpResponse&) { return Nothing{}; });
    if (answer == "bytes")
      return start(loop, future, std::move(call), [](HttpResponse& r) { return std::move(r.body); });
    if (answer == "file")
      return start(loop, future, std::move(call), [what, id](HttpResponse& r) {
        if (r.content_type.starts_with(kTar))
          throw dsec::Error(dsec::Code::kInvalidArgument,
                            fmt::format("{} in sandbox {} is a directory (download_tar reads a directory)", what, id));
        return std::move(r.body);
      });
    if (answer == "sandbox_info")
      return start(loop, future, std::move(call),
                   [json](HttpResponse& r) { return dsec::protocol::decode_sandbox_info(json(r)); });
    if (answer == "session_info")
      return start(loop, future, std::move(call),
                   [json](HttpResponse& r) { return dsec::detail::decode_session_info(json(r)); });
    if (answer == "session_list")
      return start(loop, future, std::move(call),
                   [json](HttpResponse& r) { return dsec::detail::decode_session_list(json(r)); });
    if (answer == "process_info")
      return start(loop, future, std::move(call),
                   [json](HttpResponse& r) { return dsec::detail::decode_process_info(json(r)); });
    if (answer == "process_list")
      return start(loop, future, std::move(call),
                   [json](HttpResponse& r) { return dsec::detail::decode_process_list(json(r)); });
    throw dsec::Error(dsec::Code::kInvalidArgument, "answer: unknown kind '" + answer + "'");
  }

  std::string path(const std::string& id, const std::string& suffix) const { return core_->sandbox_path(id, suffix); }

 private:
  static std::string session_suffix(const std::string& name, std::string_view suffix) {
    return fmt::format("/sessions/{}{}", dsec::detail::url_escape(name), suffix);
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
