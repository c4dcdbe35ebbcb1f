// The null backend (kind "null"): a simulation of the control plane, not a sandbox.
//
// It exists to measure and test everything around the backends (the HTTP server, the registry, admission,
// idempotency, placement across many agents) at a scale no host could run for real: 32,000 "sandboxes" cost a few
// hundred bytes each. Create succeeds at once and starts nothing. Exec always fails with UNIMPLEMENTED: there is no
// process to run. Files are kept in memory per sandbox, bounded by the spec's disk size, so the files protocol (raw
// bytes, tar streams of directories) can be exercised end to end. Nothing here isolates anything.
#pragma once

#include <memory>

#include "agent/backends/backend.hpp"

namespace dsec::agent {

std::unique_ptr<Backend> make_null_backend();

}  // namespace dsec::agent
