#!/usr/bin/env bash
# Configures and builds dsec into ./build (Ninja, RelWithDebInfo, the Python binding for /usr/bin/python3).
# Extra arguments go to the configure step, e.g. scripts/build.sh -DCMAKE_BUILD_TYPE=Debug.
# BUILD_DIR overrides ./build; JOBS overrides the number of parallel jobs (default: the number of cores).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}

cmake -S . -B "$BUILD_DIR" -G Ninja -DPython_EXECUTABLE=/usr/bin/python3 "$@"
cmake --build "$BUILD_DIR" -j "$JOBS"
