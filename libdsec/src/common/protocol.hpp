// The v1 wire format: JSON codecs for the public types, shared by the client and the agent, one file per resource
// in common/protocol/, each with both directions. Decoders validate and throw dsec::Error(INVALID_ARGUMENT) naming
// the offending field ("resources.memory: ..."). This header includes them all.
#pragma once

#include "common/protocol/body.hpp"
#include "common/protocol/error.hpp"
#include "common/protocol/exec.hpp"
#include "common/protocol/fncall.hpp"
#include "common/protocol/limits.hpp"
#include "common/protocol/node.hpp"
#include "common/protocol/process.hpp"
#include "common/protocol/sandbox.hpp"
#include "common/protocol/screen.hpp"
