"""One stream: output tokens/s with one request at a time, and what quantized weights cost in accuracy.

For each ``--quantization`` variant (``none`` = the serving dtype's weights), in one run: requests
of random prompt ids run one at a time (``max_num_seqs=1``), as llama.cpp's single-stream figure
is measured; then greedy continuations of the parity prompts of ``tests/engine/core/test_engine.py`` are
compared with the first variant's: how many tokens agree before the first difference.

The peer, ``--peer llama.cpp`` (the default when ``benchmarks/llamacpp`` has its node package:
``npm ci --prefix benchmarks/llamacpp``), is llama.cpp through node-llama-cpp on the same GGUF
file, in the same run, after the kvserve variants: the same prompt ids and output lengths, greedy,
end-of-generation tokens not stopping a request, with the intra-op thread count the kvserve run
used. Each variant's tok/s is printed next to llama.cpp's with the ratio.

    python -m kvserve.benchmarks.single_stream [--variants none int8 int4] [--num-requests 8]
        [--peer llama.cpp|none] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

import torch

from kvserve.benchmarks import write_json
from kvserve.benchmarks.offline import make_requests
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.model_loader.source import ModelSource, resolve_model

PEER_DIR = Path(__file__).resolve().parent / "llamacpp"
PEER_SCRIPT = PEER_DIR / "single_stream.mjs"
PEER_INSTALL = "npm ci --prefix benchmarks/llamacpp"

PARITY_PROMPTS = [
    "Hello",
    "The three primary colors are",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    " ".join(f"Paragraph {i}: the river carried boats of grain, salt and timber to the markets of the coast."
             for i in range(20)),
    "Translate to French: I like apples.\nFrench:",
    "What is the capital of France?",
]


def workload(args, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """The timed requests' prompt ids and output lengths: the same for every variant and the peer."""
    return make_requests(args.num_requests, (32, 128), (args.new_tokens, args.new_tokens), args.seed,
                         vocab=min(10000, vocab_size))


def measure(variant: str, args) -> dict:
    options = {} if variant == "none" else {"quantization": variant}
    if args.threads:
        options["threads"] = args.threads
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=1, **options)
    try:
        vocab_size = llm.engine.vocab_size
        prompts, outputs = workload(args, vocab_size)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs]
        t0 = time.perf_counter()
        timed = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        greedy = SamplingParams(temperature=0, max_tokens=args.parity_tokens, ignore_eos=True)
        parity = [r.token_ids for r in llm.generate(PARITY_PROMPTS, greedy, use_tqdm=False)]
        dtype = str(llm.engine.executor.dtype).removeprefix("torch.")
        threads = torch.get_num_threads()  # the engine's own count; shutdown restores the caller's
    finally:
        llm.shutdown()
    return {"variant": variant, "dtype": dtype, "output_tok_s": sum(outputs) / seconds, "parity": parity,
            "threads": threads, "vocab_size": vocab_size,
            "token_ids": [r.token_ids for r in timed]}


def peer_unavailable(source: ModelSource) -> str | None:
    """Why llama.cpp cannot be the peer of the model at ``source`` here, or None when it can."""
    if source.gguf_path is None:
        return f"model {source.path!r} is not a GGUF file, which llama.cpp needs"
    if shutil.which("node") is None:
        return "node is not on PATH (Node.js >= 20 runs the llama.cpp peer)"
    if not (PEER_DIR / "node_modules" / "node-llama-cpp").is_dir():
        return f"node-llama-cpp is not installed in {PEER_DIR}; install it with: {PEER_INSTALL}"
    return None


def peer_command(gguf_path: str, threads: int) -> list[str]:
    return ["node", str(PEER_SCRIPT), gguf_path, "--threads", str(threads)]


def peer_requests(prompts: list[list[int]], outputs: list[int]) -> dict:
    """The peer script's stdin: each request's prompt ids and its fixed number of new tokens."""
    return {"requests": [{"prompt": p, "max_tokens": m} for p, m in zip(prompts, outputs, strict=True)]}


def run_peer(gguf_path: str, threads: int, requests: dict, timeout_s: float | None = None) -> dict:
    """Run the llama.cpp script once; its one JSON line of results."""
    proc = subprocess.run(peer_command(gguf_path, threads), input=json.dumps(requests), capture_output=True,
                          text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the llama.cpp peer exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare_with_peer(results: list[dict], peer: dict) -> None:
    """Each variant's tok/s over llama.cpp's, and how many of llama.cpp's greedy tokens it repeats."""
    for r in results:
        r["llamacpp_ratio"] = r["output_tok_s"] / peer["output_tok_s"]
        r["llamacpp_agreement"] = agreement(peer["token_ids"], r["token_ids"])


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """Share of the reference's tokens that the other run repeats before its first difference."""
    agreed = 0
    for ref, out in zip(reference, other, strict=True):
        for a, b in zip(ref, out, strict=False):
            if a != b:
                break
            agreed += 1
    return agreed / sum(len(r) for r in reference)


def report(results: list[dict], peer: dict | None, skipped: str | None) -> None:
    reference = results[0]
    for r in results:
        ratio = f"; {r['llamacpp_ratio']:.2f}x llama.cpp" if peer else ""
        print(f"{r['variant']:>9} ({r['dtype']}, {r['threads']} threads): {r['output_tok_s']:7.1f} output "
              f"tok/s one request at a time; greedy agreement with {reference['variant']}: "
              f"{r['greedy_agreement']:.0%}{ratio}")
    if peer:
        decode = f"{peer['decode_tok_s']:.1f}" if peer["decode_tok_s"] is not None else "-"
        print(f"{'llama.cpp':>9} (node-llama-cpp {peer['node_llama_cpp']}, same GGUF, {peer['threads']} "
              f"threads): {peer['output_tok_s']:7.1f} output tok/s one request at a time (decode alone "
              f"{decode}); kvserve {reference['variant']} repeats {reference['llamacpp_agreement']:.0%} "
              "of its greedy tokens")
    elif skipped:
        print(f"llama.cpp peer skipped: {skipped}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--variants", nargs="+", default=["none", "int8", "int4"],
                    help="'none' and/or quantizations")
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer", choices=["llama.cpp", "none"], default=None,
                    help=f"llama.cpp on the same GGUF (default when installed: {PEER_INSTALL})")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    source = resolve_model(args.model)
    skipped = None if args.peer == "none" else peer_unavailable(source)
    if skipped and args.peer == "llama.cpp":
        ap.error(f"--peer llama.cpp: {skipped}")
    results = [measure(v, args) for v in args.variants]
    reference = results[0]
    for r in results:
        r["greedy_agreement"] = agreement(reference["parity"], r["parity"])
    peer = None
    if args.peer != "none" and skipped is None:
        requests = peer_requests(*workload(args, reference["vocab_size"]))
        peer = run_peer(source.gguf_path, reference["threads"], requests)
        compare_with_peer(results, peer)
    report(results, peer, skipped)
    figures = {"kvserve": results, "llama.cpp": peer, "peer_skipped": skipped}
    write_json(args.json, figures)
    return figures


if __name__ == "__main__":
    main()
