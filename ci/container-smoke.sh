#!/usr/bin/env bash
# The container smoke (.ci/run and the GitHub `docker` job): the STACK=cpu image built and every kind of
# container run exercised, as the calling (non-root) user:
#   make build STACK=cpu (pip check, size, non-root default user), make smoke, make profile with a py-spy
#   flame graph (py-spy attaching as the non-root user), make warmup twice on the shared cache volume (the
#   second must reuse it: faster time to first step, cache hits > 0), make verify-gpu (exit 77: no GPU).
# Exit 0 passed, 1 a step failed. Numbers: runs/ci/container-smoke.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUNTIME=docker STACK=cpu
# Its own image tag and cache volume: a developer's image (rebuilt meanwhile) or cache (cleared below) are not touched.
export IMAGE=${IMAGE:-deep-model-perf-ci} CACHE_VOLUME=${CACHE_VOLUME:-deep-model-perf-ci-cache}
DOCKER=${DOCKER:-docker}
step() { echo; echo "=== $* ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"; }
fail() { echo "FAIL container smoke: $*" >&2; exit 1; }
mkdir -p runs/ci
summary=runs/ci/container-smoke.txt
: >"$summary"

step "make build STACK=cpu"
t0=$(date +%s)
make build
img=$(make -s --no-print-directory print-image)
echo "build_s=$(($(date +%s) - t0)) image=$img size_mib=$(($("$DOCKER" image inspect -f '{{.Size}}' "$img") / 1048576))" | tee -a "$summary"
"$DOCKER" run --rm --entrypoint python "$img" -m pip check
user=$("$DOCKER" image inspect -f '{{.Config.User}}' "$img")
case "$user" in 0|0:*|root|root:*|"") fail "the image's default user is root ($user)" ;; esac

step "make verify-gpu (no GPU: the table, then exit 77)"
rc=0; make verify-gpu >runs/ci/verify-gpu.txt 2>&1 || rc=$?
cat runs/ci/verify-gpu.txt
grep -q "Error 77" runs/ci/verify-gpu.txt || fail "verify-gpu: expected the container's exit 77 (got make exit $rc)"
grep -q "py-spy ptrace *PASS" runs/ci/verify-gpu.txt || fail "verify-gpu: py-spy cannot attach in the container"

step "make smoke"
make smoke ARGS="--overwrite"
test -s runs/smoke/report.json || fail "smoke: no runs/smoke/report.json"
[ "$(stat -c %u runs/smoke/report.json)" = "$(id -u)" ] || fail "smoke: report.json not owned by $(id -u)"

step "make profile (py-spy flame graph)"
make profile CONFIG=configs/smoke.yaml ARGS="train.overwrite=true --run-id ci-container-profile"
prof=runs/ci-container-profile/profile
head -c 200 "$prof/pyspy.svg" | grep -q "<svg\|<?xml" || fail "profile: no py-spy flame graph ($prof/pyspy.svg)"
python3 - "$prof/summary.json" <<'PY' | tee -a "$summary"
import json, sys
s = json.load(open(sys.argv[1]))["pyspy"]
print(f"pyspy_overhead_ratio={s.get('overhead_ratio')} rate_hz={s['rate_hz']} native={s['native']} "
      f"nonblocking={s.get('nonblocking')} with_ms={s.get('step_time_ms_with')} without_ms={s.get('step_time_ms_without')}")
PY

step "make warmup twice (two containers, one cache volume, from empty)"
# One bucket and short stability windows keep the cold compile to a few minutes on 2 cores.
WARM_ARGS="train.overwrite=true batching.num_buckets=1 compile.warmup_max_steps=6 compile.warmup_window=3"
kernels() { "$DOCKER" run --rm -v "$CACHE_VOLUME:/cache" --entrypoint bash "$img" -c \
  "find /cache/inductor -name '*.so' 2>/dev/null | wc -l"; }
make clean-cache >/dev/null 2>&1 || true
make warmup CONFIG=configs/smoke.yaml ARGS="$WARM_ARGS --run-id ci-warmup-cold"
k_cold=$(kernels)
make warmup CONFIG=configs/smoke.yaml ARGS="$WARM_ARGS --run-id ci-warmup-warm"
k_warm=$(kernels)
python3 - runs/ci-warmup-cold/warmup.json runs/ci-warmup-warm/warmup.json "$k_cold" "$k_warm" <<'PY' | tee -a "$summary"
import json, sys
cold, warm = (json.load(open(p)) for p in sys.argv[1:3])
k_cold, k_warm = int(sys.argv[3]), int(sys.argv[4])
def first(w):  # time to first step, summed over the plan's shapes (each shape's first step compiles it)
    return sum(s["first_step_ms"] for s in w["shapes"]) / 1e3
c, w = first(cold), first(warm)
counts = (warm.get("cache") or {}).get("counts") or {}
hits = counts.get("hits") if counts else k_cold if k_warm == k_cold else 0  # torch 2.1: no FX-graph cache counters
print(f"warmup_first_steps_cold_s={c:.1f} warmup_first_steps_warm_s={w:.1f} ratio={w / c:.2f} "
      f"kernels_compiled_cold={k_cold} new_kernels_warm={k_warm - k_cold} cache_hits_warm={hits} "
      f"state_cold={cold['cache']['state']} state_warm={warm['cache']['state']}")
ok = w <= 0.4 * c and hits and hits > 0 and cold["cache"]["state"] == "cold" and warm["cache"]["state"] == "warm"
sys.exit(0 if ok else 1)
PY
echo; echo "container smoke passed:"; cat "$summary"
