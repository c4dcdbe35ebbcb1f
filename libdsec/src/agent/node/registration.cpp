#include "agent/node/registration.hpp"

#include <algorithm>

#include <fmt/format.h>

#include "cluster/node_record.hpp"
#include "common/log.hpp"

namespace dsec::agent {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

constexpr milliseconds kMinBackoff{200};
constexpr std::chrono::seconds kRepeatWarning{30};

}  // namespace

Registration::Registration(RegistrationOptions options, std::function<NodeInfo()> node_info,
                           std::function<std::string()> fncall_status)
    : options_(std::move(options)), node_info_(std::move(node_info)), fncall_status_(std::move(fncall_status)) {
  if (options_.lease_ttl.count() < 2)
    throw Error(Code::kInvalidArgument,
                fmt::format("etcd lease TTL {} s: use at least 2 s", options_.lease_ttl.count()));
  if (options_.endpoint.empty()) throw Error(Code::kInvalidArgument, "etcd registration needs an advertised endpoint");
  key_ = cluster::node_key(options_.prefix, options_.node_id);
  cluster::EtcdOptions etcd;
  etcd.endpoints = options_.etcd_endpoints;
  etcd.request_timeout = options_.request_timeout;
  etcd.connect_timeout = std::min<milliseconds>(options_.request_timeout, milliseconds(1'000));
  etcd.ca_file = options_.etcd_ca_file;
  etcd.client_cert = options_.etcd_client_cert;
  etcd.client_key = options_.etcd_client_key;
  etcd_ = std::make_unique<cluster::EtcdClient>(std::move(etcd));
}

Registration::~Registration() { stop(); }

void Registration::start() {
  std::lock_guard lock(mu_);
  if (thread_.joinable() || stopping_) return;
  thread_ = std::thread([this] { loop(); });
}

bool Registration::registered() const {
  std::lock_guard lock(mu_);
  return registered_;
}

void Registration::wait(milliseconds d) {
  std::unique_lock lock(mu_);
  wake_.wait_for(lock, d, [&] { return stopping_; });
}

void Registration::loop() {
  const milliseconds period = std::max<milliseconds>(milliseconds(options_.lease_ttl) / 3, milliseconds(500));
  const milliseconds max_backoff = std::min(period, options_.max_backoff);
  const auto started = Clock::now();
  milliseconds backoff = kMinBackoff;
  std::int64_t lease = 0;
  bool failing = false;
  bool ever_registered = false;
  auto last_warning = Clock::time_point{};

  for (;;) {
    {
      std::lock_guard lock(mu_);
      if (stopping_) return;
    }
    if (options_.stop_renewing_after.count() > 0 && Clock::now() - started >= options_.stop_renewing_after) {
      log_warn("etcd: no longer renewing {} (--etcd-stop-renewing-after): the key goes when its lease expires", key_);
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stopping_; });
      lease_ = 0;  // the lease is left to expire: shutdown does not revoke it
      return;
    }
    try {
      if (lease != 0 && etcd_->keepalive(lease) == 0) {
        log_warn(
            "etcd: the lease of {} is gone (it expired while etcd was away, or etcd lost it); registering "
            "again",
            key_);
        lease = 0;
      }
      if (lease == 0) {
        lease = etcd_->grant_lease(options_.lease_ttl).id;
        std::lock_guard lock(mu_);
        lease_ = lease;
      }
      // Written every time, not only when the load changed: a key deleted by hand comes back within a period.
      cluster::NodeRecord record{options_.endpoint, node_info_(), fncall_status_ ? fncall_status_() : std::string()};
      try {
        etcd_->put(key_, cluster::encode_node_record(record), lease);
      } catch (const Error& e) {
        if (e.code() != Code::kNotFound) throw;
        lease = 0;  // the lease went between keepalive and put: a new one at once
        continue;
      }
      {
        std::lock_guard lock(mu_);
        registered_ = true;
      }
      if (!ever_registered)
        log_info("etcd: registered {} as {} (lease TTL {} s, via {})", options_.endpoint, key_,
                 options_.lease_ttl.count(), etcd_->current_endpoint());
      else if (failing) log_info("etcd: registered again as {} (via {})", key_, etcd_->current_endpoint());
      ever_registered = true;
      failing = false;
      backoff = kMinBackoff;
      wait(period);
    } catch (const std::exception& e) {
      {
        std::lock_guard lock(mu_);
        registered_ = false;
        if (stopping_) return;
      }
      const auto now = Clock::now();
      if (!failing || now - last_warning >= kRepeatWarning) {
        log_warn("etcd: cannot {} {}: {} (retrying; the agent keeps serving)", ever_registered ? "renew" : "register",
                 key_, e.what());
        last_warning = now;
      }
      failing = true;
      wait(backoff);
      backoff = std::min(backoff * 2, max_backoff);
    }
  }
}

void Registration::stop() {
  {
    std::lock_guard lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::int64_t lease = 0;
  {
    std::lock_guard lock(mu_);
    // While etcd cannot be reached, do not hold shutdown up for a revoke that would fail too: the lease expires.
    if (registered_) lease = lease_;
    lease_ = 0;
    registered_ = false;
  }
  if (lease == 0) return;
  try {
    etcd_->revoke_lease(lease);
    log_info("etcd: revoked the lease of {}", key_);
  } catch (const std::exception& e) {
    log_warn("etcd: could not revoke the lease of {} (the key goes when it expires): {}", key_, e.what());
  }
}

}  // namespace dsec::agent
