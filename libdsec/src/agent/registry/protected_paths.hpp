// Protected paths (SandboxSpec::protected_paths): directories inside a sandbox that only its root may enter, for
// what a trainer keeps beside the code it runs as another user (a grader, the answers, a reference solution).
#pragma once

#include "agent/backends/backend.hpp"
#include "dsec/spec.hpp"

namespace dsec::agent {

// Runs one command as root inside the newly created `sandbox` that, for each of spec.protected_paths in order,
// refuses a path that is a symbolic link or lies under one, creates it as a directory (with its parents) where it is
// missing, and makes it owned by 0:0 with mode 0700. Nothing of the sandbox runs yet, so nothing can race it; the
// paths travel as arguments of the command, never inside its text. Throws INVALID_ARGUMENT naming protected_paths
// when the sandbox's files do not allow it (a symbolic link, a file in the way, a path that root inside cannot
// change: root inside has no capability, so an existing path must be root's already or missing), and the error of
// the exec itself otherwise (a sandbox without /bin/sh cannot have protected paths). Does nothing when there are
// none. The registry calls it once per create; forks and sandboxes made from snapshots carry the paths in their
// files.
void protect_paths(BackendSandbox& sandbox, const SandboxSpec& spec);

}  // namespace dsec::agent
