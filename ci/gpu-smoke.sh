#!/usr/bin/env bash
# The GPU smoke job: make build verify-gpu, a short make train, make warmup twice (the second must be faster:
# the shared cache works), a short make profile, a make bench smoke. Fails on a missing artifact or a NaN.
# Artifacts: runs/ (the workflow uploads it).
#
# Exit codes: 0 passed; 1 a step failed; 77 skipped: no GPU here (nothing to smoke-test).
# With a GPU but no Docker engine with GPU support, the non-Docker part runs with RUNTIME=local
# (REQUIRE_DOCKER=1 makes that a failure instead).
set -euo pipefail
cd "$(dirname "$0")/.."
SKIP=77
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "SKIP: no GPU on this machine (nvidia-smi missing or sees no device): gpu-smoke not run" >&2
  exit $SKIP
fi
read -r runtime why <<<"$(RUNTIME=auto scripts/detect_runtime.sh)"
if [ "$runtime" != docker ]; then
  if [ "${REQUIRE_DOCKER:-0}" = 1 ]; then echo "error: REQUIRE_DOCKER=1 but: $why" >&2; exit 1; fi
  echo "note: no Docker engine with GPU support ($why): running the non-Docker part with RUNTIME=local" >&2
fi
export RUNTIME=$runtime
mkdir -p runs/ci
marker=$(mktemp); trap 'rm -f "$marker"' EXIT
CONFIG=${CONFIG:-configs/smoke.yaml}
step() { echo; echo "=== $*"; }
new_files() { find runs -type f -newer "$1" | sort; }
require_new() {  # step name, marker: at least one new file under runs/, none containing NaN
  local files; files=$(new_files "$2")
  if [ -z "$files" ]; then echo "FAIL $1: wrote no artifact under runs/" >&2; exit 1; fi
  local json; mapfile -t json < <(grep -E '\.(json|jsonl)$' <<<"$files" || true)
  if grep -lE '(^|[^A-Za-z])NaN([^A-Za-z]|$)' "${json[@]}" /dev/null; then
    echo "FAIL $1: NaN in the files above" >&2; exit 1
  fi
  echo "ok $1: $(wc -l <<<"$files") new file(s)"
}
if [ "$runtime" = docker ]; then step "make build"; make build; fi

step "make verify-gpu"; touch "$marker"
make verify-gpu ARGS="--json runs/ci/verify-gpu.json"
require_new verify-gpu "$marker"

step "make train (smoke)"; touch "$marker"
make train CONFIG="$CONFIG" ARGS="--run-id ci-gpu-smoke train.device=cuda"
test -s runs/ci-gpu-smoke/report.json || { echo "FAIL train: no runs/ci-gpu-smoke/report.json" >&2; exit 1; }
require_new train "$marker"

step "make warmup, twice (the second must reuse the shared cache)"
t0=$(date +%s.%N); make warmup CONFIG="$CONFIG"; t1=$(date +%s.%N); make warmup CONFIG="$CONFIG"; t2=$(date +%s.%N)
python3 - "$t0" "$t1" "$t2" <<'PY' | tee runs/ci/warmup-times.txt
import sys
t0, t1, t2 = map(float, sys.argv[1:])
cold, warm = t1 - t0, t2 - t1
print(f"warmup_cold_s={cold:.1f} warmup_warm_s={warm:.1f} ratio={warm / cold:.2f}")
sys.exit(0 if warm < cold else 1)
PY

step "make profile (short)"; touch "$marker"
make profile CONFIG="$CONFIG" ARGS="train.max_steps=20"
require_new profile "$marker"

step "make bench (smoke)"; touch "$marker"
make bench ARGS="${BENCH_ARGS:-}"
require_new bench "$marker"

step "make bench-gate (vs bench/baseline-gpu.json; absolute figures allowed on the same GPU)"
if [ -f bench/baseline-gpu.json ]; then
  make bench-gate ARGS="bench_gate.precision=auto"
else
  echo "GATE SKIPPED: no bench/baseline-gpu.json yet; create it on this runner with" \
       "make bench-baseline ARGS=bench_gate.precision=auto and commit it" >&2
fi
echo; echo "gpu-smoke passed (runtime: $runtime)"
