// dsec::AsyncClient: the request table's requests (client/requests) on an AsyncTransport, their answers decoded on
// the I/O thread by the table's decoders, and handed to the caller's completion as an AsyncOutcome.
#include "dsec/async_client.hpp"

#include <type_traits>
#include <utility>

#include "client/async_transport.hpp"
#include "client/exec_stream.hpp"
#include "client/requests.hpp"
#include "dsec/client.hpp"
#include "dsec/error.hpp"

namespace dsec {

using detail::AsyncCall;
using detail::HttpResponse;
using detail::SandboxRequest;
namespace requests = detail::requests;
namespace answers = detail::answers;

struct AsyncClient::Impl {
  Impl(const Client& client, std::function<void()> after_events)
      : transport(client.core_handle(), std::move(after_events)) {}

  // Submits `call`; its answer, decoded by `decode` on the I/O thread, completes `done`. (`call` is moved into the
  // transport; clang-tidy 14 does not see a move inside a template.)
  template <typename T, typename Decode>
  // NOLINTNEXTLINE(performance-unnecessary-value-param)
  Ticket start(AsyncCall call, Decode decode, Completion<T> done) {
    if (!done) throw Error(Code::kInvalidArgument, "completion: must be set");
    return transport.submit(std::move(call), [decode = std::move(decode), done = std::move(done)](
                                                 HttpResponse* response, const std::exception_ptr& error) {
      AsyncOutcome<T> outcome;
      outcome.error = error;
      if (!outcome.error) {
        try {
          if constexpr (std::is_void_v<T>) {
            decode(*response);
          } else {
            outcome.value.emplace(decode(*response));
          }
        } catch (...) {
          outcome.error = std::current_exception();
        }
      }
      try {
        done(std::move(outcome));
      } catch (...) {
        // A completion's own failure is its own: the I/O thread goes on with the other calls.
      }
    });
  }

  // A request whose answer one of the table's decoders reads (they take the answer and the call's name).
  template <typename T, typename Decoder>
  Ticket decoded(SandboxRequest request, Decoder decoder, Completion<T> done) {
    std::string what = request.what;
    return start<T>(
        AsyncCall{std::move(request)}, [decoder, what = std::move(what)](HttpResponse& r) { return decoder(r, what); },
        std::move(done));
  }

  Ticket no_answer(SandboxRequest request, Completion<void> done) {
    return start<void>(
        AsyncCall{std::move(request)}, [](HttpResponse&) {}, std::move(done));
  }

  // A command (exec, a session's run) whose answer is an ExecResult, or NDJSON streamed to on_output.
  Ticket command(SandboxRequest request, Completion<ExecResult> done, OutputCallback on_output) {
    if (!on_output) return decoded<ExecResult>(std::move(request), answers::exec_result, std::move(done));
    auto stream = std::make_shared<detail::StreamedCommand>(std::move(on_output));
    AsyncCall call{std::move(request)};
    call.on_attempt = [s = stream.get()] { s->new_attempt(); };
    call.on_body = [s = stream.get()](std::string_view bytes) { s->feed(bytes); };
    return start<ExecResult>(
        std::move(call), [stream](HttpResponse&) { return stream->finish(); }, std::move(done));
  }

  detail::AsyncTransport transport;
};

namespace {

// The request carries `data` itself, moved in, instead of a view of the caller's bytes.
SandboxRequest owning(SandboxRequest request, std::string data) {
  request.bytes = {};
  request.body = std::move(data);
  return request;
}

}  // namespace

AsyncClient::AsyncClient(const Client& client, std::function<void()> after_events)
    : impl_(std::make_unique<Impl>(client, std::move(after_events))) {}

AsyncClient::~AsyncClient() { close(); }

void AsyncClient::cancel(Ticket ticket) { impl_->transport.cancel(ticket); }
void AsyncClient::close() { impl_->transport.close(); }
std::size_t AsyncClient::in_flight() const noexcept { return impl_->transport.in_flight(); }

AsyncClient::Ticket AsyncClient::exec(std::string_view sandbox_id, const ExecRequest& request,
                                      Completion<ExecResult> done, OutputCallback on_output) {
  SandboxRequest call = requests::exec(sandbox_id, request, static_cast<bool>(on_output));
  return impl_->command(std::move(call), std::move(done), std::move(on_output));
}

AsyncClient::Ticket AsyncClient::info(std::string_view sandbox_id, Completion<SandboxInfo> done) {
  return impl_->decoded<SandboxInfo>(requests::info(sandbox_id), answers::sandbox_info, std::move(done));
}

AsyncClient::Ticket AsyncClient::destroy(std::string_view sandbox_id, Completion<void> done) {
  return impl_->no_answer(requests::destroy(sandbox_id), std::move(done));
}

AsyncClient::Ticket AsyncClient::sleep(std::string_view sandbox_id, Completion<SleepResult> done) {
  return impl_->start<SleepResult>(
      AsyncCall{requests::sleep_or_wake(sandbox_id, true)},
      [](HttpResponse& r) { return answers::sleep_result(r, true); }, std::move(done));
}

AsyncClient::Ticket AsyncClient::wake(std::string_view sandbox_id, Completion<SleepResult> done) {
  return impl_->start<SleepResult>(
      AsyncCall{requests::sleep_or_wake(sandbox_id, false)},
      [](HttpResponse& r) { return answers::sleep_result(r, false); }, std::move(done));
}

AsyncClient::Ticket AsyncClient::write_file(std::string_view sandbox_id, std::string_view path, std::string data,
                                            unsigned mode, Completion<void> done) {
  SandboxRequest request = requests::write_file(sandbox_id, path, data, mode);
  return impl_->no_answer(owning(std::move(request), std::move(data)), std::move(done));
}

AsyncClient::Ticket AsyncClient::read_file(std::string_view sandbox_id, std::string_view path,
                                           Completion<std::string> done) {
  return impl_->start<std::string>(
      AsyncCall{requests::read_file(sandbox_id, path)},
      [path = std::string(path), id = std::string(sandbox_id)](HttpResponse& r) {
        return answers::file(std::move(r), path, id);
      },
      std::move(done));
}

AsyncClient::Ticket AsyncClient::upload_tar(std::string_view sandbox_id, std::string_view dir, std::string tar_bytes,
                                            Completion<void> done) {
  SandboxRequest request = requests::upload_tar(sandbox_id, dir, tar_bytes);
  return impl_->no_answer(owning(std::move(request), std::move(tar_bytes)), std::move(done));
}

AsyncClient::Ticket AsyncClient::download_tar(std::string_view sandbox_id, std::string_view dir,
                                              Completion<std::string> done) {
  return impl_->start<std::string>(
      AsyncCall{requests::download_tar(sandbox_id, dir)}, [](HttpResponse& r) { return std::move(r.body); },
      std::move(done));
}

AsyncClient::Ticket AsyncClient::spawn(std::string_view sandbox_id, const ProcessRequest& request,
                                       Completion<ProcessInfo> done) {
  return impl_->decoded<ProcessInfo>(requests::spawn(sandbox_id, request), answers::process_info, std::move(done));
}

AsyncClient::Ticket AsyncClient::processes(std::string_view sandbox_id, Completion<std::vector<ProcessInfo>> done) {
  return impl_->decoded<std::vector<ProcessInfo>>(requests::processes(sandbox_id), answers::process_list,
                                                  std::move(done));
}

AsyncClient::Ticket AsyncClient::process_info(std::string_view sandbox_id, int pid, Completion<ProcessInfo> done) {
  return impl_->decoded<ProcessInfo>(requests::process_info(sandbox_id, pid), answers::process_info, std::move(done));
}

AsyncClient::Ticket AsyncClient::process_wait(std::string_view sandbox_id, int pid, double wait_seconds,
                                              Completion<ProcessInfo> done) {
  requests::check_process_wait(wait_seconds);
  return impl_->decoded<ProcessInfo>(requests::process_wait(sandbox_id, pid, wait_seconds), answers::process_info,
                                     std::move(done));
}

AsyncClient::Ticket AsyncClient::process_output(std::string_view sandbox_id, int pid,
                                                std::optional<std::uint64_t> stdout_offset,
                                                std::optional<std::uint64_t> stderr_offset, double wait_seconds,
                                                std::size_t max_bytes, Completion<ProcessOutput> done) {
  SandboxRequest request =
      requests::process_output(sandbox_id, pid, stdout_offset, stderr_offset, wait_seconds, max_bytes);
  std::string what = request.what;
  return impl_->start<ProcessOutput>(
      AsyncCall{std::move(request)},
      [what = std::move(what), want_out = stdout_offset.has_value(), want_err = stderr_offset.has_value()](
          HttpResponse& r) { return answers::process_output(r, what, want_out, want_err); },
      std::move(done));
}

AsyncClient::Ticket AsyncClient::write_stdin(std::string_view sandbox_id, int pid, std::string data,
                                             Completion<void> done) {
  SandboxRequest request = requests::write_stdin(sandbox_id, pid, data);
  return impl_->no_answer(owning(std::move(request), std::move(data)), std::move(done));
}

AsyncClient::Ticket AsyncClient::close_stdin(std::string_view sandbox_id, int pid, Completion<void> done) {
  return impl_->no_answer(requests::close_stdin(sandbox_id, pid), std::move(done));
}

AsyncClient::Ticket AsyncClient::signal(std::string_view sandbox_id, int pid, int sig, bool group,
                                        Completion<ProcessInfo> done) {
  return impl_->decoded<ProcessInfo>(requests::signal(sandbox_id, pid, sig, group), answers::process_info,
                                     std::move(done));
}

AsyncClient::Ticket AsyncClient::resize(std::string_view sandbox_id, int pid, unsigned rows, unsigned cols,
                                        Completion<ProcessInfo> done) {
  return impl_->decoded<ProcessInfo>(requests::resize(sandbox_id, pid, rows, cols), answers::process_info,
                                     std::move(done));
}

AsyncClient::Ticket AsyncClient::kill(std::string_view sandbox_id, int pid, Completion<ProcessInfo> done) {
  return impl_->decoded<ProcessInfo>(requests::kill(sandbox_id, pid), answers::process_info, std::move(done));
}

AsyncClient::Ticket AsyncClient::open_session(std::string_view sandbox_id, const SessionOptions& options,
                                              Completion<SessionInfo> done) {
  return impl_->decoded<SessionInfo>(requests::open_session(sandbox_id, options), answers::session_info,
                                     std::move(done));
}

AsyncClient::Ticket AsyncClient::sessions(std::string_view sandbox_id, Completion<std::vector<SessionInfo>> done) {
  return impl_->decoded<std::vector<SessionInfo>>(requests::sessions(sandbox_id), answers::session_list,
                                                  std::move(done));
}

AsyncClient::Ticket AsyncClient::session_info(std::string_view sandbox_id, std::string_view name,
                                              Completion<SessionInfo> done) {
  return impl_->decoded<SessionInfo>(requests::session_info(sandbox_id, name), answers::session_info, std::move(done));
}

AsyncClient::Ticket AsyncClient::restart_session(std::string_view sandbox_id, std::string_view name,
                                                 Completion<SessionInfo> done) {
  return impl_->decoded<SessionInfo>(requests::restart_session(sandbox_id, name), answers::session_info,
                                     std::move(done));
}

AsyncClient::Ticket AsyncClient::close_session(std::string_view sandbox_id, std::string_view name,
                                               Completion<void> done) {
  return impl_->no_answer(requests::close_session(sandbox_id, name), std::move(done));
}

AsyncClient::Ticket AsyncClient::session_run(std::string_view sandbox_id, std::string_view name,
                                             std::string_view command, double timeout_seconds, std::size_t max_output,
                                             Completion<ExecResult> done, OutputCallback on_output) {
  SandboxRequest call =
      requests::session_run(sandbox_id, name, command, timeout_seconds, max_output, static_cast<bool>(on_output));
  return impl_->command(std::move(call), std::move(done), std::move(on_output));
}

}  // namespace dsec
