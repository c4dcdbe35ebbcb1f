#!/usr/bin/env bash
# Formats dsec's C and C++ sources with clang-format and the tree's .clang-format (Google, 120 columns).
#
#   scripts/format.sh            rewrite every tracked source in place
#   scripts/format.sh --check    change nothing; list the files that differ and fail if any does (scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files '*.cpp' '*.hpp' '*.h' '*.c' ':!tests/fuzz/corpus')
if [[ ${1:-} == --check ]]; then
  bad=()
  for f in "${files[@]}"; do
    clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
  done
  if ((${#bad[@]})); then
    printf 'format: %s differs from .clang-format (scripts/format.sh fixes it)\n' "${bad[@]}" >&2
    exit 1
  fi
  echo "format: ${#files[@]} files match .clang-format"
else
  clang-format -i "${files[@]}"
fi
