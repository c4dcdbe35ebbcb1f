#include "client/async_transport.hpp"

#include <curl/curl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "client/client_core.hpp"
#include "client/curl_exchange.hpp"
#include "http/curl.hpp"

namespace dsec::detail {
namespace {

using std::chrono::duration_cast;
using std::chrono::milliseconds;

// Easy handles kept for the next transfers (their connections live in the multi handle's cache).
constexpr std::size_t kMaxIdleHandles = 256;
// Idle connections kept for the next calls, over every node.
constexpr long kMaxIdleConnections = 1024;
// The longest the I/O thread sleeps in epoll_wait when nothing is due (work handed to it ends the wait sooner).
constexpr long kMaxPollMs = 1'000;

// One call in flight: its request, where its retries are, and its transfer when one is on the multi handle.
struct Pending {
  std::uint64_t ticket = 0;
  AsyncCall call;
  AsyncDone done;
  HttpRequest request;  // views into call
  SteadyClock::time_point deadline;
  int attempt = 0;
  bool maybe_sent = false;  // an exactly-once request may have reached the agent
  NodePtr node;
  CURL* easy = nullptr;
  std::unique_ptr<CurlExchange> exchange;
  std::multimap<SteadyClock::time_point, std::uint64_t>::iterator timer;
  bool waiting = false;  // timer is set
};

}  // namespace

// The I/O thread waits in epoll for the sockets curl asks it to watch (curl_multi_socket_action), its timers and an
// eventfd that other threads write to hand it work: each event costs the same however many calls are in flight.
struct AsyncTransport::Impl {
  Impl(std::shared_ptr<ClientCore> c, std::function<void()> after)
      : core(std::move(c)), after_events(std::move(after)) {
    http::curl::global_init("the HTTP client");
    epoll = ::epoll_create1(EPOLL_CLOEXEC);
    wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (epoll < 0 || wake < 0) {
      const int err = errno;
      if (epoll >= 0) ::close(epoll);
      if (wake >= 0) ::close(wake);
      throw Error(Code::kResourceExhausted, fmt::format("the asyncio core's epoll: {}", std::strerror(err)));
    }
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = wake;
    ::epoll_ctl(epoll, EPOLL_CTL_ADD, wake, &ev);
    multi = curl_multi_init();
    if (!multi) throw Error(Code::kResourceExhausted, "curl_multi_init failed (out of memory?)");
    curl_multi_setopt(multi, CURLMOPT_SOCKETFUNCTION, &Impl::on_socket);
    curl_multi_setopt(multi, CURLMOPT_SOCKETDATA, static_cast<void*>(this));
    curl_multi_setopt(multi, CURLMOPT_TIMERFUNCTION, &Impl::on_timer);
    curl_multi_setopt(multi, CURLMOPT_TIMERDATA, static_cast<void*>(this));
    // Connections stay open between calls (by default curl keeps only 4 per transfer in flight, so a burst's
    // connections would close as it drains and the next burst would connect again).
    curl_multi_setopt(multi, CURLMOPT_MAXCONNECTS, kMaxIdleConnections);
    std::random_device rd;
    rng.seed((static_cast<std::uint64_t>(rd()) << 32) ^ rd());
    thread = std::thread([this] { run(); });
  }
  ~Impl() {
    ::close(epoll);
    ::close(wake);
  }

  // curl: watch socket `s` for `what` (CURL_POLL_IN/OUT/INOUT), or stop (CURL_POLL_REMOVE).
  static int on_socket(CURL*, curl_socket_t s, int what, void* self, void* known) {
    auto* impl = static_cast<Impl*>(self);
    if (what == CURL_POLL_REMOVE) {
      ::epoll_ctl(impl->epoll, EPOLL_CTL_DEL, s, nullptr);
      return 0;
    }
    epoll_event ev{};
    ev.events = (what & CURL_POLL_IN ? EPOLLIN : 0u) | (what & CURL_POLL_OUT ? EPOLLOUT : 0u);
    ev.data.fd = s;
    if (!known) {
      if (::epoll_ctl(impl->epoll, EPOLL_CTL_ADD, s, &ev) != 0 && errno == EEXIST)
        ::epoll_ctl(impl->epoll, EPOLL_CTL_MOD, s, &ev);
      curl_multi_assign(impl->multi, s, impl);  // any non-null: known from now on
    } else if (::epoll_ctl(impl->epoll, EPOLL_CTL_MOD, s, &ev) != 0 && errno == ENOENT) {
      ::epoll_ctl(impl->epoll, EPOLL_CTL_ADD, s, &ev);
    }
    return 0;
  }
  // curl: call curl_multi_socket_action(CURL_SOCKET_TIMEOUT) in `ms` (-1: no timer).
  static int on_timer(CURLM*, long ms, void* self) {
    auto* impl = static_cast<Impl*>(self);
    impl->curl_due = ms < 0 ? std::nullopt : std::optional(SteadyClock::now() + milliseconds{ms});
    return 0;
  }
  void poke() {
    const std::uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake, &one, sizeof one);
  }
  void read_messages();

  void run();
  void take_requests(std::vector<std::unique_ptr<Pending>>& fresh, std::vector<std::uint64_t>& cancelled, bool& stop);
  void start(Pending& p);
  void transfer_done(CURL* easy, CURLcode rc);
  // The attempt failed with `error` (thrown by the exchange itself when `exchange` is true, else by routing): retry
  // after a backoff, or end the call.
  void attempt_failed(Pending& p, const std::exception_ptr& error, bool exchange);
  void finish(Pending& p, HttpResponse* response, std::exception_ptr error);
  void detach_transfer(Pending& p);
  long poll_timeout_ms();

  std::shared_ptr<ClientCore> core;
  int epoll = -1;
  int wake = -1;  // eventfd: work for the I/O thread
  CURLM* multi = nullptr;
  std::optional<SteadyClock::time_point> curl_due;  // curl's timer
  std::function<void()> after_events;
  std::thread thread;

  std::mutex mu;  // guards what other threads hand the I/O thread
  std::vector<std::unique_ptr<Pending>> incoming;
  std::vector<std::uint64_t> cancels;
  bool closing = false;
  std::atomic<std::uint64_t> next_ticket{1};
  std::atomic<std::size_t> in_flight{0};

  // The I/O thread's own.
  std::unordered_map<std::uint64_t, std::unique_ptr<Pending>> calls;
  std::multimap<SteadyClock::time_point, std::uint64_t> timers;  // retries waiting out their backoff
  http::curl::HandlePool handles{kMaxIdleHandles};               // easy handles for the next transfers
  std::mt19937_64 rng;
};

AsyncTransport::AsyncTransport(std::shared_ptr<ClientCore> core, std::function<void()> after_events)
    : impl_(std::make_unique<Impl>(std::move(core), std::move(after_events))) {}

AsyncTransport::~AsyncTransport() { close(); }

std::uint64_t AsyncTransport::submit(AsyncCall call, AsyncDone done) {
  auto p = std::make_unique<Pending>();
  p->ticket = impl_->next_ticket.fetch_add(1);
  p->call = std::move(call);
  p->done = std::move(done);
  p->request = p->call.request.http();
  p->request.on_body = p->call.on_body;
  const std::uint64_t ticket = p->ticket;
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->closing) throw Error(Code::kFailedPrecondition, "this dsec client is closed");
    p->deadline = impl_->core->deadline_after(p->call.request.how.extra);
    impl_->incoming.push_back(std::move(p));
    impl_->in_flight.fetch_add(1);
  }
  impl_->poke();
  return ticket;
}

void AsyncTransport::cancel(std::uint64_t ticket) {
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->closing) return;
    impl_->cancels.push_back(ticket);
  }
  impl_->poke();
}

void AsyncTransport::close() {
  if (!impl_) return;
  {
    std::lock_guard lock(impl_->mu);
    if (impl_->closing && !impl_->thread.joinable()) return;
    impl_->closing = true;
  }
  impl_->poke();
  if (impl_->thread.joinable()) {
    if (impl_->thread.get_id() == std::this_thread::get_id()) impl_->thread.detach();  // closed from a completion
    else impl_->thread.join();
  }
}

std::size_t AsyncTransport::in_flight() const noexcept { return impl_->in_flight.load(); }

void AsyncTransport::Impl::take_requests(std::vector<std::unique_ptr<Pending>>& fresh,
                                         std::vector<std::uint64_t>& cancelled, bool& stop) {
  std::lock_guard lock(mu);
  fresh.swap(incoming);
  cancelled.swap(cancels);
  stop = closing;
}

void AsyncTransport::Impl::run() {
  std::vector<std::unique_ptr<Pending>> fresh;
  std::vector<std::uint64_t> cancelled;
  bool stop = false;
  for (;;) {
    fresh.clear();
    cancelled.clear();
    take_requests(fresh, cancelled, stop);
    for (auto& p : fresh) {
      Pending& ref = *p;
      calls.emplace(ref.ticket, std::move(p));
      if (stop) continue;
      start(ref);
    }
    for (std::uint64_t t : cancelled) {
      auto it = calls.find(t);
      if (it == calls.end()) continue;
      detach_transfer(*it->second);
      auto gone = std::move(it->second);
      calls.erase(it);
      in_flight.fetch_sub(1);
    }
    if (stop) break;
    const auto now = SteadyClock::now();
    while (!timers.empty() && timers.begin()->first <= now) {
      auto it = calls.find(timers.begin()->second);
      timers.erase(timers.begin());
      if (it == calls.end()) continue;
      it->second->waiting = false;
      start(*it->second);
    }
    epoll_event events[128];
    const int n = ::epoll_wait(epoll, events, 128, static_cast<int>(poll_timeout_ms()));
    int running = 0;
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      if (fd == wake) {
        std::uint64_t count;
        [[maybe_unused]] auto r = ::read(wake, &count, sizeof count);
        continue;
      }
      int flags = 0;
      if (events[i].events & EPOLLIN) flags |= CURL_CSELECT_IN;
      if (events[i].events & EPOLLOUT) flags |= CURL_CSELECT_OUT;
      if (events[i].events & (EPOLLERR | EPOLLHUP)) flags |= CURL_CSELECT_ERR;
      curl_multi_socket_action(multi, fd, flags, &running);
    }
    if (curl_due && *curl_due <= SteadyClock::now()) {
      curl_due.reset();
      curl_multi_socket_action(multi, CURL_SOCKET_TIMEOUT, 0, &running);
    }
    read_messages();
    if (after_events) after_events();
  }
  // Closed: every call still in flight ends now.
  const Error closed(Code::kFailedPrecondition, "this dsec client is closed");
  while (!calls.empty()) {
    Pending& p = *calls.begin()->second;
    detach_transfer(p);
    finish(p, nullptr, std::make_exception_ptr(closed));
  }
  if (after_events) after_events();
  curl_multi_cleanup(multi);
  multi = nullptr;
}

void AsyncTransport::Impl::read_messages() {
  int left = 0;
  while (CURLMsg* m = curl_multi_info_read(multi, &left))
    if (m->msg == CURLMSG_DONE) transfer_done(m->easy_handle, m->data.result);
}

long AsyncTransport::Impl::poll_timeout_ms() {
  long ms = kMaxPollMs;
  const auto now = SteadyClock::now();
  for (const auto& due : {curl_due, timers.empty() ? std::nullopt : std::optional(timers.begin()->first)}) {
    if (!due) continue;
    const auto left = duration_cast<milliseconds>(*due - now).count();
    ms = std::clamp<long>(static_cast<long>(*due > now ? left + 1 : 0), 0, ms);
  }
  return ms;
}

void AsyncTransport::Impl::start(Pending& p) {
  ++p.attempt;
  try {
    core->check_open();
    // Routing is a lookup in the node table; only a sandbox of a node whose id is not known yet asks the nodes.
    p.node = core->route(p.call.request.sandbox_id, p.deadline);
    const auto now = SteadyClock::now();
    const auto until = std::min(p.deadline, now + core->options().request_timeout + p.call.request.how.extra);
    const auto remaining = duration_cast<milliseconds>(until - now).count();
    if (remaining <= 0)
      throw TransportError(Code::kDeadlineExceeded,
                           fmt::format("deadline exceeded before {} {} on {} was sent", p.request.method,
                                       p.request.target, p.node->endpoint),
                           false, false);
  } catch (...) {
    attempt_failed(p, std::current_exception(), false);
    return;
  }
  try {
    if (p.call.on_attempt) p.call.on_attempt();
    CURL* easy = handles.take();
    p.easy = easy;
    const auto now = SteadyClock::now();
    const auto until = std::min(p.deadline, now + core->options().request_timeout + p.call.request.how.extra);
    const auto& transport = p.node->transport;
    p.exchange = std::make_unique<CurlExchange>(easy, transport.endpoint(), transport.credentials().get(), p.request,
                                                static_cast<long>(duration_cast<milliseconds>(until - now).count()));
    curl_easy_setopt(easy, CURLOPT_PRIVATE, static_cast<void*>(&p));
    if (CURLMcode rc = curl_multi_add_handle(multi, easy); rc != CURLM_OK)
      throw Error(Code::kInternal, fmt::format("curl_multi_add_handle: {}", curl_multi_strerror(rc)));
  } catch (...) {
    detach_transfer(p);
    finish(p, nullptr, std::current_exception());
  }
}

void AsyncTransport::Impl::detach_transfer(Pending& p) {
  if (p.waiting) {
    timers.erase(p.timer);
    p.waiting = false;
  }
  if (!p.easy) return;
  curl_multi_remove_handle(multi, p.easy);  // mid-transfer: the connection is closed
  p.exchange.reset();
  handles.give_back(p.easy);
  p.easy = nullptr;
}

void AsyncTransport::Impl::transfer_done(CURL* easy, CURLcode rc) {
  void* priv = nullptr;
  curl_easy_getinfo(easy, CURLINFO_PRIVATE, &priv);
  Pending& p = *static_cast<Pending*>(priv);
  HttpResponse response;
  std::exception_ptr error;
  try {
    response = p.exchange->finish(rc);
  } catch (...) {
    error = std::current_exception();
  }
  detach_transfer(p);
  if (error) {
    attempt_failed(p, error, true);
    return;
  }
  // An agent that answers is alive, whatever it answered.
  core->count_exchange(p.node, true);
  if (response.status >= 200 && response.status < 300) {
    finish(p, &response, nullptr);
    return;
  }
  attempt_failed(p, std::make_exception_ptr(agent_error(p.request, p.node->endpoint, response)), true);
}

void AsyncTransport::Impl::attempt_failed(Pending& p, const std::exception_ptr& error, bool exchange) {
  const SandboxCall& how = p.call.request.how;
  std::optional<Error> failure;
  try {
    std::rethrow_exception(error);
  } catch (const TransportError& e) {
    if (exchange) core->count_exchange(p.node, false);
    failure = e;
    if (!how.request_id.empty()) {
      p.maybe_sent = p.maybe_sent || e.maybe_sent();
    } else if (exchange && !how.repeatable && e.maybe_sent() && e.retryable()) {
      // Once the agent may have the request, doing it twice is worse than failing (ClientCore::call_once).
      failure =
          Error(e.code(), std::string(e.what()) + " (not retried: the agent may have acted on it)", false, e.fault());
    }
    if (how.retry_timeouts && e.code() == Code::kDeadlineExceeded && SteadyClock::now() < p.deadline)
      failure = Error(Code::kUnavailable, std::string(e.what()) + " (retried with the same request id)", true);
  } catch (const Error& e) {
    failure = e;
    if (exchange && how.request_id.empty() && !how.repeatable) failure = Error(e.code(), e.what(), false, e.fault());
  } catch (...) {
    finish(p, nullptr, error);  // not dsec's error (a decoder's bug, out of memory): never retried
    return;
  }
  // The retry policy of dsec::retry_call, with the backoff a timer of this thread.
  const RetryPolicy& policy = core->options().retry;
  if (!failure->retryable() || p.attempt >= policy.max_attempts) {
    finish(p, nullptr, std::make_exception_ptr(*failure));
    return;
  }
  std::uniform_int_distribution<std::int64_t> jitter(0, policy.backoff_cap(p.attempt + 1).count());
  const auto due = SteadyClock::now() + milliseconds{jitter(rng)};
  if (due >= p.deadline) {
    finish(p, nullptr,
           std::make_exception_ptr(Error(Code::kDeadlineExceeded,
                                         fmt::format("deadline exceeded after {} attempts; last error: {}: {}",
                                                     p.attempt, failure->code_name(), failure->what()),
                                         false)));
    return;
  }
  p.timer = timers.emplace(due, p.ticket);
  p.waiting = true;
}

void AsyncTransport::Impl::finish(Pending& p, HttpResponse* response, std::exception_ptr error) {
  const SandboxRequest& request = p.call.request;
  if (error && !request.how.request_id.empty()) {
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      if (auto unknown = outcome_unknown(e, request.sandbox_id, request.how.request_id, p.maybe_sent))
        error = std::make_exception_ptr(*unknown);
    } catch (...) {
    }
  }
  auto it = calls.find(p.ticket);
  std::unique_ptr<Pending> owned = std::move(it->second);
  calls.erase(it);
  in_flight.fetch_sub(1);
  try {
    owned->done(response, error);
  } catch (...) {
    // A completion must not take the I/O thread down; the binding's own never throws.
  }
}

}  // namespace dsec::detail
