#!/usr/bin/env bash
# Builds dsec with sanitizers and runs its unit tests under them; fails on any finding.
#
#   scripts/sanitize.sh asan     AddressSanitizer + UndefinedBehaviorSanitizer, every unit test (./build-asan)
#   scripts/sanitize.sh tsan     ThreadSanitizer, the tests of the parts that run many threads at once: the client
#                                (its transport, retries, discovery and the embedded agent), the agent's HTTP server
#                                and router, the registry (./build-tsan)
#   scripts/sanitize.sh all      both, one after the other
#
# Run as root, as scripts/test.sh is: many unit tests make real sandboxes. dsec-init, dsec-layer-keeper and
# dsec-memhold are static programs and are built without sanitizers (CMakeLists.txt, dsec_static_program); the
# agents the tests start are sanitized. The first finding ends the test binary at once (halt_on_error) with its
# report and the test running at the time; fix it and run again. SANITIZE_FILTER narrows the tests (a gtest filter).
#
# Under ThreadSanitizer no container sandbox starts: the agent clones a sandbox's init with CLONE_VM | CLONE_VFORK,
# and the sanitizer's clone interceptor resets its own state in the child as in a forked copy, which with CLONE_VM is
# the agent's (the agent then dies at its next thread). The tests that need containers skip and say so; the agent's
# threads are watched through the null backend. (The user-namespace holder, cloned the same way, gets a copy of the
# agent's memory in that build instead: see user_namespace.cpp.)
set -euo pipefail
cd "$(dirname "$0")/.."

# The tests of threaded code that ThreadSanitizer watches: gtest suites by name (tests/unit/client, the agent's
# server and api, its registry).
TSAN_SUITES='AgentTest.*:ClientCore.*:Client.*:ClientFnCallTest.*:Transport.*:RetryTest.*:Discovery*:EtcdTest.*:ServerTest.*:AgentRoutes.*:ProcessRoutes.*:FnCallRoutes.*:GroupsTest.*:RegistryTest.*:RecoveryTest.*:ExecJournalTest.*:CreateIdsTest.*:TenantQuota.*:GuestChannel.*'

build_and_test() {
  local name=$1 sanitizers=$2 filter=$3
  local dir=build-$name launcher=()
  # ccache, where the machine has it, makes a second run rebuild only what changed.
  command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
  cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDSEC_SANITIZE="$sanitizers" \
        -DDSEC_BUILD_PYTHON=OFF -DDSEC_BUILD_BENCHMARKS=OFF -DPython_EXECUTABLE=/usr/bin/python3 "${launcher[@]}" >/dev/null
  cmake --build "$dir" -j "${JOBS:-$(nproc)}" --target dsec_unit_tests dsecd dsec-cli dsec-e2b
  echo "== unit tests under $sanitizers (${filter:-all}) =="
  # The tests start the dsecd beside them in $dir/bin, which finds the dsec-init of the same build.
  "$dir/bin/dsec_unit_tests" ${filter:+--gtest_filter="$filter"} --gtest_brief=1
}

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:halt_on_error=1:abort_on_error=0:detect_stack_use_after_return=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1}

case ${1:-} in
  asan) build_and_test asan address,undefined "${SANITIZE_FILTER:-}" ;;
  tsan) build_and_test tsan thread "${SANITIZE_FILTER:-$TSAN_SUITES}" ;;
  all)
    build_and_test asan address,undefined "${SANITIZE_FILTER:-}"
    build_and_test tsan thread "${SANITIZE_FILTER:-$TSAN_SUITES}"
    ;;
  *) echo "usage: scripts/sanitize.sh {asan|tsan|all}" >&2; exit 2 ;;
esac
