#include "agent/backends/qemu/qmp.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "common/syscall.hpp"

namespace dsec::agent::qemu {

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// Milliseconds left until `deadline`, rounded up so a wait never ends just before it; 0 once it has passed.
int poll_timeout_ms(Clock::time_point deadline) {
  auto now = Clock::now();
  if (now >= deadline) return 0;
  auto left = std::chrono::ceil<milliseconds>(deadline - now).count();
  return static_cast<int>(std::min<long long>(left, 1 << 30));
}

Clock::time_point deadline_after(milliseconds timeout) { return Clock::now() + std::max(timeout, milliseconds(0)); }

bool is_reply(const nlohmann::json& msg) { return msg.contains("return") || msg.contains("error"); }

}  // namespace

Code code_for_qmp_error_class(std::string_view error_class) noexcept {
  if (error_class == "DeviceNotFound" || error_class == "CommandNotFound") return Code::kNotFound;
  return Code::kFailedPrecondition;  // GenericError, DeviceNotActive, KVMMissingCap, and classes yet to come
}

QmpClient QmpClient::connect(const std::filesystem::path& path, Clock::time_point deadline) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string& p = path.native();
  if (p.empty() || p.size() >= sizeof(addr.sun_path)) {
    throw Error(Code::kInvalidArgument,
                fmt::format("qmp: socket path '{}' is empty or longer than {} bytes", p, sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, p.data(), p.size());
  auto pause = milliseconds(1);
  for (;;) {
    // Non-blocking, so that a full backlog (EAGAIN) is retried under the deadline instead of blocking in connect.
    UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!fd) throw_errno(errno, "qmp: socket");
    int r = retry_eintr([&] { return ::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)); });
    if (r == 0) return QmpClient(std::move(fd), deadline);
    int err = errno;
    if (err != ECONNREFUSED && err != ENOENT && err != EAGAIN) throw_errno_fmt(err, "qmp: connect to {}", p);
    auto now = Clock::now();
    if (now >= deadline) {
      throw Error(Code::kDeadlineExceeded,
                  fmt::format("qmp: connect to {}: {} until the deadline", p, std::strerror(err)));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(pause, deadline - now));
    pause = std::min(pause * 2, milliseconds(10));
  }
}

QmpClient::QmpClient(UniqueFd connected, Clock::time_point deadline) : fd_(std::move(connected)) {
  if (!fd_) throw Error(Code::kInvalidArgument, "qmp: no socket to adopt");
  int flags = ::fcntl(fd_.get(), F_GETFL);
  if (flags < 0 || ::fcntl(fd_.get(), F_SETFL, flags | O_NONBLOCK) < 0) throw_errno(errno, "qmp: fcntl O_NONBLOCK");
  handshake(deadline);
}

void QmpClient::handshake(Clock::time_point deadline) {
  for (;;) {
    nlohmann::json msg = next_message(deadline, "qmp: greeting");
    if (msg.contains("QMP") && msg["QMP"].is_object()) {
      greeting_ = std::move(msg["QMP"]);
      break;
    }
    if (msg.contains("event")) {
      queue_event(std::move(msg));
      continue;
    }
    throw Error(Code::kInternal, fmt::format("qmp: expected the greeting, got {}", msg.dump()));
  }
  run("qmp_capabilities", nlohmann::json::object(), {}, deadline, "qmp command 'qmp_capabilities'");
}

nlohmann::json QmpClient::execute(std::string_view command, const nlohmann::json& arguments, milliseconds timeout) {
  return run(command, arguments, {}, deadline_after(timeout),
             fmt::format("qmp command '{}' (timeout {} ms)", command, timeout.count()));
}

nlohmann::json QmpClient::execute_with_fds(std::string_view command, const nlohmann::json& arguments,
                                           const std::vector<int>& fds, milliseconds timeout) {
  if (fds.size() > kMaxFdsPerMessage) {
    throw Error(Code::kInvalidArgument, fmt::format("qmp command '{}': {} fds, at most {} per message", command,
                                                    fds.size(), kMaxFdsPerMessage));
  }
  return run(command, arguments, fds, deadline_after(timeout),
             fmt::format("qmp command '{}' (timeout {} ms)", command, timeout.count()));
}

nlohmann::json QmpClient::run(std::string_view command, const nlohmann::json& arguments, const std::vector<int>& fds,
                              Clock::time_point deadline, std::string_view what) {
  if (command.empty()) throw Error(Code::kInvalidArgument, "qmp: empty command name");
  if (!arguments.is_null() && !arguments.is_object()) {
    throw Error(Code::kInvalidArgument, fmt::format("{}: arguments must be an object", what));
  }
  if (closed_) throw Error(Code::kUnavailable, fmt::format("{}: {}", what, closed_reason_));

  const std::uint64_t id = next_id_++;
  nlohmann::json request = {{"execute", std::string(command)}, {"id", id}};
  if (arguments.is_object() && !arguments.empty()) request["arguments"] = arguments;
  std::string line;
  try {
    line = request.dump();
  } catch (const nlohmann::json::exception& e) {  // invalid UTF-8 in a string
    throw Error(Code::kInvalidArgument, fmt::format("{}: cannot encode the arguments: {}", what, e.what()));
  }
  line += '\n';
  send_all(line, fds, deadline, what);

  for (;;) {
    nlohmann::json msg = next_message(deadline, what);
    if (msg.contains("event")) {
      queue_event(std::move(msg));
      continue;
    }
    if (!is_reply(msg)) continue;  // nothing else is expected; ignore rather than fail
    // A reply without an id answers a request QEMU could not parse: with one request in flight, that is ours.
    // A reply with another id is late, for a request whose wait timed out: drop it.
    if (msg.contains("id") && msg["id"] != id) continue;
    if (msg.contains("error")) {
      const nlohmann::json& e = msg["error"];
      std::string cls = e.is_object() ? e.value("class", "GenericError") : "GenericError";
      std::string desc = e.is_object() ? e.value("desc", "") : e.dump();
      throw QmpError(code_for_qmp_error_class(cls), fmt::format("qmp {}: {}: {}", command, cls, desc), cls);
    }
    return std::move(msg["return"]);
  }
}

void QmpClient::send_all(std::string_view data, const std::vector<int>& fds, Clock::time_point deadline,
                         std::string_view what) {
  bool fds_sent = fds.empty();
  while (!data.empty()) {
    ssize_t n = fds_sent ? retry_eintr([&] { return ::send(fd_.get(), data.data(), data.size(), MSG_NOSIGNAL); })
                         : send_with_fds(fd_.get(), data, fds);
    if (n >= 0) {
      data.remove_prefix(static_cast<std::size_t>(n));
      fds_sent = true;
      continue;
    }
    int err = errno;
    if (err == EPIPE || err == ECONNRESET || err == ENOTCONN) fail_closed(what, err);
    if (err != EAGAIN && err != EWOULDBLOCK) throw_errno_fmt(err, "{}: send", what);
    pollfd p{fd_.get(), POLLOUT, 0};
    int r = retry_eintr([&] { return ::poll(&p, 1, poll_timeout_ms(deadline)); });
    if (r < 0) throw_errno_fmt(errno, "{}: poll", what);
    if (r == 0) throw Error(Code::kDeadlineExceeded, fmt::format("{}: QEMU did not take the command in time", what));
  }
}

std::optional<nlohmann::json> QmpClient::pop_buffered() {
  for (;;) {
    auto nl = in_.find('\n', scanned_);
    if (nl == std::string::npos) {
      scanned_ = in_.size();
      if (in_.size() > kMaxMessageBytes) {
        throw Error(Code::kInternal, fmt::format("qmp: a message longer than {} bytes", kMaxMessageBytes));
      }
      return std::nullopt;
    }
    std::string line = in_.substr(0, nl);
    in_.erase(0, nl + 1);
    scanned_ = 0;
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ' || line.back() == '\t')) line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    nlohmann::json msg = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (msg.is_discarded() || !msg.is_object()) {
      throw Error(Code::kInternal, fmt::format("qmp: not a JSON object: {}", line.substr(0, 200)));
    }
    return msg;
  }
}

nlohmann::json QmpClient::next_message(Clock::time_point deadline, std::string_view what) {
  for (;;) {
    if (auto msg = pop_buffered()) return std::move(*msg);
    if (!fill(deadline, what)) {
      throw Error(Code::kDeadlineExceeded, fmt::format("{}: no answer from QEMU in time", what));
    }
  }
}

bool QmpClient::fill(Clock::time_point deadline, std::string_view what) {
  // No early return when closed_: what QEMU sent before it went away is still to be read (then recv says EOF again).
  for (;;) {
    pollfd p{fd_.get(), POLLIN, 0};
    int r = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw_errno_fmt(errno, "{}: poll", what);
    }
    if (r == 0) return false;
    char buf[64 * 1024];
    ssize_t n = retry_eintr([&] { return ::recv(fd_.get(), buf, sizeof(buf), 0); });
    if (n > 0) {
      in_.append(buf, static_cast<std::size_t>(n));
      return true;
    }
    if (n == 0) fail_closed(what, 0);
    int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK) continue;
    if (err == ECONNRESET || err == ENOTCONN) fail_closed(what, err);
    throw_errno_fmt(err, "{}: recv", what);
  }
}

void QmpClient::fail_closed(std::string_view what, int err) {
  closed_ = true;
  closed_reason_ = err == 0 ? std::string("QEMU closed the monitor connection")
                            : fmt::format("monitor connection lost: {}", std::strerror(err));
  throw Error(Code::kUnavailable, fmt::format("{}: {}", what, closed_reason_));
}

void QmpClient::queue_event(nlohmann::json event) {
  if (events_.size() >= kMaxQueuedEvents) events_.pop_front();
  events_.push_back(std::move(event));
}

nlohmann::json QmpClient::wait_event(std::string_view name, milliseconds timeout) {
  auto match = [&](const nlohmann::json& e) {
    auto it = e.find("event");
    return it != e.end() && it->is_string() && it->get_ref<const std::string&>() == name;
  };
  if (auto it = std::find_if(events_.begin(), events_.end(), match); it != events_.end()) {
    nlohmann::json e = std::move(*it);
    events_.erase(it);
    return e;
  }
  auto deadline = deadline_after(timeout);
  std::string what = fmt::format("qmp: waiting {} ms for event {}", timeout.count(), name);
  for (;;) {
    nlohmann::json msg;
    try {
      msg = next_message(deadline, what);
    } catch (const Error& e) {
      if (e.code() != Code::kDeadlineExceeded) throw;
      throw Error(Code::kDeadlineExceeded, fmt::format("qmp: no event {} within {} ms", name, timeout.count()));
    }
    if (!msg.contains("event")) continue;  // a late reply: nobody waits for it
    if (match(msg)) return msg;
    queue_event(std::move(msg));
  }
}

std::vector<nlohmann::json> QmpClient::take_events() {
  try {
    for (;;) {
      if (auto msg = pop_buffered()) {
        if (msg->contains("event")) queue_event(std::move(*msg));
        continue;
      }
      if (!fill(Clock::now(), "qmp: reading events")) break;
    }
  } catch (const Error&) {
    // Closed, or garbage on the socket: keep what was queued; the next command reports the failure.
  }
  std::vector<nlohmann::json> out(std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
  events_.clear();
  return out;
}

std::string qmp_status(QmpClient& qmp) {
  nlohmann::json r = qmp.execute("query-status");
  auto it = r.find("status");
  if (it == r.end() || !it->is_string()) {
    throw Error(Code::kInternal, fmt::format("qmp query-status: no status in {}", r.dump()));
  }
  return it->get<std::string>();
}

void qmp_wait_migration(QmpClient& qmp, milliseconds timeout) {
  auto deadline = deadline_after(timeout);
  std::string status = "none";
  for (int polls = 0;; ++polls) {
    auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      throw Error(Code::kDeadlineExceeded,
                  fmt::format("migration not completed within {} ms (status {})", timeout.count(), status));
    }
    nlohmann::json r = qmp.execute("query-migrate", nlohmann::json::object(), std::min(left, milliseconds(10000)));
    status = r.is_object() ? r.value("status", "none") : "none";  // {} until a migration has started
    if (status == "completed") return;
    if (status == "failed" || status == "cancelled") {
      std::string desc = r.value("error-desc", "QEMU gave no error-desc");
      throw Error(status == "failed" ? Code::kInternal : Code::kCancelled,
                  fmt::format("migration {}: {}", status, desc));
    }
    // Every millisecond for the first 10 polls (a small VM's state is saved in a few ms), then every 2 ms.
    std::this_thread::sleep_for(milliseconds(polls < 10 ? 1 : 2));
  }
}

}  // namespace dsec::agent::qemu
