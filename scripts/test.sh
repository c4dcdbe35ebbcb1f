#!/usr/bin/env bash
# dsec's whole test suite: installs what is needed, builds with warnings as errors, checks the tree's habits
# (scripts/format.sh --check, scripts/lint-python.sh, and clang-tidy through scripts/tidy.py, which runs at the
# lowest CPU priority beside the image builds and the unit tests, and is waited for before the integration tests),
# builds the busybox and bookworm-python images into a test store, runs the unit tests (ctest), the integration tests (pytest against a
# real dsecd) and a short run of every fuzz target (scripts/fuzz.sh all $FUZZ_SECONDS, default 10 s each, in
# ./build-fuzz). Fails if any of them fails. Run as root: the tests create real sandboxes. The sanitizer runs
# (scripts/sanitize.sh) are apart: they cost more of CI's time than a two-core machine has to spare
# (docs/architecture.md, "Habits").
#
#   sudo scripts/test.sh
#
# BUILD_DIR (default ./build) is where scripts/build.sh builds. The test store is $DSEC_TEST_HOME (default
# $BUILD_DIR/test-home); it is exported to the tests as DSEC_HOME, its images are in $DSEC_HOME/images. The build
# directory is exported as DSEC_BUILD_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
export BUILD_DIR=${BUILD_DIR:-build}

if [[ $(id -u) -ne 0 ]]; then
  echo "test: run as root (sudo scripts/test.sh): the tests create sandboxes, cgroups and mounts" >&2
  exit 1
fi
scripts/install-deps.sh
scripts/build.sh -DDSEC_WERROR=ON
BUILD_ABS=$(cd "$BUILD_DIR" && pwd)
export DSEC_BUILD_DIR=$BUILD_ABS   # where the integration tests find dsecd, dsec-init and dsec

# clang-tidy over every source file (about 26 CPU-minutes from cold; a file it passed before is remembered), in the
# background at nice 19 while the images build (mostly downloads and disk) and the unit tests run. It is waited for
# before the integration tests: those run batch sandboxes under SCHED_IDLE, which even nice 19 work would starve.
tidy_log=$(mktemp)
nice -n 19 scripts/tidy.py >"$tidy_log" 2>&1 &
tidy_pid=$!
trap 'kill "$tidy_pid" 2>/dev/null || true' EXIT

export DSEC_HOME=${DSEC_TEST_HOME:-$BUILD_ABS/test-home}
mkdir -p "$DSEC_HOME"
"$BUILD_ABS/bin/dsec" image inspect busybox >/dev/null 2>&1 ||
  "$BUILD_ABS/bin/dsec" image build busybox --from busybox-static
# The images the README's examples use (tests/integration/test_doc_examples.py runs them), as the quickstart builds
# them: Debian bookworm with python3, debootstrapped from the Debian mirror (cached under $DSEC_HOME/cache).
"$BUILD_ABS/bin/dsec" image inspect bookworm-python >/dev/null 2>&1 ||
  "$BUILD_ABS/bin/dsec" image build bookworm-python --from debootstrap:bookworm --include python3
# The full VM tier's tests (tests/integration/test_vm.py) and examples/computer_use.py boot the desktop image
# (scripts/desktop-image.sh: Debian with its kernel, systemd and an X session; about 6 minutes to build), where QEMU is.
if command -v qemu-system-x86_64 >/dev/null 2>&1; then
  "$BUILD_ABS/bin/dsec" image inspect desktop >/dev/null 2>&1 || DSEC="$BUILD_ABS/bin/dsec" scripts/desktop-image.sh
fi

set +e
echo "== habits (format, flake8 and mypy) =="
habits_status=0
scripts/format.sh --check || habits_status=1
scripts/lint-python.sh || habits_status=1

echo "== unit tests (ctest) =="
(cd "$BUILD_ABS" && ctest --output-on-failure)
unit_status=$?

echo "== clang-tidy (scripts/tidy.py, started after the build) =="
wait "$tidy_pid"
tidy_status=$?
cat "$tidy_log"
rm -f "$tidy_log"
[[ $tidy_status -eq 0 ]] || habits_status=1

echo "== integration tests (pytest) =="
integration_status=0
if [[ -z "$(find tests/integration \( -name 'test_*.py' -o -name '*_test.py' \) -print -quit 2>/dev/null)" ]]; then
  echo "test: tests/integration has no test files; nothing to run"
else
  # pytest's status 5 ("no tests collected") with test files present means they did not load: a failure.
  PYTHONPATH="$BUILD_ABS/python${PYTHONPATH:+:$PYTHONPATH}" /usr/bin/python3 -m pytest tests/integration bindings/python/tests -q </dev/null
  integration_status=$?
fi

echo "== fuzz targets (scripts/fuzz.sh, ${FUZZ_SECONDS:-10} s each) =="
# The decoders that face the network or a sandbox, each from its seeds: a regression that crashes one, leaks, or
# breaks one of its properties fails the suite. Without clang and libFuzzer the step says so and fails.
scripts/fuzz.sh all "${FUZZ_SECONDS:-10}"
fuzz_status=$?

if [[ $habits_status -ne 0 || $unit_status -ne 0 || $integration_status -ne 0 || $fuzz_status -ne 0 ]]; then
  echo "test: FAILED (habits (format, lint, clang-tidy): status $habits_status, unit tests: status $unit_status," \
       "integration tests: status $integration_status, fuzz targets: status $fuzz_status)" >&2
  exit 1
fi
echo "test: all passed"
