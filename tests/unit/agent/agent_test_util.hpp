// Helpers for the agent's unit tests: an image source with fixed names, a backend whose creates can be slowed down,
// failed or watched, and a scratch directory.
#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "agent/backends/backend.hpp"
#include "agent/backends/null/null_backend.hpp"
#include "agent/images/image_source.hpp"
#include "dsec/error.hpp"

namespace dsec::agent::testing {

class FakeImages final : public ImageSource {
 public:
  explicit FakeImages(std::set<std::string> names) : names_(std::move(names)) {}
  ResolvedImage resolve(const std::string& name, std::string_view = {},
                        ManifestOrigin = ManifestOrigin::kCaller) override {
    std::string full = name.find(':') == std::string::npos ? name + ":latest" : name;
    if (!names_.count(full)) throw Error(Code::kNotFound, fmt::format("image '{}' not found", name));
    return ResolvedImage{full, {std::filesystem::path("/images") / full}, {}, nullptr, std::nullopt};
  }
  std::vector<std::string> names() const override { return {names_.begin(), names_.end()}; }
  // A manifest without layers for every name it resolves (snapshots look it up before they capture anything).
  std::shared_ptr<const image::Manifest> manifest(const std::string& reference) override {
    if (!names_.count(reference)) throw Error(Code::kNotFound, fmt::format("image '{}' not found", reference));
    auto m = std::make_shared<image::Manifest>();
    m->name = reference.substr(0, reference.find(':'));
    m->tag = reference.substr(reference.find(':') + 1);
    return m;
  }

 private:
  std::set<std::string> names_;
};

// Wraps the null backend: counts creates, can sleep in each, fail the n-th, and make sandboxes report dead. Takes
// sandboxes over after a restart (adopt), except those named in `dead`; with `can_sleep`, its sandboxes sleep.
class ProbeBackend final : public Backend {
 public:
  struct State {
    std::atomic<int> creates{0};
    std::atomic<int> fail_at{0};  // the create with this 1-based number fails (0: none)
    std::atomic<int> create_delay_ms{0};
    std::atomic<bool> alive{true};
    std::atomic<bool> fail_leftovers{false};
    std::atomic<bool> can_sleep{false};  // sandboxes sleep and wake (else: UNIMPLEMENTED, as the null backend)
    std::atomic<int> sleeps{0}, wakes{0};
    std::mutex mutex;
    std::vector<std::string> leftovers_removed;
    std::set<std::string> dead;        // adopt of these ids finds them gone (NOT_FOUND)
    std::vector<AdoptParams> adopted;  // every adopt call
  };

  explicit ProbeBackend(std::shared_ptr<State> state, std::string kind = "null")
      : state_(std::move(state)), kind_(std::move(kind)), inner_(make_null_backend()) {}

  std::string_view kind() const override { return kind_; }

  std::unique_ptr<BackendSandbox> create(const CreateParams& params) override {
    int n = ++state_->creates;
    if (int ms = state_->create_delay_ms.load()) std::this_thread::sleep_for(std::chrono::milliseconds{ms});
    if (n == state_->fail_at.load()) throw Error(Code::kInternal, fmt::format("create #{} failed on purpose", n));
    return std::make_unique<Sandbox>(inner_->create(params), state_);
  }

  std::unique_ptr<BackendSandbox> adopt(const AdoptParams& params) override {
    {
      std::lock_guard lock(state_->mutex);
      state_->adopted.push_back(params);
      if (state_->dead.count(params.id)) throw Error(Code::kNotFound, "its processes are gone");
    }
    auto sandbox = std::make_unique<Sandbox>(inner_->adopt(params), state_);
    sandbox->sleeping = params.sleeping;
    return sandbox;
  }

  void remove_leftovers(const std::string& id) override {
    if (state_->fail_leftovers) throw Error(Code::kInternal, "cannot remove leftovers on purpose");
    std::lock_guard lock(state_->mutex);
    state_->leftovers_removed.push_back(id);
  }

 private:
  class Sandbox final : public BackendSandbox {
   public:
    Sandbox(std::unique_ptr<BackendSandbox> inner, std::shared_ptr<State> state)
        : inner_(std::move(inner)), state_(std::move(state)) {}
    ExecResult exec(const ExecRequest& r, const OutputSink& sink = {}) override { return inner_->exec(r, sink); }
    void write_file(std::string_view p, std::string_view d, unsigned m) override { inner_->write_file(p, d, m); }
    std::string read_file(std::string_view p) override { return inner_->read_file(p); }
    void put_archive(std::string_view d, std::string_view t) override { inner_->put_archive(d, t); }
    std::string get_archive(std::string_view d) override { return inner_->get_archive(d); }
    bool is_directory(std::string_view p) override { return inner_->is_directory(p); }
    BackendState recovery_state() override { return {{"made_by", "probe"}}; }
    bool alive() override { return state_->alive.load() && inner_->alive(); }
    void destroy() override { inner_->destroy(); }
    // Each call reports its own number as memory_after_bytes, so a repeated answer is told from a new call.
    SleepReport sleep() override {
      if (!state_->can_sleep) return inner_->sleep();
      sleeping = true;
      return SleepReport{1000, static_cast<std::uint64_t>(++state_->sleeps), 0.001};
    }
    SleepReport wake() override {
      if (!state_->can_sleep) return inner_->wake();
      sleeping = false;
      return SleepReport{0, static_cast<std::uint64_t>(++state_->wakes), 0.001};
    }

    std::atomic<bool> sleeping{false};

   private:
    std::unique_ptr<BackendSandbox> inner_;
    std::shared_ptr<State> state_;
  };

  std::shared_ptr<State> state_;
  std::string kind_;
  std::unique_ptr<Backend> inner_;
};

// A fresh directory under /tmp, removed with the object.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dsec-agent-test-XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace dsec::agent::testing
