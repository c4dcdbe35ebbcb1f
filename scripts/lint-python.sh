#!/usr/bin/env bash
# Lints dsec's Python: flake8 over the package, its tests and the integration tests (.flake8), and mypy over the
# package (pyproject.toml's [tool.mypy]; the native module's types are bindings/python/dsec/_dsec.pyi). Both run with
# Debian's /usr/bin/python3 (packages flake8 and mypy, from scripts/install-deps.sh); neither imports the built
# module, so no build is needed. Prints what they find and exits non-zero if either finds anything.
#
#   scripts/lint-python.sh
set -uo pipefail
cd "$(dirname "$0")/.."

status=0
echo "lint-python: flake8"
/usr/bin/python3 -m flake8 bindings/python/dsec bindings/python/tests tests/integration || status=1
echo "lint-python: mypy"
/usr/bin/python3 -m mypy bindings/python/dsec || status=1
if [[ $status -ne 0 ]]; then
  echo "lint-python: findings above" >&2
fi
exit $status
