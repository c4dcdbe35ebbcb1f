#!/usr/bin/env bash
# An embedder's view of dsec (ctest runs it as install.find_package): install the build into a scratch prefix, build
# examples/quickstart.cpp against that prefix with find_package(dsec) (tests/install/consumer), and run it on a
# private agent taken from the prefix's bin/. Running needs root and the busybox image in $DSEC_HOME (scripts/test.sh
# gives both); without them the program is built but not run, and the test says so and counts as skipped (77).
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
cmake -S "$src/tests/install/consumer" -B "$tmp/build" -DCMAKE_PREFIX_PATH="$tmp/prefix" \
      -DDSEC_PROGRAM="$src/examples/quickstart.cpp" >"$tmp/configure.log" || { cat "$tmp/configure.log"; exit 1; }
cmake --build "$tmp/build" >"$tmp/build.log" || { cat "$tmp/build.log"; exit 1; }
# What it linked is the installed library, not the build tree's.
grep -q "$tmp/prefix" "$tmp/build/CMakeCache.txt"

if [[ $(id -u) -ne 0 ]]; then
  echo "built against the installed package; not run: containers need root"
  exit 77
fi
if [[ -z ${DSEC_HOME:-} ]] || ! "$tmp/prefix/bin/dsec" image inspect busybox >/dev/null 2>&1; then
  echo "built against the installed package; not run: no busybox image in \$DSEC_HOME (scripts/test.sh builds it)"
  exit 77
fi
out=$(DSEC_AGENT="$tmp/prefix/bin/dsecd" "$tmp/build/quickstart")
echo "$out"
grep -q "^exit 0: hello from" <<<"$out"
