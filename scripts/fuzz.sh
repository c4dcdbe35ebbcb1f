#!/usr/bin/env bash
# Runs dsec's libFuzzer targets (tests/fuzz; docs/security.md, "Fuzzing") for a while each, one after another on
# one core, and fails if any of them finds a crash, leak, undefined behaviour, broken property or timeout.
#
#   scripts/fuzz.sh TARGET SECONDS     one target: http_request, protocol_json, manifest, tar_import, sandbox_path,
#                                      wire_frames, e2b_wire
#   scripts/fuzz.sh all SECONDS        each of them for SECONDS
#
# Builds the fuzz configuration first (clang, -fsanitize=fuzzer,address,undefined) in $FUZZ_BUILD_DIR (default
# ./build-fuzz), configuring it if needed. A target starts from its seeds in tests/fuzz/corpus/<target>/, copied into
# a temporary directory: the copy grows as the fuzzer finds new inputs, the repository's seeds do not. On a failure
# the input that caused it stays in that directory and its path is printed (run the fuzzer on it to reproduce:
# build-fuzz/bin/fuzz_<target> <file>); after a clean run the directory is removed, unless FUZZ_KEEP=1.
# Per target it prints the executions, executions per second, the final coverage (libFuzzer's cov: edges and ft:
# features) and the corpus it ended with. FUZZ_RSS_MB (default 2048) is the memory limit per target.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGETS=(http_request protocol_json manifest tar_import sandbox_path wire_frames e2b_wire)
FUZZ_BUILD_DIR=${FUZZ_BUILD_DIR:-build-fuzz}
FUZZ_RSS_MB=${FUZZ_RSS_MB:-2048}

usage() {
  local IFS='|'
  echo "usage: scripts/fuzz.sh {all|${TARGETS[*]}} SECONDS" >&2
  exit 2
}
[[ $# -eq 2 && "$2" =~ ^[0-9]+$ && "$2" -gt 0 ]] || usage
what=$1
seconds=$2
if [[ "$what" == all ]]; then
  run=("${TARGETS[@]}")
elif [[ " ${TARGETS[*]} " == *" $what "* ]]; then
  run=("$what")
else
  usage
fi

# clang with libFuzzer: without them there is nothing to run, which is a failure, not a skip.
if ! command -v clang++ >/dev/null 2>&1 || ! command -v clang >/dev/null 2>&1; then
  echo "fuzz: clang/clang++ not found; install clang and libclang-rt-14-dev (scripts/install-deps.sh)" >&2
  exit 1
fi
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' >"$probe/probe.cpp"
if ! clang++ -fsanitize=fuzzer,address,undefined "$probe/probe.cpp" -o "$probe/probe" 2>"$probe/err"; then
  echo "fuzz: clang++ cannot build a libFuzzer target (libFuzzer or the sanitizer runtimes are missing; install" \
       "libclang-rt-14-dev, see scripts/install-deps.sh):" >&2
  sed 's/^/  /' "$probe/err" >&2
  exit 1
fi

if [[ ! -f "$FUZZ_BUILD_DIR/build.ninja" ]]; then
  nice -n 10 cmake -S . -B "$FUZZ_BUILD_DIR" -G Ninja -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
    -DDSEC_FUZZ=ON >/dev/null
fi
started=$SECONDS
nice -n 10 cmake --build "$FUZZ_BUILD_DIR" -j "${JOBS:-$(nproc)}"
echo "fuzz: build ready ($((SECONDS - started)) s)"

# The value of `key: value` in libFuzzer's last status line (cov, ft, corp).
# Both print nothing (and succeed) when the log has no such line: a target that failed at once must still be reported.
stat_of() { { grep -a -E '^#[0-9]+' "$1" || true; } | { grep -a " $2: " || true; } | tail -1 |
  sed -E "s/.* $2: ([^ ]+).*/\1/"; }
# libFuzzer's final stats (-print_final_stats=1): stat::number_of_executed_units and so on.
final_of() { { grep -a "^stat::$2:" "$1" || true; } | tail -1 | awk '{print $2}'; }

summary=()
failed=0
for target in "${run[@]}"; do
  seeds="tests/fuzz/corpus/$target"
  [[ -d "$seeds" ]] || { echo "fuzz: $seeds is missing" >&2; exit 1; }
  work=$(mktemp -d "${TMPDIR:-/tmp}/dsec-fuzz-$target.XXXXXX")
  mkdir -p "$work/corpus" "$work/artifacts"
  cp "$seeds"/* "$work/corpus/"
  echo "== fuzz $target for ${seconds} s (seeds: $(ls "$seeds" | wc -l), work: $work)"
  status=0
  nice -n 10 "$FUZZ_BUILD_DIR/bin/fuzz_$target" -max_total_time="$seconds" -rss_limit_mb="$FUZZ_RSS_MB" -timeout=10 \
    -print_final_stats=1 -artifact_prefix="$work/artifacts/" "$work/corpus" >"$work/log" 2>&1 || status=$?
  execs=$(final_of "$work/log" number_of_executed_units)
  rate=$(final_of "$work/log" average_exec_per_sec)
  cov=$(stat_of "$work/log" cov)
  ft=$(stat_of "$work/log" ft)
  inputs=$(ls "$work/corpus" | wc -l)
  bytes=$(du -sb "$work/corpus" | cut -f1)
  line=$(printf '%-14s %10s execs %7s exec/s  cov: %-6s ft: %-6s corpus: %s inputs, %s bytes' "$target" \
         "${execs:-?}" "${rate:-?}" "${cov:-?}" "${ft:-?}" "$inputs" "$bytes")
  if [[ $status -ne 0 ]]; then
    failed=1
    artifact=$(ls -t "$work/artifacts"/{crash,leak,timeout,oom}-* 2>/dev/null | head -1 || true)
    echo "fuzz: $target FAILED (libFuzzer status $status); what it said:" >&2
    { grep -a -E 'ERROR:|runtime error|property violated|what\(\)|SUMMARY|fuzz:' "$work/log" || true; } | head -20 |
      sed 's/^/  /' >&2
    echo "fuzz: the input that fails: ${artifact:-(none written; see the log)}" >&2
    echo "fuzz: the whole log: $work/log" >&2
    echo "fuzz: reproduce with $FUZZ_BUILD_DIR/bin/fuzz_$target ${artifact:-<input>}" >&2
    summary+=("$line  FAILED: $artifact")
    continue
  fi
  echo "$line"
  summary+=("$line")
  if [[ "${FUZZ_KEEP:-0}" == 1 ]]; then
    echo "fuzz: kept $work"
  else
    rm -rf "$work"
  fi
done

echo "== fuzz summary (${seconds} s per target)"
printf '%s\n' "${summary[@]}"
if [[ $failed -ne 0 ]]; then
  echo "fuzz: FAILED" >&2
  exit 1
fi
echo "fuzz: all passed"
