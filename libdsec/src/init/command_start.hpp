// How dsec-init starts a command, in a container and in a virtual machine alike: vfork, a new session, the
// command's cgroup joined (born in it by clone3's CLONE_INTO_CGROUP when given the group's cgroup2 directory, else
// by writing "0" to the cgroup.procs descriptors it is given), its standard streams, its
// signals and OOM score reset, its capabilities dropped (in a container) and its user set, its directory, and an
// exec that searches the command's own PATH.
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/wire/init_protocol.hpp"

namespace dsec::init {

inline constexpr const char* kDefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

struct StartRequest {
  std::vector<std::string> argv;
  std::vector<std::string> env;
  std::string cwd;
  // stdin, stdout, stderr, then the command's cgroup: cgroup.procs descriptors it joins, and (cgroup v2) the group's
  // directory, which the clone starts it in where the kernel lets it (the cgroup.procs descriptor is the fallback)
  std::vector<int> fds;
  // Run as this user: the supplementary groups, then the gid, then the uid are set (all three ids of each). A
  // non-root user also gets no_new_privs, so no setuid program makes it root again. False: dsec-init's own ids.
  bool set_user = false;
  std::uint32_t uid = 0;
  std::uint32_t gid = 0;
  std::vector<gid_t> groups;
  // A container's dsec-init holds CAP_SETUID, CAP_SETGID and CAP_SETPCAP (permitted only) to start commands as
  // users: with this set, the command gives up all of them (and the whole bounding set) before it execs, whatever
  // user it runs as, so it starts with no capability at all.
  bool drop_capabilities = false;
  // stdin is a terminal that becomes the command's controlling terminal (it leads a new session already).
  bool controlling_tty = false;
};

// The command a start payload names (argv, env, cwd, its user), with no descriptors yet.
StartRequest start_request_of(init_protocol::StartPayload&& command, bool drop_capabilities);

// Starts the command; returns its pid, or -1 with `err` and `stage` saying why not. `original_mask` is the signal
// mask the command starts with (dsec-init blocks SIGCHLD for its signalfd).
pid_t start_command(StartRequest& req, const sigset_t& original_mask, int& err, init_protocol::FailStage& stage);

// Closes every descriptor in fds (skipping -1) and empties it.
void close_all(std::vector<int>& fds);

}  // namespace dsec::init
