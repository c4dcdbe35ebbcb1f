// Umbrella header: everything a trainer needs to drive dsec sandboxes from C++.
#pragma once

#include "dsec/async_client.hpp"
#include "dsec/client.hpp"
#include "dsec/error.hpp"
#include "dsec/exec.hpp"
#include "dsec/fncall.hpp"
#include "dsec/group.hpp"
#include "dsec/placement.hpp"
#include "dsec/process.hpp"
#include "dsec/retry.hpp"
#include "dsec/sandbox.hpp"
#include "dsec/sandbox_info.hpp"
#include "dsec/screen.hpp"
#include "dsec/session.hpp"
#include "dsec/spec.hpp"
#include "dsec/version.hpp"
