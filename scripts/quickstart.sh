#!/usr/bin/env bash
# From a fresh Debian 12 machine to dsec's main job: installs what is needed, builds, builds the images the rollout
# uses (busybox, and Debian bookworm with python3, debootstrapped once from the Debian mirror and cached), then runs
# examples/rollout.py: 64 sandboxes, each playing one RL-style coding-agent episode.
#
#   sudo scripts/quickstart.sh [rollout options, e.g. --sandboxes 16]
#
# Images go to $DSEC_HOME/images (default /var/lib/dsec/images), where the embedded agent looks for them.
# BUILD_DIR (default ./build) is where scripts/build.sh builds.
set -euo pipefail
cd "$(dirname "$0")/.."
export BUILD_DIR=${BUILD_DIR:-build}

if [[ $(id -u) -ne 0 ]]; then
  echo "quickstart: run as root (sudo scripts/quickstart.sh): sandboxes need namespaces, cgroups and mounts" >&2
  exit 1
fi
scripts/install-deps.sh
scripts/build.sh
BUILD_ABS=$(cd "$BUILD_DIR" && pwd)

export DSEC_HOME=${DSEC_HOME:-/var/lib/dsec}
DSEC="$BUILD_ABS/bin/dsec"
have_image() { "$DSEC" image inspect "$1" >/dev/null 2>&1; }
have_image busybox || "$DSEC" image build busybox --from busybox-static
have_image bookworm-python || "$DSEC" image build bookworm-python --from debootstrap:bookworm --include python3
"$DSEC" image ls

if [[ ! -f examples/rollout.py ]]; then
  echo "quickstart: examples/rollout.py is missing" >&2
  exit 1
fi
echo "quickstart: running examples/rollout.py $*"
PYTHONPATH="$BUILD_ABS/python" exec /usr/bin/python3 examples/rollout.py "$@"
