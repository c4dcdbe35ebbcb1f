// A handle on one live sandbox. A handle from Client::create owns its sandbox: the destructor destroys it unless
// release() was called. A handle from Client::attach (or borrow()) does not own: destroying its sandbox is explicit.
//
// Calls on one handle may run from several threads at once, except destroy(), release() and assignment, which
// change the handle itself: give other threads a borrow() instead.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dsec/exec.hpp"
#include "dsec/process.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/screen.hpp"
#include "dsec/session.hpp"
#include "dsec/spec.hpp"

namespace dsec {

namespace detail {
class ClientCore;
}

// What Sandbox::sleep() or wake() did: the sandbox's info after it, the memory charged to it before and after, and
// how long the agent took.
struct SleepResult {
  SandboxInfo info;
  std::uint64_t memory_before_bytes = 0;
  std::uint64_t memory_after_bytes = 0;
  std::uint64_t memory_released_bytes = 0;
  double seconds = 0;
  std::uint64_t swap_bytes = 0;  // the sandbox's memory in the node's swap after the call
};

// What Sandbox::snapshot() made: an image holding the sandbox's files as they were, and what it took.
struct SnapshotResult {
  std::string image;               // the new image, pinned ("repo:tag@sha256:..."): give it to Client::create
  std::string sandbox_id;          // the sandbox it was taken of
  std::string parent;              // that sandbox's image, pinned; the new image is its layers plus one
  std::string store;               // the store it is in (the node's snapshot store)
  std::string layer_digest;        // the new layer (role "snapshot")
  std::uint64_t layer_bytes = 0;   // its size as an EROFS image
  std::uint64_t stored_bytes = 0;  // its size in the store, compressed
  std::uint64_t file_bytes = 0;    // content of the files captured (sparse files counted whole)
  std::uint64_t entries = 0;       // files, directories, links and deletions captured
  double frozen_seconds = 0;       // how long the sandbox's processes stood still for it
  double seconds = 0;              // the whole snapshot, on the node
  SandboxSpec spec;                // the sandbox's spec (fork() starts its copies with it)
};

class Sandbox {
 public:
  Sandbox() = default;
  Sandbox(std::shared_ptr<detail::ClientCore> core, std::string id, bool owning = true);
  Sandbox(Sandbox&& other) noexcept;
  Sandbox& operator=(Sandbox&& other) noexcept;
  Sandbox(const Sandbox&) = delete;
  Sandbox& operator=(const Sandbox&) = delete;
  ~Sandbox();

  const std::string& id() const noexcept { return id_; }
  explicit operator bool() const noexcept { return core_ != nullptr; }
  bool owning() const noexcept { return owning_; }

  // Runs a command. A timeout is a result (timed_out = true), not an error; an unknown sandbox, a missing
  // executable or an unreachable node are errors (dsec::Error).
  ExecResult exec(const ExecRequest& request) const;
  ExecResult exec(std::string shell_command, double timeout_seconds = 600) const;  // runs under /bin/sh -c
  // Like exec, but output is handed to on_output (fd 1 stdout, 2 stderr) as the command writes it, and the result's
  // stdout/stderr are empty (its truncation flags still say whether max_output_bytes dropped anything). on_output
  // runs on the calling thread; what it throws aborts the call and is rethrown (the command itself runs on to its
  // end or timeout). Never retried once the request may have reached the agent.
  ExecResult exec_stream(const ExecRequest& request,
                         const std::function<void(int fd, std::string_view data)>& on_output) const;

  // Starts a command that outlives this call (a server, a REPL, a long build) and answers at once; see
  // dsec/process.hpp. A command that cannot start is a process that ended at once (exit code 127 or 126 with
  // reason, as exec gives it). RESOURCE_EXHAUSTED when 64 processes run in the sandbox. Never retried once the
  // request may have reached the agent.
  Process spawn(const ProcessRequest& request) const;
  // A handle on process `pid` of this sandbox (spawned by any client); no call is made.
  Process process(int pid) const;
  // Every process spawned in the sandbox and not forgotten yet, running and ended, by pid.
  std::vector<ProcessInfo> processes() const;
  // Starts a persistent shell session (dsec/session.hpp). Never retried once the request may have reached the
  // agent. RESOURCE_EXHAUSTED when the sandbox holds 16 sessions.
  Session shell(const SessionOptions& options = {}) const;
  // A handle on session `name` of this sandbox; no call is made.
  Session session(std::string name) const;
  std::vector<SessionInfo> sessions() const;

  // One file, by path inside the sandbox; parent directories are created. Paths never leave the sandbox root.
  void write_file(std::string_view path, std::string_view data, unsigned mode = 0644) const;
  std::string read_file(std::string_view path) const;

  // A directory as a tar stream: upload extracts into `dir` (created if missing), download archives `dir`.
  void upload_tar(std::string_view dir, std::string_view tar_bytes) const;
  std::string download_tar(std::string_view dir) const;

  SandboxInfo info() const;
  // Its TTL from now: the agent destroys it `ttl` from now (0: never), whether that is earlier or later than its
  // deadline was. Answers its info with the new expires_at. INVALID_ARGUMENT beyond one year.
  SandboxInfo set_ttl(std::chrono::seconds ttl) const;
  // Sleep freezes every process of the sandbox in place and releases the memory it can (page cache always;
  // anonymous memory only where the node has swap); its state becomes "sleeping" and its cpu is free for other
  // sandboxes on the node. Files stay readable and writable; exec is FAILED_PRECONDITION until wake(), which lets
  // the processes run on where they stopped. Sleeping a sleeping sandbox, or waking an awake one, is
  // FAILED_PRECONDITION; so is sleeping a sandbox while one of its execs runs. Each call carries a request id of
  // its own, repeated on its retries, so a retry after a lost answer gets the first attempt's answer rather than
  // FAILED_PRECONDITION. Pages in swap come back as the woken processes touch them.
  SleepResult sleep() const;
  SleepResult wake() const;
  // The network policy in force, and a new one put in force at once, running or asleep (docs/networking.md): the
  // answer is what holds now; connections the new rules forbid are cut. INVALID_ARGUMENT for a malformed policy
  // (the old one stays), NOT_FOUND for a destroyed sandbox.
  NetworkPolicy network() const;
  NetworkPolicy set_network(const NetworkPolicy& policy) const;
  // What its network carried: bytes and packets each way, new connections refused, and the names the agent's
  // resolver answered for it with the addresses they admit now.
  NetworkUsage network_usage() const;
  // Exposes TCP port `port` of the sandbox at a port of its node and answers where: "host:port", reachable by
  // anyone who reaches the node (a grader, a trainer on another machine) and by no sandbox. A sandbox without a
  // network gets a link that allows no egress for it. Gone with unexpose() or the sandbox's destroy.
  // INVALID_ARGUMENT for a port outside 1-65535 or exposed already; RESOURCE_EXHAUSTED when the node's range of
  // ports (dsecd --expose-ports) is used up.
  std::string expose(std::uint32_t port) const;

  // A full VM's screen (kind "vm", dsec/screen.hpp, docs/vm.md). FAILED_PRECONDITION for a sandbox without one, or
  // while it sleeps. Input is never retried once sent (a lost answer would press the keys twice).
  std::string screenshot() const;  // PNG bytes of the screen now
  ScreenState screen() const;      // its size and where the pointer was last put
  ScreenState input(const std::vector<InputAction>& actions) const;
  ScreenState mouse_move(std::uint32_t x, std::uint32_t y) const;
  ScreenState click(std::uint32_t x, std::uint32_t y, std::string button = "left", bool double_click = false) const;
  ScreenState scroll(std::int32_t dy) const;  // notches; negative: up
  ScreenState drag(std::uint32_t x, std::uint32_t y, std::uint32_t to_x, std::uint32_t to_y) const;
  ScreenState key(std::string combo) const;  // "ctrl+s", "Return", "alt+F4"
  ScreenState type_text(std::string text) const;
  // A VNC endpoint for a person to watch the screen, and drive it: its address on the sandbox's node and the
  // password a viewer gives (VNC authentication). The same one while it lasts; stop_vnc() ends it, and so does the
  // sandbox's end. vnc() is its address alone.
  VncEndpoint vnc_endpoint() const;
  std::string vnc() const;
  void stop_vnc() const;
  void unexpose(std::uint32_t port) const;               // NOT_FOUND when it is not exposed
  std::map<std::uint32_t, std::string> exposed() const;  // its port -> "host:port"
  // Captures the sandbox's files as a new image named `name` ("repo" or "repo:tag", the tag "latest" when none) in
  // its node's snapshot store: the sandbox's image's layers plus one layer of what the sandbox changed (new and
  // changed files, and what it deleted or replaced stays deleted or replaced). Client::create(image = result.image)
  // then starts sandboxes with exactly those files, on any node that reads that store. Files only: processes,
  // memory and open files are not captured, so nothing runs in a sandbox made from it until an exec starts it.
  // The sandbox is frozen while its files are copied (a running exec pauses) and runs on; a sleeping one stays
  // asleep. Errors: INVALID_ARGUMENT (a malformed name, or one that pins a digest), ALREADY_EXISTS (the name is
  // taken: a snapshot never moves a tag), NOT_FOUND (a destroyed sandbox), UNIMPLEMENTED (a backend without
  // snapshots, such as null), RESOURCE_EXHAUSTED (the store is full, or the files exceed the node's limit; nothing
  // is tagged then).
  SnapshotResult snapshot(std::string_view name) const;
  // Branches the sandbox into n copies, all or nothing, with this sandbox's spec (without its request id and group).
  // A microVM (with `name` empty) is copied whole on its node: every copy runs on from the moment of the fork with
  // the same processes, memory and files, and so does this sandbox. Other kinds, or with a `name`: the sandbox is
  // snapshotted (under `name`, or "fork/<sandbox id>:<random>" when empty) and n sandboxes are created from the
  // snapshot, placed by the client like Client::create_many; each starts with this sandbox's files as they were at
  // the call (not its processes). The returned handles own their sandboxes. A snapshot under a generated name goes
  // with the copies: the copies carry the label "dsec.fork-snapshot" = its "name:tag", and a node removes that tag
  // from its snapshot store when the last sandbox carrying it there is destroyed (by destroy(), its TTL, its
  // group's lease or the agent's shutdown; with copies on several nodes, when the first node's last copy goes).
  // With `keep`, or under a `name` the caller gave, the snapshot stays in the store (remove it with
  // Client::remove_image or `dsec image rm` when no sandbox needs it any more).
  std::vector<Sandbox> fork(std::size_t n, std::string_view name = {}, bool keep = false) const;
  // Destroys the sandbox; idempotent. The handle is empty afterwards.
  void destroy();
  // Gives up ownership: the sandbox lives on (until its TTL) and the handle is empty. Returns its id.
  std::string release() noexcept;
  // A non-owning handle on the same sandbox, sharing this one's client.
  Sandbox borrow() const { return Sandbox(core_, id_, /*owning=*/false); }

 private:
  detail::ClientCore& core() const;

  std::shared_ptr<detail::ClientCore> core_;
  std::string id_;
  bool owning_ = true;
};

}  // namespace dsec
