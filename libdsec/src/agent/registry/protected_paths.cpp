#include "agent/registry/protected_paths.hpp"

#include <fmt/format.h>

namespace dsec::agent {
namespace {

// $@ is the paths. Every component of each path is checked not to be a symbolic link before anything is made or
// changed there, and every directory above it to be root's and closed to other users' renames (not writable by
// group or others, or sticky): else a user could move the protected directory away and put its own in its place,
// where root's later writes would land. Exit 3 names the link, 6 the directory, 4 a failed mkdir, 5 a failed chown
// or chmod (their own message on stderr). `ls -ldn` is what every image has to read a mode and an owner.
constexpr const char* kScript = R"--(umask 022
for p in "$@"; do
  d=
  rest=${p#/}
  while :; do
    c=${rest%%/*}
    d=$d/$c
    if [ -L "$d" ]; then echo "$d is a symbolic link" >&2; exit 3; fi
    [ "$rest" = "$c" ] && break
    if [ -d "$d" ]; then
      set -- $(ls -ldn "$d")
      if [ "$3" != 0 ]; then echo "$d belongs to uid $3, not root" >&2; exit 6; fi
      case $1 in
        ?????????[tT]*) ;;
        ?????w*|????????w*) echo "$d can be written by users other than root (mode $1)" >&2; exit 6 ;;
      esac
    fi
    rest=${rest#*/}
  done
  if [ ! -e "$p" ]; then mkdir -p "$p" || exit 4; fi
  chown 0:0 "$p" || exit 5
  chmod 0700 "$p" || exit 5
done
)--";

constexpr double kTimeoutSeconds = 60;

}  // namespace

void protect_paths(BackendSandbox& sandbox, const SandboxSpec& spec) {
  if (spec.protected_paths.empty()) return;
  ExecRequest req;
  req.argv = {"/bin/sh", "-c", kScript, "dsec-protect-paths"};
  req.argv.insert(req.argv.end(), spec.protected_paths.begin(), spec.protected_paths.end());
  req.user = "0";  // root, whatever spec.user says
  req.cwd = "/";
  req.timeout_seconds = kTimeoutSeconds;
  req.max_output_bytes = 4096;
  ExecResult r;
  try {
    r = sandbox.exec(req);
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("protected_paths: could not set them up in the sandbox: {}", e.what()),
                e.retryable());
  }
  if (r.exit_code == 0 && !r.timed_out) return;
  std::string why = r.stderr_data;
  while (!why.empty() && (why.back() == '\n' || why.back() == ' ')) why.pop_back();
  if (r.timed_out) why = fmt::format("the set-up took longer than {} s", kTimeoutSeconds);
  else if (why.empty()) why = fmt::format("the set-up exited with status {}", r.exit_code);
  throw Error(Code::kInvalidArgument,
              fmt::format("protected_paths: {} (root inside the sandbox holds no capability: "
                          "a path must be missing or root's own, under directories only root may change, and no "
                          "symbolic link)",
                          why));
}

}  // namespace dsec::agent
