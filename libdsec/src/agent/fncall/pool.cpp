#include "agent/fncall/pool.hpp"

#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include <fmt/format.h>

#include "agent/fncall/pool_sizing.hpp"
#include "common/log.hpp"

namespace dsec::agent::fncall {
namespace {

// Starts that fail one after another are retried ever more slowly, from one second up to this.
constexpr auto kMaxStartBackoff = std::chrono::seconds(30);
// A call whose server lost its child before the call reached it is tried on another, at most this many times.
constexpr int kMaxAttempts = 3;

bool permanent(Code code) {
  return code == Code::kFailedPrecondition || code == Code::kInvalidArgument || code == Code::kNotFound ||
         code == Code::kPermissionDenied;
}

}  // namespace

Pool::Pool(Runtime& runtime, PoolWorkers workers, std::string language, ResolvedImage image, std::size_t min,
           std::size_t max)
    : rt_(runtime),
      workers_(workers),
      language_(std::move(language)),
      image_(std::move(image)),
      min_(min),
      max_(std::max<std::size_t>(max, 1)) {}

Pool::~Pool() { shutdown(); }

std::size_t Pool::live_locked() const {
  return static_cast<std::size_t>(
      std::count_if(servers_.begin(), servers_.end(), [](const ServerPtr& s) { return !s->dead; }));
}

FnCallResult Pool::call(const FnCallRequest& request, const CallSettings& settings, Clock::time_point queue_deadline) {
  for (int attempt = 1;; ++attempt) {
    ServerPtr server;
    Slot slot;
    {
      std::unique_lock lock(mu_);
      if (shut_) throw Error(Code::kUnavailable, "function calls: the node is shutting down");
      if (waiting_ >= rt_.config.queue_limit)
        throw Error(Code::kResourceExhausted,
                    fmt::format("function calls: {} calls already wait for a {} fork server of {} on node {}", waiting_,
                                language_, image_.name, rt_.node_id));
      ++waiting_;
      struct Unwait {
        std::size_t& waiting;
        ~Unwait() { --waiting; }
      } unwait{waiting_};
      adjust_locked();
      for (;;) {
        for (const auto& s : servers_)
          if (!s->dead && !s->busy && s->armed) {
            server = s;
            break;
          }
        if (server) break;
        if (shut_) throw Error(Code::kUnavailable, "function calls: the node is shutting down");
        if (live_locked() == 0 && start_error_ && (permanent(start_error_->code()) || start_failures_ >= 3))
          throw *start_error_;
        if (cv_.wait_until(lock, queue_deadline) == std::cv_status::timeout && Clock::now() >= queue_deadline)
          throw Error(Code::kResourceExhausted,
                      fmt::format("function calls: no {} fork server of {} came free on node {} in time ({} of at "
                                  "most {} are busy{})",
                                  language_, image_.name, rt_.node_id, running_, max_,
                                  last_error_.empty() ? "" : "; last failure: " + last_error_));
      }
      server->busy = true;
      ++running_;
      slot = std::move(*server->armed);
      server->armed.reset();
      last_used_ = Clock::now();
      arm_locked(server);  // the next child arms while this call runs
    }
    bool fault = false;
    std::optional<FnCallResult> result;
    std::optional<Error> error;
    try {
      result = run_call(slot, request, settings, &fault);
    } catch (const Error& e) {
      error = e;
    } catch (const std::exception& e) {
      error = Error(Code::kInternal, e.what());
    }
    release_slot(std::move(slot), server);
    {
      std::lock_guard lock(mu_);
      server->busy = false;
      --running_;
      ++calls_;
      server->idle_since = Clock::now();
      last_used_ = server->idle_since;
      // A server found dead while its call ran (or whose child vanished with it) leaves the pool now.
      if (server->dead || (fault && (!server->process || !server->process->alive()))) retire_locked(server);
      else adjust_locked();
    }
    cv_.notify_all();
    if (result) return std::move(*result);
    if (fault && attempt < kMaxAttempts) continue;
    throw *error;
  }
}

void Pool::adjust_locked() {
  if (shut_) return;
  auto now = Clock::now();
  PoolLoad load;
  load.min = min_;
  load.max = max_;
  load.waiting = waiting_;
  std::vector<ServerPtr> expired;
  for (const auto& s : servers_) {
    if (s->dead) continue;
    ++load.servers;
    if (s->busy) ++load.busy;
    if (!s->busy && s->armed && now - s->idle_since > rt_.config.idle_timeout) expired.push_back(s);
  }
  load.idle_expired = expired.size();
  PoolDecision d = decide_pool_size(load);
  if (d.start > 0 && now >= next_start_)
    for (std::size_t i = 0; i < d.start; ++i) start_server_locked();
  // The longest idle first.
  std::sort(expired.begin(), expired.end(),
            [](const ServerPtr& a, const ServerPtr& b) { return a->idle_since < b->idle_since; });
  for (std::size_t i = 0; i < d.stop && i < expired.size(); ++i) retire_locked(expired[i]);
}

void Pool::start_server_locked() {
  auto server = std::make_shared<Server>();
  server->id = fmt::format("s{}", rt_.next_id.fetch_add(1));
  servers_.push_back(server);
  ForkServerParams params{server->id, language_, image_.name, image_.layers};
  workers_.starts.post([self = shared_from_this(), server, params] {
    {
      std::lock_guard lock(self->mu_);
      if (self->shut_ || server->dead) return;
    }
    try {
      self->on_started(server, ForkServer::start(self->rt_, params));
    } catch (const Error& e) {
      self->on_start_failed(server, e);
    } catch (const std::exception& e) {
      self->on_start_failed(server, Error(Code::kInternal, e.what()));
    }
  });
}

void Pool::on_started(const ServerPtr& server, std::unique_ptr<ForkServer> process) {
  std::unique_lock lock(mu_);
  if (shut_ || server->dead) {
    lock.unlock();
    process->kill();
    return;
  }
  for (const auto& missing : process->preload_failures())
    log_warn("fncall: fork server {} of {} could not import {}", server->id, image_.name, missing);
  server->process = std::move(process);
  server->starting = false;
  start_failures_ = 0;
  start_error_.reset();
  arm_locked(server);
}

void Pool::on_start_failed(const ServerPtr& server, const Error& error) {
  {
    std::lock_guard lock(mu_);
    ++start_failures_;
    start_error_ = error;
    last_error_ = error.what();
    if (start_failures_ >= 3) {
      auto backoff = std::min<std::chrono::steady_clock::duration>(
          std::chrono::seconds(1) * (1 << std::min<std::size_t>(start_failures_ - 3, 5)), kMaxStartBackoff);
      next_start_ = Clock::now() + backoff;
    }
    server->starting = false;
    if (!server->dead) retire_locked(server);
  }
  log_warn("fncall: a {} fork server of {} did not start: {}", language_, image_.name, error.what());
  cv_.notify_all();
}

void Pool::arm_locked(const ServerPtr& server) {
  if (server->arming || server->dead || !server->process) return;
  server->arming = true;
  workers_.arms.post([self = shared_from_this(), server] { self->arm_job(server); });
}

void Pool::arm_job(const ServerPtr& server) {
  ForkServer* process = nullptr;
  {
    std::lock_guard lock(mu_);
    if (shut_ || server->dead || !server->process) {
      server->arming = false;
      return;
    }
    process = server->process.get();
  }
  try {
    Slot slot = process->arm(language_ == "c" || language_ == "cpp");
    std::unique_lock lock(mu_);
    server->arming = false;
    if (shut_ || server->dead) {
      lock.unlock();
      release_slot(std::move(slot));
      return;
    }
    server->armed = std::move(slot);
    if (!server->busy) server->idle_since = Clock::now();
  } catch (const std::exception& e) {
    std::lock_guard lock(mu_);
    server->arming = false;
    last_error_ = e.what();
    // A server that cannot arm is of no use: replace it.
    if (!server->dead) {
      log_warn("fncall: fork server {} of {} failed to arm a call's child and is replaced: {}", server->id, image_.name,
               e.what());
      if (!server->busy) retire_locked(server);
      else server->dead = true;
    }
    adjust_locked();
  }
  cv_.notify_all();
}

void Pool::retire_locked(const ServerPtr& server) {
  server->dead = true;
  servers_.erase(std::remove(servers_.begin(), servers_.end(), server), servers_.end());
  std::optional<Slot> slot = std::move(server->armed);
  server->armed.reset();
  workers_.cleanup.post([server, slot = std::make_shared<std::optional<Slot>>(std::move(slot))]() mutable {
    if (*slot) {
      (*slot)->sock.reset();
      if ((*slot)->cgroup) (*slot)->cgroup->destroy();
      if ((*slot)->run_cgroup) (*slot)->run_cgroup->destroy();
      slot->reset();
    }
    if (server->process) server->process->kill();
  });
}

void Pool::release_slot(Slot slot, const ServerPtr& server) {
  auto held = std::make_shared<Slot>(std::move(slot));
  if (server && server->process) {
    workers_.cleanup.post([held, server] { server->process->recycle(std::move(*held)); });
    return;
  }
  workers_.cleanup.post([held] {
    // The child is gone (or, for a slot never used, ends at its socket's end of file); the cgroup's removal waits
    // for its last process.
    if (held->pidfd) ::syscall(SYS_pidfd_send_signal, held->pidfd.get(), SIGKILL, nullptr, 0);
    held->sock.reset();
    held->pidfd.reset();
    held->mount_ns.reset();  // the call's mounts (its /tmp) go now
    if (held->cgroup) held->cgroup->destroy();
    if (held->run_cgroup) held->run_cgroup->destroy();
  });
}

void Pool::maintain() {
  {
    std::lock_guard lock(mu_);
    if (shut_) return;
    std::vector<ServerPtr> gone;
    for (const auto& s : servers_)
      if (!s->dead && !s->starting && s->process && !s->process->alive()) gone.push_back(s);
    for (const auto& s : gone) {
      log_warn("fncall: fork server {} of {} ({}) died and is replaced", s->id, image_.name, language_);
      if (s->busy) {
        s->dead = true;  // its call ends on its own; the server leaves the list now
        servers_.erase(std::remove(servers_.begin(), servers_.end(), s), servers_.end());
        workers_.cleanup.post([s] { s->process->kill(); });
      } else {
        retire_locked(s);
      }
    }
    adjust_locked();
  }
  cv_.notify_all();
}

void Pool::warm() {
  std::lock_guard lock(mu_);
  adjust_locked();
}

void Pool::shutdown() {
  std::vector<ServerPtr> servers;
  {
    std::lock_guard lock(mu_);
    if (shut_) return;
    shut_ = true;
    servers.swap(servers_);
    for (auto& s : servers) s->dead = true;
  }
  cv_.notify_all();
  for (auto& s : servers) {
    if (s->armed) {
      s->armed->sock.reset();
      s->armed.reset();  // its cgroup is removed by its destructor, once the server's kill ended the child
    }
    if (s->process) s->process->kill();
  }
}

PoolStatus Pool::status() const {
  std::lock_guard lock(mu_);
  PoolStatus st;
  st.image = image_.name;
  st.language = language_;
  st.min = min_;
  st.max = max_;
  st.waiting = waiting_;
  st.calls = calls_;
  st.last_error = last_error_;
  for (const auto& s : servers_) {
    if (s->dead) continue;
    if (s->busy) ++st.busy;
    else if (s->armed) ++st.idle;
    else ++st.starting;
  }
  return st;
}

bool Pool::unused_since(Clock::time_point since) const {
  std::lock_guard lock(mu_);
  return servers_.empty() && waiting_ == 0 && running_ == 0 && last_used_ < since;
}

}  // namespace dsec::agent::fncall
