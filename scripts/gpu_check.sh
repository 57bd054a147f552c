#!/usr/bin/env bash
# scripts/gpu_check.sh: one command that runs every CUDA path of the project once and returns every number
# (docs/gpu-check.md). Budget: <= 10 min on one H200 (the default steps' timeouts add up to 600 s, + 5 s kill grace
# each; compile-default, 140 s more, runs when STEPS names it).
# Rerunnable: every step overwrites its own run directory under WORK (STEPS=... reruns only those).
#
#   scripts/gpu_check.sh                      # on the GPU host, with its own python3 (no .venv, pins not enforced)
#   DRY_RUN=1 scripts/gpu_check.sh            # the same steps on the CPU with tiny sizes (a slow test runs this)
#
# Environment: PYTHON (default python3), OUT (default runs/gpu-check; gets gpu_check.json, gpu_check.md and a few
# PNGs/traces, at most 8 files), WORK (scratch run directories, default $OUT.work; kept for inspection),
# WORDNET_DIR (a directory with WordNet's data.* files; default shared/wordnet or wordnet/ in the repo if present,
# else the usual places: WNHOME, /usr/share/wordnet), STEPS (comma-separated subset of the steps, to rerun only
# those), CONFIG (default configs/gpu-bert-base.yaml), BENCH_CONFIGS (the bench rows), TIMEOUT_PCT (scales every step's timeout, in percent: 100
# on a GPU, 300 in a dry run). Each step has a timeout; a failing or timed-out step is
# recorded in gpu_check.json and the script goes on; the exit status is 1 if any step failed, else 0.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
PYTHON=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-check}
WORK=${WORK:-$OUT.work}
CONFIG=${CONFIG:-configs/gpu-bert-base.yaml}
DRY_RUN=${DRY_RUN:-0}
ALL_STEPS="verify-gpu,bench-precision,bench,compile-default,compile-reduce-overhead,compile-run,profile,sync-audit,optimize,causal-lm,generate,generate-0.5b,fsdp,fsdp-run"
# On a GPU the default leaves compile-default and causal-lm out: with cold caches the compile steps need ~120 s each,
# and all ten steps' budgets would not fit one 10-minute call. STEPS=compile-default,causal-lm runs them (a second
# call): causal-lm trains the tiny Llama of configs/causal-cpu.yaml packed, bf16, compiled, with the chunked loss.
# generate and generate-0.5b (bench-generate on a random-init tiny Llama and on a Qwen2-0.5B-shaped one, bf16: TTFT and
# TPOT at batch 1 and at saturation, static cache + compile through CUDA graphs) likewise: STEPS=generate,generate-0.5b.
# fsdp and fsdp-run (dist.strategy=fsdp, torch >= 2.6) likewise: STEPS=fsdp,fsdp-run. fsdp: scripts/fsdp_memory.py, the
# product's sharding + Trainer as ddp, fsdp and fsdp with dist.offload over min(GPUs, 2) ranks, bf16 (one GPU: a group
# of one), per-rank bytes on the device and the host. fsdp-run: a whole torchrun run, 2 ranks, fsdp + offload; it
# needs 2 GPUs (a one-rank torchrun is a single process, which ignores dist.strategy), and is skipped with fewer.
GPU_STEPS="verify-gpu,bench-precision,bench,compile-reduce-overhead,compile-run,profile,sync-audit,optimize"
if [ "${DRY_RUN:-0}" = 1 ]; then STEPS=${STEPS:-$ALL_STEPS}; else STEPS=${STEPS:-$GPU_STEPS}; fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# Every step needs torch: a python without it is one line and exit 2 here (before OUT is touched), not a traceback per step.
if ! torch_err=$("$PYTHON" -c "import torch" 2>&1 >/dev/null); then
  echo "gpu-check: error: $PYTHON cannot import torch ($(printf '%s\n' "$torch_err" | grep -v '^[[:space:]]*$' | tail -n 1)); install torch into it or point PYTHON at a python that has it" >&2
  exit 2
fi

if [ -n "${WORDNET_DIR:-}" ]; then
  export WNHOME="$WORDNET_DIR"
else
  for d in shared/wordnet wordnet shared/wordnet/dict; do
    if [ -f "$d/data.noun" ]; then export WNHOME="$ROOT/$d"; break; fi
  done
fi

mkdir -p "$OUT" "$WORK/steps" || exit 2
rm -f "$OUT"/gpu_check.json "$OUT"/gpu_check.md "$OUT"/*.png "$OUT"/*.json.gz

# Per step: timeout in seconds (GPU) and the overrides every step shares.
if [ "$DRY_RUN" = 1 ]; then
  MODE=dry-run
  COMMON=(train.device=cpu train.progress=false train.overwrite=true "train.output_dir=$WORK" "data.cache_dir=$WORK/cache"
          data.max_samples=400 data.vocab_size=300 data.max_len=32 data.num_workers=0 model.num_layers=1
          model.hidden_size=32 model.num_heads=2 model.ffn_size=64 batching.num_buckets=2 batching.max_tokens=512
          train.precision=fp32 compile.backend=eager compile.warmup_window=2 compile.warmup_max_steps=3
          compile.warmup_cv=0.9 train.num_threads=1)
  TIMEOUT_PCT=${TIMEOUT_PCT:-300}; PRECISION_STEPS=4; BENCH=(--warmup-steps 1 --rounds 1 --window 2 --requests 4 --inference-batch-size 2)
  COMPILE_STEPS=(--steps 2 --rounds 1); RUN_STEPS=4; SYNC_STEPS=6; RO_MODE=default  # no CUDA graphs on a CPU
  OPTIMIZE=(optimize.budget_s=60 optimize.rounds=2 optimize.window_samples=16 optimize.confirm_rounds=2
            optimize.quality_samples=32 optimize.profile_steps=2 "optimize.levers=precision,batching,fast_dropout")
  CAUSAL=(train.max_steps=4 train.eval_every=4 train.log_every=2 compile.enabled=false model.chunked_loss=true)
  GENERATE=(generate.requests=4 generate.max_new_tokens=4 generate.batch_size=2 generate.load_levels=0.5
            generate.fresh_process=false generate.profile_requests=1 bench.rounds=2)
  HALF_B=("model.hf_overrides={num_hidden_layers: 2, hidden_size: 64, num_attention_heads: 4, num_key_value_heads: 2, intermediate_size: 128}")
  FSDP_NPROC=2; FSDP_MEMORY=(--device cpu --precision fp32 --layers 2 --hidden 64 --vocab 512 --rows 2 --seq 32 --steps 3)
  FSDP_RUN=(train.max_steps=4 train.eval_every=4 train.log_every=2 compile.enabled=false)
else
  MODE=gpu
  COMMON=(train.device=cuda train.progress=false train.overwrite=true "train.output_dir=$WORK")
  TIMEOUT_PCT=${TIMEOUT_PCT:-100}; PRECISION_STEPS=120; BENCH=(--warmup-steps 3 --rounds 3 --window 8 --requests 100)
  COMPILE_STEPS=(--steps 8 --rounds 3); RUN_STEPS=40; SYNC_STEPS=30; RO_MODE=reduce-overhead
  # make optimize on bert-base: 50 s from start to outputs (compile left out: its warm-up alone would take the step)
  OPTIMIZE=(optimize.budget_s=50 optimize.rounds=4 optimize.window_samples=256 optimize.confirm_rounds=4
            "optimize.levers=precision,batching,token_budget,fast_dropout,fused_adamw,workers")
  CAUSAL=(train.max_steps=60 train.eval_every=60 train.log_every=20 train.precision=bf16 compile.enabled=true
          model.chunked_loss=true data.vocab_size=8192 batching.max_tokens=16384)
  GENERATE=(generate.precision=bf16 generate.requests=32 generate.max_new_tokens=32 generate.batch_size=8
            generate.ignore_eos=true bench.rounds=3)
  # Qwen2-0.5B's shape (24 layers, hidden 896, 14 heads, 2 KV heads, MLP 4864) on the Llama architecture, random init
  HALF_B=("model.hf_overrides={num_hidden_layers: 24, hidden_size: 896, num_attention_heads: 14, num_key_value_heads: 2, intermediate_size: 4864}")
  # CUDA_VISIBLE_DEVICES counts: torch's device count, not nvidia-smi -L's list
  FSDP_NPROC=$("$PYTHON" -c "import torch; print(min(torch.cuda.device_count(), 2))" 2>/dev/null || echo 0)
  FSDP_MEMORY=(--device cuda --precision bf16 --layers 4 --hidden 512 --vocab 32000 --rows 8 --seq 256 --steps 3)
  FSDP_RUN=(train.max_steps=20 train.eval_every=20 train.log_every=10 train.precision=bf16 compile.enabled=false
            data.vocab_size=8192 batching.max_tokens=16384)
fi
# bench-precision trains bert-base 4 times (fp32 without TF32 is ~22 TFLOP a step at the config's 32k tokens: ~0.4 s on
# an H200); an 8k-token budget keeps its 4 x 120 steps and evaluations inside the step's budget.
PRECISION_TOKENS=(); [ "$DRY_RUN" = 1 ] || PRECISION_TOKENS=(batching.max_tokens=8192)
# Compile steps: 2 buckets, no partial batches: 2 training shapes (+ their evaluation graphs), so cold compiles fit.
FEW_SHAPES=(batching.num_buckets=2 batching.drop_last=true)

echo "gpu-check ($MODE): python $PYTHON, config $CONFIG, out $OUT, work $WORK, wordnet ${WNHOME:-default search}"
"$PYTHON" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"

FAILED=0
# run_step NAME TIMEOUT_S COMMAND...: runs it with a timeout, its output in $WORK/steps/NAME.log (and the console),
# its status in $WORK/steps/NAME.status (rc seconds timeout), then a one-line summary.
run_step() {
  local name=$1 limit=$2; shift 2
  case ",$STEPS," in *",$name,"*) ;; *) return 0 ;; esac
  local log="$WORK/steps/$name.log" t0 t1 rc
  limit=$(((limit * TIMEOUT_PCT + 99) / 100))
  echo "== $name (timeout ${limit}s): $*"
  t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" >"$log" 2>&1
  rc=$?
  t1=$(date +%s)
  tail -n 5 "$log" | sed "s/^/   [$name] /"
  echo "$rc $((t1 - t0)) $limit" >"$WORK/steps/$name.status"
  "$PYTHON" scripts/gpu_check_report.py line "$WORK" "$name" "$MODE" || echo "$name: (no summary: see $log)"
  if ! "$PYTHON" scripts/gpu_check_report.py ok "$WORK" "$name" "$MODE"; then FAILED=1; fi
}

M=(-m train)
# bench rows: naive, hf-style, optimized, and the packed / bring-your-own-model rows where this checkout has them
BENCH_CONFIGS=${BENCH_CONFIGS:-$("$PYTHON" -c "from train.bench.rows import CONFIGS as C
print(','.join(['naive', 'hf-style', 'optimized'] + [n for n in C if 'packed' in n or n.startswith('byo')]))" 2>/dev/null \
  || echo naive,hf-style,optimized)}
run_step verify-gpu 15 "$PYTHON" -m train.tools.verify_gpu --json "$WORK/verify_gpu.json"
run_step bench-precision 70 "$PYTHON" "${M[@]}" bench-precision --config "$CONFIG" --run-id gc-precision \
  "${COMMON[@]}" "${PRECISION_TOKENS[@]}" compile.enabled=false --steps "$PRECISION_STEPS" --bf16-cpu-steps 0 --warmup 2
run_step bench 50 "$PYTHON" "${M[@]}" bench --config "$CONFIG" --run-id gc-bench "${COMMON[@]}" compile.enabled=false \
  --configs "$BENCH_CONFIGS" "${BENCH[@]}"
run_step compile-default 140 "$PYTHON" "${M[@]}" bench-compile --config "$CONFIG" --run-id gc-compile-default \
  "${COMMON[@]}" "${FEW_SHAPES[@]}" compile.mode=default "${COMPILE_STEPS[@]}"
run_step compile-reduce-overhead 140 "$PYTHON" "${M[@]}" bench-compile --config "$CONFIG" --run-id gc-compile-ro \
  "${COMMON[@]}" "${FEW_SHAPES[@]}" "compile.mode=$RO_MODE" "${COMPILE_STEPS[@]}"
run_step compile-run 150 "$PYTHON" "${M[@]}" train --config "$CONFIG" --run-id gc-compile-run "${COMMON[@]}" \
  "${FEW_SHAPES[@]}" compile.enabled=true "compile.mode=$RO_MODE" "train.max_steps=$RUN_STEPS" train.eval_every=100000 \
  train.log_every=10
run_step profile 60 "$PYTHON" "${M[@]}" profile --config "$CONFIG" --run-id gc-profile --tools torch,gpu "${COMMON[@]}" \
  compile.enabled=false
run_step sync-audit 50 "$PYTHON" "${M[@]}" sync-audit --config "$CONFIG" --mode warn --out "$WORK/sync_audit.json" \
  "${COMMON[@]}" train.run_id=gc-sync train.overwrite=true compile.enabled=false "train.max_steps=$SYNC_STEPS" \
  train.log_every=10 train.eval_every=100000
run_step optimize 65 "$PYTHON" "${M[@]}" optimize --config "$CONFIG" --run-id gc-optimize "${COMMON[@]}" \
  compile.enabled=false "${OPTIMIZE[@]}"
run_step causal-lm 120 "$PYTHON" "${M[@]}" train --config configs/causal-cpu.yaml --run-id gc-causal "${COMMON[@]}" \
  "${CAUSAL[@]}"
# the decoders are random init (model.source=hf:llama of configs/causal-cpu.yaml): no trained run is needed
run_step generate 150 "$PYTHON" "${M[@]}" bench-generate --config configs/causal-cpu.yaml --run-id gc-generate \
  "${COMMON[@]}" "${GENERATE[@]}"
run_step generate-0.5b 200 "$PYTHON" "${M[@]}" bench-generate --config configs/causal-cpu.yaml --run-id gc-generate-05b \
  "${COMMON[@]}" "${GENERATE[@]}" "${HALF_B[@]}" generate.fresh_process=false
# FSDP2 (torch >= 2.6): sharded steps, and a whole 2-rank run, with dist.offload (docs/scale-out.md)
run_step fsdp 90 "$PYTHON" scripts/fsdp_memory.py --nproc "$FSDP_NPROC" "${FSDP_MEMORY[@]}" --out "$WORK/fsdp_memory.json"
if [ "$FSDP_NPROC" -ge 2 ]; then
  run_step fsdp-run 120 "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node=2 "${M[@]}" train \
    --config configs/causal-cpu.yaml --run-id gc-fsdp "${COMMON[@]}" "${FSDP_RUN[@]}" dist.strategy=fsdp dist.offload=true
else
  case ",$STEPS," in *",fsdp-run,"*) echo "== fsdp-run: skipped: $FSDP_NPROC GPU(s); a 2-rank run needs 2" ;; esac
fi

"$PYTHON" scripts/gpu_check_report.py write "$WORK" "$OUT" "$MODE" "$ALL_STEPS" || FAILED=1
echo "gpu-check ($MODE): $([ "$FAILED" = 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED'); see $OUT/gpu_check.md"
exit "$FAILED"
