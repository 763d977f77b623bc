#!/usr/bin/env bash
# kvserve's GPU checks in one go, about 3-5 minutes on one GPU and never more than
# GPU_CHECK_BUDGET_S (default 480 s) for the six steps together:
#   1. kernels     the Triton kernel tests (attention with split-K decode, KV store, fused MoE)
#                  compiled for the GPU, and the count of compiled variants over a varied run (no
#                  recompiles after warm-up)
#   2. parity      tiny random-weight Llama and Qwen3 models on the GPU (Triton backend) against
#                  the torch backend on this machine's CPU: logits close, clear greedy choices
#                  equal; no step's metadata or attention waits for the GPU (sync debug mode)
#   2b. moe        the tiny Qwen3-MoE and Mixtral on the GPU (fused Triton MoE kernel, CUDA graphs)
#                  against the CPU: logits close, greedy tokens equal; and against transformers
#   3. graphs      decode CUDA graphs: bucket/padding logic, the ModelRunner's graph path against
#                  its eager path, and whole engines (LLM on random Llama- and Qwen3-shaped model
#                  directories) with CUDA graphs against enforce_eager=True: equal greedy tokens
#                  (the engine comparison needs CUDA: in a CPU smoke run it is skipped)
#   3b. timing     each Triton kernel through its launcher at the compile table's reference step
#                  (python -m kvserve.benchmarks.gpu_compile.timing), measured beside its expected
#                  H200 roofline time; the summary gets that table under its own
#   4. throughput  nano-vllm's workload (256 requests, prompts and outputs of 100-1024 tokens,
#                  ignore_eos) on a Qwen3-0.6B-shaped model with random weights, no download
#   5. peer        optional, only with GPU_CHECK_PEER=1, after the summary of 1-4 is written:
#                  the same workload with transformers' continuous batching in the same run, for
#                  the ratio (its own time limit, GPU_CHECK_PEER_S, default 600 s)
# It ends with one summary table, rewritten after every step so that a run cut short still leaves
# one. The output folder ($OUT) receives only summary.md and one short log per step (at most the
# last 200 lines, 1 MiB): at most 8 files. The random model, a path shim and the full logs go to
# a temporary directory that is removed at exit.
#
# Needs torch (CUDA), triton, transformers, safetensors, tokenizers, xxhash, numpy, tqdm and
# pytest; no flash-attn, gguf or network. kvserve need not be installed: the repository is put
# on PYTHONPATH. The preflight imports every engine module before the first step.
#
#   benchmarks/gpu_check.sh                      # on a machine with an NVIDIA GPU: all steps
#   benchmarks/gpu_check.sh graphs throughput    # only these steps
#   GPU_CHECK_PEER=1 benchmarks/gpu_check.sh     # and transformers on the same workload, last
#   PYTHON=/path/to/python OUT=/some/dir benchmarks/gpu_check.sh
#   GPU_CHECK_ON_CPU=1 benchmarks/gpu_check.sh   # smoke-run the script itself on a CPU, tiny sizes
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
ON_CPU="${GPU_CHECK_ON_CPU:-0}"
WITH_PEER="${GPU_CHECK_PEER:-0}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-480}"
PEER_S="${GPU_CHECK_PEER_S:-600}"
ALL_STEPS=(kernels parity moe graphs timing throughput)
if (( $# )); then STEPS=("$@"); else STEPS=("${ALL_STEPS[@]}"); fi
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvserve-gpu-check.XXXXXX")}"
mkdir -p "$OUT"
SCRATCH="$(mktemp -d "${TMPDIR:-/tmp}/kvserve-gpu-scratch.XXXXXX")"
trap 'rm -rf "$SCRATCH"' EXIT
SHIM="$SCRATCH/pythonpath"

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi

die() { echo "gpu_check: $*" | tee "$OUT/preflight.log" >&2; exit 2; }

for step in "${STEPS[@]}"; do
  [[ " ${ALL_STEPS[*]} " == *" $step "* ]] || die "unknown step '$step'; steps: ${ALL_STEPS[*]}"
done

# ---------------------------------------------------------------- preflight (fails fast)
CUDA="$("$PY" -c 'import torch; print(torch.__version__, torch.cuda.is_available())' 2>/dev/null)" \
  || die "$PY cannot import torch; set PYTHON to a python with a CUDA build of torch"
if [[ "$ON_CPU" != 1 && "$CUDA" != *True ]]; then
  die "no CUDA device: torch ${CUDA% *} in $PY sees no GPU (torch.cuda.is_available() is False)." \
      "These checks need an NVIDIA GPU; GPU_CHECK_ON_CPU=1 smoke-runs them on the CPU."
fi

# kvserve from this checkout, installed or not: a link named kvserve to the repository root
# (its package root), plus pytest's pure-python packages from .venv if the python lacks them.
mkdir -p "$SHIM"
if ! "$PY" -c "import kvserve.engine" 2>/dev/null; then
  ln -sfn "$ROOT" "$SHIM/kvserve"
fi
if ! "$PY" -c "import pytest" 2>/dev/null; then
  for site in "$ROOT"/.venv/lib/python3*/site-packages; do
    for pkg in pytest _pytest pluggy iniconfig py.py; do
      [[ -e "$site/$pkg" ]] && ln -sfn "$site/$pkg" "$SHIM/$pkg"
    done
  done
fi
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"

# Every third-party package the engine and these steps import (some only lazily, deep inside a
# step), then every module of kvserve's engine, kernels and benchmarks: all missing ones at once.
"$PY" - >"$SCRATCH/preflight.log" 2>&1 <<'EOF' || die "preflight: $(tail -n 5 "$SCRATCH/preflight.log")"
import importlib, pkgutil
missing = []
for name in ("torch", "triton", "transformers", "safetensors", "tokenizers", "xxhash", "numpy", "tqdm",
             "pytest"):
    try:
        importlib.import_module(name)
    except Exception as exc:
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if not missing:
    import kvserve.benchmarks, kvserve.engine, kvserve.kernels
    for pkg in (kvserve.engine, kvserve.kernels, kvserve.benchmarks):
        for mod in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if mod.name.endswith(".flash_backend"):
                continue  # optional: flash-attn is not needed here
            if mod.name.endswith(".__main__"):
                continue  # a command (python -m kvserve.benchmarks.serving): importing it runs it
            try:
                importlib.import_module(mod.name)
            except Exception as exc:
                missing.append(f"{mod.name} ({type(exc).__name__}: {exc})")
if missing:
    raise SystemExit("cannot import: " + "; ".join(missing))
print("preflight: every import is there")
EOF

DEVICE_NAME="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (smoke run)")')"
VERSIONS="$("$PY" -c 'import torch, triton, transformers as t; print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {t.__version__}")')"
echo "gpu_check: $DEVICE_NAME; $VERSIONS; results in $OUT"

# ---------------------------------------------------------------- steps
ROWS=()
FAILED=0
STARTED=$SECONDS

write_summary() {
  {
    echo "kvserve GPU check, $(date -u +%Y-%m-%d), $DEVICE_NAME ($VERSIONS)"
    echo
    echo "| step | result | time | detail |"
    echo "|---|---|---|---|"
    printf '%s\n' "${ROWS[@]}"
    if [[ -s "$SCRATCH/timing.log" ]] && grep -q '^| kernel' "$SCRATCH/timing.log"; then
      echo
      echo "Kernel times, measured beside expected (the H200 roofline of docs/performance/gpu_compile.md):"
      echo
      grep '^|' "$SCRATCH/timing.log"
    fi
  } >"$OUT/summary.md"
}

# run_step NAME LIMIT_S COMMAND...: runs COMMAND (a program) with its output in
# the scratch log, keeps the log's tail in $OUT, and records a summary row
run_step() {
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS status result detail log="$SCRATCH/$name.log"
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" >"$log" 2>&1
  status=$?
  case $status in
    0) result=pass ;;
    124) result="FAIL (timeout ${limit}s)"; FAILED=1 ;;
    *) result="FAIL (exit $status)"; FAILED=1 ;;
  esac
  tail -n 200 "$log" | tail -c 1048576 >"$OUT/$name.log"
  detail="$(summarize "$name" "$log")"
  [[ $status -ne 0 ]] && tail -n 30 "$log"
  echo "   $result in $((SECONDS - start)) s: $detail"
  ROWS+=("| $name | $result | $((SECONDS - start)) s | $detail |")
  write_summary
}

# limit_for WANTED_S: the step's own limit, cut to what is left of the budget
limit_for() {
  local left=$((BUDGET_S - (SECONDS - STARTED)))
  (( left < 10 )) && left=10
  echo $(( $1 < left ? $1 : left ))
}

# summarize NAME LOG: one line from a step's log (pytest's tally, or the benchmark's figures)
summarize() {
  if [[ "$1" == timing ]]; then
    echo "$(grep -c '^| [a-z]' "$2" | awk '{print $1 - 1}') kernels timed; measured vs expected below"
  elif [[ "$1" == throughput || "$1" == peer ]]; then
    grep -E "^(requests=|kvserve |transformers |ratio )" "$2" | sed -E 's/ +/ /g' | paste -sd ';' -
  elif grep -qE "[0-9]+ (passed|failed|error)" "$2"; then
    grep -E "[0-9]+ (passed|failed|error)" "$2" | tail -1 | sed -E 's/=//g; s/^ +| +$//g'
  else
    tail -n 1 "$2"
  fi
}

PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="")

if [[ "$ON_CPU" == 1 ]]; then
  TIMING=(--smoke)
  SHAPE=qwen3-tiny; BENCH=(--num-requests 8 --min-prompt 10 --max-prompt 40 --min-output 4 --max-output 12 --max-num-seqs 8)
else
  TIMING=()
  SHAPE=qwen3-0.6b; BENCH=(--num-requests 256 --min-prompt 100 --max-prompt 1024 --min-output 100 --max-output 1024
                           --max-num-seqs 256 --max-num-batched-tokens 16384)
fi
MODEL="$SCRATCH/$SHAPE"

# bench PEER: a command line for bash -c: the benchmark with PEER as its peer, on the random model
# (written on first use)
bench() {
  printf '[[ -e %q/config.json ]] || %s || exit; %s' "$MODEL" \
    "$(printf '%q ' "$PY" -m kvserve.testing.random_model "$SHAPE" "$MODEL")" \
    "$(printf '%q ' "$PY" -m kvserve.benchmarks.offline --model "$MODEL" "${BENCH[@]}" --peer "$1" --quiet)"
}

for step in "${STEPS[@]}"; do
  case $step in
    kernels) run_step kernels "$(limit_for 150)" "${PYTEST[@]}" tests/kernels/triton/test_kernels.py tests/kernels/triton/test_kernel_variants.py tests/kernels/triton/test_launch.py \
               tests/engine/layers/test_moe.py ;;
    parity) run_step parity "$(limit_for 90)" "${PYTEST[@]}" tests/engine/layers/attention/test_attention_triton.py -k "not graph" ;;
    moe) run_step moe "$(limit_for 120)" "${PYTEST[@]}" tests/engine/models/test_moe_models.py -k "gpu or logits" ;;
    graphs) run_step graphs "$(limit_for 150)" "${PYTEST[@]}" tests/engine/runner/test_cuda_graphs.py tests/engine/runner/test_model_runner_graphs.py \
              tests/engine/layers/attention/test_attention_triton.py::test_graph_decode_metadata_over_padded_static_buffers_gives_the_same_rows \
              tests/engine/layers/attention/test_attention_triton.py::test_decode_graph_replay_of_a_tiny_model_matches_its_eager_decode ;;
    timing) run_step timing "$(limit_for 120)" "$PY" -m kvserve.benchmarks.gpu_compile.timing "${TIMING[@]}" ;;
    throughput) run_step throughput "$(limit_for 300)" bash -c "$(bench none)" ;;
  esac
done
if [[ "$WITH_PEER" == 1 ]]; then
  run_step peer "$PEER_S" bash -c "$(bench hf-batch)"
fi

echo
cat "$OUT/summary.md"
exit $FAILED
