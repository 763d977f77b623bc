#!/usr/bin/env bash
# kvserve's GPU checks in one go (issue 5), about 8 minutes on one GPU:
#   1. kernels     the Triton kernel tests (attention, KV store, fused MoE), compiled for the GPU
#   2. parity      tiny random-weight Llama and Qwen3 models on the GPU (Triton backend) against
#                  the torch backend on this machine's CPU: logits close, clear greedy choices equal
#   2b. moe        the tiny Qwen3-MoE and Mixtral on the GPU (fused Triton MoE kernel, CUDA graphs)
#                  against the CPU: logits close, greedy tokens equal; and against transformers
#   3. graphs      decode CUDA graphs: bucket/padding logic, the ModelRunner's graph path against
#                  its eager path, and whole engines (LLM on random Llama- and Qwen3-shaped model
#                  directories) with CUDA graphs against enforce_eager=True: equal greedy tokens
#                  (the engine comparison needs CUDA: in a CPU smoke run it is skipped)
#   4. throughput  nano-vllm's workload (256 requests, prompts and outputs of 100-1024 tokens,
#                  ignore_eos) on a Qwen3-0.6B-shaped model with random weights, no download;
#                  transformers on the same requests in the same run when the benchmark offers
#                  its continuous-batching peer (generate_batch)
# and one summary table at the end (also written to $OUT/summary.md).
#
# Every step is a test or benchmark that also runs on a CPU; here they run on the GPU.
# Needs torch (CUDA), triton, transformers, safetensors, tokenizers and pytest; no flash-attn,
# gguf or network. kvserve need not be installed: the repository is put on PYTHONPATH.
#
#   benchmarks/gpu_check.sh                      # on a machine with an NVIDIA GPU
#   PYTHON=/path/to/python benchmarks/gpu_check.sh
#   GPU_CHECK_ON_CPU=1 benchmarks/gpu_check.sh   # smoke-run the script itself on a CPU, tiny sizes
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
ON_CPU="${GPU_CHECK_ON_CPU:-0}"
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvserve-gpu-check.XXXXXX")}"
mkdir -p "$OUT"
SHIM="$OUT/pythonpath"

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi

die() { echo "gpu_check: $*" >&2; exit 2; }

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
"$PY" -c "import kvserve.engine, triton, transformers" 2>"$OUT/preflight.log" \
  || die "cannot import kvserve.engine, triton and transformers: $(tail -1 "$OUT/preflight.log")"
"$PY" -c "import pytest" 2>/dev/null || die "pytest is missing: install it, or bring this repository's .venv"

DEVICE_NAME="$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU (smoke run)")')"
VERSIONS="$("$PY" -c 'import torch, triton, transformers as t; print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {t.__version__}")')"
echo "gpu_check: $DEVICE_NAME; $VERSIONS; logs in $OUT"

# ---------------------------------------------------------------- steps
ROWS=()
FAILED=0

# run_step NAME TIMEOUT_S COMMAND...: runs COMMAND, logs to $OUT/NAME.log, records a summary row
run_step() {
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS status result detail
  echo "== $name: $*"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  status=$?
  case $status in
    0) result=pass ;;
    124) result="FAIL (timeout ${limit}s)"; FAILED=1 ;;
    *) result="FAIL (exit $status)"; FAILED=1 ;;
  esac
  detail="$(summarize "$name")"
  [[ $status -ne 0 ]] && tail -n 30 "$OUT/$name.log"
  echo "   $result in $((SECONDS - start)) s: $detail"
  ROWS+=("| $name | $result | $((SECONDS - start)) s | $detail |")
}

# summarize NAME: one line from a step's log (pytest's tally, or the benchmark's figures)
summarize() {
  local log="$OUT/$1.log"
  if [[ "$1" == throughput ]]; then
    grep -E "^(kvserve|transformers|ratio) " "$log" | sed -E 's/ +/ /g' | paste -sd ';' -
  elif grep -qE "[0-9]+ (passed|failed|error)" "$log"; then
    grep -E "[0-9]+ (passed|failed|error)" "$log" | tail -1 | sed -E 's/=//g; s/^ +| +$//g'
  else
    tail -n 1 "$log"
  fi
}

pytest_step() {
  local name="$1" limit="$2"; shift 2
  run_step "$name" "$limit" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" "$@"
}

pytest_step kernels 180 tests/test_kernels.py tests/test_moe.py
pytest_step parity 180 tests/test_attention_triton.py -k "not graph"
pytest_step moe 240 tests/test_moe_models.py -k "gpu or logits"
pytest_step graphs 240 tests/test_cuda_graphs.py tests/test_model_runner_graphs.py \
  tests/test_attention_triton.py::test_graph_decode_metadata_over_padded_static_buffers_gives_the_same_rows \
  tests/test_attention_triton.py::test_decode_graph_replay_of_a_tiny_model_matches_its_eager_decode

if [[ "$ON_CPU" == 1 ]]; then
  SHAPE=qwen3-tiny; BENCH=(--num-requests 8 --min-prompt 10 --max-prompt 40 --min-output 4 --max-output 12 --max-num-seqs 8)
else
  SHAPE=qwen3-0.6b; BENCH=(--num-requests 256 --min-prompt 100 --max-prompt 1024 --min-output 100 --max-output 1024
                           --max-num-seqs 256 --max-num-batched-tokens 16384)
fi
PEER=none
if "$PY" -m kvserve.benchmarks.offline --help 2>/dev/null | grep -q "hf-batch"; then PEER=hf-batch; fi
run_step model-dir 300 "$PY" -m kvserve.benchmarks.random_model "$SHAPE" "$OUT/$SHAPE"
run_step throughput 420 "$PY" -m kvserve.benchmarks.offline --model "$OUT/$SHAPE" "${BENCH[@]}" --peer "$PEER" --quiet

# ---------------------------------------------------------------- summary
{
  echo "kvserve GPU check, $(date -u +%Y-%m-%d), $DEVICE_NAME ($VERSIONS)"
  echo
  echo "| step | result | time | detail |"
  echo "|---|---|---|---|"
  printf '%s\n' "${ROWS[@]}"
  [[ "$PEER" == none ]] && echo && echo "No transformers peer: kvserve.benchmarks.offline has no --peer hf-batch (generate_batch) yet."
} >"$OUT/summary.md"
echo
cat "$OUT/summary.md"
exit $FAILED
